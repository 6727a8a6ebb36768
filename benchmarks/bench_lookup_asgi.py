"""The server's own time for one ``POST /v1/lookup``, without sockets: ``kvevents
serve``'s HTTP protocol fed the request's bytes on an in-memory transport, with the
common body answered in the protocol (``kvevents/api/server_protocol.py``) and with
every lookup sent through the ASGI app's route (``lookup_in_protocol`` false),
alternating. Both include uvicorn's parsing and the answer's bytes; the route side also
its request cycle, task and middleware stack. The index holds one 2,048-token prompt (or
``--tokens``) announced by 16 engines (``--engines``).

    .venv/bin/python benchmarks/bench_lookup_asgi.py [--requests 3000 --rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

from uvicorn.server import ServerState

from kvevents.api import create_app
from kvevents.cli.serve import uvicorn_config
from kvevents.service.aggregator import Aggregator
from kvevents.service.settings import AggregatorSettings
from kvevents.wire.schema import BlockStored, KVEventBatch


class Transport:
    """What the protocol writes, kept; counts the whole answers (framed by length)."""

    def __init__(self) -> None:
        self.buf = b""
        self.answers = 0

    def write(self, data: bytes) -> None:
        self.buf += data
        while b"\r\n\r\n" in self.buf:
            head, rest = self.buf.split(b"\r\n\r\n", 1)
            size = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
            if len(rest) < size:
                return
            assert head.startswith(b"HTTP/1.1 200 "), head
            self.buf, self.answers = rest[size:], self.answers + 1

    def get_extra_info(self, name: str, default=None):
        return default

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    agg = Aggregator(AggregatorSettings())
    toks = [random.Random(0).randrange(30000) for _ in range(args.tokens)]
    for e in range(args.engines):
        hashes = list(range(e * 100_000, e * 100_000 + args.tokens // 16))
        agg.index.apply_batch(f"e{e}", KVEventBatch(0.0, [BlockStored(hashes, None, toks, 16, None, "GPU")]))
    app = create_app(aggregator=agg)
    body = json.dumps({"token_ids": toks}).encode()
    request = (b"POST /v1/lookup HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n%s" % (len(body), body))

    async def run() -> None:
        loop = asyncio.get_running_loop()
        state = ServerState()
        state.default_headers = [(b"server", b"uvicorn"), (b"date", b"Thu, 01 Jan 2026 00:00:00 GMT")]
        sides = []
        for name, in_protocol in (("protocol", True), ("route", False)):
            config = uvicorn_config(app, lookup_in_protocol=in_protocol, access_log=False)
            config.load()
            proto = config.http_protocol_class(config=config, server_state=state, app_state={}, _loop=loop)
            transport = Transport()
            proto.connection_made(transport)
            sides.append((name, proto, transport))

        async def one(proto, transport) -> None:
            want = transport.answers + 1
            proto.data_received(request)
            while transport.answers < want:  # the route's answer comes from its task
                await asyncio.sleep(0)

        async with app.router.lifespan_context(app):
            for r in range(args.rounds):
                for name, proto, transport in sides:
                    await one(proto, transport)
                    t = time.perf_counter()
                    for _ in range(args.requests):
                        await one(proto, transport)
                    print(f"round {r} {name}: {(time.perf_counter() - t) / args.requests * 1e6:.1f} us")
            for _, proto, _ in sides:
                proto.connection_lost(None)
    asyncio.run(run())


if __name__ == "__main__":
    main()
