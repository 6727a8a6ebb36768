"""One followed engine, as every part of the service names it: :class:`EngineSpec`.

An engine is one KV event publisher (a vLLM or SGLang engine, or a data-parallel rank
of one): its name, the live endpoint, the replay endpoint that fills gaps, the model
its blocks belong to, the topic and whether we bind. Settings (flags, environment,
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

__all__ = ["ENGINE_NAME_PATTERN", "EngineSpec", "PodSpec", "validate_engine_name"]

ENGINE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
_ENGINE_NAME = re.compile(ENGINE_NAME_PATTERN)


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
    a target of the gateway (``POST /v1/chat/completions`` and ``/v1/completions``)."""

    name: str
    endpoint: str
    replay_endpoint: str | None = None
    model: str | None = None
    topic: str = ""
    bind: bool = False
    http: str | None = None

    def __post_init__(self) -> None:
        validate_engine_name(self.name)
        check_engine_endpoint(self.endpoint, "endpoint", connect=not self.bind)
        if self.replay_endpoint is not None:
            check_engine_endpoint(self.replay_endpoint, "replay_endpoint", connect=True)
        if self.http is not None:
            object.__setattr__(self, "http", check_http_url(self.http))

    @classmethod
    def parse(cls, text: str) -> EngineSpec:
        """Parse ``NAME=ENDPOINT[,replay=E][,model=M][,topic=T][,bind=1][,http=URL]``."""
        name, sep, rest = text.partition("=")
        if not sep or not rest:
            raise ValueError(f"expected NAME=tcp://HOST:PORT[,replay=...], got {text!r}")
        endpoint, *opts = rest.split(",")
        kw: dict[str, Any] = {}
        for opt in opts:
            key, sep, value = opt.partition("=")
            key = key.strip()
            if not sep:
                raise ValueError(f"option {opt!r} in {text!r} must be key=value")
            if key == "replay":
                kw["replay_endpoint"] = value
            elif key in ("model", "topic", "http"):
                kw[key] = value
            elif key == "bind":
                kw["bind"] = value.lower() in ("1", "true", "yes")
            else:
                raise ValueError(f"unknown option {key!r} in {text!r} "
                                 "(replay, model, topic, bind, http)")
        return cls(name=name.strip(), endpoint=endpoint.strip(), **kw)

    @classmethod
    def from_table(cls, table: Mapping[str, Any]) -> EngineSpec:
        """An engine written as a table (config file); unknown keys are errors."""
        known = ("name", "endpoint", "replay_endpoint", "model", "topic", "bind", "http")
        unknown = sorted(set(table) - set(known))
        if unknown:
            raise ValueError(f"unknown key {unknown[0]!r} (keys: {', '.join(known)})")
        missing = [k for k in ("name", "endpoint") if k not in table]
        if missing:
            raise ValueError(f"missing key {missing[0]!r}")
        for key, value in table.items():
            want = bool if key == "bind" else str
            if not isinstance(value, want) and not (value is None and key in ("replay_endpoint", "model", "http")):
                raise ValueError(f"key {key!r} must be a {want.__name__}, got {value!r}")
        return cls(**table)

    def source(self, resume_seq: int | None = None, resume_ts: float | None = None) -> SourceConfig:
        """What the subscriber follows for this engine; ``resume_*``: continue a stream
        restored from a snapshot after batch ``resume_seq - 1`` (stamped ``resume_ts``)."""
        return SourceConfig(self.name, self.endpoint, replay_endpoint=self.replay_endpoint,
                            topic=self.topic, bind=self.bind, resume_seq=resume_seq,
                            resume_ts=resume_ts)


#: Deprecated alias of :class:`EngineSpec` (engines were called pods before); kept for
#: code that embeds the aggregator and still imports the old name.
PodSpec = EngineSpec
