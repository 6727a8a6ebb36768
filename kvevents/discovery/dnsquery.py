"""DNS questions and what their answers mean for discovery: :class:`Asker`, :func:`lookup`.

:class:`Asker` sends one question (a name, a record type) to the nameservers in order,
over UDP with EDNS (1232-byte answers) and over TCP when the answer is truncated, and
classifies what came back as an :class:`Outcome`:

========================  =========  ====================================================
answer                    kind       meaning for discovery
========================  =========  ====================================================
records of the type       answer     these records (CNAMEs followed), TTL the lowest seen
NOERROR, no records       nodata     the name holds none of this type: authoritative
NXDOMAIN                  nxdomain   the name does not exist: authoritative
SERVFAIL/REFUSED/NOTIMP   failed     the next server is asked; all failed: unknown
no answer in timeout_s    failed     reason ``timeout``; likewise ``network``, ``bad-response``
========================  =========  ====================================================

:func:`lookup` asks every record type of a list of candidate names (a name's search-domain
expansions) and decides: the first candidate with records of *any* type answers (types
that failed are reported, not fatal: a resolver that refuses AAAA does not hide the A
records); when every candidate is NXDOMAIN for some type or NODATA for every type, the
set is empty (NXDOMAIN says the name is gone, whatever the other type's question did);
otherwise (some question failed and none had records) the lookup failed and the caller
keeps what it knew.

Lifecycle and failure: stateless apart from the servers and timeout; never raises for
anything a server or the network does. Each question waits at most ``timeout_s`` per
server, in slices of under a second, so ``stop`` is noticed within about a second.
"""

from __future__ import annotations

import time
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.query
import dns.rcode
import dns.rdataclass
import dns.rdatatype

__all__ = ["Asker", "Lookup", "Outcome", "lookup"]

# dnspython overshoots a query's timeout by up to ~0.1 s; 0.9 s slices keep a waiting
# question within about a second of stop. A slice that times out sends the question again.
_SLICE_S = 0.9
_EDNS_PAYLOAD = 1232  # the DNS flag day's size: no IP fragments, few TCP fallbacks

ANSWER, NODATA, NXDOMAIN, FAILED = "answer", "nodata", "nxdomain", "failed"


@dataclass(frozen=True)
class Outcome:
    """What one question got (see the module docstring's table)."""

    kind: str
    records: tuple = ()  # A/AAAA: address strings; SRV: (target, port, priority, weight)
    ttl: int | None = None  # answer: lowest TTL; negative: from the SOA; None: not said
    reason: str | None = None  # failed: refused, servfail, notimp, timeout, network, ...
    detail: str = ""  # failed: what each server did, for last_error and the log
    glue: dict = field(default_factory=dict)  # SRV: {target: {"A": [...], "AAAA": [...]}}

    @property
    def negative(self) -> bool:
        return self.kind in (NODATA, NXDOMAIN)


def _server_text(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _negative_ttl(msg: dns.message.Message) -> int | None:
    """RFC 2308: the lower of the SOA's TTL and its MINIMUM; None without an SOA."""
    for rrset in msg.authority:
        if rrset.rdtype == dns.rdatatype.SOA and len(rrset):
            return min(rrset.ttl, rrset[0].minimum)
    return None


def _glue(msg: dns.message.Message) -> dict:
    out: dict[str, dict[str, list[str]]] = {}
    for rrset in msg.additional:
        if rrset.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA) and rrset.rdclass == dns.rdataclass.IN:
            kinds = out.setdefault(rrset.name.to_text().lower(), {})
            kinds.setdefault(dns.rdatatype.to_text(rrset.rdtype), []).extend(r.address for r in rrset)
    return out


def classify(msg: dns.message.Message, rdtype: str, server: str) -> Outcome:
    """One server's response to one question, as an :class:`Outcome`."""
    rcode = msg.rcode()
    if rcode == dns.rcode.NXDOMAIN:
        return Outcome(NXDOMAIN, ttl=_negative_ttl(msg))
    if rcode != dns.rcode.NOERROR:
        text = dns.rcode.to_text(rcode)
        return Outcome(FAILED, reason=text.lower(), detail=f"{server} answered {text}")
    try:
        chain = msg.resolve_chaining()
    except (dns.exception.DNSException, KeyError) as exc:
        return Outcome(FAILED, reason="bad-response", detail=f"{server}: {type(exc).__name__}: {exc}")
    if chain.answer is None:
        return Outcome(NODATA, ttl=_negative_ttl(msg))
    if rdtype == "SRV":
        records = tuple((r.target.to_text().lower(), r.port, r.priority, r.weight) for r in chain.answer)
        return Outcome(ANSWER, records, ttl=chain.minimum_ttl, glue=_glue(msg))
    return Outcome(ANSWER, tuple(r.address for r in chain.answer), ttl=chain.minimum_ttl)


class Asker:
    """Asks ``servers`` ((IP, port) pairs, in order) one question at a time."""

    def __init__(self, servers: Sequence[tuple[str, int]], timeout_s: float) -> None:
        self.servers = list(servers)
        self.timeout_s = timeout_s

    def ask(self, qname: str, rdtype: str, stop: threading.Event) -> Outcome:
        """``qname`` (absolute, ending in ``.``) of type ``rdtype``. A server that fails
        (any :data:`FAILED` reason) passes the question to the next; the outcome of the
        last one tried stands, with every server's failure in its ``detail``."""
        failures: list[Outcome] = []
        for host, port in self.servers:
            outcome = self._ask_one(host, port, qname, rdtype, stop)
            if outcome.kind != FAILED:
                return outcome
            failures.append(outcome)
            if stop.is_set():
                break
        return Outcome(FAILED, reason=failures[-1].reason,
                       detail="; ".join(f.detail for f in failures))

    def _ask_one(self, host: str, port: int, qname: str, rdtype: str,
                 stop: threading.Event) -> Outcome:
        server = _server_text(host, port)
        query = dns.message.make_query(qname, rdtype, use_edns=0, payload=_EDNS_PAYLOAD)
        query.flags |= dns.flags.RD
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                msg, _ = dns.query.udp_with_fallback(query, host, timeout=max(min(left, _SLICE_S), 0.01),
                                                     port=port, ignore_unexpected=True)
            except dns.exception.Timeout:
                if stop.is_set() or deadline - time.monotonic() < 0.05:
                    return Outcome(FAILED, reason="timeout",
                                   detail=f"no answer from {server} within {self.timeout_s:g} s")
                continue
            except OSError as exc:  # TCP fallback refused, no route, ...
                return Outcome(FAILED, reason="network", detail=f"{server}: {exc.strerror or exc}")
            except (dns.exception.DNSException, ValueError) as exc:  # malformed, mismatched
                return Outcome(FAILED, reason="bad-response", detail=f"{server}: {type(exc).__name__}: {exc}")
            return classify(msg, rdtype, server)


@dataclass
class Lookup:
    """What :func:`lookup` decided: ``state`` answer / empty / failed."""

    state: str
    name: str | None = None  # the candidate that answered
    outcomes: dict[str, Outcome] = field(default_factory=dict)  # per type: the deciding ones
    ttl: int | None = None  # answer: lowest TTL of its records; empty: lowest negative TTL
    failed: list[tuple[str, Outcome, str]] = field(default_factory=list)  # (type, outcome, name)

    def records(self, rdtype: str) -> tuple:
        outcome = self.outcomes.get(rdtype)
        return outcome.records if outcome is not None and outcome.kind == ANSWER else ()


def _lowest(ttls: list[int | None]) -> int | None:
    return None if not ttls or None in ttls else min(t for t in ttls if t is not None)


def lookup(asker: Asker, candidates: Sequence[str], rdtypes: Sequence[str],
           stop: threading.Event) -> Lookup:
    """Every type of every candidate until one has records (module docstring)."""
    failed: list[tuple[str, Outcome, str]] = []
    summary: dict[str, Outcome] = {}
    negative_ttls: list[int | None] = []
    unknown = False
    for candidate in candidates:
        outcomes = {}
        for rdtype in rdtypes:
            if stop.is_set():
                return Lookup("failed", outcomes=summary, failed=failed)
            outcomes[rdtype] = outcome = asker.ask(candidate, rdtype, stop)
            if outcome.kind == FAILED:
                failed.append((rdtype, outcome, candidate))
        answered = [o for o in outcomes.values() if o.kind == ANSWER]
        if answered:
            return Lookup("answer", candidate, outcomes, _lowest([o.ttl for o in answered]), failed)
        for rdtype, outcome in outcomes.items():  # a failure anywhere outweighs a negative
            if rdtype not in summary or outcome.kind == FAILED:
                summary[rdtype] = outcome
        # NXDOMAIN is about the name, not one type (RFC 8020): the name is gone even when
        # the other family's question failed (a resolver that always fails AAAA must
        # not hide a Service scaled to zero). NODATA is about one type only.
        if all(o.negative for o in outcomes.values()) or any(o.kind == NXDOMAIN for o in outcomes.values()):
            negative_ttls.append(_lowest([o.ttl for o in outcomes.values() if o.negative]))
        else:
            unknown = True
    if unknown or not candidates:
        return Lookup("failed", outcomes=summary, failed=failed)
    return Lookup("empty", outcomes=summary, ttl=_lowest(negative_ttls), failed=failed)
