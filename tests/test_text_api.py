"""Lookups and routes by prompt text and chat messages, on a real server and publisher.

The tokenizer directory is built locally (``tests/text_tokenizer.py``); the engine
side publishes the blocks of the ids ``transformers`` gives for a conversation, and the
aggregator, asked with the same conversation as messages, finds them.
"""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from support import ServerThread, free_port, wait_until
from text_tokenizer import build_bytelevel, build_metaspace, require_transformers
from kvevents.api import create_app
from kvevents.wire.publisher import PublisherConfig, ZmqEventPublisher
from kvevents.wire.schema import BlockStored, KVEventBatch
from kvevents.service.settings import AggregatorSettings, EngineSpec, load_settings

BS = 16
CHAT = [{"role": "system", "content": "You route prompts to the engine that holds them."},
        {"role": "user", "content": "Which engine holds the prefix of this conversation? " * 4}]


@pytest.fixture(scope="module")
def tokdirs(tmp_path_factory):
    require_transformers()
    root = tmp_path_factory.mktemp("tok")
    return build_bytelevel(root / "chat"), build_metaspace(root / "plain")


@pytest.fixture(scope="module")
def fleet(tokdirs):
    """A server following one publisher for model ``m``, with tokenizers for ``m`` and
    ``plain`` (no chat template), and the ids transformers gives for CHAT."""
    from transformers import AutoTokenizer

    chat_dir, plain_dir = tokdirs
    auto = AutoTokenizer.from_pretrained(chat_dir)
    out = auto.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    ids = list(out["input_ids"] if hasattr(out, "keys") else out)
    live, replay = free_port(), free_port()
    pub = ZmqEventPublisher(PublisherConfig(endpoint=f"tcp://*:{live}",
                                            replay_endpoint=f"tcp://*:{replay}"))
    settings = AggregatorSettings(
        engines=(EngineSpec("engine-0", f"tcp://127.0.0.1:{live}",
                            replay_endpoint=f"tcp://127.0.0.1:{replay}", model="m"),),
        tokenizers=(("m", str(chat_dir)), ("plain", str(plain_dir))))
    with ServerThread(create_app(settings)) as srv:
        assert wait_until(lambda: httpx.get(f"{srv.url}/v1/engines").json()["engines"][0]["connected"], 10)
        full = len(ids) // BS * BS
        pub.publish(KVEventBatch(time.time(), [BlockStored(
            list(range(1, full // BS + 1)), None, ids[:full], BS, None, "GPU", None)]))
        assert wait_until(lambda: httpx.get(f"{srv.url}/v1/engines").json()["engines"][0]["blocks"], 10)
        yield srv, ids, auto
    pub.shutdown(0.5)


def post(srv, path, body):
    return httpx.post(f"{srv.url}{path}", json=body, timeout=10)


def lookups_counted(srv) -> float:
    text = httpx.get(f"{srv.url}/metrics").text
    return sum(s.value for fam in text_string_to_metric_families(text) if fam.name == "kvevents_lookups"
               for s in fam.samples if s.name == "kvevents_lookups_total")


def test_lookup_by_messages_prompt_and_ids_agree(fleet):
    srv, ids, auto = fleet
    cached = len(ids) // BS * BS
    by_ids = post(srv, "/v1/lookup", {"token_ids": ids, "model": "m"}).json()
    by_chat = post(srv, "/v1/lookup", {"messages": CHAT, "model": "m"}).json()
    text = auto.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert by_chat == by_ids
    assert by_chat["prompt_tokens"] == len(ids)
    assert by_chat["engines"] == [{"engine": "engine-0", "matched_tokens": cached, "tiers": {"GPU": cached}}]
    # As a plain prompt the text gets the tokenizer's BOS in front: one more token, the
    # same as transformers' tokenizer(text), and the cached blocks no longer line up.
    by_prompt = post(srv, "/v1/lookup", {"prompt": text, "model": "m"}).json()
    assert by_prompt["prompt_tokens"] == len(auto(text)["input_ids"]) == len(ids) + 1
    route = post(srv, "/v1/route", {"messages": CHAT, "model": "m"}).json()
    assert route["engine"] == "engine-0" and route["matched_tokens"] == cached


@pytest.mark.parametrize("body,status,field", [
    ({"prompt": "hi"}, 422, "model"),
    ({"prompt": "hi", "model": "nope"}, 422, "model"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "plain"}, 422, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}], "model": "m"}, 422, "messages"),
    ({"messages": [], "model": "m"}, 422, "messages"),
    ({"messages": [{"content": "hi"}], "model": "m"}, 422, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}], "model": "m"}, 422, "messages[0].content"),
    ({"messages": [{"role": "user", "contents": "x"}], "model": "m"}, 422, "messages[0].contents"),
    ({"messages": {"role": "user"}, "model": "m"}, 422, "messages"),
    ({"prompt": 7, "model": "m"}, 422, "prompt"),
    ({"model": "m"}, 422, "token_ids"),
    ({"token_ids": [1], "prompt": "x", "model": "m"}, 422, "prompt"),
    ({"prompt": "x", "messages": [{"role": "user"}], "model": "m"}, 422, "messages"),
])
@pytest.mark.parametrize("path", ["/v1/lookup", "/v1/route"])
def test_bad_text_bodies_name_the_field(fleet, path, body, status, field):
    srv, _, _ = fleet
    before = lookups_counted(srv)
    r = post(srv, path, body)
    assert r.status_code == status, r.text
    assert r.json()["field"] == field, r.text
    assert lookups_counted(srv) == before  # refused before any lookup: nothing counted


def test_prompt_over_the_limit_is_400_on_its_field(tokdirs):
    chat_dir, _ = tokdirs
    app = create_app(AggregatorSettings(tokenizers=(("m", str(chat_dir)),), max_prompt_tokens=8))
    with ServerThread(app) as srv:
        r = post(srv, "/v1/lookup", {"prompt": "a long prompt " * 10, "model": "m"})
        assert r.status_code == 400 and r.json()["field"] == "prompt", r.text


def test_prefixes_show_text_where_the_model_has_a_tokenizer(fleet):
    srv, ids, auto = fleet
    prefixes = httpx.get(f"{srv.url}/v1/prefixes").json()["prefixes"]
    assert prefixes and prefixes[0]["model"] == "m"
    lead = prefixes[0]["leading_tokens"]
    assert lead == ids[:len(lead)]
    assert prefixes[0]["text"] == auto.decode(lead)
    assert prefixes[0]["text"].startswith("<s><|im_start|>system\nYou route")


def test_openapi_documents_the_text_fields(fleet):
    srv, _, _ = fleet
    spec = httpx.get(f"{srv.url}/openapi.json").json()
    body = spec["paths"]["/v1/lookup"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"] == {"$ref": "#/components/schemas/LookupBody"}
    props = spec["components"]["schemas"]["LookupBody"]["properties"]
    assert {"token_ids", "prompt", "messages", "model", "lora_name"} <= set(props)
    assert "candidates" in spec["components"]["schemas"]["RouteBody"]["properties"]


def test_tokenizer_settings_from_flag_env_and_file(tmp_path, tokdirs):
    chat_dir, plain_dir = tokdirs
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[tokenizers]\nm = "{chat_dir}"\n')
    assert load_settings(str(cfg), env={}).tokenizers == (("m", str(chat_dir)),)
    env = {"KVEVENTS_TOKENIZERS": f"m={chat_dir};plain={plain_dir}"}
    assert load_settings(str(cfg), env=env).tokenizers == (("m", str(chat_dir)), ("plain", str(plain_dir)))
    assert load_settings(None, env=env, tokenizers=(("x", "/y"),)).tokenizers == (("x", "/y"),)
    with pytest.raises(ValueError, match="MODEL=PATH"):
        load_settings(None, env={"KVEVENTS_TOKENIZERS": "no-equals-sign"})
    with pytest.raises(ValueError, match="given more than once"):
        create_app(AggregatorSettings(tokenizers=(("m", str(chat_dir)), ("m", str(plain_dir)))))


def test_serve_with_a_bad_tokenizer_path_fails_in_one_line(tmp_path):
    missing = tmp_path / "missing"
    r = subprocess.run([sys.executable, "-m", "kvevents.cli", "serve", "--port", str(free_port()),
                        "--tokenizer", f"m={missing}"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and f"model 'm': {missing} is not a directory" in r.stderr


# Arbitrary JSON values, and message lists built from roles, content shapes and junk.
_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.text(max_size=12)),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
_content = st.one_of(st.text(max_size=40), st.none(), _json,
                     st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                     "text": st.text(max_size=20)}), max_size=3))
_message = st.one_of(_json, st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "robot", ""])},
    optional={"content": _content, "name": _json, "tool_calls": _json, "tool_call_id": _json}))
_bodies = st.fixed_dictionaries({}, optional={
    "messages": st.one_of(st.lists(_message, max_size=4), _json),
    "prompt": st.one_of(st.text(max_size=60), _json),
    "token_ids": st.one_of(st.lists(st.integers(0, 1000), max_size=8), _json),
    "model": st.sampled_from(["m", "plain", "nope", None]),
})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=_bodies)
def test_any_text_body_gets_a_json_answer_never_a_5xx(fleet, body):
    srv, _, _ = fleet
    for path in ("/v1/lookup", "/v1/route"):
        r = post(srv, path, body)
        assert r.status_code in (200, 400, 422), (body, r.text)
        if r.status_code != 200:
            assert r.json()["error"] and "field" in r.json(), r.text
