"""A fast fake OpenAI engine and a fast load generator, for bench_gateway_cost.py.

Both are raw asyncio protocols with httptools on uvloop, one process each, so the
benchmark measures the router between them, not them.

The engine (``python fake_openai.py engine --port P --zmq-port Z --replay-port R``):
``POST /v1/chat/completions`` answers vLLM-shaped: streamed, a ``text/event-stream`` in
chunked transfer encoding with ``--chunks`` chunks of ``--tokens-per-chunk`` tokens
(fewer when the request's ``max_tokens`` stops it earlier; one HTTP chunk each,
``bench_step_ms`` in the body spaces them, as decode steps do),
the usage chunk when ``stream_options.include_usage``, then ``data: [DONE]``; not
streamed, one JSON answer. The text is a deterministic function of the request's
messages (:func:`answer_key`: a router may re-serialize the body, as vllm-router does,
adding its defaults), so the load generator checks every byte it gets. ``GET /metrics``
has vLLM's load gauges; ``GET /v1/models`` and ``GET /health`` answer; a ZeroMQ
publisher with a replay socket is bound on 127.0.0.1. Without ``--tokenizer`` it
publishes nothing (the index stays empty, the routing decision still runs); with
``--tokenizer DIR`` it tokenizes each chat as the gateway does and publishes its prompt's
full 16-token blocks that it does not hold yet (``BlockStored``, one batch a request),
keeping ``--capacity`` blocks and publishing the least recently used ones it drops
(``BlockRemoved``), as a prefix-caching engine does; ``--no-publish`` keeps that work
and publishes nothing (a vLLM engine hashes its prompts' blocks whether or not it
publishes events: this is its work with events off). ``POST /v1/chat/completions/render``
answers as vLLM 0.32 does (a generate request: ``request_id``, the prompt's
``token_ids``, ``sampling_params``, ``model``...), the chat tokenized with ``--tokenizer``
or ``--render-tokenizer`` (the demo's chat template); vllm-router's ``cache_aware`` asks it
before every routing decision.

The load generator (``python fake_openai.py load --port P --bodies F --requests N
--concurrency C``) keeps C keep-alive connections, each sending its share of the requests
one after the other, checks each answer against :func:`answer`, and prints one JSON line:
wall time, latencies, mismatches, its own CPU seconds. The latency probe (``python
fake_openai.py probe --port P --direct-port E --bodies F``) sends each body through the
router and straight to the engine, one at a time, and prints both sides' latencies.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
import time
import zlib

import httptools

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
         "rho sigma tau upsilon phi chi psi omega").split()


def answer_key(doc: dict) -> bytes:
    """What the answer depends on: the messages, compact JSON (the same through any router
    that keeps them, whatever else it adds to or reorders in the body)."""
    return json.dumps(doc["messages"], separators=(",", ":")).encode()


def answer_chunks(doc: dict, chunks: int, per_chunk: int) -> int:
    """Chunks in the answer to request ``doc``: ``chunks``, fewer when the request's
    ``max_tokens`` (or ``max_completion_tokens``) stops it earlier."""
    limit = doc.get("max_tokens", doc.get("max_completion_tokens"))
    if type(limit) is int and limit > 0:
        return min(chunks, -(-limit // per_chunk))
    return chunks


def answer(body: bytes, chunks: int, per_chunk: int) -> tuple[list[bytes], bytes]:
    """The SSE events of a streamed answer to messages ``body`` (:func:`answer_key`) and the
    non-streamed JSON."""
    seed = zlib.crc32(body)
    pieces = [" ".join(WORDS[(seed + i * per_chunk + j) % len(WORDS)] for j in range(per_chunk))
              for i in range(chunks)]
    rid = f"chatcmpl-{seed:08x}"
    events = [f'data: {{"id":"{rid}","object":"chat.completion.chunk","model":"m","choices":'
              f'[{{"index":0,"delta":{{"role":"assistant","content":""}},"finish_reason":null}}]}}\n\n'.encode()]
    for i, text in enumerate(pieces):
        finish = '"length"' if i == chunks - 1 else "null"
        events.append(f'data: {{"id":"{rid}","object":"chat.completion.chunk","model":"m","choices":'
                      f'[{{"index":0,"delta":{{"content":"{text}"}},"finish_reason":{finish}}}]}}\n\n'.encode())
    usage = (f'{{"prompt_tokens":{len(body) // 4},"completion_tokens":{chunks * per_chunk},'
             f'"total_tokens":{len(body) // 4 + chunks * per_chunk},'
             f'"prompt_tokens_details":{{"cached_tokens":0}}}}')
    events.append(f'data: {{"id":"{rid}","object":"chat.completion.chunk","model":"m","choices":[],'
                  f'"usage":{usage}}}\n\n'.encode())
    events.append(b"data: [DONE]\n\n")
    whole = (f'{{"id":"{rid}","object":"chat.completion","model":"m","choices":[{{"index":0,'
             f'"message":{{"role":"assistant","content":"{" ".join(pieces)}"}},'
             f'"finish_reason":"length"}}],"usage":{usage}}}').encode()
    return events, whole


class KVCache:
    """The engine's prefix cache as its events describe it: 16-token blocks, chained
    hashes, LRU eviction past ``capacity``."""

    BS = 16

    def __init__(self, publisher, tokenizer, capacity: int, publish: bool = True) -> None:
        from collections import OrderedDict

        self.pub, self.tok, self.capacity, self.publish = publisher, tokenizer, capacity, publish
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def admit(self, body: bytes) -> None:
        import msgspec

        from kvevents.text.chat import ChatMessage
        from kvevents.wire.schema import BlockRemoved, BlockStored, KVEventBatch

        messages = msgspec.json.decode(body)["messages"]
        ids = self.tok.chat_ids(msgspec.convert(messages, list[ChatMessage])).tolist()
        parent, hashes, tokens, first_parent = None, [], [], None
        for i in range(len(ids) // self.BS):
            chunk = ids[i * self.BS:(i + 1) * self.BS]
            h = zlib.crc32(str(chunk).encode(), (parent or 0) & 0xFFFFFFFF) | ((i + 1) << 32)
            if h in self.blocks:
                self.blocks.move_to_end(h)
            else:
                if not hashes:
                    first_parent = parent
                hashes.append(h)
                tokens += chunk
                self.blocks[h] = None
            parent = h
        events = []
        if hashes:
            events.append(BlockStored(hashes, first_parent, tokens, self.BS, None, "GPU", None))
        evicted = []
        while len(self.blocks) > self.capacity:
            evicted.append(self.blocks.popitem(last=False)[0])
        if evicted:
            events.append(BlockRemoved(evicted, "GPU"))
        if events and self.publish:
            self.pub.publish(KVEventBatch(time.time(), events))


class _Engine(asyncio.Protocol):
    chunks = 64
    per_chunk = 3
    running = 0
    cache: KVCache | None = None
    tok = None  # renders chats for /v1/chat/completions/render

    def connection_made(self, transport) -> None:
        self.t = transport
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.t.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        url, body = self.url, b"".join(self.body)
        self.url, self.body = b"", []
        method = self.parser.get_method()
        if method == b"GET" and url == b"/metrics":
            m = 'model_name="m"'
            text = (f"vllm:num_requests_running{{{m}}} {_Engine.running}\n"
                    f"vllm:num_requests_waiting{{{m}}} 0\nvllm:kv_cache_usage_perc{{{m}}} 0.0\n")
            return self._plain(200, text.encode(), b"text/plain")
        if method == b"GET" and url in (b"/health", b"/v1/models"):
            return self._plain(200, b'{"object":"list","data":[{"id":"m","object":"model"}]}',
                               b"application/json")
        if method == b"POST" and url == b"/v1/chat/completions/render":
            return self._render(body)
        if method == b"POST" and url == b"/v1/chat/completions":
            doc = json.loads(body)
            if _Engine.cache is not None:
                _Engine.cache.admit(body)
            events, whole = answer(answer_key(doc), answer_chunks(doc, self.chunks, self.per_chunk),
                                   self.per_chunk)
            if not doc.get("stream"):
                return self._plain(200, whole, b"application/json")
            if not (doc.get("stream_options") or {}).get("include_usage"):
                events = events[:-2] + events[-1:]
            self.t.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            step = float(doc.get("bench_step_ms", 0)) / 1000
            _Engine.running += 1
            if step <= 0:
                self.t.writelines([b"%x\r\n%s\r\n" % (len(e), e) for e in events] + [b"0\r\n\r\n"])
                _Engine.running -= 1
                return
            self._paced(events, 0, step)
            return
        self._plain(404, b'{"error":"not found"}', b"application/json")

    def _render(self, body: bytes) -> None:
        """vLLM 0.32's answer to a render: the request as its engine would be handed it."""
        import msgspec

        from kvevents.text.chat import ChatMessage

        if _Engine.tok is None:
            return self._plain(404, b'{"error":"no tokenizer: render is off"}', b"application/json")
        try:
            doc = msgspec.json.decode(body)
            ids = _Engine.tok.chat_ids(msgspec.convert(doc["messages"], list[ChatMessage])).tolist()
        except (msgspec.DecodeError, msgspec.ValidationError, KeyError, TypeError):
            return self._plain(400, b'{"error":"messages: expected a list of chat messages"}',
                               b"application/json")
        out = {"request_id": f"chatcmpl-{zlib.crc32(body):08x}", "token_ids": ids, "features": None,
               "sampling_params": {"max_tokens": doc.get("max_tokens"), "temperature": 1.0, "n": 1},
               "model": doc.get("model", "m"), "stream": False, "cache_salt": None, "priority": 0,
               "kv_transfer_params": None}
        self._plain(200, msgspec.json.encode(out), b"application/json")

    def _paced(self, events: list[bytes], i: int, step: float) -> None:
        if self.t.is_closing():
            _Engine.running -= 1
            return
        e = events[i]
        self.t.write(b"%x\r\n%s\r\n" % (len(e), e))
        if i + 1 == len(events):
            self.t.write(b"0\r\n\r\n")
            _Engine.running -= 1
            return
        asyncio.get_running_loop().call_later(step, self._paced, events, i + 1, step)

    def _plain(self, status: int, body: bytes, kind: bytes) -> None:
        reason = {200: b"OK", 400: b"Bad Request"}.get(status, b"Not Found")
        self.t.write(b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
                     % (status, reason, kind, len(body), body))


def run_engine(args: argparse.Namespace) -> None:
    import uvloop

    from kvevents.wire.publisher import PublisherConfig, ZmqEventPublisher

    if args.no_publish and not args.tokenizer:
        raise SystemExit("--no-publish needs --tokenizer (the cache it keeps without publishing)")
    _Engine.chunks, _Engine.per_chunk = args.chunks, args.tokens_per_chunk
    pub = ZmqEventPublisher(PublisherConfig(endpoint=f"tcp://127.0.0.1:{args.zmq_port}",
                                            replay_endpoint=f"tcp://127.0.0.1:{args.replay_port}",
                                            bind=True))  # the gateway connects, as to vLLM's *:PORT
    if args.tokenizer or args.render_tokenizer:
        from kvevents.text import TextTokenizer

        _Engine.tok = TextTokenizer("m", args.tokenizer or args.render_tokenizer)
    if args.tokenizer:
        _Engine.cache = KVCache(pub, _Engine.tok, args.capacity, publish=not args.no_publish)

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(_Engine, "127.0.0.1", args.port,
                                                                backlog=1024)
        print("ready", flush=True)
        async with server:
            await server.serve_forever()
    try:
        uvloop.run(main())
    finally:
        pub.shutdown(0.5)


class _Client(asyncio.Protocol):
    """One keep-alive connection; :meth:`request` sends one and returns its body."""

    def connection_made(self, transport) -> None:
        self.t = transport
        self.parser = httptools.HttpResponseParser(self)
        self.done: asyncio.Future | None = None
        self.body: list[bytes] = []

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body, self.body = b"".join(self.body), []
        if self.done is not None and not self.done.done():
            self.done.set_result((self.parser.get_status_code(), body))

    def connection_lost(self, exc) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("closed"))

    async def request(self, raw: bytes) -> tuple[int, bytes]:
        self.done = asyncio.get_running_loop().create_future()
        self.t.write(raw)
        return await self.done


def chat_request(host: str, port: int, body: bytes) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: %s:%d\r\ncontent-type: application/json"
            b"\r\ncontent-length: %d\r\n\r\n%s" % (host.encode(), port, len(body), body))


def expected(body: bytes, args: argparse.Namespace) -> bytes:
    """The bytes the engine answers ``body`` with (streamed: its SSE events)."""
    doc = json.loads(body)
    events, whole = answer(answer_key(doc), answer_chunks(doc, args.chunks, args.tokens_per_chunk),
                           args.tokens_per_chunk)
    return b"".join(events) if doc.get("stream") else whole


def run_load(args: argparse.Namespace) -> None:
    import uvloop

    bodies = [line.encode() for line in open(args.bodies).read().splitlines()]
    host, port = args.host, args.port
    lat: list[float] = []
    bad = [0]

    async def worker(k: int) -> None:
        loop = asyncio.get_running_loop()
        _, client = await loop.create_connection(_Client, host, port)
        for i in range(k, args.requests, args.concurrency):
            body = bodies[i % len(bodies)]
            want = expected(body, args)
            t0 = time.perf_counter()
            status, got = await client.request(chat_request(host, port, body))
            lat.append(time.perf_counter() - t0)
            if status != 200 or got != want:
                bad[0] += 1

    async def main() -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(k) for k in range(args.concurrency)))
        return time.perf_counter() - t0
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    wall = uvloop.run(main())
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime
    print(json.dumps({"wall_s": wall, "latencies": lat, "mismatches": bad[0], "cpu_s": cpu}))


def run_probe(args: argparse.Namespace) -> None:
    """Each body once through the server (``--port``) and once straight to the engine
    (``--direct-port``), one at a time, in one process on one keep-alive connection each;
    which of the two goes first alternates from body to body, so both see the box alike.
    The first ``--warmup`` bodies are sent and checked, not timed."""
    import uvloop

    bodies = [line.encode() for line in open(args.bodies).read().splitlines()]
    got: dict[str, list[float]] = {"via": [], "direct": []}
    bad = [0]

    async def main() -> None:
        loop = asyncio.get_running_loop()
        sides = {}
        for side, port in (("via", args.port), ("direct", args.direct_port)):
            sides[side] = (port, (await loop.create_connection(_Client, args.host, port))[1])
        for i, body in enumerate(bodies):
            want = expected(body, args)
            for side in (("via", "direct") if i % 2 == 0 else ("direct", "via")):
                port, client = sides[side]
                t0 = time.perf_counter()
                status, data = await client.request(chat_request(args.host, port, body))
                if i >= args.warmup:
                    got[side].append(time.perf_counter() - t0)
                if status != 200 or data != want:
                    bad[0] += 1
    uvloop.run(main())
    print(json.dumps({**got, "mismatches": bad[0]}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("engine")
    e.add_argument("--port", type=int, required=True)
    e.add_argument("--zmq-port", type=int, required=True)
    e.add_argument("--replay-port", type=int, required=True)
    e.add_argument("--tokenizer", default=None, help="tokenizer directory: publish KV events")
    e.add_argument("--no-publish", action="store_true",
                   help="with --tokenizer: track the prefix cache, publish nothing")
    e.add_argument("--render-tokenizer", default=None,
                   help="tokenizer directory: answer /v1/chat/completions/render (publish nothing)")
    e.add_argument("--capacity", type=int, default=4096, help="blocks the engine keeps")
    load, probe = sub.add_parser("load"), sub.add_parser("probe")
    for p in (e, load, probe):
        p.add_argument("--chunks", type=int, default=64)
        p.add_argument("--tokens-per-chunk", type=int, default=3)
    for p in (load, probe):
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--port", type=int, required=True)
        p.add_argument("--bodies", required=True, help="file of request bodies, one a line")
    load.add_argument("--requests", type=int, required=True)
    load.add_argument("--concurrency", type=int, required=True)
    probe.add_argument("--direct-port", type=int, required=True, help="the engine's port")
    probe.add_argument("--warmup", type=int, default=0, help="bodies sent first, not timed")
    args = ap.parse_args()
    {"engine": run_engine, "load": run_load, "probe": run_probe}[args.cmd](args)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
