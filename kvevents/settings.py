"""Typed settings of the aggregator, validated once at the edge.

Sources, later ones winning: built-in defaults < a config file (JSON or TOML,
``--config``) < environment variables (``KVEVENTS_*``) < command-line flags.

A pod (one publisher to follow) is written ``NAME=ENDPOINT[,replay=ENDPOINT][,model=M]
[,topic=T]``, e.g. ``vllm-0=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558``.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from kvevents.transport import validate_endpoint

POD_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
_POD_NAME = re.compile(POD_NAME_PATTERN)


def validate_pod_name(name: str) -> str:
    if not _POD_NAME.match(name):
        raise ValueError(
            f"pod name {name!r} must be 1-128 characters of letters, digits, '.', '_', ':' or '-'"
        )
    return name


@dataclass(frozen=True)
class PodSpec:
    """One publisher the aggregator follows. ``bind``: publishers connect to us."""

    name: str
    endpoint: str
    replay_endpoint: str | None = None
    model: str | None = None
    topic: str = ""
    bind: bool = False

    def __post_init__(self) -> None:
        validate_pod_name(self.name)
        validate_endpoint(self.endpoint)
        if self.replay_endpoint is not None:
            validate_endpoint(self.replay_endpoint)

    @classmethod
    def parse(cls, text: str) -> PodSpec:
        """Parse ``NAME=ENDPOINT[,replay=E][,model=M][,topic=T][,bind=1]``."""
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
            elif key in ("model", "topic"):
                kw[key] = value
            elif key == "bind":
                kw["bind"] = value.lower() in ("1", "true", "yes")
            else:
                raise ValueError(f"unknown option {key!r} in {text!r} (replay, model, topic, bind)")
        return cls(name=name.strip(), endpoint=endpoint.strip(), **kw)


@dataclass(frozen=True)
class AggregatorSettings:
    """Everything ``kvevents serve`` needs; immutable once built."""

    pods: tuple[PodSpec, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    auth_token: str | None = None
    stale_after_s: float = 30.0  # a pod silent this long is "stale"
    replay_timeout_s: float = 2.0
    max_body_bytes: int = 8 * 1024 * 1024
    max_prompt_tokens: int = 1_000_000
    event_feed_size: int = 2048
    log_level: str = "info"
    # Ingest robustness (issue 11): replay deadline per gap (no progress this long:
    # the gap is lost and the pod resyncs), the believable seq jump, byte bound of the
    # live messages held back during a replay, ZeroMQ receive queue per pod (messages),
    # pods allowed (None: what the socket/file budget allows), and how old the ingest
    # loop's heartbeat may get before /healthz says it is stuck.
    replay_deadline_s: float = 5.0
    seq_window: int = 1_000_000
    max_pending_bytes: int = 32 * 1024 * 1024
    recv_hwm: int = 1000
    max_pods: int | None = None
    ingest_stuck_after_s: float = 10.0

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be 1..65535, got {self.port}")
        if self.stale_after_s <= 0 or self.replay_timeout_s <= 0:
            raise ValueError("stale_after_s and replay_timeout_s must be > 0")
        if self.max_body_bytes < 1024 or self.max_prompt_tokens < 1:
            raise ValueError("max_body_bytes must be >= 1024 and max_prompt_tokens >= 1")
        if self.replay_deadline_s <= 0 or self.ingest_stuck_after_s <= 0:
            raise ValueError("replay_deadline_s and ingest_stuck_after_s must be > 0")
        if self.seq_window < 1 or self.max_pending_bytes < 0 or self.recv_hwm < 1:
            raise ValueError("seq_window and recv_hwm must be >= 1, max_pending_bytes >= 0")
        if self.max_pods is not None and self.max_pods < 0:
            raise ValueError(f"max_pods must be >= 0, got {self.max_pods}")
        names = [p.name for p in self.pods]
        if len(names) != len(set(names)):
            raise ValueError(f"pod names must be unique: {names}")


_ENV = {
    "KVEVENTS_HOST": ("host", str),
    "KVEVENTS_PORT": ("port", int),
    "KVEVENTS_AUTH_TOKEN": ("auth_token", str),
    "KVEVENTS_STALE_AFTER": ("stale_after_s", float),
    "KVEVENTS_REPLAY_TIMEOUT": ("replay_timeout_s", float),
    "KVEVENTS_MAX_BODY_BYTES": ("max_body_bytes", int),
    "KVEVENTS_MAX_PROMPT_TOKENS": ("max_prompt_tokens", int),
    "KVEVENTS_REPLAY_DEADLINE": ("replay_deadline_s", float),
    "KVEVENTS_SEQ_WINDOW": ("seq_window", int),
    "KVEVENTS_MAX_PENDING_BYTES": ("max_pending_bytes", int),
    "KVEVENTS_RECV_HWM": ("recv_hwm", int),
    "KVEVENTS_MAX_PODS": ("max_pods", int),
    "KVEVENTS_INGEST_STUCK_AFTER": ("ingest_stuck_after_s", float),
}


def _from_mapping(data: dict[str, Any], origin: str) -> dict[str, Any]:
    known = {f.name for f in fields(AggregatorSettings)}
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key == "endpoints" or key == "pods":
            out["pods"] = tuple(
                PodSpec.parse(v) if isinstance(v, str) else PodSpec(**v) for v in value
            )
        elif key in known:
            out[key] = value
        else:
            raise ValueError(f"unknown setting {key!r} in {origin}")
    return out


def load_settings(
    config_path: str | None = None,
    env: dict[str, str] | None = None,
    **overrides: Any,
) -> AggregatorSettings:
    """Build settings from file, environment and explicit overrides (None = unset).

    ``KVEVENTS_ENDPOINTS`` holds pods separated by ``;`` or whitespace. Raises
    ``ValueError`` naming the bad setting.
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    if config_path:
        path = Path(config_path)
        text = path.read_text()
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        values.update(_from_mapping(data, str(path)))
    for var, (name, conv) in _ENV.items():
        if env.get(var):
            try:
                values[name] = conv(env[var])
            except ValueError:
                raise ValueError(f"{var}={env[var]!r} is not a valid {conv.__name__}") from None
    if env.get("KVEVENTS_ENDPOINTS"):
        specs = re.split(r"[;\s]+", env["KVEVENTS_ENDPOINTS"].strip())
        values["pods"] = tuple(PodSpec.parse(s) for s in specs if s)
    for key, value in overrides.items():
        if value is not None:
            values[key] = value
    return replace(AggregatorSettings(), **values) if values else AggregatorSettings()
