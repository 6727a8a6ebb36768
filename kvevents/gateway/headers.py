"""The request headers the gateway forwards to an engine, and the one it adds.

Not forwarded (ASGI names them in lower case): hop-by-hop ones, those the upstream
client sets, and ``x-data-parallel-rank``: the rank of a data-parallel server is the
gateway's choice (the engine it chose), never the client's. Added: that header, for an
engine that is one rank of a data-parallel server (``EngineSpec.dp_rank``), so the
server runs the request on the rank whose cache the gateway scored instead of letting
its own balancer pick one. vLLM 0.32 reads ``X-data-parallel-rank``
(``OpenAIServing._get_data_parallel_rank``), SGLang the same name
(``extract_routed_dp_rank_from_header``).
"""

from __future__ import annotations

from kvevents.engines import EngineSpec

__all__ = ["DROP", "DROP_KEYED", "RANK_HEADER", "with_rank"]

RANK_HEADER = b"x-data-parallel-rank"

DROP = frozenset({b"host", b"content-length", b"connection", b"keep-alive", b"transfer-encoding",
                  b"upgrade", b"te", b"trailer", b"proxy-authorization", b"accept-encoding",
                  b"expect", RANK_HEADER})
#: With the gateway's own API key: the client's ``authorization`` stays here too.
DROP_KEYED = DROP | {b"authorization"}

_RANKS = [str(r).encode() for r in range(64)]  # (the common ranks' values, made once)


def with_rank(headers: list[tuple[bytes, bytes]], engine: EngineSpec) -> list[tuple[bytes, bytes]]:
    """``headers`` for a request sent to ``engine``: with its data-parallel rank, when it
    is one rank of a server (a new list; ``headers`` is shared by the request's tries)."""
    rank = engine.dp_rank
    if rank is None:
        return headers
    return [*headers, (RANK_HEADER, _RANKS[rank] if rank < 64 else str(rank).encode())]
