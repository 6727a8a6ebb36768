"""Index lookups and tokenization from async handlers, without blocking the event loop
for longer than a bound.

A lookup holds the index lock for microseconds, and the ingest thread holds it for one
batch at a time in the lane (handing it to a waiting lookup first), or one part of a
group on the Python path (``PrefixIndex.apply_batches``: about 16 KiB of batches, a
tenth of a millisecond here). So the caller waits for the lock on the event loop for at
most ``_LOOP_WAIT_S``; only past that (the ingest thread descheduled while holding it,
say) does the wait move to the thread pool, and the event loop keeps serving other
requests. Measured under 200k block events/s of ingest, when every busy lock meant a
thread-pool hop: 46% of lookups found the lock taken, and their hop was the slow part
of the lookup (p50 0.9 ms, p99 8 ms, against 0.08 / 0.9 ms for the others); waiting
here, 3 of 2,000 lookups still went to the pool.

Text is tokenized on the thread pool: a few thousand new tokens cost milliseconds
(benchmarks P9), which would stall every other request on the event loop; the
``tokenizers`` library releases the GIL while it encodes.
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.concurrency import run_in_threadpool

from kvevents.index import IndexBusy, LookupResult, MediaItem
from kvevents.service.aggregator import Aggregator
from kvevents.text import TokenizerRegistry
from kvevents.text.chat import ChatMessage
from kvevents.text.chat_inputs import ChatOptions
from kvevents.text.limits import PromptLimits
from kvevents.text.prompt import chosen_input, text_encoder

# Longest the event loop waits for the index lock before handing the wait to a thread.
_LOOP_WAIT_S = 0.002


def lookup_now(agg: Aggregator, token_ids, model: str | None, lora_name: str | None,
               endpoint: str, cache_salt: str | None = None,
               media: Sequence[MediaItem] = ()) -> LookupResult | None:
    """The lookup, waiting for the index lock on this thread for at most the event
    loop's bound; None when the lock stayed taken (wait for it off the loop)."""
    try:
        return agg.lookup(token_ids, model=model, lora_name=lora_name, cache_salt=cache_salt,
                          media=media, endpoint=endpoint, timeout=_LOOP_WAIT_S)
    except IndexBusy:
        return None


async def lookup(agg: Aggregator, token_ids, model: str | None, lora_name: str | None,
                 endpoint: str, cache_salt: str | None = None,
                 media: Sequence[MediaItem] = ()) -> LookupResult:
    result = lookup_now(agg, token_ids, model, lora_name, endpoint, cache_salt, media)
    if result is None:
        return await run_in_threadpool(lambda: agg.lookup(
            token_ids, model, lora_name, cache_salt=cache_salt, media=media, endpoint=endpoint))
    return result


async def prompt_token_ids(tokenizers: TokenizerRegistry, limit: int, *, max_chars: int,
                           model: str | None, token_ids: Sequence[int] | None = None,
                           prompt: str | None = None,
                           messages: Sequence[ChatMessage] | None = None,
                           options: ChatOptions | None = None) -> Sequence[int]:
    """The request's prompt as token ids (at most ``limit``); text is tokenized on the
    thread pool, once it is known to have no more characters than it is worth tokenizing
    (``max_chars``, ``max_prompt_chars``, or fewer when ``limit`` tokens of the model's
    tokenizer cannot hold more: :func:`~kvevents.text.limits.chars_limit`; a longer one
    is a 400 before any tokenizer memory is spent), as vLLM would for a request with
    ``options`` (its ``tools``, ``add_special_tokens``...). Raises
    :class:`~kvevents.text.prompt.InputError` (400 for a prompt over either limit)."""
    field = chosen_input(token_ids, prompt, messages)
    limits = PromptLimits(max_chars, limit)
    if field == "token_ids":
        ids = token_ids
    else:
        text = prompt if field == "prompt" else messages
        tok = tokenizers.get(model)
        limits.check_text(text, field, tok.max_token_chars() if tok else None)
        encode = text_encoder(tokenizers, model, field, text, options)  # type: ignore[arg-type]
        ids = await run_in_threadpool(encode)
    limits.check_ids(ids, field)  # type: ignore[arg-type]
    return ids  # type: ignore[return-value]
