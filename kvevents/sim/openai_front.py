"""An OpenAI-compatible HTTP front for the simulated engine process, like ``vllm serve``.

Routes (one port): ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models``, ``GET /health``, ``POST /tokenize`` (vLLM's) and ``GET /metrics``
(the process's registry in the classic text format, so ``vllm:*`` names keep their
colon; see :func:`kvevents.sim.metrics.serve_metrics`). A request is submitted to the
engine over the process's own RPC (a DEALER on the ROUTER's ``inproc`` endpoint, one
request id each) and answered from its ``done`` reply: ``usage.prompt_tokens_details.
cached_tokens`` = GPU + CPU-tier hit tokens, ``completion_tokens`` = ``max_tokens``
(default 16; finish_reason "length"). The text is deterministic: ``max_tokens`` pieces
(single-token words of the tokenizer's vocabulary, else `` tok<n>``) chosen from a CRC of
the prompt ids, so the same request gets the same content from any engine, streamed or not.
Streams are vLLM's: one chunk per token (chat: a role chunk first; ``finish_reason`` on
the last token's chunk), a usage chunk (``choices: []``) only with
``stream_options.include_usage``, then ``data: [DONE]``. The engine does not stream:
every chunk is sent once the engine has finished the request, as fast as the client reads
or ``token_interval`` seconds apart (``--http-token-interval``: a stream held open for a
known time, whatever the machine's speed). Other OpenAI fields
(temperature, stop...) are accepted and ignored; ``n`` > 1 and batched prompts are a 400.

Lifecycle: :class:`OpenAIFront` binds its TCP socket at construction (a taken port fails
the process before the engine is built), :meth:`~OpenAIFront.start` runs uvicorn in a
daemon thread with its own asyncio loop and returns once it accepts connections;
:meth:`~OpenAIFront.stop` (the process's ``close``: SIGTERM, SIGINT or the ``stop`` op)
answers requests still waiting with 503, stops uvicorn (2 s grace) and joins the thread.

Threads: the engine loop stays single-threaded; this front only talks RPC, from its own
thread. ``/metrics`` reads the registry from this thread, as ``serve_metrics`` does.

Failure: bad input is a 4xx in OpenAI's shape ``{"error": {"message", "type", "param",
"code"}}`` (unknown model: 404 ``model_not_found``; too long: 400
``context_length_exceeded``; whatever the engine's ``submit`` rejects: 400 with its
reason). A client that disconnects before its answer: the engine still runs the request
(it cannot abort); its reply is dropped and counted in
``kvevents_sim_http_disconnects_total``; ``kvevents_sim_http_inflight`` is the number of
requests the engine has not answered yet.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import threading
import time
import uuid
import zlib
from array import array
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvevents.text import ChatTemplateError, TextTokenizer
from kvevents.text.chat import ChatMessage

RPC_INPROC = "inproc://kvevents-sim-openai"  # the process's ROUTER binds this too
DEFAULT_MODEL = "sim"
_NO_VOCAB = 2**31  # token ids accepted without a tokenizer: [0, 2**31)
_WORD = re.compile(r" [a-z]{2,12}")


class FrontError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "service_unavailable_error"
        return JSONResponse({"error": {"message": self.message, "type": kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


def _vocabulary(tok_dir: str | None) -> tuple[int, list[str]]:
    """The vocabulary's size and up to 256 of its single-token words (`` the``...)."""
    if tok_dir is None:
        return _NO_VOCAB, []
    from tokenizers import Tokenizer
    tk = Tokenizer.from_file(f"{tok_dir}/tokenizer.json")
    size, words = tk.get_vocab_size(with_added_tokens=True), []
    for i in range(min(size, 50_000)):
        s = tk.decode([i], skip_special_tokens=True)
        if _WORD.fullmatch(s) and tk.encode(s, add_special_tokens=False).ids == [i]:
            words.append(s)
            if len(words) == 256:
                break
    return size, words


def _int(body: dict, key: str, default: int | None, low: int) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise FrontError(400, f"{key} must be an integer >= {low}", key)
    return v


def _bool(body: dict, key: str) -> bool:
    v = body.get(key)
    if v is not None and not isinstance(v, bool):
        raise FrontError(400, f"{key} must be a boolean", key)
    return bool(v)


async def _health(_: Request) -> Response:
    return Response(status_code=200)


class OpenAIFront:
    """See the module docstring."""

    def __init__(self, host: str, port: int, model: str = DEFAULT_MODEL,
                 tokenizer: TextTokenizer | None = None, tokenizer_dir: str | None = None,
                 token_interval: float = 0.0) -> None:
        self.host, self.port, self.model, self.tokenizer = host, port, model, tokenizer
        self.token_interval = token_interval
        self.vocab, self.words = _vocabulary(tokenizer_dir)
        try:
            self.sock = socket.create_server(
                (host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        except OSError as exc:
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            raise OSError(f"--http-port {port} on {host}: {reason}") from None
        self.created = int(time.time())
        self._pending: dict[str, asyncio.Future] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: Any = None

    def start(self, ctx: zmq.Context, registry: CollectorRegistry, engine: str,
              max_model_len: int, model_label: str = "") -> None:
        import uvicorn

        self.max_model_len = max_model_len
        self.registry = registry
        lv = (model_label, engine)
        self.disconnects = Counter("kvevents_sim_http_disconnects", "OpenAI requests whose client "
                                   "left before the answer", ["model_name", "engine"],
                                   registry=registry).labels(*lv)
        inflight = Gauge("kvevents_sim_http_inflight", "OpenAI requests the engine has not "
                         "answered yet", ["model_name", "engine"], registry=registry).labels(*lv)
        inflight.set_function(lambda: len(self._pending))
        self._ctx = zmq.asyncio.Context.shadow(ctx.underlying)
        self._server = uvicorn.Server(uvicorn.Config(
            self.app(), log_level="warning", access_log=False, lifespan="off",
            timeout_graceful_shutdown=2, loop="asyncio"))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._main(),),
                                        name="openai-front", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 15
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._server.started:
            raise RuntimeError(f"the OpenAI front on {self.host}:{self.port} did not start")

    async def _main(self) -> None:
        """The front thread's whole life: the DEALER and its reader, then uvicorn."""
        self._dealer = self._ctx.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.LINGER, 0)
        self._dealer.connect(RPC_INPROC)
        reader = asyncio.create_task(self._read_replies())
        try:
            await self._server.serve(sockets=[self.sock])
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            self._fail_pending()
            self._dealer.close(0)

    def stop(self, timeout: float = 5.0) -> None:
        if self._thread is None or self._loop is None:
            self.sock.close()
            return
        try:
            self._loop.call_soon_threadsafe(self._fail_pending)
        except RuntimeError:  # the loop is already closed
            pass
        self._server.should_exit = True
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._loop.close()
        self.sock.close()

    def _fail_pending(self) -> None:
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(FrontError(503, "the engine stopped before answering"))
        self._pending.clear()

    async def _read_replies(self) -> None:
        dec = msgspec.msgpack.Decoder(dict)
        while True:
            try:
                msg = dec.decode(await self._dealer.recv())
            except msgspec.DecodeError:
                continue
            fut = self._pending.pop(str(msg.get("id")), None)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    async def _submit(self, ids: list[int], max_tokens: int) -> dict[str, Any]:
        rid = f"oai-{uuid.uuid4().hex}"
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            await self._dealer.send(msgspec.msgpack.encode(
                {"op": "submit", "id": rid, "token_ids": ids, "max_new_tokens": max_tokens}))
        except zmq.ZMQError:  # closing
            self._pending.pop(rid, None)
            raise FrontError(503, "the engine is stopping") from None
        reply = await fut
        if reply.get("op") == "error":
            reason = str(reply.get("error", "rejected")).removeprefix("submit: ")
            raise FrontError(400, f"the engine rejected the request: {reason}")
        return reply

    async def _body(self, request: Request) -> dict[str, Any]:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            raise FrontError(400, "request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise FrontError(400, "request body must be a JSON object")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise FrontError(400, "model must be a string", "model")
        if model is not None and model != self.model:
            raise FrontError(404, f"The model `{model}` does not exist.", "model", "model_not_found")
        return body

    def _need_tokenizer(self, param: str) -> TextTokenizer:
        if self.tokenizer is None:
            raise FrontError(400, f"{param}: this engine has no tokenizer (start it with "
                             "--tokenizer DIR); send token ids", param)
        return self.tokenizer

    def _encode(self, param: str, fn: Any, arg: Any) -> list[int]:
        try:
            return list(fn(arg))
        except ChatTemplateError as exc:
            raise FrontError(400, f"{param}: {exc}", param) from None
        except Exception as exc:  # a tokenizer refusing odd text is the input's fault
            raise FrontError(400, f"{param}: cannot tokenize ({exc})", param) from None

    def _ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            tok = self._need_tokenizer("prompt")
            return self._encode("prompt", tok.encode_prompt, prompt)
        if not isinstance(prompt, list) or not prompt:
            raise FrontError(400, "prompt must be a string, a non-empty list of token ids, "
                             "or a list with one of those", "prompt")
        if any(isinstance(p, (str, list)) for p in prompt):
            raise FrontError(400, "prompt: only one prompt per request is supported", "prompt")
        for t in prompt:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab:
                raise FrontError(400, f"prompt: token id {t!r} is not an integer in "
                                 f"[0, {self.vocab})", "prompt")
        return prompt

    def _messages(self, body: dict) -> list[int]:
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise FrontError(400, "messages must be a non-empty list of messages", "messages")
        tok = self._need_tokenizer("messages")
        try:
            msgs = msgspec.convert(raw, list[ChatMessage])
        except msgspec.ValidationError as exc:
            raise FrontError(400, "messages: " + str(exc).replace("`$", "`messages"),
                             "messages") from None
        return self._encode("messages", tok.encode_chat, msgs)

    def _options(self, body: dict, ids: list[int], param: str) -> tuple[int, bool, bool]:
        max_tokens = _int(body, "max_completion_tokens", None, 1) or _int(body, "max_tokens", 16, 1)
        if _int(body, "n", 1, 1) != 1:
            raise FrontError(400, "n: only n=1 is supported", "n")
        stream = _bool(body, "stream")
        opts = body.get("stream_options")
        if opts is not None and not isinstance(opts, dict):
            raise FrontError(400, "stream_options must be an object", "stream_options")
        usage = stream and _bool(opts or {}, "include_usage")
        if not ids:
            raise FrontError(400, f"{param}: the prompt is empty", param)
        if len(ids) + max_tokens > self.max_model_len:
            raise FrontError(400, f"This model's maximum context length is {self.max_model_len} "
                             f"tokens. However, you requested {len(ids) + max_tokens} tokens "
                             f"({len(ids)} in the {param}, {max_tokens} in the completion).",
                             param if len(ids) >= self.max_model_len else "max_tokens",
                             "context_length_exceeded")
        return max_tokens, stream, usage

    def _pieces(self, ids: list[int], n: int) -> list[str]:
        h = zlib.crc32(array("q", ids).tobytes())
        if self.words:
            return [self.words[(h + i) % len(self.words)] for i in range(n)]
        return [f" tok{(h + i) % 1000}" for i in range(n)]

    def app(self) -> Starlette:
        async def http_error(_: Request, exc: Exception) -> Response:
            assert isinstance(exc, HTTPException)
            code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
            return FrontError(exc.status_code, str(exc.detail), None, code).response()

        routes = [Route("/v1/completions", self._wrap(self.completions), methods=["POST"]),
                  Route("/v1/chat/completions", self._wrap(self.chat), methods=["POST"]),
                  Route("/tokenize", self._wrap(self.tokenize), methods=["POST"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/health", _health, methods=["GET"]),
                  Route("/metrics", self.metrics, methods=["GET"])]
        return Starlette(routes=routes, exception_handlers={HTTPException: http_error})

    @staticmethod
    def _wrap(handler: Any) -> Any:
        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except FrontError as exc:
                return exc.response()
        return route

    async def completions(self, request: Request) -> Response:
        body = await self._body(request)
        if "prompt" not in body:
            raise FrontError(400, "prompt is required", "prompt")
        return await self._generate(request, body, self._ids(body["prompt"]), "prompt", chat=False)

    async def chat(self, request: Request) -> Response:
        body = await self._body(request)
        return await self._generate(request, body, self._messages(body), "messages", chat=True)

    async def _generate(self, request: Request, body: dict, ids: list[int], param: str,
                        chat: bool) -> Response:
        max_tokens, stream, include_usage = self._options(body, ids, param)
        done = await self._submit(ids, max_tokens)
        if await request.is_disconnected():
            self.disconnects.inc()
            return Response(status_code=204)
        pieces = self._pieces(ids, max_tokens)
        prompt = int(done["prompt_tokens"])
        usage = {"prompt_tokens": prompt, "completion_tokens": max_tokens,
                 "total_tokens": prompt + max_tokens,
                 "prompt_tokens_details": {"cached_tokens": int(done["gpu_hit_tokens"])
                                           + int(done["cpu_hit_tokens"])}}
        obj = ("chat.completion.chunk" if stream else "chat.completion") if chat \
            else "text_completion"
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "object": obj,
                "created": int(time.time()), "model": self.model}
        if not stream:
            text = "".join(pieces)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}}
                      if chat else {"index": 0, "text": text})
            choice.update(logprobs=None, finish_reason="length", stop_reason=None)
            return JSONResponse({**head, "choices": [choice], "usage": usage})
        return StreamingResponse(self._stream(head, pieces, usage if include_usage else None, chat),
                                 media_type="text/event-stream")

    async def _stream(self, head: dict, pieces: list[str], usage: dict | None, chat: bool):
        def chunk(choices: list, **extra: Any) -> bytes:
            data = json.dumps({**head, "choices": choices, **extra},
                              ensure_ascii=False, separators=(",", ":"))
            return f"data: {data}\n\n".encode()

        finished = False
        try:
            if chat:
                yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
            for i, piece in enumerate(pieces):
                last = "length" if i == len(pieces) - 1 else None
                choice = {"index": 0, "delta": {"content": piece}} if chat else \
                         {"index": 0, "text": piece}
                choice.update(logprobs=None, finish_reason=last, stop_reason=None)
                if i and self.token_interval:
                    await asyncio.sleep(self.token_interval)
                yield chunk([choice])
            if usage is not None:
                yield chunk([], usage=usage)
            yield b"data: [DONE]\n\n"
            finished = True
        finally:
            if not finished:
                self.disconnects.inc()

    async def tokenize(self, request: Request) -> Response:
        body = await self._body(request)
        if "messages" in body:
            ids = self._messages(body)
        elif isinstance(body.get("prompt"), str):
            ids = self._encode("prompt", self._need_tokenizer("prompt").encode_prompt,
                               body["prompt"])
        else:
            raise FrontError(400, "prompt (a string) or messages is required", "prompt")
        return JSONResponse({"count": len(ids), "max_model_len": self.max_model_len,
                             "tokens": ids, "token_strs": None})

    async def models(self, _: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.model, "object": "model", "created": self.created,
            "owned_by": "kvevents-sim", "root": self.model, "parent": None,
            "max_model_len": self.max_model_len}]})

    async def metrics(self, _: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_PLAIN_0_0_4)
