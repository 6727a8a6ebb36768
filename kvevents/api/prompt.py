"""A request's prompt as token ids: given as ids, or tokenized from text or chat.

Exactly one of ``token_ids``, ``prompt`` or ``messages``; text needs ``model`` to name
a model with a tokenizer (``serve --tokenizer MODEL=PATH``). Every refusal is a 4xx
naming the field; nothing is looked up or counted before the ids are known.
"""

from __future__ import annotations

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from kvevents.api.body import LookupBody
from kvevents.api.errors import ApiError
from kvevents.text import ChatTemplateError, TokenizerRegistry

_INPUTS = ("token_ids", "prompt", "messages")


# async, as every dependency of the lookup and route handlers must be: FastAPI runs a
# plain ``def`` dependency on the thread pool, a thread hop per request (about 0.5 ms
# here, several under ingest, where the hop waits for the GIL).
async def get_tokenizers(request: Request) -> TokenizerRegistry:
    return request.app.state.tokenizers


async def prompt_token_ids(body: LookupBody, tokenizers: TokenizerRegistry, limit: int
                           ) -> list[int]:
    """The body's prompt as token ids (at most ``limit``). Raises :class:`ApiError`.

    Text is tokenized on the thread pool: a few thousand new tokens cost milliseconds
    (benchmarks P9), which would stall every other request on the event loop; the
    ``tokenizers`` library releases the GIL while it encodes."""
    given = [name for name in _INPUTS if getattr(body, name) is not None]
    if not given:
        raise ApiError(422, "one of token_ids, prompt or messages is required", "token_ids")
    if len(given) > 1:
        raise ApiError(422, f"give exactly one of token_ids, prompt or messages, not "
                            f"{' and '.join(given)}", given[1])
    field = given[0]
    if field == "token_ids":
        ids = body.token_ids
    else:
        tok = tokenizers.get(body.model)
        if tok is None:
            known = ", ".join(tokenizers.models()) or "none configured"
            if body.model is None:
                raise ApiError(422, f"{field} needs model to name its tokenizer "
                                    f"(tokenizers: {known})", "model")
            raise ApiError(422, f"no tokenizer for model {body.model!r} (tokenizers: {known}; "
                                f"add one with serve --tokenizer MODEL=PATH)", "model")
        if field == "prompt":
            ids = await run_in_threadpool(tok.encode_prompt, body.prompt)  # type: ignore[arg-type]
        else:
            try:
                ids = await run_in_threadpool(tok.encode_chat, body.messages)  # type: ignore[arg-type]
            except ChatTemplateError as exc:
                raise ApiError(422, f"messages: {exc}", "messages") from None
    if len(ids) > limit:  # type: ignore[arg-type]
        raise ApiError(413, f"{field} has {len(ids)} tokens; the limit is {limit}", field)  # type: ignore[arg-type]
    return ids  # type: ignore[return-value]
