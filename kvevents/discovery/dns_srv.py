"""Engines from DNS SRV records: :class:`DnsSrvSource` (``--discover-dns-srv NAME``).

An SRV record names a host and a port, so engines on different ports need no port
flags. Kubernetes publishes one SRV name per named port of a headless Service,
``_PORTNAME._PROTO.SERVICE.NAMESPACE.svc.cluster.local``, with one record per ready pod;
``--discover-dns-srv _kv-events._tcp.vllm.llm.svc.cluster.local`` follows every record
of the events port:

* each record is one engine server: its events port is the record's port (rank ``r``
  at port + r, as ``--discover-dp-size`` says); priority and weight are not used, every
  record is followed. A record whose target is ``.`` (the service is not offered) adds none;
* its address: the target's A/AAAA records (from the answer's additional section when
  the server sent them, else asked, each family on its own as for ``--discover-dns``);
  the first IPv4 address, else the first IPv6 one. Engines are named
  ``{service}-{address}:{port}`` (``vllm-10.1.2.7:5557``), service being the first label
  after ``_PORTNAME._PROTO``;
* its replay and HTTP ports: with ``replay_name`` / ``http_name``
  (``--discover-srv-replay-name kv-replay``), the port of the SRV record
  ``_kv-replay._PROTO.DOMAIN`` with the same target (a target with several engines pairs
  its records in port order: the lowest events port with the lowest replay port); an
  engine without one, or without the option, uses the port flags
  (``--discover-replay-port``, ``--discover-http-port``).

What answers do (as :mod:`~kvevents.discovery.dns`): NXDOMAIN/NODATA for the SRV name
is the empty set; a failed SRV question (or a failed replay/HTTP SRV question) fails
the round and the last set stands; a target whose address questions all fail keeps
the addresses it had last round (if any; else it is left out, listed in ``skipped``).
TTLs: the lowest of every record used.

Lifecycle and failure: as :class:`~kvevents.discovery.dns.DnsSource`.
"""

from __future__ import annotations

import ipaddress
import threading

from kvevents.discovery.dns import FAMILIES, DnsSource, Round, check_name
from kvevents.discovery.dnsquery import Lookup
from kvevents.discovery.targets import PortPlan, engine_specs, name_for_address
from kvevents.engines.spec import EngineSpec

__all__ = ["DnsSrvSource"]


class DnsSrvSource(DnsSource):
    """The engines the SRV records of ``name`` point at (see the module docstring)."""

    kind = "dns-srv"

    def __init__(self, name: str, ports: PortPlan, *, replay_name: str | None = None,
                 http_name: str | None = None, **kwargs) -> None:
        check_name(name, "discover-dns-srv")
        super().__init__(name, ports, **kwargs)
        self.origin = f"dns-srv:{name}"
        self._report.origin = self.origin
        labels = name.rstrip(".").split(".")
        self._service_form = len(labels) >= 3 and labels[0].startswith("_") and labels[1].startswith("_")
        self._prefix = (labels[2] if self._service_form else labels[0]).strip("_") or "engine"
        self.port_names: dict[str, str] = {}
        for role, value in (("replay", replay_name), ("http", http_name)):
            if value is None:
                continue
            flag = f"discover-srv-{role}-name"
            if not self._service_form:
                raise ValueError(f"{flag}: needs --discover-dns-srv in the form _PORT._PROTO.DOMAIN, "
                                 f"got {name!r}")
            label = value.strip()
            label = label if label.startswith("_") else f"_{label}"
            if "." in label:
                raise ValueError(f"{flag}: expected a port name such as kv-replay, got {value!r}")
            check_name(label, flag)
            self.port_names[role] = label
        self._last_addresses: dict[str, list[str]] = {}  # target -> its addresses last round

    def describe(self) -> dict:
        out = super().describe()
        out["srv_ports"] = {role: label[1:] for role, label in self.port_names.items()}
        return out

    def _resolve(self, stop: threading.Event) -> Round:
        main = self._ask(self.name, ("SRV",), stop)
        self._report.record_lookup(main, ["SRV"])
        self.status.extra["resolved_name"] = main.name
        if main.state != "answer":
            if main.state == "failed":
                return Round(None, error=self._errors() or f"SRV {self.name}: no answer")
            self._last_addresses = {}
            return Round(self._built([], {}, {}), main.ttl)
        ttls = [main.ttl]
        # The replay / HTTP ports: SRV records of the same domain, matched by target.
        assert main.name is not None
        domain = main.name.split(".", 2)[2] if self._service_form else ""
        role_ports: dict[str, dict[str, int]] = {}
        for role, label in self.port_names.items():
            proto = main.name.split(".")[1]
            found = self._ask(f"{label}.{proto}.{domain}", ("SRV",), stop, search=False)
            self._report.record_lookup(found, ["SRV"], label=f"{role} ")
            if found.state == "failed":  # unknown ports would replace every engine: wait
                return Round(None, error=self._errors())
            ttls.append(found.ttl)
            role_ports[role] = {}
            for target, port, _, _ in sorted(found.records("SRV"), key=lambda r: r[1]):
                role_ports[role].setdefault(target, []).append(port)
        records = [r for r in main.records("SRV") if r[0] != "."]
        addresses, partial = self._addresses(main, records, ttls, stop)
        if stop.is_set():
            return Round(None)
        ttl = None if None in ttls else min(t for t in ttls if t is not None)
        return Round(self._built(records, addresses, role_ports), ttl, partial=partial,
                     error=self._errors())

    def _addresses(self, main: Lookup, records: list, ttls: list,
                   stop: threading.Event) -> tuple[dict[str, list[str]], bool]:
        """Each target's addresses: glue, else asked (per family), else last round's."""
        glue = main.outcomes["SRV"].glue
        out: dict[str, list[str]] = {}
        partial = False
        verdicts: dict[str, list] = {}
        for target in dict.fromkeys(r[0] for r in records):
            if target in glue:
                out[target] = glue[target].get("A", []) + glue[target].get("AAAA", [])
                continue
            found = self._ask(target, FAMILIES, stop, search=False)
            if stop.is_set():
                break
            for rdtype, outcome, _ in found.failed:  # counted here; the verdict below
                key = (rdtype, outcome.reason or "unknown")
                self.status.query_failures[key] = self.status.query_failures.get(key, 0) + 1
            for rdtype in FAMILIES:
                if rdtype in found.outcomes:
                    verdicts.setdefault(rdtype, []).append(found.outcomes[rdtype])
            partial |= any(found.outcomes.get(f) is not None and found.outcomes[f].kind == "failed"
                           for f in FAMILIES)
            if found.state == "answer":
                ttls.append(found.ttl)
                out[target] = list(found.records("A")) + list(found.records("AAAA"))
            elif found.state == "failed" and target in self._last_addresses:
                out[target] = self._last_addresses[target]  # keep it: an outage, not a departure
        for rdtype, outcomes in verdicts.items():  # a family's verdict over the targets:
            # a failure if any failed, else an answer if any answered
            ranked = sorted(outcomes, key=lambda o: (o.kind == "failed", o.kind == "answer"))
            self._report.record(rdtype, ranked[-1], count=False)
        self._last_addresses = {t: a for t, a in out.items() if a}
        return out, partial

    @staticmethod
    def _paired(role_ports: dict[str, dict[str, list[int]]], role: str, target: str, i: int,
                default: int | None) -> int | None:
        """The ``i``-th (in port order) ``role`` port of ``target``, else ``default``."""
        ports = role_ports.get(role, {}).get(target, [])
        return ports[i] if i < len(ports) else default

    def _errors(self) -> str:
        return "; ".join(f"{self.name}: {f}" for f in self._report.failing())

    def _built(self, records: list, addresses: dict[str, list[str]],
               role_ports: dict[str, dict[str, int]]) -> list[EngineSpec]:
        specs: list[EngineSpec] = []
        skipped: list[str] = []
        seen: set[tuple[str, int]] = set()
        rank: dict[str, int] = {}  # a target's records so far, in port order
        for target, port, _, _ in sorted(records, key=lambda r: (r[0], r[1])):
            if (target, port) in seen:
                continue
            seen.add((target, port))
            i = rank[target] = rank.get(target, -1) + 1
            ips = sorted({ipaddress.ip_address(a) for a in addresses.get(target, [])},
                         key=lambda ip: (ip.version, ip))
            if not ips:
                skipped.append(f"{target}:{port}: no address")
                continue
            address = str(ips[0])
            replay, http = (self._paired(role_ports, role, target, i, default)
                            for role, default in (("replay", self.ports.replay), ("http", self.ports.http)))
            try:
                plan = PortPlan(events=port, replay=replay, http=http, dp_size=self.ports.dp_size)
                specs.extend(engine_specs(f"{name_for_address(self._prefix, address)}:{port}", address,
                                          plan, self.model, self.role))
            except ValueError as exc:  # one odd record must not hide the others
                skipped.append(f"{target}:{port}: {exc}")
        self.status.extra["skipped"] = skipped
        return specs
