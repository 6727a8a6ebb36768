"""Typed settings of the aggregator, validated once at the edge (pydantic-settings).

Sources, earlier ones winning: command-line flags (keyword arguments) > environment
variables ``KVEVENTS_<FIELD>`` (e.g. ``KVEVENTS_PORT``) > a config file (JSON, or TOML
when the name ends in ``.toml``; ``--config`` or ``KVEVENTS_CONFIG``) > the defaults
below. Keys in a config file are the field names; unknown keys are errors.

A tokenizer (for lookups by prompt text or chat) is written ``MODEL=PATH``, PATH a local
Hugging Face tokenizer directory; ``KVEVENTS_TOKENIZERS`` separates them with ``;``,
the config file's ``tokenizers`` is a table ``{MODEL = "PATH"}`` or a list of
``"MODEL=PATH"``.

An engine (one publisher to follow) is written ``NAME=ENDPOINT[,replay=ENDPOINT][,model=M]
[,topic=T][,bind=1][,http=URL][,dp=N]``, e.g.
``vllm-0=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558``, or in a config file as a
table with :class:`EngineSpec`'s field names (and ``dp``). ``dp=N`` names a data-parallel
server: N engines ``NAME-dp0``... (:meth:`EngineSpec.ranks`). In the environment,
engines are separated by ``;`` or whitespace.

Engines were called pods before: the old config keys ``pods`` / ``max_pods`` (and
``endpoints``), the variables ``KVEVENTS_PODS`` / ``KVEVENTS_MAX_PODS`` and the name
``PodSpec`` are still accepted; the new names win when both are given.

Failure: :func:`load_settings` raises :class:`SettingsError`, one line per bad field,
each naming where the value came from (flag, variable, or file and key) and what is
expected. Nothing is half-applied: settings are built whole or not at all.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, Field, InstanceOf, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from kvevents.defaults import (DEFAULT_PORT, ROUTE_AFFINITY_WEIGHT, ROUTE_BALANCE_WEIGHT,
                               ROUTE_LOAD_WEIGHT, ROUTE_MAX_IMBALANCE)
# EngineSpec (and its deprecated alias PodSpec) lives in kvevents.engines; re-exported
# here, where 0.1.0 defined it, with the name pattern.
from kvevents.engines.spec import ENGINE_NAME_PATTERN, EngineSpec, PodSpec  # noqa: F401

ENV_PREFIX = "KVEVENTS_"
__all__ = ["DEFAULT_PORT", "AggregatorSettings", "EngineSpec", "PodSpec", "SettingsError",
           "load_settings"]


def parse_tokenizer(text: str) -> tuple[str, str]:
    """Parse ``MODEL=PATH`` (a tokenizer directory for the model's prompts)."""
    model, sep, path = text.partition("=")
    if not sep or not model.strip() or not path.strip():
        raise ValueError(f"expected MODEL=PATH (a tokenizer directory), got {text!r}")
    return model.strip(), path.strip()


class SettingsError(ValueError):
    """Bad settings: ``lines`` has one human-readable line per problem."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines


# Where the environment and the config file are read from while settings are built.
# ``load_settings`` sets it (tests hand in their own environment); otherwise the process
# environment. A ContextVar, so concurrent builds in threads do not see each other's.
_INPUTS: ContextVar[tuple[Mapping[str, str], str | None] | None] = ContextVar("_INPUTS", default=None)


def _inputs() -> tuple[Mapping[str, str], str | None]:
    got = _INPUTS.get()
    if got is not None:
        return got
    return os.environ, os.environ.get(f"{ENV_PREFIX}CONFIG") or None


# Older variable names users already set; the field-named ones win when both are (and
# earlier ones in a tuple over later ones). KVEVENTS_PODS / KVEVENTS_MAX_PODS: engines
# were called pods before.
_LEGACY_ENV: dict[str, tuple[str, ...]] = {
    "engines": ("KVEVENTS_PODS", "KVEVENTS_ENDPOINTS"), "max_engines": ("KVEVENTS_MAX_PODS",),
    "stale_after_s": ("KVEVENTS_STALE_AFTER",), "replay_timeout_s": ("KVEVENTS_REPLAY_TIMEOUT",),
    "down_after_s": ("KVEVENTS_DOWN_AFTER",), "snapshot_interval_s": ("KVEVENTS_SNAPSHOT_INTERVAL",),
    "replay_deadline_s": ("KVEVENTS_REPLAY_DEADLINE",),
    "ingest_stuck_after_s": ("KVEVENTS_INGEST_STUCK_AFTER",)}
# Older config-file keys (and keyword arguments) of renamed fields, accepted as aliases.
_OLD_KEYS: dict[str, tuple[str, ...]] = {"engines": ("pods", "endpoints"), "max_engines": ("max_pods",)}
_NEW_KEY = {old: new for new, olds in _OLD_KEYS.items() for old in olds}


def env_name(field: str) -> str:
    return f"{ENV_PREFIX}{field.upper()}"


class _EnvironmentSource(PydanticBaseSettingsSource):
    """``KVEVENTS_<FIELD>`` (and the legacy names); empty values count as unset."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        environ, _ = _inputs()
        for var in (env_name(field_name), *_LEGACY_ENV.get(field_name, ())):
            if var and environ.get(var):
                return environ[var], field_name, False
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        out = {}
        for name, field in self.settings_cls.model_fields.items():
            value, key, _ = self.get_field_value(field, name)
            if value is not None:
                out[key] = value
        return out


def read_config_file(path: str) -> dict[str, Any]:
    """The mapping in a JSON or TOML file; ``SettingsError`` naming file and position."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise SettingsError([f"{path}: cannot read the config file ({exc.strerror or exc})"]) from None
    if p.suffix == ".toml":
        try:
            data: Any = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:  # its message ends "(at line L, column C)"
            raise SettingsError([f"{path}: invalid TOML: {exc}"]) from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SettingsError([f"{path}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg} "
                                 "(TOML files must end in .toml)"]) from None
    if not isinstance(data, dict):
        raise SettingsError([f"{path}: the top level must be an object/table of settings"])
    return data


class _ConfigFileSource(PydanticBaseSettingsSource):
    """The config file named by ``--config`` / ``KVEVENTS_CONFIG``, if any."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ returns the whole file

    def __call__(self) -> dict[str, Any]:
        _, path = _inputs()
        return read_config_file(path) if path else {}


class AggregatorSettings(BaseSettings):
    """Everything ``kvevents serve`` needs; immutable once built.

    A flat list of fields, each with its default and a description (shown by
    ``kvevents serve --help`` and in error messages).
    """

    model_config = SettingsConfigDict(frozen=True, extra="forbid", validate_default=True)

    engines: tuple[InstanceOf[EngineSpec], ...] = Field(
        (), validation_alias=AliasChoices("engines", *_OLD_KEYS["engines"]),
        description="publishers to follow, NAME=tcp://HOST:PORT[,replay=...] or tables")
    host: str = Field("127.0.0.1", min_length=1, description="HTTP listen address")
    port: int = Field(DEFAULT_PORT, ge=1, le=65535, description="HTTP listen port, 1-65535")
    auth_token: str | None = Field(None, description="bearer token required on mutating endpoints")
    stale_after_s: float = Field(30.0, gt=0, description="seconds of silence after which an engine is 'stale'")
    replay_timeout_s: float = Field(2.0, gt=0, description="seconds to wait for a replay reply")
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="largest HTTP request body")
    max_prompt_tokens: int = Field(1_000_000, ge=1, description="longest prompt a lookup takes")
    lookup_in_protocol: bool = Field(True, description="kvevents serve: answer common "
                                     "POST /v1/lookup bodies in the HTTP protocol, before the "
                                     "ASGI app (false: every lookup through the app)")
    openai_in_protocol: bool = Field(True, description="kvevents serve: hand the gateway's "
                                     "OpenAI requests to it from the HTTP protocol, past the "
                                     "ASGI app's middleware (false: through the app)")
    workers: int = Field(1, ge=1, le=256, description="kvevents serve: processes serving the "
                         "one port, each following every engine (SO_REUSEPORT); 'auto': the "
                         "cores this process may use (its CPU affinity, or its cgroup's CPU "
                         "quota rounded up where that is fewer)")
    event_feed_size: int = Field(2048, ge=1, description="events kept for /v1/events clients")
    log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = Field(
        "info", description="uvicorn log level")
    down_after_s: float = Field(
        30.0, ge=0, description="seconds disconnected after which an engine is not routed to")
    data_dir: str | None = Field(
        None, description="directory for index snapshots, restored on start (none: start empty)")
    snapshot_interval_s: float = Field(60.0, gt=0, description="seconds between snapshots")
    bootstrap_from: str | None = Field(
        None, pattern=r"^https?://", description="a peer aggregator (http://HOST:PORT) whose "
                                                 "snapshot a fresh replica loads first")
    tokenizers: tuple[tuple[str, str], ...] = Field(
        (), description="(model, tokenizer directory) pairs for lookups by prompt text or "
                        "chat: MODEL=PATH, ';'-separated in the environment, a table "
                        "{MODEL = \"PATH\"} or a list in the config file")
    # Ingest robustness: replay deadline per gap (no progress this long: the gap is lost
    # and the engine resyncs), the believable seq jump, byte bound of the live messages held
    # back during a replay, ZeroMQ receive queue per engine (messages), engines allowed (None:
    # what the socket/file budget allows), and how old the ingest loop's heartbeat may
    # get before /healthz says it is stuck.
    replay_deadline_s: float = Field(5.0, gt=0, description="seconds a replay may make no "
                                                            "progress before its gap is lost")
    seq_window: int = Field(1_000_000, ge=1, description="largest believable forward seq jump")
    max_pending_bytes: int = Field(32 * 1024 * 1024, ge=0,
                                   description="bytes of live messages held back during a replay")
    recv_hwm: int = Field(1000, ge=1, description="ZeroMQ receive queue per engine, in messages")
    ingest_lane: bool = Field(True, description="apply each engine's in-order batches of the "
                              "common wire shape in the compiled lane, without the GIL (false: "
                              "every batch through the Python path, the reference)")
    max_engines: int | None = Field(
        None, ge=0, validation_alias=AliasChoices("max_engines", *_OLD_KEYS["max_engines"]),
        description="engines allowed (none: the socket and file budget decides)")
    ingest_stuck_after_s: float = Field(10.0, gt=0, description="heartbeat age at which "
                                                                "/healthz reports ingest stuck")
    # The OpenAI gateway (engines with an http URL): its bearer token, how long a request
    # may go without an answer, requests in flight before 503, and how often each engine's
    # /metrics is read for its load (idle, and while the gateway is routing).
    api_key: str | None = Field(None, description="bearer token required on the OpenAI endpoints "
                                                  "(/v1/chat/completions, /v1/completions, /v1/models)")
    request_timeout_s: float = Field(600.0, gt=0, description="seconds a proxied request may wait "
                                                              "for (more of) its answer")
    max_inflight: int = Field(1024, ge=1, description="proxied requests in flight before the "
                                                      "gateway answers 503")
    # Hostile clients: the longest prompt text tokenized (characters, checked before the
    # tokenizer's memory is spent), HTTP connections open at once (past it the one waiting
    # longest for its request head is closed), and how long a request's head may take
    # and its body may go without a byte.
    max_prompt_chars: int = Field(4_000_000, ge=1, description="longest prompt text or chat "
                                  "messages, in characters, tokenized (gateway, /v1/lookup, "
                                  "/v1/route; longer: 400 before tokenizing)")
    max_connections: int = Field(4096, ge=1, description="HTTP connections open at once; past "
                                 "it the one waiting longest for its request head is closed "
                                 "(none waiting: the new one gets 503)")
    header_timeout_s: float = Field(10.0, gt=0, description="seconds a request's head may take "
                                    "to arrive, from its first byte or the connection's opening")
    body_timeout_s: float = Field(30.0, gt=0, description="seconds a request's body may go "
                                  "without a byte arriving")
    # The KV-aware policy's trade of cache against load (kvevents.routing.policies), for
    # POST /v1/route and the gateway alike.
    route_load_weight: float = Field(
        ROUTE_LOAD_WEIGHT, ge=0,
        description="routing: weight of an engine's load against the share of the prompt it caches")
    route_max_imbalance: float = Field(
        ROUTE_MAX_IMBALANCE, ge=0,
        description="routing: an engine more than this many requests busier than the least "
                    "loaded one is not chosen, however much it caches")
    route_affinity_weight: float = Field(
        ROUTE_AFFINITY_WEIGHT, ge=0,
        description="routing: bonus of the engine a prompt's distinctive part hashes to (keeps "
                    "a conversation on one engine)")
    route_balance_weight: float = Field(
        ROUTE_BALANCE_WEIGHT, ge=0,
        description="routing (gateway): pull toward the engines the gateway sent less than "
                    "their share of its recent requests (evens out requests per engine, across "
                    "replicas too); 0: off")
    token_parity_sample_rate: float = Field(
        0.01, ge=0, le=1, description="gateway: the share of requests whose ids are checked "
                                      "against the engine's /tokenize (besides each model's first); "
                                      "0: no checks")
    token_parity_threshold: int = Field(
        3, ge=1, description="gateway: mismatches in a row after which a model's requests are "
                             "routed with the engines' /tokenize ids until a check matches")
    pd_skip_cached_share: float = Field(
        0.9, ge=0, le=1, description="prefill/decode disaggregation: the decode engine computes "
                                     "the prompt itself (no prefill hop) when it holds at least "
                                     "this share of it")
    pd_skip_uncached_tokens: int = Field(
        256, ge=0, description="prefill/decode disaggregation: likewise when the part of the "
                               "prompt it lacks is shorter than this many tokens; 0: never")
    engine_poll_interval_s: float = Field(1.0, gt=0, description="seconds between reads of each "
                                                                 "engine's /metrics (its load)")
    engine_poll_busy_interval_s: float = Field(
        1.0, gt=0, description="seconds between reads of each engine's /metrics while the "
                               "gateway has requests in flight (or had within "
                               "engine_poll_interval_s); not shorter than engine_poll_interval_s: "
                               "one cadence")

    # Discovery (kvevents.discovery): engines found by DNS names and/or a Kubernetes pod
    # selector, the ports and model of what is found (pod annotations override), how often
    # DNS is asked, and how long a vanished engine keeps its state (unroutable meanwhile).
    discover_dns: tuple[str, ...] = Field(
        (), description="DNS names whose A/AAAA records are engines (a headless Service); "
                        "';'-separated in the environment")
    discover_dns_srv: tuple[str, ...] = Field(
        (), description="DNS SRV names whose records are engines (host and events port), e.g. "
                        "_kv-events._tcp.vllm.NAMESPACE.svc.cluster.local; ';'-separated in "
                        "the environment")
    discover_srv_replay_name: str | None = Field(
        None, min_length=1, description="port name of the engines' replay socket: its SRV "
                                        "record _NAME._PROTO.DOMAIN gives each engine's replay "
                                        "port (default: discover_replay_port)")
    discover_srv_http_name: str | None = Field(
        None, min_length=1, description="port name of the engines' OpenAI server, likewise "
                                        "(default: discover_http_port)")
    discover_interval_s: float | None = Field(
        None, gt=0, le=3600, description="seconds between DNS resolutions, even when shorter "
                                         "than the records' TTL (default: when the TTL runs "
                                         "out, at least 1 s)")
    dns_server: str | None = Field(None, pattern=r"^(\[[0-9A-Fa-f:.]+\]|[^\s:\[\]]+)(:\d{1,5})?$",
                                   description="DNS server HOST[:PORT] to ask instead of the "
                                               "system resolver")
    dns_resolv_conf: str = Field("/etc/resolv.conf", min_length=1,
                                 description="the system resolver's configuration (nameservers, "
                                             "search, ndots) when no dns_server is given")
    discover_k8s_selector: str | None = Field(
        None, min_length=1, description="label selector of engine pods to follow "
                                        "(needs the k8s extra)")
    discover_k8s_namespace: str | None = Field(
        None, min_length=1, description="namespace of the engine pods (default: this pod's own)")
    discover_events_port: int = Field(5557, ge=1, le=65535, description="discovered engines' "
                                                                        "KV events port")
    discover_replay_port: int = Field(5558, ge=0, le=65535, description="discovered engines' "
                                                                        "replay port (0: none)")
    discover_http_port: int = Field(8000, ge=0, le=65535, description="discovered engines' "
                                                                      "OpenAI port (0: none)")
    discover_dp_size: int = Field(1, ge=1, le=1024, description="data-parallel ranks per "
                                                                "discovered server")
    discover_model: str | None = Field(None, min_length=1, description="model of discovered "
                                                                       "engines")
    discover_grace_s: float = Field(30.0, ge=0, description="seconds a vanished engine keeps "
                                                            "its state (unroutable) before it is "
                                                            "dropped")
    recovery_timeout_s: float = Field(30.0, gt=0, description="seconds readiness waits for an "
                                                              "engine's first replay before giving "
                                                              "up on it (counted)")

    @field_validator("workers", mode="before")
    @classmethod
    def _parse_workers(cls, value: Any) -> Any:
        # "auto": the cores this process may use: its CPU affinity, or its cgroup's CPU
        # quota (a container's CPU limit) rounded up where that is fewer (cpus.py).
        if isinstance(value, str) and value.strip().lower() == "auto":
            from kvevents.service.cpus import usable_cpus

            return usable_cpus()
        return value

    @field_validator("discover_dns", "discover_dns_srv", mode="before")
    @classmethod
    def _parse_names(cls, value: Any) -> Any:
        if isinstance(value, str):  # from the environment: NAME;NAME
            value = [s for s in re.split(r"[;,\s]+", value.strip()) if s]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
            raise ValueError("expected DNS names")
        return tuple(value)

    @field_validator("tokenizers", mode="before")
    @classmethod
    def _parse_tokenizers(cls, value: Any) -> Any:
        if isinstance(value, str):  # from the environment: MODEL=PATH;MODEL=PATH
            value = [t for t in value.split(";") if t.strip()]
        if isinstance(value, Mapping):  # a config-file table {MODEL = "PATH"}
            value = list(value.items())
        if not isinstance(value, (list, tuple)):
            raise ValueError("expected MODEL=PATH entries")
        out = []
        for i, item in enumerate(value):
            if isinstance(item, str):
                try:
                    out.append(parse_tokenizer(item))
                except ValueError as exc:
                    raise ValueError(f"entry {i}: {exc}") from None
            elif isinstance(item, (list, tuple)) and len(item) == 2 and all(isinstance(x, str) for x in item):
                out.append((item[0], item[1]))
            else:
                raise ValueError(f"entry {i}: expected 'MODEL=PATH', got {item!r}")
        models = [m for m, _ in out]
        for m in models:
            if models.count(m) > 1:
                raise ValueError(f"model {m!r} given more than once")
        return tuple(out)

    @field_validator("engines", mode="before")
    @classmethod
    def _parse_engines(cls, value: Any) -> Any:
        if isinstance(value, str):  # from the environment: separated by ';' or whitespace
            value = [s for s in re.split(r"[;\s]+", value.strip()) if s]
        if not isinstance(value, (list, tuple)):
            raise ValueError("expected a list of engines")
        out = []
        for i, item in enumerate(value):
            try:
                if isinstance(item, EngineSpec):
                    out.append(item)
                elif isinstance(item, str):  # (dp=N: the N engines of a data-parallel server)
                    out.extend(EngineSpec.parse_all(item))
                elif isinstance(item, Mapping):
                    out.extend(EngineSpec.from_table_all(item))
                else:
                    raise ValueError(f"expected 'NAME=ENDPOINT,...' or a table, got {item!r}")
            except ValueError as exc:
                raise ValueError(f"entry {i}: {exc}") from None
        return tuple(out)

    @model_validator(mode="after")
    def _unique_engines(self) -> AggregatorSettings:
        names = [p.name for p in self.engines]
        if len(names) != len(set(names)):
            raise ValueError(f"engine names must be unique, got {names}")
        return self

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings,
                                   dotenv_settings, file_secret_settings):
        # Priority order, highest first: flags (init kwargs) > environment > config file.
        return (init_settings, _EnvironmentSource(settings_cls), _ConfigFileSource(settings_cls))


def field_default(name: str) -> Any:
    """The default of one setting (for ``--help``)."""
    return AggregatorSettings.model_fields[name].default


def _where(field: str, flags: Mapping[str, Any], environ: Mapping[str, str],
           config: str | None, file_data: Mapping[str, Any]) -> str:
    """Which source supplied ``field``, in priority order, as the user would name it."""
    if field in flags:
        return "--" + {"engines": "endpoint"}.get(field, field.replace("_", "-"))
    for var in (env_name(field), *_LEGACY_ENV.get(field, ())):
        if var and environ.get(var):
            return f"environment variable {var}"
    if config:
        for key in (field, *_OLD_KEYS.get(field, ())):
            if key in file_data:
                return f"{config}: field {key!r}"
    return f"setting {field!r}"


def _describe(exc: ValidationError, flags: Mapping[str, Any], environ: Mapping[str, str],
              config: str | None) -> list[str]:
    file_data: Mapping[str, Any] = {}
    if config:
        try:
            file_data = read_config_file(config)
        except SettingsError:
            pass
    known = list(AggregatorSettings.model_fields)
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        field = _NEW_KEY.get(loc[0], loc[0]) if loc else ""
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            where = f"{config}: field {field!r}" if config and field in file_data else f"setting {field!r}"
            lines.append(f"{where}: unknown setting; known: {', '.join(known)}")
            continue
        if not field:  # a rule across fields
            lines.append(f"settings: {msg}")
            continue
        where = _where(field, flags, environ, config, file_data)
        info = AggregatorSettings.model_fields.get(field)
        if field == "engines":  # EngineSpec's messages already quote the entry and the syntax
            lines.append(f"{where}: {msg}")
            continue
        hint = f" (expected: {info.description})" if info is not None and info.description else ""
        got = f", got {err.get('input')!r}"
        lines.append(f"{where}: {msg}{got}{hint}")
    return lines


@contextmanager
def _reading(environ: Mapping[str, str], config: str | None) -> Iterator[None]:
    token = _INPUTS.set((environ, config))
    try:
        yield
    finally:
        _INPUTS.reset(token)


def load_settings(
    config_path: str | None = None,
    env: Mapping[str, str] | None = None,
    **flags: Any,
) -> AggregatorSettings:
    """Build settings from flags (None = not given), environment and config file.

    ``config_path`` falls back to ``KVEVENTS_CONFIG``; ``env`` defaults to the process
    environment. Raises :class:`SettingsError` with one line per bad setting.
    """
    environ = os.environ if env is None else env
    config = config_path or environ.get(f"{ENV_PREFIX}CONFIG") or None
    given = {k: v for k, v in flags.items() if v is not None}
    with _reading(environ, config):
        try:
            return AggregatorSettings(**given)
        except ValidationError as exc:
            raise SettingsError(_describe(exc, given, environ, config)) from None
