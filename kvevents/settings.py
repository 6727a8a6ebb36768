"""Typed settings of the aggregator, validated once at the edge.

Sources, later ones winning: built-in defaults < a config file (JSON or TOML,
``--config``) < environment variables (``KVEVENTS_*``) < command-line flags.

A tokenizer (for lookups by prompt text or chat) is written ``MODEL=PATH``, PATH a local
Hugging Face tokenizer directory; ``KVEVENTS_TOKENIZERS`` separates them with ``;``,
the config file's ``tokenizers`` is a table ``{MODEL = "PATH"}`` or a list of
``"MODEL=PATH"``.

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


def parse_tokenizer(text: str) -> tuple[str, str]:
    """Parse ``MODEL=PATH`` (a tokenizer directory for the model's prompts)."""
    model, sep, path = text.partition("=")
    if not sep or not model.strip() or not path.strip():
        raise ValueError(f"expected MODEL=PATH (a tokenizer directory), got {text!r}")
    return model.strip(), path.strip()


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
    # (model, tokenizer directory) pairs: lookups by prompt text or chat for that model.
    tokenizers: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be 1..65535, got {self.port}")
        if self.stale_after_s <= 0 or self.replay_timeout_s <= 0:
            raise ValueError("stale_after_s and replay_timeout_s must be > 0")
        if self.max_body_bytes < 1024 or self.max_prompt_tokens < 1:
            raise ValueError("max_body_bytes must be >= 1024 and max_prompt_tokens >= 1")
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
}


def _from_mapping(data: dict[str, Any], origin: str) -> dict[str, Any]:
    known = {f.name for f in fields(AggregatorSettings)}
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key == "endpoints" or key == "pods":
            out["pods"] = tuple(
                PodSpec.parse(v) if isinstance(v, str) else PodSpec(**v) for v in value
            )
        elif key == "tokenizers":
            items = value.items() if isinstance(value, dict) else (
                parse_tokenizer(v) if isinstance(v, str) else v for v in value)
            out["tokenizers"] = tuple((str(m), str(p)) for m, p in items)
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
    if env.get("KVEVENTS_TOKENIZERS"):
        specs = re.split(r"[;\n]+", env["KVEVENTS_TOKENIZERS"].strip())
        values["tokenizers"] = tuple(parse_tokenizer(s) for s in specs if s.strip())
    for key, value in overrides.items():
        if value is not None:
            values[key] = value
    return replace(AggregatorSettings(), **values) if values else AggregatorSettings()
