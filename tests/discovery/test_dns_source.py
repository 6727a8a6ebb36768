"""DnsSource against a real DNS server: dnsmasq (Debian package dnsmasq-base) answering
from a hosts file the test rewrites, on 127.0.0.1 and a free port; 127.0.0.x only."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import pytest

from kvevents.discovery.dns import DnsSource, parse_server
from kvevents.discovery.targets import PortPlan

from dnsmasq import Dnsmasq, _closed_udp_port  # noqa: E402
from dnsrun import Running, _names, running  # noqa: E402
from support import wait_until  # noqa: E402  (dnsmasq puts tests/ on the path)


@pytest.fixture
def dnsmasq(tmp_path) -> Iterator[Dnsmasq]:
    server = Dnsmasq(tmp_path, ["127.0.0.2 vllm.test", "127.0.0.3 vllm.test"])
    try:
        yield server
    finally:
        server.close()


@pytest.mark.timeout(20)
def test_records_change_and_vanish(dnsmasq):
    src = DnsSource("vllm.test", PortPlan(), interval_s=0.1, server=dnsmasq.server, model="m")
    assert src.origin == "dns:vllm.test"
    assert src.describe() == {"kind": "dns", "name": "vllm.test", "role": "both", "server": dnsmasq.server,
                              "interval_s": 0.1,
                              "ports": {"events": 5557, "replay": 5558, "http": 8000, "dp_size": 1}}
    with running(src) as r:
        specs = r.wait_for(lambda s: len(s) == 2, 3)
        assert _names(specs) == ["vllm-127.0.0.2", "vllm-127.0.0.3"]
        first = specs[0]
        assert (first.endpoint, first.replay_endpoint, first.http, first.model) == \
            ("tcp://127.0.0.2:5557", "tcp://127.0.0.2:5558", "http://127.0.0.2:8000", "m")
        assert specs[1].endpoint == "tcp://127.0.0.3:5557"
        assert src.status.first_round_done and src.status.engines == 2 and src.status.errors == 0

        dnsmasq.set_hosts(["127.0.0.4 vllm.test", "127.0.0.3 vllm.test"])
        specs = r.wait_for(lambda s: _names(s) != ["vllm-127.0.0.2", "vllm-127.0.0.3"], 2)
        assert _names(specs) == ["vllm-127.0.0.3", "vllm-127.0.0.4"]  # sorted by address
        assert specs[1].endpoint == "tcp://127.0.0.4:5557"

        dnsmasq.set_hosts([])  # no pods ready: NXDOMAIN is an answer, the set is empty
        assert r.wait_for(lambda s: s == [], 2) == []
        assert src.status.engines == 0 and src.status.errors == 0


@pytest.mark.timeout(20)
def test_dp_ranks_get_their_ports(dnsmasq):
    dnsmasq.set_hosts(["127.0.0.2 vllm.test"])
    src = DnsSource("vllm.test", PortPlan(events=6000, replay=None, http=None, dp_size=2),
                    interval_s=0.1, server=dnsmasq.server)
    with running(src) as r:
        specs = r.wait_for(lambda s: len(s) == 2, 3)
    assert _names(specs) == ["vllm-127.0.0.2-dp0", "vllm-127.0.0.2-dp1"]
    assert [s.endpoint for s in specs] == ["tcp://127.0.0.2:6000", "tcp://127.0.0.2:6001"]
    assert [(s.replay_endpoint, s.http) for s in specs] == [(None, None), (None, None)]


@pytest.mark.timeout(20)
def test_one_name_per_pool_gives_its_engines_role(dnsmasq):
    from kvevents.discovery import build_sources
    from kvevents.service.settings import AggregatorSettings

    sources = build_sources(AggregatorSettings(
        discover_dns=("prefill=vllm.test", "vllm.test"), dns_server=dnsmasq.server, discover_interval_s=0.1))
    assert [(s.name, s.role) for s in sources] == [("vllm.test", "prefill"), ("vllm.test", "both")]
    with running(sources[0]) as r:
        specs = r.wait_for(lambda s: len(s) == 2, 3)
    assert [s.role for s in specs] == ["prefill", "prefill"]
    with pytest.raises(ValueError, match="discover-dns: 'prefil=vllm.test': the pool's role"):
        build_sources(AggregatorSettings(discover_dns=("prefil=vllm.test",)))


@pytest.mark.timeout(20)
def test_dead_server_counts_errors_and_never_emits():
    src = DnsSource("vllm.test", PortPlan(), interval_s=0.1, timeout_s=0.5,
                    server=f"127.0.0.1:{_closed_udp_port()}")
    r = Running(src)
    r.thread.start()
    try:
        assert wait_until(lambda: src.status.errors >= 2, 5), src.status
        time.sleep(0.3)  # stop in the middle of a query, the worst case for returning
    finally:
        took = r.stop_and_join()
    assert took < 1.5, f"run() took {took:.2f} s to return after stop"
    assert r.sets == [] and not src.status.first_round_done
    assert "no answer" in src.status.last_error and "within 0.5 s" in src.status.last_error


@pytest.mark.timeout(20)
def test_refused_is_a_failure_not_an_empty_set(dnsmasq):
    """A name the server will not answer for (REFUSED) keeps the last set: no emit."""
    src = DnsSource("vllm.example", PortPlan(), interval_s=0.1, server=dnsmasq.server)
    with running(src) as r:
        assert wait_until(lambda: src.status.errors >= 1, 3), src.status
    assert r.sets == []
    assert "REFUSED" in src.status.last_error


@pytest.mark.timeout(20)
def test_system_resolver_localhost():
    src = DnsSource("localhost", PortPlan(), interval_s=0.1)
    assert src.describe()["server"] == "system"
    with running(src) as r:
        specs = r.wait_for(lambda s: len(s) >= 1, 5)
    assert {s.endpoint for s in specs} <= {"tcp://127.0.0.1:5557", "tcp://[::1]:5557"}
    assert {s.name for s in specs} <= {"localhost-127.0.0.1", "localhost-::1"}


@pytest.mark.parametrize("server", ["localhost:53", "127.0.0.1:0", "127.0.0.1:65536",
                                    "127.0.0.1:dns", "[::1", "[::1]x", "[::1]:", "127.0.0.1:", "", "1.2.3:53"])
def test_bad_server(server):
    with pytest.raises(ValueError, match="dns-server"):
        DnsSource("vllm.test", PortPlan(), server=server)


@pytest.mark.parametrize("interval", [0, -1, math.nan, math.inf])
def test_bad_interval(interval):
    with pytest.raises(ValueError, match="discover-interval"):
        DnsSource("vllm.test", PortPlan(), interval_s=interval)


@pytest.mark.parametrize("name", ["", "bad name", "a..b", "-x.test", "x" * 64 + ".test"])
def test_bad_name(name):
    with pytest.raises(ValueError, match="discover-dns"):
        DnsSource(name, PortPlan())


def test_bad_timeout():
    with pytest.raises(ValueError, match="dns-timeout"):
        DnsSource("vllm.test", PortPlan(), timeout_s=0)


def test_parse_server():
    assert parse_server("127.0.0.1:5353") == ("127.0.0.1", 5353)
    assert parse_server("127.0.0.1") == ("127.0.0.1", 53)
    assert parse_server("[::1]:53") == ("::1", 53)
    assert parse_server("[::1]") == ("::1", 53)
    assert parse_server("::1") == ("::1", 53)
