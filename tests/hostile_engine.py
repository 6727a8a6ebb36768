"""A fast fake OpenAI engine for the hostile-client tests and ``bench_hostile_clients.py``:
raw asyncio + httptools, vLLM-shaped SSE, ``/metrics`` gauges, and a count of the answers
it is streaming now (what a hostile client must not leave open on an engine).

Answers ``POST /v1/chat/completions`` and ``/v1/completions``: ``max_tokens`` chunks
(default 64), one every ``fake_interval_ms`` (default 2), each padded to
``fake_chunk_bytes`` (default: a short vLLM-like chunk); streamed when ``"stream": true``
(with a usage chunk and ``[DONE]``), else one JSON answer; ``fake_break_after``: the
connection is closed after that many chunks (an engine that dies mid-answer);
``fake_break_at_end``: closed after ``[DONE]``, before the chunked body's end marker;
``fake_delay_ms``: a whole answer sent that long after its request. A stream counts as *open*
from its request until its last byte is written or its connection is lost (the gateway
closed it). It stops writing while the gateway's socket is full (backpressure) and
resumes when it drains. ``GET /metrics``: vLLM's three load gauges. ``POST /tokenize``
(a chat's ids, ``transformers``' own) when started with a tokenizer. ``GET /stats``:
``{"open", "peak", "started", "finished", "aborted"}`` (``/stats/reset``: the same, then
the peak starts again from the streams open now). Each completion request's
``X-data-parallel-rank`` header is recorded in ``stats.ranks``, its body in
``stats.bodies``. A whole answer to a request with ``kv_transfer_params``
``{"do_remote_decode": true}`` (a disaggregated request's prefill hop) returns
``kv_transfer_params`` shaped as vLLM's NIXL connector returns them.

As vLLM 0.32 answers them: ``POST /v1/responses`` (streamed: ``response.created``, text
deltas, ``response.completed`` with the usage; each response stored by the engine that
answered it, whose id names that engine's port; a ``previous_response_id`` it does not
hold is vLLM's 404; ``fake_cached``: the cached tokens its usage reports; ``GET
/v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel`` answer a stored one, else 404),
``POST /v1/embeddings`` (a two-number vector per input), ``POST /detokenize`` and, with
``stats.tokenize_prompts`` set (and no tokenizer), ``POST /tokenize`` (a prompt's
characters as ids). Each of these paths' requests is counted per engine port in
``stats.paths``.

Several engines (one per port) run on one event loop and are counted together. Run in
a thread (:class:`EngineThread`, for tests) or as a process (``python
tests/hostile_engine.py --port P [--port P2]``, for the benchmark). 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading

import httptools

_METRICS = (b"vllm:num_requests_waiting 0\nvllm:num_requests_running %d\n"
            b"vllm:kv_cache_usage_perc 0.1\n")


class Stats:
    def __init__(self) -> None:
        self.open = self.peak = self.started = self.finished = self.aborted = 0
        self.tokenized = 0  # /tokenize answers
        # Each completion request's X-data-parallel-rank header, in order (None: absent).
        self.ranks: list[bytes | None] = []
        self.bodies: list[dict] = []  # each completion request's body, in order
        self.transports: set = set()  # open connections (closed when serving stops)
        # (messages dicts, add_generation_prompt) -> ids: set by EngineThread(tokenizer=...)
        self.tokenize = None
        # GET /v1/models' answer (vLLM's carries max_model_len: EngineThread(max_model_len=...))
        self.models = b'{"object":"list","data":[{"id":"fake"}]}'
        self.stored: dict[int, dict[str, dict]] = {}  # port -> the responses it stored, by id
        self.paths: dict[tuple[int, str], int] = {}  # (port, path) -> requests
        self.tokenize_prompts = False  # POST /tokenize of a prompt, without a tokenizer
        # POST /v1/chat/completions/render: body dict -> answer dict (None: 404, as a
        # vLLM without --enable-scale-out answers 403); set by EngineThread(render=...)
        self.render = None
        self.rendered: list[dict] = []  # the render requests' bodies

    def as_dict(self) -> dict:
        return {"open": self.open, "peak": self.peak, "started": self.started,
                "finished": self.finished, "aborted": self.aborted}


class _Conn(asyncio.Protocol):
    def __init__(self, stats: Stats, port: int = 0) -> None:
        self.stats = stats
        self.port = port
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []
        self.streaming = False  # an answer is being written
        self.paused = False
        self.pending: list = []  # the next step, held while the socket is full
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.stats.transports.add(transport)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def connection_lost(self, exc) -> None:
        self.stats.transports.discard(self.transport)
        if self.timer is not None:
            self.timer.cancel()
        if self.streaming:
            self.streaming = False
            self.stats.open -= 1
            self.stats.aborted += 1

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.pending:
            step, self.pending = self.pending[0], []
            step()

    def on_message_begin(self) -> None:
        self.url, self.body, self.rank = b"", [], None

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"x-data-parallel-rank":
            self.rank = value

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method()
        if method == b"GET" and self.url.startswith(b"/metrics"):
            self._reply(200, b"text/plain", _METRICS % self.stats.open)
        elif method == b"GET" and self.url in (b"/stats", b"/stats/reset"):
            self._reply(200, b"application/json", json.dumps(self.stats.as_dict()).encode())
            if self.url == b"/stats/reset":  # a new measurement: the peak from now on
                self.stats.peak = self.stats.open
        elif method == b"GET" and self.url == b"/health":
            self._reply(200, b"application/json", b"{}")
        elif method == b"GET" and self.url == b"/v1/models":
            self._reply(200, b"application/json", self.stats.models)
        elif method == b"POST" and self.url == b"/tokenize" and self.stats.tokenize is not None:
            try:
                doc = json.loads(b"".join(self.body))
                ids = self.stats.tokenize(doc["messages"], doc.get("add_generation_prompt", True),
                                          doc.get("tools"))
            except (ValueError, KeyError, TypeError) as exc:
                self._reply(400, b"application/json", json.dumps({"error": str(exc)}).encode())
                return
            self.stats.tokenized += 1
            self._reply(200, b"application/json", json.dumps({"count": len(ids), "tokens": ids}).encode())
        elif self.url.startswith(b"/v1/responses/"):  # retrieve (GET) or cancel (POST .../cancel)
            rid, _, action = self.url[len(b"/v1/responses/"):].partition(b"?")[0].decode().partition("/")
            key = (self.port, "/v1/responses/{id}" + ("/" + action if action else ""))
            self.stats.paths[key] = self.stats.paths.get(key, 0) + 1
            response = self.stats.stored.get(self.port, {}).get(rid)
            if response is None or (method, action) not in ((b"GET", ""), (b"POST", "cancel")):
                self._reply(404, b"application/json", _error(404, f"Response with id '{rid}' not found.",
                                                             "response_id"))
            else:
                self._reply(200, b"application/json", json.dumps(response).encode())
        elif method == b"POST" and self.url == b"/v1/chat/completions/render" and self.stats.render:
            doc = json.loads(b"".join(self.body))
            self.stats.rendered.append(doc)
            self._reply(200, b"application/json", json.dumps(self.stats.render(doc)).encode())
        elif method == b"POST" and (self.url in _VLLM_PATHS or (
                self.url == b"/tokenize" and self.stats.tokenize_prompts)):
            key = (self.port, self.url.decode())
            self.stats.paths[key] = self.stats.paths.get(key, 0) + 1
            try:
                doc = json.loads(b"".join(self.body))
            except ValueError:
                doc = None
            if not isinstance(doc, dict):
                self._reply(400, b"application/json", _error(400, "invalid JSON body", None))
            else:
                getattr(self, "_" + self.url.decode().strip("/").replace("v1/", ""))(doc)
        elif method == b"POST" and self.url in (b"/v1/chat/completions", b"/v1/completions"):
            self.stats.ranks.append(self.rank)
            try:
                doc = json.loads(b"".join(self.body))
            except ValueError:
                doc = {}
            self.stats.bodies.append(doc)
            self._answer(doc if isinstance(doc, dict) else {})
        else:
            self._reply(404, b"application/json", b'{"error":"not found"}')

    def _responses(self, doc: dict) -> None:
        store = self.stats.stored.setdefault(self.port, {})
        prev = doc.get("previous_response_id")
        if prev is not None and prev not in store:  # vLLM's own answer
            self._reply(404, b"application/json", _error(404, f"Response with id '{prev}' not found.",
                                                         "response_id"))
            return
        rid = f"resp_{self.port}_{len(store)}"
        n = int(doc.get("max_output_tokens") or 4)
        usage = {"input_tokens": 10, "input_tokens_details": {"cached_tokens": int(doc.get("fake_cached", 0))},
                 "output_tokens": n, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 10 + n}
        text = "ab" * n
        response = {"id": rid, "created_at": 1, "model": doc.get("model"), "object": "response",
                    "output": [{"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
                                "content": [{"type": "output_text", "text": text, "annotations": []}]}],
                    "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "status": "completed",
                    "previous_response_id": prev, "usage": usage}
        store[rid] = response
        if not doc.get("stream"):
            self._reply(200, b"application/json", json.dumps(response).encode())
            return
        created = dict(response, status="in_progress", output=[], usage=None)
        item, at = response["output"][0], {"item_id": "msg_1", "output_index": 0, "content_index": 0}
        part = {"type": "output_text", "text": "", "annotations": []}
        events = [("response.created", {"response": created}),
                  ("response.output_item.added", {"output_index": 0, "item": dict(item, content=[],
                                                                                  status="in_progress")}),
                  ("response.content_part.added", {**at, "part": part}),
                  *(("response.output_text.delta", {**at, "delta": "ab", "logprobs": []}) for _ in range(n)),
                  ("response.output_text.done", {**at, "text": text, "logprobs": []}),
                  ("response.content_part.done", {**at, "part": dict(part, text=text)}),
                  ("response.output_item.done", {"output_index": 0, "item": item}),
                  ("response.completed", {"response": response})]
        self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
        for seq, (kind, data) in enumerate(events):  # (vLLM writes "type" last)
            event = b"event: %s\ndata: %s\n\n" % (kind.encode(), json.dumps(
                {**data, "sequence_number": seq, "type": kind}, separators=(",", ":")).encode())
            self.transport.write(b"%x\r\n%s\r\n" % (len(event), event))
        self.transport.write(b"0\r\n\r\n")

    def _embeddings(self, doc: dict) -> None:
        inputs = doc.get("input")
        inputs = inputs if isinstance(inputs, list) else [inputs]
        self._reply(200, b"application/json", json.dumps({
            "id": "embd-1", "object": "list", "model": doc.get("model"), "created": 1,
            "data": [{"index": i, "object": "embedding", "embedding": [0.5, -0.5]} for i in range(len(inputs))],
            "usage": {"prompt_tokens": 3, "total_tokens": 3}}).encode())

    def _tokenize(self, doc: dict) -> None:
        ids = [ord(c) for c in str(doc.get("prompt", ""))]
        self._reply(200, b"application/json", json.dumps(
            {"count": len(ids), "max_model_len": 4096, "tokens": ids, "token_strs": None}).encode())

    def _detokenize(self, doc: dict) -> None:
        self._reply(200, b"application/json", json.dumps(
            {"prompt": "".join(chr(t) for t in doc.get("tokens") or [])}).encode())

    def _reply(self, status: int, ctype: bytes, body: bytes) -> None:
        self.transport.write(b"HTTP/1.1 %d X\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
                             % (status, ctype, len(body), body))

    def _answer(self, doc: dict) -> None:
        n = int(doc.get("max_tokens") or 64)
        cut = doc.get("fake_break_after")  # close the connection after this many chunks
        interval = float(doc.get("fake_interval_ms", 2)) / 1000
        pad = int(doc.get("fake_chunk_bytes", 0))
        text = "abc" + "x" * max(0, pad - 120)
        chunk = b"data: " + json.dumps({"id": "cmpl-1", "object": "chat.completion.chunk",
                                        "choices": [{"index": 0, "delta": {"content": text}}]}
                                       ).encode() + b"\n\n"
        if not doc.get("stream"):
            answer = {"id": "cmpl-1", "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": text * n}}],
                "usage": {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n,
                          "prompt_tokens_details": {"cached_tokens": 0}}}
            params = doc.get("kv_transfer_params")
            if isinstance(params, dict) and params.get("do_remote_decode"):
                answer["kv_transfer_params"] = {
                    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [7, 8],
                    "remote_engine_id": "fake-prefill", "remote_host": "127.0.0.1", "remote_port": 5600}
            body = json.dumps(answer).encode()
            delay = float(doc.get("fake_delay_ms", 0)) / 1000
            if delay:  # (an engine still computing: the gateway waits for its head)
                asyncio.get_running_loop().call_later(
                    delay, lambda: None if self.transport.is_closing() else self._reply(
                        200, b"application/json", body))
                return
            self._reply(200, b"application/json", body)
            return
        self.stats.open += 1
        self.stats.started += 1
        self.stats.peak = max(self.stats.peak, self.stats.open)
        self.streaming = True
        self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
        loop = asyncio.get_running_loop()
        left = [n]

        def step() -> None:
            self.timer = None
            if not self.streaming or self.transport.is_closing():
                return
            if self.paused:
                self.pending = [step]
                return
            if cut is not None and n - left[0] >= cut:  # the engine dies mid-answer
                self.transport.close()
                return
            if left[0] > 0:
                left[0] -= 1
                self.transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.timer = loop.call_later(interval, step)
                return
            end = (b'data: {"id":"cmpl-1","choices":[],"usage":{"prompt_tokens":10,'
                   b'"completion_tokens":%d,"prompt_tokens_details":{"cached_tokens":0}}}\n\n'
                   b"data: [DONE]\n\n" % n)
            if doc.get("fake_break_at_end"):  # dies after [DONE], before the body's end
                self.transport.write(b"%x\r\n%s\r\n" % (len(end), end))
                self.transport.close()
                return
            self.transport.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(end), end))
            self.streaming = False
            self.stats.open -= 1
            self.stats.finished += 1

        self.timer = loop.call_later(interval, step)


_VLLM_PATHS = (b"/v1/responses", b"/v1/embeddings", b"/detokenize")


def _error(status: int, message: str, param: str | None) -> bytes:
    """vLLM's error body."""
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                 "code": status}}).encode()


async def serve(ports: list[int], stats: Stats, started: threading.Event | None = None,
                stop: asyncio.Event | None = None) -> None:
    """Serve on every port of ``ports`` (one engine each, counted together in ``stats``)."""
    loop = asyncio.get_running_loop()
    servers = [await loop.create_server(lambda p=port: _Conn(stats, p), "127.0.0.1", port, backlog=4096)
               for port in ports]
    if started is not None:
        started.set()
    try:
        await (asyncio.Event().wait() if stop is None else stop.wait())
    finally:
        for server in servers:
            server.close()
        for transport in list(stats.transports):  # as a process that ends closes its sockets
            transport.close()


def models_answer(max_model_len: int) -> bytes:
    """``GET /v1/models`` with the model's context, as vLLM gives it."""
    return json.dumps({"object": "list", "data": [
        {"id": "fake", "object": "model", "max_model_len": max_model_len}]}).encode()


class EngineThread:
    """Fake engines on one event loop thread, one per port of ``ports``, counted together
    in ``stats`` (read live: their sum, so ``peak`` is the fleet's)."""

    def __init__(self, ports: list[int], tokenizer: str | None = None, template: str | None = None,
                 max_model_len: int | None = None, render=None) -> None:
        """``tokenizer``: a tokenizer directory; then ``POST /tokenize`` answers a chat's
        ids as ``transformers``' ``apply_chat_template`` gives them for its messages,
        ``add_generation_prompt`` and ``tools`` (with ``template`` instead of the
        directory's, if given). ``render``: the answer of ``POST
        /v1/chat/completions/render`` to a body (vLLM's ``GenerateRequest`` shape)."""
        self.ports = ports
        self.urls = [f"http://127.0.0.1:{p}" for p in ports]
        self.stats = Stats()
        self.stats.render = render
        if max_model_len is not None:
            self.stats.models = models_answer(max_model_len)
        if tokenizer is not None:
            from transformers import AutoTokenizer

            auto = AutoTokenizer.from_pretrained(tokenizer)

            def tokenize(messages: list, generation: bool, tools: list | None = None) -> list[int]:
                out = auto.apply_chat_template(messages, chat_template=template, tokenize=True,
                                               add_generation_prompt=generation, tools=tools)
                return list(out["input_ids"] if hasattr(out, "keys") else out)
            self.stats.tokenize = tokenize
        self._started = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("the fake engine did not start")

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            await serve(self.ports, self.stats, self._started, self._stop)
        asyncio.run(main())

    def close(self) -> None:
        """Stop serving (its ports then refuse connections); idempotent."""
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(5)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="a fake OpenAI engine (127.0.0.1)")
    ap.add_argument("--port", type=int, action="append", required=True, help="repeatable")
    ap.add_argument("--max-model-len", type=int, default=0, help="in /v1/models, as vLLM gives it")
    a = ap.parse_args()
    stats = Stats()
    if a.max_model_len:
        stats.models = models_answer(a.max_model_len)
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(a.port, stats))
