"""Token parity checked live (kvevents/gateway/parity.py): the gateway's ids against an
engine's ``/tokenize`` for the same body, a real ``kvevents serve`` in front of fake
engines whose ``/tokenize`` is the tokenizer's own (a match) or one that renders another
template (a mismatch). Counted per engine, model, result and reason; past the threshold
the model is routed with the engine's ids, and ``GET /v1/engines`` says so."""

from __future__ import annotations

import contextlib

import httpx
import pytest

from hostile_engine import EngineThread
from hostile_support import GatewayProcess, wait_for
from support import free_port
from kvevents.gateway.parity import TokenParity, first_difference, mismatch_reason


def test_reasons_and_positions():
    assert mismatch_reason([1, 5, 6], [5, 6], False, False) == "special_tokens"  # a BOS more
    assert mismatch_reason([5, 6, 7], [5, 6, 9], True, True) == "tools"
    assert mismatch_reason([5, 6, 7], [5, 6, 9], False, True) == "content_format"
    assert mismatch_reason([5, 6, 7], [5, 8, 9, 9], False, False) == "template"
    assert first_difference([5, 6, 7], [5, 6, 9]) == 2 and first_difference([5], [5, 6]) == 1


def test_mismatches_in_a_row_switch_a_model_to_the_engines_ids_and_a_match_switches_back():
    seen = []
    parity = TokenParity(lambda *a: seen.append(a), sample_rate=0.0, threshold=2)
    assert not parity.engine_ids("m")
    assert not parity.record("e0", "m", [1, 2], [1, 3])
    assert not parity.engine_ids("m")
    assert not parity.record("e0", "m", [1, 2], [1, 3])
    assert parity.engine_ids("m") and parity.state("m")["ids"] == "engine"
    assert parity.record("e0", "m", [1, 2], [1, 2])
    state = parity.state("m")
    assert not parity.engine_ids("m") and state["checks"] == 3 and state["mismatches"] == 2
    assert state["mismatch_reasons"] == {"template": 2} and state["last_mismatch"]["position"] == 1
    assert seen == [("e0", "m", "mismatch", "template")] * 2 + [("e0", "m", "match", "")]


@pytest.fixture
def tok_dir(tmp_path):
    from text_tokenizer import build_bytelevel, require_transformers

    require_transformers()
    return build_bytelevel(tmp_path / "tok")


def _engines_parity(g: GatewayProcess) -> dict:
    return {e["name"]: e["gateway"]["token_parity"] for e in httpx.get(g.url + "/v1/engines").json()["engines"]}


@contextlib.contextmanager
def _engines(tok_dir, template=None):
    eng = EngineThread([free_port(), free_port()], tokenizer=str(tok_dir), template=template)
    try:
        yield eng
    finally:
        eng.close()


def test_every_checked_request_matches_an_engine_that_renders_as_we_do(tok_dir):
    """Fake engines whose /tokenize is transformers' own for the same directory: every
    check a match, the ids stay local."""
    with _engines(tok_dir) as eng, GatewayProcess(
            eng.urls, "--tokenizer", f"fake={tok_dir}", "--token-parity-sample-rate", "1") as g:
        for i in range(3):
            resp = httpx.post(g.url + "/v1/chat/completions", json={
                "model": "fake", "max_tokens": 2, "messages": [{"role": "user", "content": f"hello {i}"}]})
            assert resp.status_code == 200, resp.text
        assert wait_for(lambda: g.metric("kvevents_gateway_token_parity_checks_total", result="match") == 3, 5)
        assert g.metric("kvevents_gateway_token_parity_checks_total", result="mismatch") == 0
        states = _engines_parity(g)
        assert all(s["ids"] == "local" and s["checks"] == 3 for s in states.values()), states


def test_an_engine_that_renders_otherwise_is_caught_and_its_ids_used(tok_dir):
    """The engines render with another template: mismatches, logged once, and after the
    threshold the requests are routed with the engines' ids (their /tokenize is asked)."""
    with _engines(tok_dir, template="{% for m in messages %}[{{ m.role }}] {{ m.content }}\n"
                                    "{% endfor %}") as eng, GatewayProcess(
            eng.urls, "--tokenizer", f"fake={tok_dir}", "--token-parity-sample-rate", "1",
            "--token-parity-threshold", "2") as g:
        for i in range(4):
            resp = httpx.post(g.url + "/v1/chat/completions", json={
                "model": "fake", "max_tokens": 2, "messages": [{"role": "user", "content": f"hello {i}"}]})
            assert resp.status_code == 200, resp.text
        assert wait_for(lambda: g.metric("kvevents_gateway_token_parity_checks_total", result="mismatch",
                                         reason="template") >= 3, 5)
        states = _engines_parity(g)
        assert all(s["ids"] == "engine" for s in states.values()), states
        assert eng.stats.tokenized >= 4  # the checks, then the ids themselves
        log = g.log_text()
        assert log.count("differs from engine") == 1 and "routing it with the engines' /tokenize ids" in log


def test_the_tools_of_tool_choice_none_are_left_out_for_an_engine_that_drops_them(tok_dir, tmp_path):
    """``exclude_tools_when_tool_choice_none=true``: the gateway renders a chat with
    ``tool_choice: "none"`` without its tools, and its parity checks ask ``/tokenize``
    (which takes no ``tool_choice``) without them too, so they match; a chat with another
    choice keeps its tools on both sides."""
    from kvevents.demo.chat_templates import TOOLS

    (tmp_path / "engine.jinja").write_text(TOOLS)
    # (every field vLLM hands the template written out: the fake engine renders the raw dict)
    weather = {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    with _engines(tok_dir, template=TOOLS) as eng, GatewayProcess(
            eng.urls, "--tokenizer", f"fake={tok_dir},chat_template={tmp_path / 'engine.jinja'},"
                                     "exclude_tools_when_tool_choice_none=true",
            "--token-parity-sample-rate", "1") as g:
        for i, choice in enumerate(("none", "none", "auto")):
            resp = httpx.post(g.url + "/v1/chat/completions", json={
                "model": "fake", "max_tokens": 2, "tools": [weather], "tool_choice": choice,
                "messages": [{"role": "user", "content": f"hello {i}"}]})
            assert resp.status_code == 200, resp.text
        assert wait_for(lambda: g.metric("kvevents_gateway_token_parity_checks_total", result="match") == 3, 5), \
            g.log_text()[-2000:]
        assert g.metric("kvevents_gateway_token_parity_checks_total", result="mismatch") == 0
