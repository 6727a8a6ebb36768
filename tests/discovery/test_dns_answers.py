"""What each DNS answer does to a DnsSource's set, against real DNS servers on 127.0.0.1:

* dnsmasq (Debian package dnsmasq-base) with and without ``--local=/test/``: without it,
  a family dnsmasq holds no record of (AAAA of an IPv4-only name, A of an IPv6-only one)
  and a name it does not hold are REFUSED, as from a forwarder without upstream;
* the tests' own server (dnsserver.TinyDns), answering each type REFUSED, SERVFAIL,
  NOTIMP, nothing at all, NODATA or NXDOMAIN as the case says.

Each case asserts the engines emitted (or that nothing was, the last set standing) and
what the source shows: the per-family ``queries`` states, ``query_failures`` counts,
``errors``, ``partial_rounds`` and ``last_error``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from kvevents.discovery.dns import DnsSource
from kvevents.discovery.targets import PortPlan

from dnsmasq import Dnsmasq  # noqa: E402
from dnsrun import _names, running  # noqa: E402
from dnsserver import Records, TinyDns  # noqa: E402
from support import wait_until  # noqa: E402  (dnsmasq puts tests/ on the path)

V4 = ["127.0.0.2 vllm.test", "127.0.0.3 vllm.test"]


@pytest.fixture
def tiny() -> Iterator[TinyDns]:
    server = TinyDns()
    try:
        yield server
    finally:
        server.close()


def source(server: str, name: str = "vllm.test", **kw) -> DnsSource:
    kw.setdefault("interval_s", 0.1)
    return DnsSource(name, PortPlan(), timeout_s=0.3, server=server, **kw)


def queries(src: DnsSource) -> dict:
    return {k: (v["state"], v.get("reason")) for k, v in src.status.extra["queries"].items()}


# -- dnsmasq ----------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_dnsmasq_without_local_refuses_aaaa_and_the_a_records_are_followed(tmp_path, caplog):
    """The stock forwarder setup: A answered, AAAA REFUSED on every round. The engines
    are followed, the round is partial (not an error), the refusal shown and counted,
    and logged once however many rounds refuse."""
    dns = Dnsmasq(tmp_path, V4, local=False)
    src = source(dns.server)
    caplog.set_level(logging.INFO, logger="kvevents.discovery")
    try:
        with running(src) as r:
            specs = r.wait_for(lambda s: len(s) == 2, 5)
            assert wait_until(lambda: src.status.rounds >= 5, 5), src.status
    finally:
        dns.close()
    assert _names(specs) == ["vllm-127.0.0.2", "vllm-127.0.0.3"]
    assert src.status.errors == 0 and src.status.first_round_done
    assert queries(src) == {"A": ("answer", None), "AAAA": ("failed", "refused")}
    assert src.status.extra["queries"]["A"]["records"] == 2
    assert src.status.extra["partial_rounds"] >= 5
    assert src.status.extra["query_failures"]["AAAA"]["refused"] >= 5
    assert "AAAA refused" in src.status.last_error and "REFUSED" in src.status.last_error
    warned = [rec for rec in caplog.records if "AAAA questions fail" in rec.getMessage()]
    assert len(warned) == 1, [rec.getMessage() for rec in caplog.records]


@pytest.mark.timeout(30)
def test_dnsmasq_without_local_a_name_that_disappears_is_an_outage(tmp_path):
    """Without --local dnsmasq REFUSES a name it no longer holds: nobody said the name
    is gone, so the last set stands and the rounds count as errors."""
    dns = Dnsmasq(tmp_path, V4, local=False)
    src = source(dns.server)
    try:
        with running(src) as r:
            r.wait_for(lambda s: len(s) == 2, 5)
            dns.set_hosts([])
            errors = src.status.errors
            assert wait_until(lambda: src.status.errors >= errors + 3, 5), src.status
            emitted = len(r.sets)
            assert wait_until(lambda: src.status.errors >= errors + 6, 5)
            assert len(r.sets) == emitted, "a refused round emitted a set"
    finally:
        dns.close()
    assert _names(r.sets[-1]) == ["vllm-127.0.0.2", "vllm-127.0.0.3"]
    assert queries(src) == {"A": ("failed", "refused"), "AAAA": ("failed", "refused")}
    assert src.status.extra["query_failures"]["A"]["refused"] >= 3


@pytest.mark.timeout(30)
def test_dnsmasq_with_local_nodata_is_no_failure_and_a_vanished_name_empties_the_set(tmp_path):
    """With --local: AAAA of an IPv4-only name is NODATA (nothing failed, nothing
    partial); a name gone from the hosts file is NXDOMAIN for both families: []."""
    dns = Dnsmasq(tmp_path, V4, local=True)
    src = source(dns.server)
    try:
        with running(src) as r:
            r.wait_for(lambda s: len(s) == 2, 5)
            assert queries(src) == {"A": ("answer", None), "AAAA": ("nodata", None)}
            dns.set_hosts([])
            assert r.wait_for(lambda s: s == [], 5) == []
    finally:
        dns.close()
    assert queries(src) == {"A": ("nxdomain", None), "AAAA": ("nxdomain", None)}
    assert src.status.errors == 0 and src.status.extra["partial_rounds"] == 0
    assert src.status.extra["query_failures"] == {} and src.status.last_error is None


@pytest.mark.timeout(30)
@pytest.mark.parametrize("local", [True, False], ids=["local", "no-local"])
def test_dnsmasq_aaaa_only_name(tmp_path, local):
    """An IPv6-only name (loopback addresses only): with --local A is NODATA, without it
    A is REFUSED; either way its AAAA records are the engines."""
    dns = Dnsmasq(tmp_path, ["::1 v6.test", "::ffff:127.0.0.2 v6.test"], local=local)
    src = source(dns.server, "v6.test")
    try:
        with running(src) as r:
            specs = r.wait_for(lambda s: len(s) == 2, 5)
    finally:
        dns.close()
    assert _names(specs) == ["v6-::1", "v6-::ffff:7f00:2"]  # as Python writes ::ffff:127.0.0.2
    assert specs[0].endpoint == "tcp://[::1]:5557"
    assert queries(src)["AAAA"] == ("answer", None)
    assert queries(src)["A"] == (("nodata", None) if local else ("failed", "refused"))
    assert src.status.errors == 0


@pytest.mark.timeout(30)
def test_dnsmasq_large_answer_comes_over_tcp(tmp_path):
    """100 addresses do not fit a 1232-byte UDP answer: dnsmasq truncates, the question
    is asked again over TCP, and every address is followed."""
    hosts = [f"127.0.1.{i} many.test" for i in range(1, 101)]
    dns = Dnsmasq(tmp_path, hosts, local=True)
    src = source(dns.server, "many.test")
    try:
        with running(src) as r:
            specs = r.wait_for(lambda s: len(s) == 100, 10)
    finally:
        dns.close()
    assert {s.endpoint for s in specs} == {f"tcp://127.0.1.{i}:5557" for i in range(1, 101)}


# -- the tests' own server: each failure of each family ----------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("failing", ["A", "AAAA"])
@pytest.mark.parametrize("how", ["refused", "servfail", "notimp", "drop"])
def test_one_family_failing_keeps_the_other(tiny, failing, how):
    """One family fails in each of the four ways; the other's records are followed."""
    answering = "AAAA" if failing == "A" else "A"
    tiny.set("vllm.test", answering, Records(["::1"] if answering == "AAAA" else ["127.0.0.2"]))
    tiny.set("vllm.test", failing, how)
    src = source(tiny.server)
    with running(src) as r:
        specs = r.wait_for(lambda s: len(s) == 1, 5)
        assert wait_until(lambda: src.status.rounds >= 2, 5)
    assert _names(specs) == (["vllm-::1"] if answering == "AAAA" else ["vllm-127.0.0.2"])
    reason = "timeout" if how == "drop" else how
    assert queries(src) == {answering: ("answer", None), failing: ("failed", reason)}
    assert src.status.errors == 0 and src.status.extra["query_failures"][failing][reason] >= 1
    assert src.status.extra["partial_rounds"] >= 1


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["refused", "servfail", "notimp", "drop"])
def test_every_family_failing_keeps_the_last_set(tiny, how):
    """Both families fail after a good round: an outage. Nothing is emitted, errors
    count, last_error names both families and the reason."""
    tiny.set("vllm.test", "A", Records(["127.0.0.2", "127.0.0.3"]))
    tiny.set("vllm.test", "AAAA", "nodata")
    src = source(tiny.server)
    with running(src) as r:
        r.wait_for(lambda s: len(s) == 2, 5)
        tiny.set("vllm.test", "A", how)
        tiny.set("vllm.test", "AAAA", how)
        assert wait_until(lambda: src.status.errors >= 2, 5), src.status
        emitted = len(r.sets)
        assert wait_until(lambda: src.status.errors >= 4, 5)
        assert len(r.sets) == emitted
        assert _names(r.sets[-1]) == ["vllm-127.0.0.2", "vllm-127.0.0.3"]
        reason = "timeout" if how == "drop" else how
        assert queries(src) == {"A": ("failed", reason), "AAAA": ("failed", reason)}
        assert f"A {reason}" in src.status.last_error and f"AAAA {reason}" in src.status.last_error
        # It answers again: the next round's set is emitted, the failures stay counted.
        tiny.set("vllm.test", "A", Records(["127.0.0.4"]))
        tiny.set("vllm.test", "AAAA", "nodata")
        assert _names(r.wait_for(lambda s: len(s) == 1, 5)) == ["vllm-127.0.0.4"]
    assert queries(src) == {"A": ("answer", None), "AAAA": ("nodata", None)}
    assert src.status.extra["query_failures"]["A"][reason] >= 4


@pytest.mark.timeout(30)
@pytest.mark.parametrize("a, aaaa", [("nxdomain", "nxdomain"), ("nodata", "nodata"), ("nodata", "nxdomain")])
def test_negative_for_every_family_is_the_empty_set(tiny, a, aaaa):
    tiny.set("vllm.test", "A", Records(["127.0.0.2"]))
    src = source(tiny.server)
    with running(src) as r:
        r.wait_for(lambda s: len(s) == 1, 5)
        tiny.set("vllm.test", "A", a)
        tiny.set("vllm.test", "AAAA", aaaa)
        assert r.wait_for(lambda s: s == [], 5) == []
    assert queries(src) == {"A": (a, None), "AAAA": (aaaa, None)}
    assert src.status.errors == 0 and src.status.engines == 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["servfail", "drop"])
def test_nxdomain_beside_a_failing_family_is_the_empty_set(tiny, how):
    """NXDOMAIN is about the name: a resolver that always fails AAAA still shows a
    Service scaled to zero (A NXDOMAIN). The failure is shown and counted."""
    tiny.set("vllm.test", "A", Records(["127.0.0.2"]))
    tiny.set("vllm.test", "AAAA", how)
    src = source(tiny.server)
    with running(src) as r:
        r.wait_for(lambda s: len(s) == 1, 5)
        tiny.set("vllm.test", "A", "nxdomain")
        assert r.wait_for(lambda s: s == [], 5) == []
    reason = "timeout" if how == "drop" else how
    assert queries(src) == {"A": ("nxdomain", None), "AAAA": ("failed", reason)}
    assert src.status.errors == 0 and src.status.extra["query_failures"]["AAAA"][reason] >= 2


@pytest.mark.timeout(30)
def test_negative_and_failed_is_an_outage_not_an_empty_set(tiny):
    """A NODATA while AAAA is refused: the name may well hold AAAA records; unknown."""
    tiny.set("vllm.test", "A", Records(["127.0.0.2"]))
    src = source(tiny.server)
    with running(src) as r:
        r.wait_for(lambda s: len(s) == 1, 5)
        tiny.set("vllm.test", "A", "nodata")
        tiny.set("vllm.test", "AAAA", "refused")
        assert wait_until(lambda: src.status.errors >= 3, 5), src.status
    assert _names(r.sets[-1]) == ["vllm-127.0.0.2"]
    assert queries(src) == {"A": ("nodata", None), "AAAA": ("failed", "refused")}


@pytest.mark.timeout(30)
def test_a_failing_server_passes_the_question_to_the_next(tiny, tmp_path):
    """resolv.conf with two nameservers, the first refusing everything: the second's
    answer is used and nothing counts as failed."""
    refusing = TinyDns(default="refused")
    try:
        tiny.set("vllm.test", "A", Records(["127.0.0.2"]))
        conf = tmp_path / "resolv.conf"
        conf.write_text(f"nameserver {refusing.server}\nnameserver {tiny.server}\n")
        src = DnsSource("vllm.test", PortPlan(), interval_s=0.1, timeout_s=0.3,
                        resolv_conf=str(conf), hosts_file=str(tmp_path / "no-hosts"))
        with running(src) as r:
            assert _names(r.wait_for(lambda s: len(s) == 1, 5)) == ["vllm-127.0.0.2"]
        assert refusing.asked("vllm.test", "A") and tiny.asked("vllm.test", "A")
        assert queries(src) == {"A": ("answer", None), "AAAA": ("nxdomain", None)}
        assert src.status.extra["query_failures"] == {}
    finally:
        refusing.close()


@pytest.mark.timeout(30)
def test_failure_counters_on_the_aggregators_registry(tiny):
    """The Discovery of a DNS source registers kvevents_discovery_* on the aggregator's
    registry while it runs and takes them away on stop (a second one can register)."""
    from prometheus_client import generate_latest

    from kvevents.discovery import Discovery
    from kvevents.service.aggregator import Aggregator
    from kvevents.service.settings import AggregatorSettings

    tiny.set("vllm.test", "A", Records(["127.0.0.2"]))
    tiny.set("vllm.test", "AAAA", "servfail")
    agg = Aggregator(AggregatorSettings())
    agg.start()
    try:
        for _ in range(2):
            src = source(tiny.server, interval_s=None)  # TTL 0: a round a second
            disc = Discovery(agg, [src])
            disc.start()
            try:
                assert wait_until(lambda: src.status.rounds >= 1, 5)
                text = generate_latest(agg.registry).decode()
                series = ('kvevents_discovery_query_failures_total{origin="dns:vllm.test",query="AAAA",'
                          'reason="servfail"} ')
                assert series in text
                assert float(text.split(series)[1].split()[0]) == src.status.query_failures[("AAAA", "servfail")]
                assert 'kvevents_discovery_errors_total{origin="dns:vllm.test"} 0.0' in text
            finally:
                disc.stop()
            assert b"kvevents_discovery" not in generate_latest(agg.registry)
    finally:
        agg.stop()
