"""Engines behind a DNS name: :class:`DnsSource` (``--discover-dns NAME``).

Each round resolves the A and AAAA records of one name (a Kubernetes headless Service,
a round-robin record), turns every address into its engines with
:func:`~kvevents.discovery.targets.engine_specs` (named ``{first label}-{address}``)
and emits the whole set. The name is asked of one DNS server directly
(``--dns-server HOST:PORT``, with dnspython) or of the system resolver
(``getaddrinfo``: ``/etc/hosts``, ``resolv.conf`` search domains and all).

Lifecycle and failure: :meth:`DnsSource.run` resolves, emits, then waits
``interval_s``, until ``stop`` is set; it returns within about a second of it, since no
single query waits longer than that. NXDOMAIN or no records for both families is an
authoritative answer and emits ``[]`` (a headless Service without ready pods answers
so). A timeout, SERVFAIL, REFUSED or network error is a failed round: it is recorded
on :attr:`~kvevents.discovery.source.Source.status` and nothing is emitted, so the
last set stands; the next round comes after ``interval_s`` as usual. None of these
raise out of ``run``.
"""

from __future__ import annotations

import ipaddress
import math
import re
import socket
import threading
import time

import dns.exception
import dns.resolver

from kvevents.discovery.source import Emit, Source
from kvevents.discovery.targets import PortPlan, engine_specs, name_for_address
from kvevents.engines.spec import EngineSpec

__all__ = ["DnsSource", "parse_server"]

# dnspython overshoots a query's lifetime by ~0.1 s; 0.9 s slices keep run() returning
# within about a second of stop. A longer timeout_s is spent as several slices.
_SLICE_S = 0.9
_LABEL = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")


class _Failed(Exception):
    """A round that did not get an answer (its message is the status's last_error)."""


def parse_server(text: str) -> tuple[str, int]:
    """``HOST[:PORT]`` / ``[V6][:PORT]`` / bare ``V6`` to (IP, port); port 53 by default.
    Only IP literals: the server is what resolves names, so it cannot be one."""
    text = text.strip()
    host, port = text, "53"
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"dns-server: expected [IPV6]:PORT, got {text!r}")
        port = rest[1:] if rest else "53"
    elif text.count(":") == 1:
        host, port = text.split(":")
    try:
        address = ipaddress.ip_address(host)
        number = int(port)
    except ValueError:
        raise ValueError(f"dns-server: expected IP[:PORT] or [IPV6]:PORT, got {text!r}") from None
    if not 0 < number < 65536:
        raise ValueError(f"dns-server: port must be 1..65535, got {text!r}")
    return str(address), number


class DnsSource(Source):
    """The engines at the addresses of ``name`` (see the module docstring)."""

    def __init__(self, name: str, ports: PortPlan, *, model: str | None = None,
                 interval_s: float = 1.0, server: str | None = None, timeout_s: float = 1.0) -> None:
        super().__init__()
        labels = name.removesuffix(".").split(".") if isinstance(name, str) else [""]
        if not isinstance(name, str) or len(name) > 254 or not all(map(_LABEL.match, labels)):
            raise ValueError(f"discover-dns: expected a DNS name, got {name!r}")
        if not (isinstance(interval_s, (int, float)) and math.isfinite(interval_s) and interval_s > 0):
            raise ValueError(f"discover-interval: must be a number of seconds > 0, got {interval_s!r}")
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"dns-timeout: must be a number of seconds > 0, got {timeout_s!r}")
        self.name, self.ports, self.model = name, ports, model
        self.interval_s, self.timeout_s, self.server = float(interval_s), float(timeout_s), server
        self.origin = f"dns:{name}"
        # Engine names carry the first label only: "vllm-10.0.0.7", not the whole FQDN.
        self._prefix = name.rstrip(".").split(".")[0]
        self._resolver: dns.resolver.Resolver | None = None
        if server is not None:
            host, port = parse_server(server)
            # configure=False: no resolv.conf, so no search domains or other servers.
            self._resolver = dns.resolver.Resolver(configure=False)
            self._resolver.nameservers = [host]
            self._resolver.port = port
        # The system resolver's lookup in flight (getaddrinfo cannot be cancelled): a
        # round that gave up on it waits for the same one rather than piling up threads.
        self._lookup: tuple[threading.Thread, dict] | None = None

    def describe(self) -> dict:
        return {"kind": "dns", "name": self.name, "server": self.server or "system",
                "interval_s": self.interval_s,
                "ports": {"events": self.ports.events, "replay": self.ports.replay,
                          "http": self.ports.http, "dp_size": self.ports.dp_size}}

    def run(self, emit: Emit, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                addresses = self._resolve(stop)
            except _Failed as exc:
                if not stop.is_set():  # a query cut short by shutdown is no outage
                    self.status.failed(str(exc))
            else:
                if not stop.is_set():  # a round cut short by stop may be partial
                    specs = self._specs(addresses)
                    emit(specs)
                    self.status.succeeded(len(specs))
            stop.wait(self.interval_s)

    def _specs(self, addresses: list[str]) -> list[EngineSpec]:
        specs: list[EngineSpec] = []
        skipped = []
        for address in addresses:
            try:
                specs.extend(engine_specs(name_for_address(self._prefix, address), address,
                                          self.ports, self.model))
            except ValueError as exc:  # one odd address must not hide the others
                skipped.append(f"{address}: {exc}")
        self.status.extra["skipped"] = skipped
        return specs

    def _resolve(self, stop: threading.Event) -> list[str]:
        """Sorted, distinct addresses of the name; [] when it authoritatively has none."""
        if self._resolver is None:
            found = self._system(stop)
        else:
            found = self._ask("A", stop)
            if not stop.is_set():
                found += self._ask("AAAA", stop)
        ips = {ipaddress.ip_address(a) for a in found}
        return [str(ip) for ip in sorted(ips, key=lambda ip: (ip.version, ip))]

    def _ask(self, rdtype: str, stop: threading.Event) -> list[str]:
        assert self._resolver is not None
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                answer = self._resolver.resolve(self.name, rdtype, lifetime=min(left, _SLICE_S),
                                                raise_on_no_answer=False, search=False)
                return [r.address for r in answer.rrset or ()]
            except dns.resolver.NXDOMAIN:
                return []
            except dns.exception.Timeout:
                if stop.is_set() or deadline - time.monotonic() < 0.05:
                    raise _Failed(f"{rdtype} {self.name}: no answer from {self.server} "
                                  f"within {self.timeout_s:g} s") from None
            except dns.resolver.NoNameservers as exc:  # SERVFAIL, REFUSED, ICMP unreachable
                raise _Failed(f"{rdtype} {self.name}: {exc}") from None
            except (dns.exception.DNSException, OSError) as exc:
                raise _Failed(f"{rdtype} {self.name}: {type(exc).__name__}: {exc}") from None

    def _system(self, stop: threading.Event) -> list[str]:
        """getaddrinfo on a helper thread, waited for at most timeout_s (or until stop)."""
        if self._lookup is None:
            box: dict = {}

            def lookup() -> None:
                try:
                    box["infos"] = socket.getaddrinfo(self.name, None, type=socket.SOCK_STREAM)
                except OSError as exc:
                    box["error"] = exc
            thread = threading.Thread(target=lookup, name=f"dns-{self.name}", daemon=True)
            thread.start()
            self._lookup = (thread, box)
        thread, box = self._lookup
        deadline = time.monotonic() + self.timeout_s
        while thread.is_alive() and not stop.is_set() and time.monotonic() < deadline:
            thread.join(0.05)
        if thread.is_alive():
            raise _Failed(f"{self.name}: system resolver gave no answer within {self.timeout_s:g} s")
        self._lookup = None
        error = box.get("error")
        if error is None:
            return [info[4][0] for info in box["infos"] if info[0] in (socket.AF_INET, socket.AF_INET6)]
        none = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}
        if isinstance(error, socket.gaierror) and error.errno in none:
            return []  # NXDOMAIN / no address: authoritative
        raise _Failed(f"{self.name}: system resolver: {error}")
