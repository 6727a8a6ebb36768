"""Queries of the index: ``/v1/lookup``, ``/v1/blocks/{hash}``, ``/v1/prefixes``.

``POST /v1/lookup`` is answered two ways, with the same bytes: under ``kvevents serve``
its server protocol (:mod:`~kvevents.api.server_protocol`) answers the common body with
:func:`common_answer` before the ASGI app, and the route answers everything else (any
other body, every error, a lookup that finds the index lock busy) and every lookup under
another server. The route is the reference for the semantics.
"""

from __future__ import annotations

import re

import msgspec
from fastapi import APIRouter, Depends, Query, Request, Response

from kvevents.api._fastbody import lookup_body
from kvevents.api.body import LookupBody, body_doc, decode_lookup
from kvevents.api.errors import ApiError
from kvevents.api.media_prompt import body_prompt
from kvevents.api.models import (ERRORS, PROMPT_ERRORS, BlockResponse, LookupResponse,
                                  PrefixesResponse)
from kvevents.api.routes_engines import get_aggregator
from kvevents.index import LookupResult
from kvevents.routing.offloop import lookup as lookup_off_loop
from kvevents.routing.offloop import lookup_now
from kvevents.service.aggregator import Aggregator
from kvevents.text import TokenizerRegistry
from kvevents.wire.schema import BlockHash, hash_to_str

router = APIRouter(prefix="/v1", tags=["queries"])
_json = msgspec.json.Encoder()


def json_response(payload: object, status: int = 200) -> Response:
    """Encode with msgspec: the index's results are Structs, no pydantic round trip."""
    return Response(_json.encode(payload), status_code=status, media_type="application/json")


def lookup_payload(result: LookupResult, down: frozenset[str] | set[str] = frozenset()) -> dict:
    """``down``: engines gone for ``down_after_s``; still listed, marked ``"down": true``.
    The answer also carries 0.1.0's ``pods`` (entries keyed ``pod``), deprecated."""
    # "pods" with "pod" entries: 0.1.0's names, for routers written against them (until
    # 0.3.0). Both lists in one pass, spelled out: this runs for every lookup.
    engines, pods = [], []
    for p in result.engines:
        name, tokens, tiers = p.engine, p.tokens, p.tiers
        if down and name in down:
            engines.append({"engine": name, "matched_tokens": tokens, "tiers": tiers, "down": True})
            pods.append({"pod": name, "matched_tokens": tokens, "tiers": tiers, "down": True})
        else:
            engines.append({"engine": name, "matched_tokens": tokens, "tiers": tiers})
            pods.append({"pod": name, "matched_tokens": tokens, "tiers": tiers})
    return {"prompt_tokens": result.prompt_tokens, "block_size": result.block_size, "engines": engines,
            "pods": pods}


# async: the lookup is CPU-light and short, so it runs on the event loop instead of
# paying a thread-pool hop per request; a wait for the index lock goes to a thread.
# No ``Depends``: resolving dependencies was a third of the event loop's time per
# lookup; the body is documented by ``openapi_extra`` and decoded by msgspec.
@router.post("/lookup", response_model=LookupResponse, responses=PROMPT_ERRORS,
             openapi_extra=body_doc(LookupBody),
             summary="Per engine, how many leading prompt tokens are cached, per tier and in total")
async def lookup(request: Request) -> Response:
    body = await decode_lookup(request)
    agg: Aggregator = request.app.state.aggregator
    token_ids, media = await body_prompt(request.app.state, body, agg.settings.max_prompt_tokens,
                                         agg.settings.max_prompt_chars)
    result = await lookup_off_loop(agg, token_ids, body.model, body.lora_name, "lookup",
                                   body.cache_salt, media)
    return json_response(lookup_payload(result, agg.unroutable_engines()))


def common_answer(agg: Aggregator, raw: bytes) -> bytes | None:
    """The route's answer to a common lookup body, looked up now on this thread: the
    JSON bytes of a 200, or None for the route to answer. Common: ``{"token_ids": [...],
    "model"?, "lora_name"?}`` as the compiled reader takes it
    (:mod:`~kvevents.api._fastbody`), within the prompt limit; None also when the index
    lock stays taken past the event loop's bound (the route waits for it off the loop).
    The same lookup (timed into the same metrics), payload and encoding as the route."""
    got = lookup_body(raw)
    if got is None or len(got[0]) > agg.settings.max_prompt_tokens:
        return None
    result = lookup_now(agg, *got, "lookup")
    return None if result is None else _json.encode(lookup_payload(result, agg.unroutable_engines()))


# async, as every dependency of the handlers must be: FastAPI runs a plain ``def``
# dependency on the thread pool, a thread hop per request.
async def get_tokenizers(request: Request) -> TokenizerRegistry:
    return request.app.state.tokenizers


# ASCII digits only: str.isdigit() also accepts "²", which int() then rejects.
_DECIMAL = re.compile(r"-?[0-9]+")
_MAX_HASH_CHARS = 130  # a 64-byte digest in hex, with "0x"


def parse_block_hash(text: str) -> BlockHash:
    """Decimal digits -> 64-bit int (SGLang's signed ones too); otherwise hex -> raw
    digest bytes. Anything else, or longer than any engine hash, is a 422."""
    if len(text) > _MAX_HASH_CHARS:
        raise ApiError(422, f"hash is longer than {_MAX_HASH_CHARS} characters", "hash")
    if _DECIMAL.fullmatch(text):
        value = int(text)
        if not -(2**63) <= value < 2**64:
            raise ApiError(422, "a decimal block hash must fit in 64 bits", "hash")
        return value
    if not text.isascii():
        raise ApiError(422, "hash must be a decimal uint64 or hex digest bytes", "hash")
    try:
        raw = bytes.fromhex(text.removeprefix("0x"))
    except ValueError:
        raise ApiError(422, "hash must be a decimal uint64 or hex digest bytes", "hash") from None
    if not raw:
        raise ApiError(422, "hash must not be empty", "hash")
    return raw


@router.get("/blocks/{hash}", response_model=BlockResponse, responses=ERRORS,
            summary="Which engines and tiers hold an engine block hash, with its tokens")
def block(hash: str, agg: Aggregator = Depends(get_aggregator)) -> Response:  # noqa: A002
    info = agg.index.blocks_by_engine_hash(parse_block_hash(hash))
    if not info.holders and info.tokens is None:
        raise ApiError(404, f"no engine holds block {hash}", "hash")
    return json_response({
        "hash": hash_to_str(info.engine_hash),
        "holders": info.holders,
        "tokens": info.tokens,
        "depth": info.depth,
        "model": info.model,
        "block_size": info.block_size,
        "lora_name": info.lora_name,
    })


@router.get("/prefixes", response_model=PrefixesResponse, responses=ERRORS,
            summary="The most widely cached prefixes and where they live")
def prefixes(
    model: str | None = None,
    limit: int = Query(10, ge=1, le=1000),
    agg: Aggregator = Depends(get_aggregator),
    tokenizers: TokenizerRegistry = Depends(get_tokenizers),
) -> Response:
    found = agg.index.top_prefixes(model=model, limit=limit)
    if not len(tokenizers):
        return json_response({"prefixes": found})
    out = []
    for p in found:
        item = msgspec.to_builtins(p)
        tok = tokenizers.get(item.get("model"))
        # The text of the leading tokens, where the prefix's model has a tokenizer.
        item["text"] = tok.decode(item["leading_tokens"]) if tok is not None else None
        out.append(item)
    return json_response({"prefixes": out})
