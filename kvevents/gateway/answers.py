"""What an engine's answer says, for the gateway's accounting: whether a stream got to
its end (its endpoint's end marker: ``data: [DONE]``, a Responses stream's
``response.completed``), the cached tokens it reports (a chat's or completion's
``usage.prompt_tokens_details.cached_tokens``, vLLM's ``--enable-prompt-tokens-details``;
a response's ``usage.input_tokens_details.cached_tokens``, streamed in its
``response.completed`` event), the cached tokens the routing decision predicted, and the
headers passed back to the client: pure functions, none of which raises on a malformed
answer (None instead); and a whole answer's response, whose accounting runs once it is
written (:class:`WholeAnswer`)."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import msgspec
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kvevents.gateway.upstream import TAIL_BYTES, UpstreamResponse
from kvevents.routing import RouteDecision

__all__ = ["WholeAnswer", "answer_headers", "cached_tokens", "expected_cached", "is_complete",
           "stream_cached_tokens"]


#: The end of a chat's or completion's stream.
DONE = (b"data: [DONE]",)


def is_complete(tail: bytes, ends: tuple[bytes, ...] = DONE) -> bool:
    """Whether a streamed answer got to its end marker (one of ``ends``: its endpoint's):
    a client that leaves right after ``[DONE]`` (before the engine closed the stream) had
    its whole answer."""
    return tail.rstrip().endswith(ends)


def expected_cached(decision: RouteDecision, prompt_tokens: int) -> int:
    """The cached tokens the chosen engine should report for this prompt: the matched
    prefix, less one block when it covers the whole prompt (vLLM always computes the
    prompt's last token, so a fully cached prompt reports one block less)."""
    matched = decision.matched_tokens
    if prompt_tokens and matched >= prompt_tokens and decision.block_size:
        return max(0, matched - decision.block_size)
    return matched


def answer_headers(upstream: UpstreamResponse | httpx.Response, engine: str) -> dict[str, str]:
    """The engine's headers the client gets back, and which engine answered (of a
    proxied answer, or of one the gateway asked for itself)."""
    out = {"x-kvevents-engine": engine}
    for name in ("content-type", "x-request-id", "cache-control"):
        if name in upstream.headers:
            out[name] = upstream.headers[name]
    return out


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens_details: _Details | None = None  # chat, completions
    input_tokens_details: _Details | None = None  # responses


class _Response(msgspec.Struct):
    usage: _Usage | None = None


class _Answer(msgspec.Struct):
    usage: _Usage | None = None
    response: _Response | None = None  # a Responses stream's response.completed event


# Only the usage is decoded (the rest of the answer is skipped in C): a JSON parse of
# the whole answer into Python objects cost more than the rest of its accounting.
_decode_answer = msgspec.json.Decoder(_Answer).decode


def cached_tokens(body: bytes) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of a whole answer (a response's:
    ``usage.input_tokens_details.cached_tokens``), if reported."""
    return _cached_of(body) if b"cached_tokens" in body else None


def _cached_of(doc: bytes) -> int | None:
    try:
        answer = _decode_answer(doc)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None  # not JSON, not numbers there, or nested past the decoder's depth
    usage = answer.usage or (answer.response.usage if answer.response is not None else None)
    details = usage and (usage.prompt_tokens_details or usage.input_tokens_details)
    cached = details.cached_tokens if details is not None else None
    return cached if cached is not None and cached >= 0 else None


def _cached_in_cut(line: bytes, at: int) -> int | None:
    """The count after ``"cached_tokens":`` at ``at`` in a line whose start was cut off
    (a response.completed event longer than the tail kept): the key, quoted, cannot
    occur inside a JSON string (its quotes would be escaped there)."""
    key = line.find(b'"cached_tokens":', at - 1)
    if key != at - 1:
        return None
    digits = line[at + 15:].lstrip()[:20]
    n = len(digits) - len(digits.lstrip(b"0123456789"))
    return int(digits[:n]) if n else None


def stream_cached_tokens(tail: bytes) -> int | None:
    """The same, from the last usage chunk of a streamed answer (``include_usage``; a
    Responses stream's ``response.completed`` event, whose start may be past the tail
    kept: then the count after the key)."""
    at = tail.rfind(b"cached_tokens")  # the last line that has it: no split of the tail
    if at < 0:
        return None
    start = tail.rfind(b"\n", 0, at) + 1
    end = tail.find(b"\n", at)
    line = tail[start:] if end < 0 else tail[start:end]
    if line.startswith(b"data:"):
        return _cached_of(line[5:])
    cut = start == 0 and len(tail) >= TAIL_BYTES  # (the tail kept began inside this line)
    return _cached_in_cut(line, at - start) if cut else None


class WholeAnswer(Response):
    """A whole (non-streamed) answer; ``after()`` runs once its writing ended, however it
    ended: the engine connection's release and the request's accounting, off the
    client's clock."""

    def __init__(self, body: bytes, status: int, headers: dict[str, str],
                 after: Callable[[], None]) -> None:
        super().__init__(body, status_code=status, headers=headers)
        self._after = after

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._after()
