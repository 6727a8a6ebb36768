"""The server's own time for one ``POST /v1/lookup``, without sockets: the app called
with an in-memory ``receive`` / ``send``, through the fast path
(``kvevents/api/fastpath.py``) and through the route with the same body (the fast path
taken out of the middleware stack), alternating. The index holds one 2,048-token prompt
(or ``--tokens``) announced by 16 engines (``--engines``).

    .venv/bin/python benchmarks/bench_lookup_asgi.py [--requests 3000 --rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

from kvevents.api import create_app
from kvevents.service.aggregator import Aggregator
from kvevents.service.settings import AggregatorSettings
from kvevents.wire.schema import BlockStored, KVEventBatch


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
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/lookup", "raw_path": b"/v1/lookup", "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    async def one() -> int:
        status = []

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
        await app(dict(scope), receive, send)
        return status[0]

    async def run() -> None:
        async with app.router.lifespan_context(app):
            fast = [m for m in app.user_middleware if m.cls.__name__ == "LookupFastPath"]
            everything = list(app.user_middleware)
            for r in range(args.rounds):
                for name, stack in (("fast path", everything),
                                    ("route", [m for m in everything if m not in fast])):
                    app.user_middleware[:] = stack
                    app.middleware_stack = app.build_middleware_stack()
                    assert await one() == 200
                    t = time.perf_counter()
                    for _ in range(args.requests):
                        await one()
                    print(f"round {r} {name}: {(time.perf_counter() - t) / args.requests * 1e6:.1f} us")
    asyncio.run(run())


if __name__ == "__main__":
    main()
