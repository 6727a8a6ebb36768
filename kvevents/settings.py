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


class EndpointError(ValueError):
    """A pod endpoint the subscriber could not use; ``field`` names which one."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def check_pod_endpoint(endpoint: str, field: str, *, connect: bool) -> None:
    """Raise :class:`EndpointError` unless ``endpoint`` works for the subscriber.

    Every tcp endpoint needs a port in 1..65535; one the subscriber connects to (the
    live endpoint unless ``bind``, and always the replay endpoint) also needs a real
    host, not a wildcard: ZeroMQ refuses ``connect("tcp://*:5557")``.
    """
    try:
        validate_endpoint(endpoint)
    except ValueError as exc:
        raise EndpointError(f"{field}: {exc}", field) from None
    if not endpoint.startswith("tcp://"):
        return
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    if not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        raise EndpointError(f"{field}: port must be 1..65535 in {endpoint!r}", field)
    if connect and host.strip("[]") in ("*", "0.0.0.0", "::", ""):
        raise EndpointError(
            f"{field}: {endpoint!r} is a wildcard address the subscriber cannot connect to; "
            "give the publisher's host (or bind=1 for publishers that connect to us)", field)


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
        check_pod_endpoint(self.endpoint, "endpoint", connect=not self.bind)
        if self.replay_endpoint is not None:
            check_pod_endpoint(self.replay_endpoint, "replay_endpoint", connect=True)

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
    # A pod disconnected this long is not offered for routing (still listed, "down").
    down_after_s: float = 30.0
    # Durable restarts: snapshots of the index in this directory (None: no snapshots).
    data_dir: str | None = None
    snapshot_interval_s: float = 60.0
    # A fresh replica loads this peer aggregator's snapshot (http://HOST:PORT) first.
    bootstrap_from: str | None = None

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be 1..65535, got {self.port}")
        if self.stale_after_s <= 0 or self.replay_timeout_s <= 0:
            raise ValueError("stale_after_s and replay_timeout_s must be > 0")
        if self.max_body_bytes < 1024 or self.max_prompt_tokens < 1:
            raise ValueError("max_body_bytes must be >= 1024 and max_prompt_tokens >= 1")
        if self.down_after_s < 0 or self.snapshot_interval_s <= 0:
            raise ValueError("down_after_s must be >= 0 and snapshot_interval_s > 0")
        if self.bootstrap_from is not None and not self.bootstrap_from.startswith(
                ("http://", "https://")):
            raise ValueError(f"bootstrap_from must be http://HOST:PORT, got {self.bootstrap_from!r}")
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
    "KVEVENTS_DOWN_AFTER": ("down_after_s", float),
    "KVEVENTS_DATA_DIR": ("data_dir", str),
    "KVEVENTS_SNAPSHOT_INTERVAL": ("snapshot_interval_s", float),
    "KVEVENTS_BOOTSTRAP_FROM": ("bootstrap_from", str),
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
