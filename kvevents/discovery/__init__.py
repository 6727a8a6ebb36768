"""Engines found as a fleet scales: discovery sources feeding the engine registry.

* :mod:`.targets`: a discovered server -> its engines (names, endpoints, ports, ranks).
* :mod:`.source`: what a source is (:class:`Source`) and shows (:class:`SourceStatus`).
* :mod:`.dns`: names with several A/AAAA records (a Kubernetes headless Service);
  :mod:`.dns_srv`: SRV records (host and port per engine). Both ask through
  :mod:`.dnsquery` (questions, what answers mean), :mod:`.resolvconf` (the system
  resolver's settings) and report through :mod:`.dnsreport`.
* :mod:`.k8s`: pods by label selector, listed and watched (the ``k8s`` extra).
* :mod:`.manager`: :class:`Discovery`, which reconciles each source's desired set into
  the aggregator under the source's origin, with a grace period for vanished engines.

:func:`build_sources` makes the sources the settings ask for. Imports ``engines`` (and,
for types only, ``service``); the API layer owns the :class:`Discovery` of a server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvevents.discovery.manager import Discovery
from kvevents.discovery.source import Source, SourceStatus
from kvevents.discovery.targets import PortPlan, engine_specs, name_for_address, split_role

if TYPE_CHECKING:
    from kvevents.service.settings import AggregatorSettings

__all__ = ["Discovery", "DiscoveryConfigError", "PortPlan", "Source", "SourceStatus", "build_sources", "engine_specs",
           "name_for_address"]


class DiscoveryConfigError(ValueError):
    """Discovery settings that cannot work (a bad value, the ``k8s`` extra missing)."""


def port_plan(settings: AggregatorSettings) -> PortPlan:
    """The ports discovered engines use unless a pod's annotations say otherwise."""
    return PortPlan(events=settings.discover_events_port,
                    replay=settings.discover_replay_port or None,
                    http=settings.discover_http_port or None,
                    dp_size=settings.discover_dp_size)


def build_sources(settings: AggregatorSettings) -> list[Source]:
    """One source per ``discover_dns`` and ``discover_dns_srv`` name, and one for
    ``discover_k8s_selector``.
    Raises :class:`DiscoveryConfigError` for a bad value, or when Kubernetes discovery is
    asked for without the ``k8s`` extra installed (the message names the extra)."""
    try:
        return _build(settings)
    except (ValueError, ImportError) as exc:
        raise DiscoveryConfigError(str(exc)) from None


def _pools(entries: tuple[str, ...], flag: str) -> list[tuple[str, str]]:
    """Each distinct ``[ROLE=]NAME`` as ``(NAME, ROLE)`` (:func:`~.targets.split_role`)."""
    return [split_role(entry, flag) for entry in dict.fromkeys(entries)]


def _build(settings: AggregatorSettings) -> list[Source]:
    ports = port_plan(settings)
    sources: list[Source] = []
    if settings.discover_dns:
        from kvevents.discovery.dns import DnsSource

        sources += [DnsSource(name, ports, model=settings.discover_model,
                              interval_s=settings.discover_interval_s,
                              server=settings.dns_server, resolv_conf=settings.dns_resolv_conf, role=role)
                    for name, role in _pools(settings.discover_dns, "discover-dns")]
    if settings.discover_dns_srv:
        from kvevents.discovery.dns_srv import DnsSrvSource

        sources += [DnsSrvSource(name, ports, model=settings.discover_model,
                                 interval_s=settings.discover_interval_s,
                                 server=settings.dns_server, resolv_conf=settings.dns_resolv_conf,
                                 replay_name=settings.discover_srv_replay_name,
                                 http_name=settings.discover_srv_http_name, role=role)
                    for name, role in _pools(settings.discover_dns_srv, "discover-dns-srv")]
    elif settings.discover_srv_replay_name or settings.discover_srv_http_name:
        raise ValueError("discover-srv-replay-name / discover-srv-http-name: need --discover-dns-srv")
    if settings.discover_k8s_selector:
        from kvevents.discovery.k8s import K8sSource

        sources.append(K8sSource(settings.discover_k8s_selector, ports,
                                 namespace=settings.discover_k8s_namespace,
                                 model=settings.discover_model))
    return sources
