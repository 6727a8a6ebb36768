"""One followed engine, as every part of the service names it: :class:`EngineSpec`.

An engine is one KV event publisher (a vLLM or SGLang engine, or a data-parallel rank
of one): its name, the live endpoint, the replay endpoint that fills gaps, the model
its blocks belong to, the topic and whether we bind, and for a rank of a data-parallel
server its rank (:attr:`EngineSpec.dp_rank`). Settings (flags, environment,
config file), ``POST /v1/engines`` and snapshots all build it here, and it is checked
once, here: a bad name or endpoint raises ``ValueError`` (an
:class:`~kvevents.wire.framing.EndpointError` names the field).

The subscriber follows it as a :class:`~kvevents.ingest.source.SourceConfig`
(:meth:`EngineSpec.source`), the one place the ingest view of an engine is made.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvevents.ingest.source import SourceConfig
from kvevents.wire.framing import EndpointError, check_engine_endpoint

__all__ = ["ENGINE_NAME_PATTERN", "MAX_DP_SIZE", "ROLES", "EngineSpec", "PodSpec", "check_role",
           "dp_endpoint", "validate_engine_name"]

ENGINE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
_ENGINE_NAME = re.compile(ENGINE_NAME_PATTERN)
#: The most data-parallel ranks one server may have (``dp=N``).
MAX_DP_SIZE = 1024
#: What an engine does for the gateway (``role=``): ``both`` (whole requests: the
#: default), ``prefill`` (the first hop of a disaggregated request only: an engine with
#: a KV-transfer connector as producer) or ``decode`` (the second hop: its consumer;
#: it also takes whole requests when no prefill engine can).
ROLES = ("both", "prefill", "decode")


def check_role(role: object, field: str = "role") -> str:
    """``role`` if it is one of :data:`ROLES` (any case), lowercased; else
    :class:`~kvevents.wire.framing.EndpointError` naming ``field``."""
    text = role.strip().lower() if isinstance(role, str) else None
    if text not in ROLES:
        raise EndpointError(f"{field}: expected one of {', '.join(ROLES)}, got {role!r}", field)
    return text


def dp_endpoint(endpoint: str | None, rank: int) -> str | None:
    """The endpoint data-parallel rank ``rank`` of a server publishes on, by vLLM's rule
    (``ZmqEventPublisher.offset_endpoint_port``, also SGLang's): rank 0 the endpoint
    itself; tcp port + rank (port 0 stays 0); ``inproc://X`` becomes ``inproc://X_dp{rank}``.
    Raises :class:`~kvevents.wire.framing.EndpointError` for anything else."""
    if endpoint is None or rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    head, sep, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and sep and port.isdigit():
        return endpoint if int(port) == 0 else f"{head}:{int(port) + rank}"
    raise EndpointError(f"dp: a data-parallel server's endpoint must be tcp://HOST:PORT or "
                        f"inproc://, got {endpoint!r}", "dp")


def check_http_url(url: str) -> str:
    """An engine's OpenAI server: ``http(s)://HOST:PORT`` with an optional path prefix
    (no query, no fragment); returned without a trailing ``/``. Raises
    :class:`~kvevents.wire.framing.EndpointError` naming ``http``."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None \
            or parts.query or parts.fragment or parts.username or parts.password:
        raise EndpointError(f"http: expected http://HOST:PORT (the engine's OpenAI server), "
                            f"got {url!r}", "http")
    return url.rstrip("/")


def validate_engine_name(name: str) -> str:
    if not _ENGINE_NAME.match(name):
        raise ValueError(
            f"engine name {name!r} must be 1-128 characters of letters, digits, '.', '_', ':' or '-'"
        )
    return name


@dataclass(frozen=True)
class EngineSpec:
    """One publisher the aggregator follows. ``bind``: publishers connect to us.
    ``http``: the engine's OpenAI server (``http://HOST:PORT``); an engine with one is
    a target of the gateway (``POST /v1/chat/completions`` and ``/v1/completions``).
    ``dp_rank``: this engine is that rank of a data-parallel server (its batches carry
    that ``data_parallel_rank``, and the gateway sends its requests with
    ``X-data-parallel-rank``); None: a server of its own, or a rank followed as one.
    ``role``: what the gateway sends it (:data:`ROLES`; see
    :mod:`kvevents.gateway.disagg`)."""

    name: str
    endpoint: str
    replay_endpoint: str | None = None
    model: str | None = None
    topic: str = ""
    bind: bool = False
    http: str | None = None
    dp_rank: int | None = None
    role: str = "both"

    def __post_init__(self) -> None:
        validate_engine_name(self.name)
        object.__setattr__(self, "role", check_role(self.role))
        if self.dp_rank is not None and (type(self.dp_rank) is not int
                                         or not 0 <= self.dp_rank < MAX_DP_SIZE):
            raise ValueError(f"dp_rank must be 0..{MAX_DP_SIZE - 1}, got {self.dp_rank!r}")
        check_engine_endpoint(self.endpoint, "endpoint", connect=not self.bind)
        if self.replay_endpoint is not None:
            check_engine_endpoint(self.replay_endpoint, "replay_endpoint", connect=True)
        if self.http is not None:
            object.__setattr__(self, "http", check_http_url(self.http))

    @classmethod
    def parse(cls, text: str) -> EngineSpec:
        """Parse ``NAME=ENDPOINT[,replay=E][,model=M][,topic=T][,bind=1][,http=URL][,role=R]``
        (one engine: ``dp=N`` with N > 1 is :meth:`parse_all`'s)."""
        specs = cls.parse_all(text)
        if len(specs) != 1:
            raise ValueError(f"{text!r} is {len(specs)} engines (dp=): use EngineSpec.parse_all")
        return specs[0]

    @classmethod
    def parse_all(cls, text: str) -> list[EngineSpec]:
        """:meth:`parse`, where ``,dp=N`` makes the N engines of a data-parallel server
        (:meth:`ranks`)."""
        name, sep, rest = text.partition("=")
        if not sep or not rest:
            raise ValueError(f"expected NAME=tcp://HOST:PORT[,replay=...], got {text!r}")
        endpoint, *opts = rest.split(",")
        kw: dict[str, Any] = {}
        dp = 1
        for opt in opts:
            key, sep, value = opt.partition("=")
            key = key.strip()
            if not sep:
                raise ValueError(f"option {opt!r} in {text!r} must be key=value")
            if key == "replay":
                kw["replay_endpoint"] = value
            elif key in ("model", "topic", "http", "role"):
                kw[key] = value
            elif key == "bind":
                kw["bind"] = value.lower() in ("1", "true", "yes")
            elif key == "dp":
                dp = _dp_size(value.strip())
            else:
                raise ValueError(f"unknown option {key!r} in {text!r} "
                                 "(replay, model, topic, bind, http, dp, role)")
        return cls.ranks(dp, name=name.strip(), endpoint=endpoint.strip(), **kw)

    @classmethod
    def ranks(cls, dp: int, **fields: Any) -> list[EngineSpec]:
        """The engines of a server with ``dp`` data-parallel ranks (``fields`` as for
        the constructor, naming the server): one engine as given when ``dp`` is 1, else
        rank ``r`` as ``NAME-dp{r}``, publishing on ``endpoint`` and ``replay_endpoint``
        offset by ``r`` (:func:`dp_endpoint`), sharing the server's ``http``."""
        if dp == 1:
            return [cls(**fields)]
        name, endpoint, replay = fields.pop("name"), fields.pop("endpoint"), fields.pop("replay_endpoint", None)
        out = [cls(name=f"{name}-dp{r}", endpoint=dp_endpoint(endpoint, r),  # type: ignore[arg-type]
                   replay_endpoint=dp_endpoint(replay, r), dp_rank=r, **fields) for r in range(dp)]
        clash = {s.endpoint for s in out} & {s.replay_endpoint for s in out}
        if clash:  # (vLLM's default ports, 5557 and 5558, do this from dp=2)
            raise EndpointError(f"dp={dp}: a rank's events endpoint is another's replay endpoint "
                                f"({min(clash)}); give a replay port at least {dp} above "
                                "the events port", "replay_endpoint")
        return out

    @classmethod
    def from_table(cls, table: Mapping[str, Any]) -> EngineSpec:
        """An engine written as a table (config file); unknown keys are errors (``dp``
        with more than one rank is :meth:`from_table_all`'s)."""
        specs = cls.from_table_all(table)
        if len(specs) != 1:
            raise ValueError(f"a table with dp = {len(specs)} is {len(specs)} engines: "
                             "use EngineSpec.from_table_all")
        return specs[0]

    @classmethod
    def from_table_all(cls, table: Mapping[str, Any]) -> list[EngineSpec]:
        """:meth:`from_table`, where ``dp = N`` makes a data-parallel server's N
        engines (:meth:`ranks`)."""
        known = ("name", "endpoint", "replay_endpoint", "model", "topic", "bind", "http", "dp", "role")
        unknown = sorted(set(table) - set(known))
        if unknown:
            raise ValueError(f"unknown key {unknown[0]!r} (keys: {', '.join(known)})")
        missing = [k for k in ("name", "endpoint") if k not in table]
        if missing:
            raise ValueError(f"missing key {missing[0]!r}")
        for key, value in table.items():
            want = bool if key == "bind" else int if key == "dp" else str
            wrong = not isinstance(value, want) or (want is int and isinstance(value, bool))
            if wrong and not (value is None and key in ("replay_endpoint", "model", "http")):
                raise ValueError(f"key {key!r} must be a {want.__name__}, got {value!r}")
        fields = dict(table)
        dp = fields.pop("dp", 1)
        if not 1 <= dp <= MAX_DP_SIZE:
            raise ValueError(f"dp must be 1..{MAX_DP_SIZE}, got {dp}")
        return cls.ranks(dp, **fields)

    def source(self, resume_seq: int | None = None, resume_ts: float | None = None) -> SourceConfig:
        """What the subscriber follows for this engine; ``resume_*``: continue a stream
        restored from a snapshot after batch ``resume_seq - 1`` (stamped ``resume_ts``)."""
        return SourceConfig(self.name, self.endpoint, replay_endpoint=self.replay_endpoint,
                            topic=self.topic, bind=self.bind, resume_seq=resume_seq,
                            resume_ts=resume_ts)


def _dp_size(value: str) -> int:
    if not value.isdigit() or not 1 <= int(value) <= MAX_DP_SIZE:
        raise ValueError(f"dp must be the server's data-parallel size, 1..{MAX_DP_SIZE}, "
                         f"got {value!r}")
    return int(value)


#: Deprecated alias of :class:`EngineSpec` (engines were called pods before); kept for
#: code that embeds the aggregator and still imports the old name.
PodSpec = EngineSpec
