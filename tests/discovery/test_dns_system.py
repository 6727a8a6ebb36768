"""The system resolver as a Kubernetes pod uses it, and TTLs: DnsSource without a
``server``, reading a resolv.conf the test writes (never the machine's) whose
nameservers are real DNS servers on 127.0.0.1 and a free port (``nameserver IP:PORT``):
dnsmasq authoritative for ``cluster.local``, or the tests' own server (dnsserver.TinyDns),
whose question log shows the search order and when each name was asked again."""

from __future__ import annotations

import time

import pytest

from kvevents.discovery.dns import DnsSource
from kvevents.discovery.resolvconf import ResolvConf, hosts_addresses, read_resolv_conf, search_candidates
from kvevents.discovery.targets import PortPlan

from dnsmasq import Dnsmasq  # noqa: E402
from dnsrun import _names, running  # noqa: E402
from dnsserver import Records, TinyDns  # noqa: E402
from support import wait_until  # noqa: E402  (dnsmasq puts tests/ on the path)

SEARCH = "search llm.svc.cluster.local svc.cluster.local cluster.local\noptions ndots:5\n"
FQDN = "vllm-headless.llm.svc.cluster.local"


def resolv(tmp_path, *servers: str, tail: str = SEARCH) -> str:
    path = tmp_path / "resolv.conf"
    path.write_text("".join(f"nameserver {s}\n" for s in servers) + tail)
    return str(path)


def system_source(conf: str, tmp_path, name: str = "vllm-headless", **kw) -> DnsSource:
    kw.setdefault("interval_s", 0.1)
    return DnsSource(name, PortPlan(), timeout_s=0.3, resolv_conf=conf,
                     hosts_file=str(tmp_path / "hosts-none"), **kw)


@pytest.fixture
def tiny():
    server = TinyDns()
    try:
        yield server
    finally:
        server.close()


@pytest.mark.timeout(30)
def test_short_name_through_search_domains_with_dnsmasq(tmp_path):
    """A pod's short name: dnsmasq (authoritative for cluster.local, and for the bare
    name as a cluster's upstream would be: NXDOMAIN) holds the Service's FQDN; the first
    search domain finds it. Scaled to zero, every candidate is NXDOMAIN: the empty set."""
    dns = Dnsmasq(tmp_path, [f"127.0.0.2 {FQDN}", f"127.0.0.3 {FQDN}"], local=False,
                  extra=["--local=/cluster.local/", "--local=/vllm-headless/"])
    src = system_source(resolv(tmp_path, dns.server), tmp_path)
    try:
        with running(src) as r:
            specs = r.wait_for(lambda s: len(s) == 2, 5)
            dns.set_hosts([])  # scaled to zero: NXDOMAIN for every candidate
            assert r.wait_for(lambda s: s == [], 5) == []
    finally:
        dns.close()
    assert _names(specs) == ["vllm-headless-127.0.0.2", "vllm-headless-127.0.0.3"]
    described = src.describe()
    assert described["server"] == "system"
    assert described["resolv_conf"]["search"] == ["llm.svc.cluster.local", "svc.cluster.local", "cluster.local"]
    assert described["resolv_conf"]["ndots"] == 5 and described["resolv_conf"]["nameservers"] == [dns.server]
    assert src.status.errors == 0


@pytest.mark.timeout(30)
def test_search_order_follows_ndots(tiny, tmp_path):
    """ndots:5: "vllm-headless.llm" (1 dot) is tried with each search domain first, then as
    given; ndots:1: as given first. The question log shows the order."""
    tiny.set(FQDN, "A", Records(["127.0.0.2"]))
    src = system_source(resolv(tmp_path, tiny.server), tmp_path, name="vllm-headless.llm")
    with running(src) as r:
        assert _names(r.wait_for(lambda s: len(s) == 1, 5)) == ["vllm-headless-127.0.0.2"]
    asked = list(dict.fromkeys(q[1] for q in tiny.asked(rdtype="A")))
    assert asked[:2] == ["vllm-headless.llm.llm.svc.cluster.local.", f"{FQDN}."]
    assert src.status.extra["resolved_name"] == f"{FQDN}."

    tiny.questions.clear()
    conf = resolv(tmp_path, tiny.server, tail="search svc.cluster.local cluster.local\noptions ndots:1\n")
    src = system_source(conf, tmp_path, name="vllm-headless.llm")
    with running(src) as r:
        r.wait_for(lambda s: len(s) == 1, 5)
    asked = list(dict.fromkeys(q[1] for q in tiny.asked(rdtype="A")))
    assert asked[:2] == ["vllm-headless.llm.", f"{FQDN}."]


@pytest.mark.timeout(30)
def test_a_search_candidate_failing_does_not_stop_the_search(tiny, tmp_path):
    """As glibc: a candidate that SERVFAILs is passed over for the next one that
    answers; the failure is counted. When no candidate answers and one failed, the
    round is an outage; when all are NXDOMAIN, the set is empty."""
    tiny.set("vllm-headless.llm.svc.cluster.local", "A", "servfail")
    tiny.set("vllm-headless.llm.svc.cluster.local", "AAAA", "servfail")
    tiny.set("vllm-headless.svc.cluster.local", "A", Records(["127.0.0.2"]))
    src = system_source(resolv(tmp_path, tiny.server), tmp_path)
    with running(src) as r:
        assert _names(r.wait_for(lambda s: len(s) == 1, 5)) == ["vllm-headless-127.0.0.2"]
        assert src.status.extra["query_failures"]["A"]["servfail"] >= 1
        assert src.status.errors == 0
        tiny.set("vllm-headless.svc.cluster.local", "A", "nxdomain")
        assert wait_until(lambda: src.status.errors >= 2, 5), src.status
        assert _names(r.sets[-1]) == ["vllm-headless-127.0.0.2"]
        tiny.set("vllm-headless.llm.svc.cluster.local", "A", "nxdomain")
        tiny.set("vllm-headless.llm.svc.cluster.local", "AAAA", "nxdomain")
        assert r.wait_for(lambda s: s == [], 5) == []


@pytest.mark.timeout(30)
def test_hosts_file_answers_first(tiny, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("# comment\n127.0.0.5 other\n127.0.0.2 vllm-headless alias  # engine\n")
    src = DnsSource("vllm-headless", PortPlan(), interval_s=0.1, resolv_conf=resolv(tmp_path, tiny.server),
                    hosts_file=str(hosts))
    with running(src) as r:
        assert _names(r.wait_for(lambda s: len(s) == 1, 5)) == ["vllm-headless-127.0.0.2"]
    assert tiny.asked() == []
    assert src.status.extra["resolved_name"] == f"vllm-headless ({hosts})"
    assert src.status.extra["queries"] == {} and src.status.extra["ttl_s"] is None


@pytest.mark.timeout(30)
def test_ttl_sets_the_pace_unless_the_interval_is_shorter(tiny, tmp_path):
    """TTL 2 s: without an interval the name is asked again only when it runs out (not
    every second); with --discover-interval 0.25 (shorter) every 0.25 s."""
    tiny.set(f"{FQDN}", "A", Records(["127.0.0.2"], ttl=2))
    tiny.set(f"{FQDN}", "AAAA", Records(["::1"], ttl=3))
    src = system_source(resolv(tmp_path, tiny.server), tmp_path, name=f"{FQDN}.", interval_s=None)
    with running(src) as r:
        r.wait_for(lambda s: len(s) == 2, 5)
        assert wait_until(lambda: len(tiny.asked(FQDN, "A")) >= 3, 8)
    times = [t for t, _, _ in tiny.asked(FQDN, "A")][:3]
    gaps = [b - a for a, b in zip(times, times[1:])]
    # Asked again when the lower of the two TTLs (2 s) runs out: never inside it, and not
    # much later (a round's own time, on a shared machine).
    assert all(1.95 <= g < 2.8 for g in gaps), gaps
    assert src.status.extra["ttl_s"] == 2 and src.status.extra["next_round_s"] == 2

    tiny.questions.clear()
    src = system_source(resolv(tmp_path, tiny.server), tmp_path, name=f"{FQDN}.", interval_s=0.25)
    with running(src) as r:
        r.wait_for(lambda s: len(s) == 2, 5)
        time.sleep(2.0)
    assert len(tiny.asked(FQDN, "A")) >= 6
    assert src.status.extra["next_round_s"] == 0.25


@pytest.mark.timeout(30)
def test_negative_ttl_from_the_soa(tmp_path):
    """An empty answer is asked again after the SOA's negative TTL (2 s here)."""
    tiny = TinyDns(neg_ttl=2)
    try:
        src = system_source(resolv(tmp_path, tiny.server), tmp_path, name=f"{FQDN}.", interval_s=None)
        with running(src) as r:
            assert r.wait_for(lambda s: s == [], 5) == []
            assert wait_until(lambda: len(tiny.asked(FQDN, "A")) >= 2, 5)
        first, second = [t for t, _, _ in tiny.asked(FQDN, "A")][:2]
        assert 1.95 <= second - first < 2.8
        assert src.status.extra["ttl_s"] == 2
    finally:
        tiny.close()


def test_read_resolv_conf(tmp_path):
    path = tmp_path / "resolv.conf"
    path.write_text("; comment\n# another\nnameserver 127.0.0.1:5353\nnameserver [::1]:53\n"
                    "nameserver not-an-ip\nnameserver 127.0.0.1\nnameserver 127.0.0.1:54\n"
                    "domain first.example\nsearch a.svc.cluster.local svc.cluster.local.  # trailing\n"
                    "options timeout:2 ndots:5 attempts:3\noptions ndots:x\n")
    conf = read_resolv_conf(str(path))
    assert conf.nameservers == (("127.0.0.1", 5353), ("::1", 53), ("127.0.0.1", 53))
    assert conf.search == ("a.svc.cluster.local", "svc.cluster.local")  # the last line wins
    assert conf.ndots == 5 and conf.found
    assert len(conf.ignored) == 3  # not-an-ip, the fourth server, ndots:x
    missing = read_resolv_conf(str(tmp_path / "none"))
    assert not missing.found and missing.nameservers == (("127.0.0.1", 53),) and missing.ndots == 1


def test_search_candidates():
    conf = ResolvConf("x", search=("ns.svc.cluster.local", "svc.cluster.local"), ndots=5)
    assert search_candidates("vllm", conf) == ["vllm.ns.svc.cluster.local.", "vllm.svc.cluster.local.", "vllm."]
    assert search_candidates("a.b.c.d.e.f", conf)[0] == "a.b.c.d.e.f."
    assert search_candidates("vllm.", conf) == ["vllm."]
    assert search_candidates("vllm", ResolvConf("x")) == ["vllm."]


def test_hosts_addresses(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("127.0.0.2 a b\n::1 A\nbad a\n127.0.0.3 c # a\n")
    assert hosts_addresses("a.", str(path)) == ["127.0.0.2", "::1"]
    assert hosts_addresses("c", str(path)) == ["127.0.0.3"] and hosts_addresses("d", str(path)) == []
    assert hosts_addresses("a", str(tmp_path / "none")) == []
