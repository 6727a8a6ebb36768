"""Engines behind a DNS name: :class:`DnsSource` (``--discover-dns NAME``).

Each round asks for the A and AAAA records of one name (a Kubernetes headless Service,
a round-robin record), turns every address into its engines with
:func:`~kvevents.discovery.targets.engine_specs` (named ``{first label}-{address}``)
and emits the whole set. The name is asked of one DNS server directly
(``--dns-server HOST:PORT``: the name as given, no search domains) or as the system
resolver would: the hosts file first, then the servers, ``search`` domains and
``ndots`` of ``resolv.conf`` (see :mod:`~kvevents.discovery.resolvconf`).

What each answer does to the set (:mod:`~kvevents.discovery.dnsquery` decides):

* records of either family: those addresses. The families are asked independently: a
  family that is refused, fails, is not implemented or times out does not discard the
  other's records (the round counts as *partial*, the failure is shown and counted);
* NXDOMAIN (for either family: it is about the name) or NODATA for both families, on
  every search candidate: the empty set, a Service scaled to zero, whose engines leave
  after the grace period;
* no records, no NXDOMAIN, and at least one family failed (timeouts, SERVFAIL, REFUSED,
  or NODATA beside a failure): an outage of DNS, not of the engines. The round fails
  (``errors``, ``last_error``), nothing is emitted, the last set stands.

When the next round comes: after ``interval_s`` when it is given (``--discover-interval``,
even when shorter than the records' TTL); without it, when the answer's TTL runs out
(the lowest TTL of the records used, or the negative TTL of an empty answer), but not
sooner than :data:`MIN_INTERVAL_S`. A failed round is retried after ``interval_s``, or
:data:`MIN_INTERVAL_S`.

Lifecycle and failure: :meth:`DnsSource.run` resolves, emits, then waits, until ``stop``
is set; it returns within about a second of it, since no single question waits longer
than that. Nothing a server or the network does raises out of ``run``.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import re
import threading
from dataclasses import dataclass

from kvevents.discovery.dnsquery import Asker, Lookup, lookup
from kvevents.discovery.dnsreport import QueryReport
from kvevents.discovery.resolvconf import (DEFAULT_HOSTS, DEFAULT_RESOLV_CONF, ResolvConf, hosts_addresses,
                                           parse_server, read_resolv_conf, search_candidates)
from kvevents.discovery.source import Emit, Source
from kvevents.discovery.targets import PortPlan, engine_specs, name_for_address
from kvevents.engines.spec import EngineSpec

__all__ = ["MIN_INTERVAL_S", "DnsSource", "parse_server"]

log = logging.getLogger(__name__)

#: Without ``--discover-interval``: the shortest wait between rounds (a TTL of 0, an
#: answer without TTL, a failed round).
MIN_INTERVAL_S = 1.0
FAMILIES = ("A", "AAAA")
_LABEL = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")


@dataclass
class Round:
    """What one round found: ``specs`` None when it failed (``error`` says why);
    ``partial`` when it has an answer although some question failed (``error`` too)."""

    specs: list[EngineSpec] | None
    ttl: int | None = None
    partial: bool = False
    error: str = ""


def check_name(name: object, flag: str) -> str:
    """``name`` if it is a DNS name (labels of letters, digits, ``-``, ``_``); else
    ``ValueError`` naming ``flag``."""
    labels = name.removesuffix(".").split(".") if isinstance(name, str) else [""]
    if not isinstance(name, str) or len(name) > 254 or not all(map(_LABEL.match, labels)):
        raise ValueError(f"{flag}: expected a DNS name, got {name!r}")
    return name


class DnsSource(Source):
    """The engines at the addresses of ``name`` (see the module docstring).

    ``interval_s`` None: rounds follow the records' TTL. ``server``: ask this one
    ``HOST[:PORT]`` only; None: the system resolver as read from ``resolv_conf`` and
    ``hosts_file`` (re-read every round). ``timeout_s``: per question and server.
    ``role``: the gateway role of the engines found (``--discover-dns ROLE=NAME``)."""

    kind = "dns"

    def __init__(self, name: str, ports: PortPlan, *, model: str | None = None,
                 interval_s: float | None = None, server: str | None = None, timeout_s: float = 1.0,
                 resolv_conf: str = DEFAULT_RESOLV_CONF, hosts_file: str = DEFAULT_HOSTS,
                 role: str = "both") -> None:
        super().__init__()
        check_name(name, "discover-dns")
        if interval_s is not None and not (isinstance(interval_s, (int, float))
                                           and math.isfinite(interval_s) and interval_s > 0):
            raise ValueError(f"discover-interval: must be a number of seconds > 0, got {interval_s!r}")
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"dns-timeout: must be a number of seconds > 0, got {timeout_s!r}")
        self.name, self.ports, self.model = name, ports, model
        self.role = role  # the gateway role of every engine found (one name per pool)
        self.interval_s = None if interval_s is None else float(interval_s)
        self.timeout_s, self.server = float(timeout_s), server
        self.resolv_conf, self.hosts_file = resolv_conf, hosts_file
        self.origin = f"dns:{name}"
        # Engine names carry the first label only: "vllm-10.0.0.7", not the whole FQDN.
        self._prefix = name.rstrip(".").split(".")[0]
        # --dns-server: that server only, the name as given (no resolv.conf, no search).
        self._asker = None if server is None else Asker([parse_server(server)], self.timeout_s)
        self._conf: ResolvConf | None = None
        self._report = QueryReport(self.origin, self.status)
        self._outage = False  # the last round failed (logged once per outage)

    def describe(self) -> dict:
        out = {"kind": self.kind, "name": self.name, "role": self.role, "server": self.server or "system",
               "interval_s": self.interval_s,
               "ports": {"events": self.ports.events, "replay": self.ports.replay,
                         "http": self.ports.http, "dp_size": self.ports.dp_size}}
        if self.server is None:
            out["hosts_file"] = self.hosts_file
            out["resolv_conf"] = (self._conf or read_resolv_conf(self.resolv_conf)).describe()
        return out

    # -- rounds ---------------------------------------------------------------------------

    def run(self, emit: Emit, stop: threading.Event) -> None:
        while not stop.is_set():
            stop.wait(self.round(emit, stop))

    def round(self, emit: Emit, stop: threading.Event) -> float:
        """One round: resolve, emit unless it failed; returns the seconds to the next."""
        found = self._resolve(stop)
        if stop.is_set():  # a round cut short by stop may be partial or failed: no verdict
            return 0.0
        extra = self.status.extra
        if found.specs is None:
            self.status.failed(found.error)
            if not self._outage:
                log.warning("%s: no answer from DNS (%s); keeping the last %d engines until one comes",
                            self.origin, found.error, self.status.engines)
            self._outage = True
            wait = self.interval_s or MIN_INTERVAL_S
        else:
            emit(found.specs)
            self.status.succeeded(len(found.specs))
            if found.partial:  # shown, but the round counts: errors is for failed rounds
                self.status.last_error = found.error
            if self._outage:
                log.info("%s: DNS answers again: %d engines", self.origin, len(found.specs))
            self._outage = False
            wait = self.interval_s or max(MIN_INTERVAL_S, float(found.ttl or 0))
        self._report.publish(found.partial)
        extra["ttl_s"] = found.ttl
        extra["next_round_s"] = wait
        return wait

    def _ask(self, name: str, rdtypes: tuple[str, ...], stop: threading.Event,
             search: bool = True) -> Lookup:
        """``name``'s records of ``rdtypes``: from the one server, or through resolv.conf
        (its search domains when ``search``)."""
        if self._asker is not None:
            return lookup(self._asker, [name if name.endswith(".") else name + "."], rdtypes, stop)
        conf = self._conf = read_resolv_conf(self.resolv_conf)
        asker = Asker(conf.nameservers, self.timeout_s)
        absolute = name if name.endswith(".") else name + "."
        return lookup(asker, search_candidates(name, conf) if search else [absolute], rdtypes, stop)

    def _resolve(self, stop: threading.Event) -> Round:
        if self._asker is None:
            local = hosts_addresses(self.name, self.hosts_file)
            if local:  # glibc asks "files" before "dns"; a hosts entry carries no TTL
                self.status.extra["resolved_name"] = f"{self.name} ({self.hosts_file})"
                self._report.reset()
                return Round(self._specs(local))
        found = self._ask(self.name, FAMILIES, stop)
        self._report.record_lookup(found, list(FAMILIES))
        self.status.extra["resolved_name"] = found.name
        error = "; ".join(f"{self.name}: {f}" for f in self._report.failing())
        if found.state == "failed":
            return Round(None, error=error or f"{self.name}: no answer")
        addresses = list(found.records("A")) + list(found.records("AAAA"))
        return Round(self._specs(addresses), found.ttl, partial=bool(error), error=error)

    def _specs(self, addresses: list[str]) -> list[EngineSpec]:
        """Sorted, distinct addresses to their engines; an odd one skipped and listed."""
        ips = sorted({ipaddress.ip_address(a) for a in addresses}, key=lambda ip: (ip.version, ip))
        specs: list[EngineSpec] = []
        skipped = []
        for ip in map(str, ips):
            try:
                specs.extend(engine_specs(name_for_address(self._prefix, ip), ip, self.ports, self.model,
                                          self.role))
            except ValueError as exc:  # one odd address must not hide the others
                skipped.append(f"{ip}: {exc}")
        self.status.extra["skipped"] = skipped
        return specs
