"""A small DNS server of the tests' own: UDP on 127.0.0.1 and a free port, answering each
(name, type) as the test says, including the ways real resolvers fail.

Behaviours per (name, type): ``Records([...], ttl)`` (A/AAAA: address strings; SRV:
``(priority, weight, port, target)``), ``"nodata"`` (NOERROR, no records), ``"nxdomain"``,
``"refused"``, ``"servfail"``, ``"notimp"`` (those rcodes), ``"drop"`` (no response: a
timeout). Negative answers carry an SOA with MINIMUM ``neg_ttl`` when it is set. A
question not in the table gets ``default`` (NXDOMAIN unless said). Every question is
logged in :attr:`TinyDns.questions` as (monotonic time, name, type).

Only what a stub resolver needs: one question per message, UDP only (no TCP, no
truncation). It answers from its own thread until :meth:`TinyDns.close`.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from dataclasses import dataclass

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdata
import dns.rdataclass
import dns.rdatatype
import dns.rrset

_RCODES = {"nxdomain": dns.rcode.NXDOMAIN, "refused": dns.rcode.REFUSED,
           "servfail": dns.rcode.SERVFAIL, "notimp": dns.rcode.NOTIMP}


@dataclass(frozen=True)
class Records:
    """An answer with these records and TTL."""

    values: list
    ttl: int = 0


class TinyDns:
    """See the module docstring."""

    def __init__(self, default: object = "nxdomain", neg_ttl: int | None = None) -> None:
        self.table: dict[tuple[str, str], object] = {}
        self.default = default
        self.neg_ttl = neg_ttl
        self.questions: list[tuple[float, str, str]] = []
        self._lock = threading.Lock()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="tinydns")
        self._thread.start()

    @property
    def server(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set(self, name: str, rdtype: str, behaviour: object) -> None:
        with self._lock:
            self.table[(name.rstrip(".").lower() + ".", rdtype)] = behaviour

    def clear(self) -> None:
        with self._lock:
            self.table.clear()

    def asked(self, name: str | None = None, rdtype: str | None = None) -> list[tuple[float, str, str]]:
        with self._lock:
            return [q for q in self.questions
                    if (name is None or q[1] == name.rstrip(".").lower() + ".")
                    and (rdtype is None or q[2] == rdtype)]

    def _serve(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self.sock], [], [], 0.1)
            if not ready:
                continue
            try:
                data, peer = self.sock.recvfrom(4096)
                query = dns.message.from_wire(data)
            except (OSError, dns.exception.DNSException):
                continue
            reply = self._reply(query)
            if reply is not None:
                try:
                    self.sock.sendto(reply.to_wire(), peer)
                except OSError:
                    pass

    def _reply(self, query: dns.message.Message) -> dns.message.Message | None:
        question = query.question[0]
        name, rdtype = question.name.to_text().lower(), dns.rdatatype.to_text(question.rdtype)
        with self._lock:
            self.questions.append((time.monotonic(), name, rdtype))
            behaviour = self.table.get((name, rdtype), self.default)
        if behaviour == "drop":
            return None
        reply = dns.message.make_response(query)
        reply.flags |= dns.flags.RA
        if isinstance(behaviour, Records):
            rrset = dns.rrset.RRset(question.name, dns.rdataclass.IN, question.rdtype)
            for value in behaviour.values:
                text = " ".join(map(str, value)) if isinstance(value, tuple) else value
                rrset.add(dns.rdata.from_text(dns.rdataclass.IN, question.rdtype, text), behaviour.ttl)
            reply.answer.append(rrset)
            return reply
        if behaviour in _RCODES:
            reply.set_rcode(_RCODES[behaviour])
        elif behaviour != "nodata":
            raise ValueError(f"unknown behaviour {behaviour!r}")
        if behaviour in ("nodata", "nxdomain") and self.neg_ttl is not None:
            zone = dns.name.from_text("test.")
            soa = dns.rrset.from_text(zone, self.neg_ttl, "IN", "SOA",
                                      f"ns.test. admin.test. 1 60 60 60 {self.neg_ttl}")
            reply.authority.append(soa)
        return reply

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()
