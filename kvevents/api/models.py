"""Response models of the HTTP API and the engine body (pydantic, for OpenAPI).

The lookup and route bodies are msgspec Structs in :mod:`kvevents.api.body` (defined
once, schema generated from them). Unknown fields are rejected so a typo (``tokens``
for ``token_ids``) is an error naming the field, not a silent default. Responses are
documented here but encoded straight from the index's msgspec results.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvevents.engines import ENGINE_NAME_PATTERN

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EngineScoreOut(BaseModel):
    engine: str
    score: float
    cache_score: float
    load: float
    matched_tokens: int
    tiers: dict[str, int]
    eligible: bool = Field(description="False when the load guard excluded it.")


_OLD = "Deprecated: 0.1.0's name (engines were called pods); removed in 0.3.0. "


class RouteResponse(BaseModel):
    engine: str
    pod: str | None = Field(None, deprecated=True, description=_OLD + "Same as `engine`.")
    matched_tokens: int
    tiers: dict[str, int]
    scores: list[EngineScoreOut]
    reason: str


class EngineMatchOut(BaseModel):
    engine: str
    matched_tokens: int = Field(description="Leading prompt tokens cached in any tier.")
    tiers: dict[str, int] = Field(description="Per tier, that tier's own leading run in tokens.")
    down: bool | None = Field(None, description="Present (true) when the engine has been down for "
                                                "--down-after seconds: not offered for routing.")


class PodMatchOut(BaseModel):
    pod: str
    matched_tokens: int
    tiers: dict[str, int]
    down: bool | None = None


class LookupResponse(BaseModel):
    prompt_tokens: int
    block_size: int
    engines: list[EngineMatchOut] = Field(description="Engines holding a prefix, best first.")
    pods: list[PodMatchOut] | None = Field(None, deprecated=True,
                                           description=_OLD + "Same as `engines`, keyed `pod`.")


class EngineCreate(_Strict):
    name: str = Field(pattern=ENGINE_NAME_PATTERN)
    endpoint: str = Field(description="The publisher's live endpoint, tcp://HOST:PORT.")
    replay_endpoint: str | None = Field(None, description="Its replay (ROUTER) endpoint.")
    model: str | None = None
    topic: str = ""
    http: str | None = Field(None, description="Its OpenAI server, http://HOST:PORT: the "
                                               "gateway routes OpenAI requests to it.")
    dp_rank: int | None = Field(None, ge=0, lt=1024, description="The engine is this rank of a "
                                "data-parallel server (its endpoint that rank's): the gateway "
                                "sends it X-data-parallel-rank, and batches of another rank are "
                                "counted. Post one engine per rank.")
    role: Literal["both", "prefill", "decode"] = Field(
        "both", description="What the gateway sends it: whole requests (both), the prefill hop "
                            "of a disaggregated request (prefill), or its decode hop (decode).")


class TokenParityView(BaseModel):
    ids: str = Field(description="`local`: requests are routed with the gateway's own ids; "
                                 "`engine`: with the engines' /tokenize ids, after mismatches.")
    checks: int
    mismatches: int
    mismatches_in_a_row: int
    mismatch_reasons: dict[str, int] = Field(description="Mismatches by reason: special_tokens, "
                                                         "tools, content_format, template.")
    last_mismatch: dict[str, Any] | None = Field(description="The last mismatch: engine, reason, "
                                                             "first differing position, lengths.")


class GatewayView(BaseModel):
    reachable: bool = Field(description="Its OpenAI server answered the last poll or request.")
    inflight: int = Field(description="Requests in flight from this gateway.")
    others_load: float = Field(description="Its waiting + running requests not from this gateway "
                                           "(its /metrics at the last poll).")
    kv_usage: float
    last_error: str | None
    predicted_cached_tokens: int = Field(description="Cached prompt tokens the index predicted "
                                                     "for the answers that reported theirs.")
    reported_cached_tokens: int = Field(description="What the engine reported for them "
                                                    "(usage.prompt_tokens_details.cached_tokens).")
    usage_reports: int
    token_parity: TokenParityView | None = Field(
        None, description="Its model's token parity: the gateway's ids checked against the "
                          "engines' /tokenize (null: no check yet).")


class EngineOut(BaseModel):
    name: str
    endpoint: str
    replay_endpoint: str | None
    model: str | None
    http: str | None = None
    dp_rank: int | None = Field(None, description="Its rank of a data-parallel server (dp=).")
    role: Literal["both", "prefill", "decode"] = Field(
        "both", description="What the gateway sends it (role=): both, prefill or decode.")
    gateway: GatewayView | None = Field(None, description="Present for engines with an OpenAI "
                                                          "server (http).")
    status: Literal["live", "stale", "down", "replaying"]
    connected: bool
    last_seq: int | None
    lag_seconds: float | None
    last_event_age_seconds: float | None
    blocks: dict[str, int]
    batches: int
    lane_batches: int = Field(0, description="Of ``batches``, those applied by the compiled "
                                              "ingest lane (without the GIL).")
    gaps: int
    replayed_batches: int
    lost_batches: int
    restarts: int
    resyncs: int
    malformed: int
    routable: bool = Field(True, description="False once down for --down-after seconds: "
                                             "its blocks are not offered for routing.")
    restore: str | None = Field(None, description="'resumed' when restored from a snapshot.")
    origin: str = Field("static", description="Who asked to follow it: 'static' (settings), "
                                              "'api', or a discovery source ('dns:NAME', "
                                              "'k8s:NAMESPACE/SELECTOR').")
    leaving_since: float | None = Field(
        None, description="Wall time its discovery source stopped listing it: not routable, "
                          "dropped after --discover-grace unless it returns.")
    recovery_given_up: bool = Field(
        False, description="Its first replay did not finish within --recovery-timeout: "
                           "readiness no longer waits for it (still followed).")
    replay_gap: dict[str, int | None] | None = Field(
        None, description="While replaying: the seq awaited, the first held-back live seq "
                          "and the bytes held back.")


class EngineBlocksResponse(BaseModel):
    engine: str
    tiers: dict[str, list[int | str]] = Field(
        description="Per tier, the resident engine block hashes (ints, or hex for digests).")


class EnginesResponse(BaseModel):
    engines: list[EngineOut]


class PodsResponse(EnginesResponse):
    """``GET /v1/pods`` (deprecated): the engines, also under 0.1.0's key."""

    pods: list[EngineOut] = Field(deprecated=True, description=_OLD + "Same as `engines`.")


class PodBlocksResponse(EngineBlocksResponse):
    """``GET /v1/pods/{name}/blocks`` (deprecated): also 0.1.0's key."""

    pod: str = Field(deprecated=True, description=_OLD + "Same as `engine`.")


class BlockHolderOut(BaseModel):
    engine: str
    tiers: dict[str, int] = Field(description="Tier -> reference count.")


class BlockResponse(BaseModel):
    hash: str
    holders: list[BlockHolderOut]
    tokens: list[int] | None
    depth: int
    model: str | None
    block_size: int
    lora_name: str | None


class PrefixOut(BaseModel):
    tokens: int
    blocks: int
    block_size: int
    leading_tokens: list[int]
    text: str | None = Field(None, description="The leading tokens' text, when the prefix's "
                             "model has a tokenizer (absent when no tokenizer is configured).")
    engines: list[str]
    model: str | None = None
    lora_name: str | None = None


class PrefixesResponse(BaseModel):
    prefixes: list[PrefixOut]


class ErrorResponse(BaseModel):
    error: str
    field: str | None


ERRORS = {
    401: {"model": ErrorResponse, "description": "Missing or wrong bearer token"},
    404: {"model": ErrorResponse, "description": "Unknown engine or block"},
    409: {"model": ErrorResponse, "description": "Name already taken"},
    413: {"model": ErrorResponse, "description": "Body larger than max_body_bytes"},
    422: {"model": ErrorResponse, "description": "Invalid field (named in `field`)"},
}

#: The errors of the endpoints that tokenize prompt text: the 400 also for text with
#: more characters than are worth tokenizing, refused before it is tokenized.
PROMPT_ERRORS = {
    **ERRORS,
    400: {"model": ErrorResponse, "description": "Prompt over max_prompt_tokens tokens, or "
                                                 "text with more characters than max_prompt_chars "
                                                 "or than max_prompt_tokens tokens of the model's "
                                                 "tokenizer can hold, refused before tokenizing "
                                                 "(`field`: token_ids, prompt or messages)"},
}
