"""From a discovered address to the engines it serves: :func:`engine_specs`.

A discovery source finds *servers* (an address from DNS, a pod from Kubernetes); each
server publishes one KV event stream per data-parallel rank, rank ``r`` on the events
and replay ports plus ``r`` (vLLM's convention), and serves one OpenAI API. This module
turns one server into its :class:`~kvevents.engines.EngineSpec` list, the one place
discovered engines get their names and endpoints.

Each rank of a server with more than one knows its rank (``EngineSpec.dp_rank``): the
gateway sends its requests with ``X-data-parallel-rank``, and its batches' ranks are
checked against it.

Names: the source's ``base`` (``vllm-10.0.0.7`` for DNS, the pod's name for
Kubernetes), plus ``-dp{r}`` when the server has more than one rank. A name that does
not fit :data:`~kvevents.engines.ENGINE_NAME_PATTERN` raises ``ValueError`` (the
source counts it and skips that server).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from kvevents.engines.spec import ROLES, EngineSpec

__all__ = ["PortPlan", "engine_specs", "name_for_address", "split_role"]

DEFAULT_EVENTS_PORT = 5557
DEFAULT_REPLAY_PORT = 5558
DEFAULT_HTTP_PORT = 8000


@dataclass(frozen=True)
class PortPlan:
    """Where a discovered server publishes and serves. ``replay`` / ``http`` None: it
    has no replay socket / no OpenAI server (not a gateway target). ``dp_size``: its
    data-parallel ranks, rank ``r`` publishing on ``events + r`` and ``replay + r``."""

    events: int = DEFAULT_EVENTS_PORT
    replay: int | None = DEFAULT_REPLAY_PORT
    http: int | None = DEFAULT_HTTP_PORT
    dp_size: int = 1

    def __post_init__(self) -> None:
        for field, port in (("events", self.events), ("replay", self.replay), ("http", self.http)):
            if port is not None and not 0 < port < 65536:
                raise ValueError(f"{field} port must be 1..65535, got {port}")
        if not 1 <= self.dp_size <= 1024:
            raise ValueError(f"dp_size must be 1..1024, got {self.dp_size}")
        top = self.dp_size - 1
        if self.events + top > 65535 or (self.replay is not None and self.replay + top > 65535):
            raise ValueError(f"ports + {top} ranks pass 65535")


def split_role(entry: str, flag: str) -> tuple[str, str]:
    """``[ROLE=]NAME`` (a pool's DNS name, e.g. ``prefill=vllm-prefill.ns.svc``) as
    ``(NAME, ROLE)``; no role: ``both``. ``ValueError`` naming ``flag`` for a bad role."""
    role, sep, name = entry.rpartition("=")
    if not sep:
        return entry, "both"
    if role.strip().lower() not in ROLES:
        raise ValueError(f"{flag}: {entry!r}: the pool's role (before '=') must be one of "
                         f"{', '.join(ROLES)}")
    return name, role.strip().lower()


def _host(address: str) -> str:
    """``address`` as it goes into a URL: IPv6 literals in brackets."""
    try:
        if ipaddress.ip_address(address).version == 6:
            return f"[{address}]"
    except ValueError:
        pass  # a host name
    return address


def name_for_address(prefix: str, address: str) -> str:
    """``{prefix}-{address}``: the address stays readable in the name (an IPv6 literal
    keeps its colons; ``%zone`` suffixes are dropped)."""
    clean = re.sub(r"[^A-Za-z0-9._:-]", "-", prefix).strip("-.:_") or "engine"
    return f"{clean}-{address.split('%', 1)[0]}"


def engine_specs(base: str, address: str, ports: PortPlan, model: str | None = None,
                 role: str = "both") -> list[EngineSpec]:
    """The engines of one discovered server at ``address`` (an IP or host name), each
    with the gateway ``role`` of its pool (:data:`~kvevents.engines.spec.ROLES`)."""
    host = _host(address)
    out = []
    for rank in range(ports.dp_size):
        name = base if ports.dp_size == 1 else f"{base}-dp{rank}"
        out.append(EngineSpec(
            name=name,
            endpoint=f"tcp://{host}:{ports.events + rank}",
            replay_endpoint=None if ports.replay is None else f"tcp://{host}:{ports.replay + rank}",
            model=model,
            http=None if ports.http is None else f"http://{host}:{ports.http}",
            dp_rank=None if ports.dp_size == 1 else rank,
            role=role,
        ))
    return out
