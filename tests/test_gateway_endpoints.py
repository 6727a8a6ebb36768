"""The gateway's endpoint table and the endpoints beyond chat and completions.

* The table (:mod:`kvevents.gateway.endpoints`) is what the app routes, the server
  protocol's fast path, the hot paths and the OpenAI-shaped 413s list.
* ``/v1/responses``: its ``input`` rendered as the chat vLLM 0.32 renders
  (``construct_input_messages``, compared with vLLM's own where vLLM is installed); the
  end and cached tokens of its answers, streamed (``response.completed``, cut or whole)
  and not; through ``kvevents serve`` in front of two engines that answer as vLLM's do
  (:mod:`hostile_engine`), with the official ``openai`` client: streamed and not, a
  ``previous_response_id`` follow-up always on the engine that stored the response, and
  vLLM's 404 when that engine has left the fleet.
* ``/v1/embeddings`` routed by load and counted; ``/tokenize`` and ``/detokenize``
  passed through; bad bodies a 4xx naming the field, never a 5xx.

The same endpoints through a real vLLM engine: :mod:`test_gateway_endpoints_vllm`.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from hostile_engine import EngineThread
from hostile_support import GatewayProcess, wait_for
from support import free_port
from kvevents.gateway.answers import cached_tokens, is_complete, stream_cached_tokens
from kvevents.gateway.endpoints import BY_PATH, ENDPOINTS, PATHS, RESPONSE_END
from kvevents.gateway.errors import OpenAIError
from kvevents.gateway.prompt import RESPONSES
from kvevents.gateway.responses import (ResponseHomes, parse_responses, response_id,
                                        stream_response_id)

openai = pytest.importorskip("openai")


# -- the table ----------------------------------------------------------------------------------


def test_everything_that_lists_the_endpoints_reads_the_table():
    from kvevents.api import HOT_PATHS, api_routes, create_app
    from kvevents.api.server_protocol import path_table
    from kvevents.gateway.proxy import PATHS as FORWARDED

    assert PATHS == ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings",
                     "/tokenize", "/detokenize")
    fast = path_table(lookup=False)
    assert {p.decode(): kind for p, (_, kind) in fast.items()} == {p: r.kind for p, r in BY_PATH.items()}
    assert FORWARDED == {r.kind: r.path for r in ENDPOINTS.values()}
    assert set(PATHS) <= set(HOT_PATHS)
    app = create_app()
    posts = {r.path for r in api_routes(app.router.routes) if "POST" in r.methods}
    assert set(PATHS) <= posts
    limit = next(m for m in app.user_middleware if m.cls.__name__ == "BodySizeLimit")
    assert tuple(limit.kwargs["openai_paths"]) == PATHS
    assert [r.path for r in ENDPOINTS.values() if r.affinity] == [
        "/v1/chat/completions", "/v1/completions", "/v1/responses"]


# -- /v1/responses: the prompt --------------------------------------------------------------------

CASES = [
    {"input": "Tell me a story"},
    {"input": "Hi", "instructions": "Be brief."},
    {"input": [{"role": "user", "content": "Hi"}], "instructions": "Be brief."},
    {"input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                               {"type": "input_text", "text": "b"}]},
               {"type": "message", "role": "assistant", "id": "m0", "status": "completed",
                "content": [{"type": "output_text", "text": "c", "annotations": []}]},
               {"role": "assistant", "content": "c2"},
               {"role": "user", "content": "d"}]},
    {"input": [{"role": "developer", "content": "rules"}, {"role": "user", "content": "q"},
               {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"x\":1}"},
               {"type": "function_call_output", "call_id": "c1", "output": "42"}]},
    {"input": [{"role": "user", "content": "q"},
               {"type": "message", "role": "assistant", "id": "m1", "status": "incomplete",
                "content": [{"type": "output_text", "text": "The answer is"}]}]},
    {"input": "think", "reasoning": {"effort": "low"}, "chat_template_kwargs": {"x": 1}},
]


def _plain(messages: list) -> list:
    """Messages as a chat template sees them: text parts' types are all text to vLLM."""
    out = []
    for m in messages:
        m = {k: v for k, v in dict(m).items() if k in ("role", "content", "name", "tool_calls", "tool_call_id")}
        if isinstance(m.get("content"), list):
            m["content"] = [{"type": "text", "text": p["text"]} for p in m["content"]]
        if m.get("tool_calls"):
            m["tool_calls"] = [{"id": c["id"], "type": "function", "function": dict(c["function"])}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


class _Config:
    max_model_len = 4096


@pytest.mark.parametrize("case", CASES)
def test_responses_input_is_the_chat_vllm_renders(case):
    req = parse_responses(json.dumps({"model": "m", **case}).encode())
    assert req.kind == RESPONSES and req.chat is not None
    ours = json.loads(req.messages_json)
    utils = pytest.importorskip("vllm.entrypoints.openai.responses.utils")
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    request = ResponsesRequest.model_validate({"model": "m", **case})
    theirs = utils.construct_input_messages(request_instructions=request.instructions,
                                            request_input=request.input)
    assert _plain(ours) == _plain(theirs)
    params = request.build_chat_params(None, "auto")
    options = req.options
    assert options.continue_final_message == params.chat_template_kwargs.get("continue_final_message", False)
    assert options.add_generation_prompt == params.chat_template_kwargs["add_generation_prompt"]
    # (vLLM tokenizes a response's text with the special tokens: TokenizeParams' default)
    assert options.add_special_tokens is True
    assert request.build_tok_params(_Config()).add_special_tokens is True
    if case.get("reasoning"):
        assert options.reasoning_effort == "low" and options.chat_template_kwargs == {"x": 1, "enable_thinking": True}


def test_responses_not_rendered_here_route_by_load_or_by_the_stored_response():
    for body in ({"input": "x", "previous_response_id": "resp_1"},
                 {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {}}]},
                 {"input": [{"type": "reasoning", "id": "r", "summary": []}]},
                 {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}):
        req = parse_responses(json.dumps(body).encode())
        assert req.chat is None and req.messages_json == b""
    assert parse_responses(b'{"input":"x","previous_response_id":"r9"}').previous_response_id == "r9"


@pytest.mark.parametrize("body, param", [
    (b'{"model":"m"}', "input"),
    (b'{"input":3}', "input"),
    (b'{"input":"x","instructions":5}', "instructions"),
    (b'{"input":"x","previous_response_id":1}', "previous_response_id"),
    (b'{"input":"x","model":[]}', "model"),
    (b'{"input":"x","stream":"yes"}', "stream"),
    (b'[1]', None),
    (b'{"input":', None),
])
def test_bad_responses_bodies_are_400_naming_the_field(body, param):
    with pytest.raises(OpenAIError) as err:
        parse_responses(body)
    assert err.value.status == 400 and err.value.param == param


# -- /v1/responses: the answers -----------------------------------------------------------------


def _event(kind: str, data: dict) -> bytes:
    return b"event: %s\ndata: %s\n\n" % (kind.encode(), json.dumps({**data, "type": kind}, separators=(",", ":")).encode())


def test_response_answers_their_end_id_and_cached_tokens():
    usage = {"input_tokens": 40, "input_tokens_details": {"cached_tokens": 32}, "output_tokens": 2}
    whole = json.dumps({"id": "resp_a", "object": "response", "output": [], "usage": usage}).encode()
    assert cached_tokens(whole) == 32 and response_id(whole) == "resp_a"
    assert response_id(b'{"id":"chatcmpl-1","object":"chat.completion"}') is None
    created = _event("response.created", {"response": {"id": "resp_b", "object": "response"},
                                          "sequence_number": 0})
    assert stream_response_id(created + _event("response.in_progress", {})) == "resp_b"
    completed = _event("response.completed", {"response": {"id": "resp_b", "output": [
        {"content": [{"text": "x" * 40000}]}], "usage": usage}, "sequence_number": 9})
    assert is_complete(created + completed, RESPONSE_END) and not is_complete(completed)
    assert not is_complete(created, RESPONSE_END)
    assert stream_cached_tokens(completed[-16384:]) == 32  # its data line cut by the tail kept
    assert stream_cached_tokens(created + completed) == 32
    text = json.dumps({"t": '"cached_tokens": 7'}).encode()  # (quoted in a string: escaped)
    assert stream_cached_tokens(text[-20:]) is None


def test_response_homes_are_bounded_and_follow_ups_go_home():
    from kvevents.engines import EngineSpec

    homes = ResponseHomes(size=2)
    for i in range(3):
        homes.remember(f"r{i}", f"e{i}")
    assert homes.home("r0") is None and homes.home("r1") == "e1"
    e1, e2 = EngineSpec("e1", "tcp://h:1", http="http://h:2"), EngineSpec("e2", "tcp://h:3", http="http://h:4")
    req = parse_responses(b'{"input":"x","previous_response_id":"r1"}')
    assert homes.targets(req, [e1, e2], [e1, e2]) == [e1]
    with pytest.raises(OpenAIError) as err:
        homes.targets(req, [e1, e2], [e2])
    assert err.value.status == 503
    with pytest.raises(OpenAIError) as err:
        homes.targets(req, [e2], [e2])
    assert err.value.status == 404 and err.value.message.startswith("Response with id 'r1' not found")
    fresh = parse_responses(b'{"input":"x","previous_response_id":"unknown"}')
    assert homes.targets(fresh, [e1, e2], [e1, e2]) == [e1, e2]


# -- through kvevents serve ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def served():
    eng = EngineThread([free_port(), free_port()])
    eng.stats.tokenize_prompts = True
    try:
        with GatewayProcess(eng.urls, "--engine-poll-interval", "0.2") as g:
            yield g, eng
    finally:
        eng.close()


def _port(g: GatewayProcess, engine: str) -> int:
    got = {e["name"]: e["http"] for e in httpx.get(g.url + "/v1/engines").json()["engines"]}
    return int(got[engine].rsplit(":", 1)[1])


def test_responses_with_the_openai_client_streamed_and_not(served):
    g, eng = served
    client = openai.OpenAI(base_url=g.url + "/v1", api_key="x", max_retries=0)
    first = client.responses.create(model="fake", input="Hello", max_output_tokens=3,
                                    extra_body={"fake_cached": 5})
    assert first.output_text == "ababab" and first.usage.input_tokens_details.cached_tokens == 5
    with client.responses.stream(model="fake", input="Hello", max_output_tokens=4,
                                 extra_body={"fake_cached": 7}) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        done = stream.get_final_response()
    assert text == "abababab" and done.status == "completed"
    # Both answers' cached tokens read (a whole body's usage, a stream's response.completed)
    assert wait_for(lambda: g.metric("kvevents_gateway_usage_reports_total") == 2, 5)
    assert g.metric("kvevents_gateway_reported_cached_tokens_total") == 12
    # Follow-ups, streamed and not, each on the engine that stored the one it names.
    for _ in range(6):
        raw = client.responses.with_raw_response.create(model="fake", input="Hi", max_output_tokens=1)
        home = raw.headers["x-kvevents-engine"]
        rid = raw.parse().id
        assert rid.startswith(f"resp_{_port(g, home)}_")
        follow = client.responses.with_raw_response.create(model="fake", input="More",
                                                           previous_response_id=rid, max_output_tokens=1)
        assert follow.headers["x-kvevents-engine"] == home
        with client.responses.stream(model="fake", input="Again", previous_response_id=follow.parse().id,
                                     max_output_tokens=2) as stream:
            last = stream.get_final_response()
        assert last.id.startswith(f"resp_{_port(g, home)}_")
        again = client.responses.with_raw_response.create(model="fake", input="!", previous_response_id=last.id)
        assert again.headers["x-kvevents-engine"] == home
    served_by = {port for (port, path) in eng.stats.paths if path == "/v1/responses"}
    assert len(served_by) == 2  # (load spread the first ones over both engines)
    assert wait_for(lambda: g.metric("kvevents_gateway_requests_total", status="200") >= 26, 5)


def test_follow_up_of_a_response_whose_engine_left_is_vllms_404(served):
    g, eng = served
    port = free_port()
    extra = EngineThread([port])
    try:
        add = httpx.post(g.url + "/v1/engines", json={"name": "extra", "endpoint": f"tcp://127.0.0.1:{free_port()}",
                                                      "model": "fake", "http": extra.urls[0]})
        assert add.status_code == 201, add.text
        client = openai.OpenAI(base_url=g.url + "/v1", api_key="x", max_retries=0)
        rid = None
        for _ in range(40):  # until one lands on the new engine (by load)
            raw = client.responses.with_raw_response.create(model="fake", input="Hi", max_output_tokens=1)
            if raw.headers["x-kvevents-engine"] == "extra":
                rid = raw.parse().id
                break
        assert rid is not None
        assert httpx.delete(g.url + "/v1/engines/extra").status_code == 204
        with pytest.raises(openai.NotFoundError) as err:
            client.responses.create(model="fake", input="More", previous_response_id=rid)
        body = err.value.response.json()["error"]
        assert body["message"].startswith(f"Response with id '{rid}' not found")
        assert body["param"] == "previous_response_id" and body["type"] == "invalid_request_error"
    finally:
        extra.close()


def test_stored_responses_are_retrieved_and_cancelled_on_the_engine_that_stored_them(served):
    g, eng = served
    client = openai.OpenAI(base_url=g.url + "/v1", api_key="x", max_retries=0)
    for _ in range(4):
        raw = client.responses.with_raw_response.create(model="fake", input="Hi", max_output_tokens=2)
        rid, home = raw.parse().id, raw.headers["x-kvevents-engine"]
        got = client.responses.with_raw_response.retrieve(rid)
        assert got.headers["x-kvevents-engine"] == home and got.parse().output_text == "abab"
        cancel = httpx.post(f"{g.url}/v1/responses/{rid}/cancel", timeout=5)
        assert cancel.status_code == 200 and cancel.headers["x-kvevents-engine"] == home, cancel.text
    # One this gateway never saw (stored through an engine directly): found by asking.
    direct = httpx.post(eng.urls[1] + "/v1/responses", json={"model": "fake", "input": "x"}, timeout=5).json()
    got = client.responses.with_raw_response.retrieve(direct["id"])
    assert got.parse().id == direct["id"] and _port(g, got.headers["x-kvevents-engine"]) == eng.ports[1]
    # None has it: vLLM's own 404, in OpenAI's shape.
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve("resp_nowhere")
    assert err.value.response.json()["error"]["message"] == "Response with id 'resp_nowhere' not found."


def _settled(read, pause: float = 0.3) -> float:
    """A counter once the counts of answers already written have landed."""
    last, now = None, read()
    while now != last:
        time.sleep(pause)
        last, now = now, read()
    return now


def test_embeddings_by_load_and_counted(served):
    g, eng = served
    before = _settled(lambda: g.metric("kvevents_gateway_requests_total", status="200"))
    client = openai.OpenAI(base_url=g.url + "/v1", api_key="x", max_retries=0)
    for _ in range(8):
        got = client.embeddings.create(model="fake", input=["a", "b"])
        assert [d.embedding for d in got.data] == [[0.5, -0.5], [0.5, -0.5]]
    assert wait_for(lambda: g.metric("kvevents_gateway_requests_total", status="200") - before == 8, 5)
    assert len({port for (port, path) in eng.stats.paths if path == "/v1/embeddings"}) == 2


def test_tokenize_and_detokenize_passed_through(served):
    g, _ = served
    tok = httpx.post(g.url + "/tokenize", json={"model": "fake", "prompt": "hi"})
    assert tok.status_code == 200 and tok.json()["tokens"] == [104, 105] and tok.headers["x-kvevents-engine"]
    de = httpx.post(g.url + "/detokenize", json={"model": "fake", "tokens": [104, 105]})
    assert de.status_code == 200 and de.json() == {"prompt": "hi"}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/responses", b'{"model":"fake"}', "input"),
    ("/v1/responses", b'{"model":"fake","input":"x","previous_response_id":7}', "previous_response_id"),
    ("/v1/embeddings", b'{"model":"fake"}', "input"),
    ("/v1/embeddings", b'{"model":1,"input":"x"}', "model"),
    ("/detokenize", b'{"model":"fake"}', "tokens"),
    ("/tokenize", b'not json', None),
    ("/v1/responses", b'{"model":"other","input":"x"}', "model"),
])
def test_bad_bodies_are_4xx_naming_the_field(served, path, body, param):
    g, _ = served
    resp = httpx.post(g.url + path, content=body, headers={"content-type": "application/json"})
    assert 400 <= resp.status_code < 500, resp.text
    assert resp.json()["error"]["param"] == param
