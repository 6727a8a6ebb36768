"""Index calls from async handlers without blocking the event loop on the index lock.

A lookup holds the lock for microseconds, so the handler first tries it without
waiting (no thread hop on the common path); when the ingest thread holds the lock, the
wait moves to the thread pool and the event loop keeps serving other requests.
"""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool

from kvevents.aggregator import Aggregator
from kvevents.index import IndexBusy, LookupResult


async def lookup(agg: Aggregator, token_ids, model: str | None, lora_name: str | None,
                 endpoint: str) -> LookupResult:
    try:
        return agg.lookup(token_ids, model=model, lora_name=lora_name, endpoint=endpoint,
                          blocking=False)
    except IndexBusy:
        return await run_in_threadpool(agg.lookup, token_ids, model, lora_name,
                                       endpoint=endpoint)
