"""What an engine's answer says, for the gateway's accounting: whether a stream got to
its end, the cached tokens it reports (``usage.prompt_tokens_details.cached_tokens``,
vLLM's ``--enable-prompt-tokens-details``), the cached tokens the routing decision
predicted, and the headers passed back to the client. Pure functions; nothing here
raises on a malformed answer (None instead)."""

from __future__ import annotations

import json

from kvevents.gateway.upstream import UpstreamResponse
from kvevents.routing import RouteDecision

__all__ = ["answer_headers", "cached_tokens", "expected_cached", "is_complete",
           "stream_cached_tokens", "usage_cached"]


def is_complete(tail: bytes) -> bool:
    """Whether a streamed answer got to its end marker: a client that leaves right after
    ``[DONE]`` (before the engine closed the stream) had its whole answer."""
    return tail.rstrip().endswith(b"data: [DONE]")


def expected_cached(decision: RouteDecision, prompt_tokens: int) -> int:
    """The cached tokens the chosen engine should report for this prompt: the matched
    prefix, less one block when it covers the whole prompt (vLLM always computes the
    prompt's last token, so a fully cached prompt reports one block less)."""
    matched = decision.matched_tokens
    if prompt_tokens and matched >= prompt_tokens and decision.block_size:
        return max(0, matched - decision.block_size)
    return matched


def answer_headers(upstream: UpstreamResponse, engine: str) -> dict[str, str]:
    """The engine's headers the client gets back, and which engine answered."""
    out = {"x-kvevents-engine": engine}
    for name in ("content-type", "x-request-id", "cache-control"):
        if name in upstream.headers:
            out[name] = upstream.headers[name]
    return out


def usage_cached(doc: object) -> int | None:
    if not isinstance(doc, dict):
        return None
    usage = doc.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if type(cached) is int and cached >= 0 else None


def cached_tokens(body: bytes) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of a whole answer, if reported."""
    if b"cached_tokens" not in body:
        return None
    try:
        return usage_cached(json.loads(body))
    except ValueError:
        return None


def stream_cached_tokens(tail: bytes) -> int | None:
    """The same, from the last usage chunk of a streamed answer (``include_usage``)."""
    at = tail.rfind(b"cached_tokens")  # the last line that has it: no split of the tail
    if at < 0:
        return None
    start = tail.rfind(b"\n", 0, at) + 1
    end = tail.find(b"\n", at)
    line = tail[start:] if end < 0 else tail[start:end]
    if not line.startswith(b"data:"):
        return None
    try:
        return usage_cached(json.loads(line[5:]))
    except ValueError:
        return None
