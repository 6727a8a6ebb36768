"""DnsSrvSource against real DNS servers on 127.0.0.1: dnsmasq's ``--srv-host`` records
(with and without ``--local=/test/``) and the tests' own server (dnsserver.TinyDns) for
SRV answers without glue and targets whose address questions fail.

Each case asserts the engines emitted (names, events/replay/HTTP endpoints) and what the
source shows (``queries``, ``errors``, ``skipped``)."""

from __future__ import annotations

import pytest

from kvevents.discovery.dns_srv import DnsSrvSource
from kvevents.discovery.targets import PortPlan

from dnsmasq import Dnsmasq  # noqa: E402
from dnsrun import _names, running  # noqa: E402
from dnsserver import Records, TinyDns  # noqa: E402
from support import wait_until  # noqa: E402  (dnsmasq puts tests/ on the path)

SRV = "_kv-events._tcp.vllm.test"
HOSTS = ["127.0.0.2 e1.vllm.test", "127.0.0.3 e2.vllm.test"]
RECORDS = ["_kv-events._tcp.vllm.test,e1.vllm.test,6001", "_kv-events._tcp.vllm.test,e1.vllm.test,6002",
           "_kv-events._tcp.vllm.test,e2.vllm.test,6003"]


def srv_source(server: str, name: str = SRV, ports: PortPlan = PortPlan(), **kw) -> DnsSrvSource:
    return DnsSrvSource(name, ports, interval_s=0.1, timeout_s=0.3, server=server, **kw)


def queries(src) -> dict:
    return {k: (v["state"], v.get("reason")) for k, v in src.status.extra["queries"].items()}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("local", [True, False], ids=["local", "no-local"])
def test_srv_records_give_hosts_and_ports(tmp_path, local):
    """Three records, two on one host: three engines, each on its own events port;
    replay ports from the _kv-replay SRV records (e1's one record pairs with its lowest
    events port), else the flag; HTTP ports from the flag."""
    replay = ["_kv-replay._tcp.vllm.test,e1.vllm.test,7001"]
    dns = Dnsmasq(tmp_path, HOSTS, local=local, srv=RECORDS + replay)
    src = srv_source(dns.server, replay_name="kv-replay", ports=PortPlan(replay=5558, http=8000))
    assert src.origin == f"dns-srv:{SRV}"
    assert src.describe()["kind"] == "dns-srv" and src.describe()["srv_ports"] == {"replay": "kv-replay"}
    try:
        with running(src) as r:
            specs = r.wait_for(lambda s: len(s) == 3, 5)
    finally:
        dns.close()
    assert _names(specs) == ["vllm-127.0.0.2:6001", "vllm-127.0.0.2:6002", "vllm-127.0.0.3:6003"]
    assert [(s.endpoint, s.replay_endpoint, s.http) for s in specs] == [
        ("tcp://127.0.0.2:6001", "tcp://127.0.0.2:7001", "http://127.0.0.2:8000"),
        ("tcp://127.0.0.2:6002", "tcp://127.0.0.2:5558", "http://127.0.0.2:8000"),
        ("tcp://127.0.0.3:6003", "tcp://127.0.0.3:5558", "http://127.0.0.3:8000")]
    assert queries(src)["SRV"] == ("answer", None) and queries(src)["replay SRV"] == ("answer", None)
    assert src.status.errors == 0 and src.status.extra["resolved_name"] == f"{SRV}."


@pytest.mark.timeout(30)
def test_srv_name_that_disappears_with_local_is_empty(tmp_path):
    dns = Dnsmasq(tmp_path, HOSTS, local=True, srv=RECORDS)
    src = srv_source(dns.server)
    try:
        with running(src) as r:
            r.wait_for(lambda s: len(s) == 3, 5)
            dns.restart(srv=[])  # no --srv-host: NXDOMAIN under --local
            assert r.wait_for(lambda s: s == [], 10) == []
    finally:
        dns.close()
    assert queries(src)["SRV"] == ("nxdomain", None) and src.status.errors == 0


@pytest.mark.timeout(30)
def test_srv_name_that_disappears_without_local_is_an_outage(tmp_path):
    dns = Dnsmasq(tmp_path, HOSTS, local=False, srv=RECORDS)
    src = srv_source(dns.server)
    try:
        with running(src) as r:
            r.wait_for(lambda s: len(s) == 3, 5)
            dns.restart(srv=[])  # no --srv-host and no upstream: REFUSED
            assert wait_until(lambda: src.status.errors >= 3, 10), src.status
    finally:
        dns.close()
    assert len(r.sets[-1]) == 3
    assert queries(src)["SRV"] == ("failed", "refused")


@pytest.mark.timeout(30)
def test_replay_srv_refused_fails_the_round(tmp_path):
    """Without --local, a replay SRV name dnsmasq does not hold is REFUSED: the replay
    ports are unknown, so nothing is emitted (emitting flag ports would replace engines)."""
    dns = Dnsmasq(tmp_path, HOSTS, local=False, srv=RECORDS)
    src = srv_source(dns.server, replay_name="_kv-replay")
    try:
        with running(src) as r:
            assert wait_until(lambda: src.status.errors >= 2, 5), src.status
    finally:
        dns.close()
    assert r.sets == [] and not src.status.first_round_done
    assert queries(src)["replay SRV"] == ("failed", "refused")
    assert "replay SRV refused" in src.status.last_error


@pytest.fixture
def tiny():
    server = TinyDns()
    try:
        yield server
    finally:
        server.close()


@pytest.mark.timeout(30)
def test_targets_resolved_per_family_and_kept_through_their_outage(tiny):
    """No glue: each target is asked. e1's AAAA is refused (its A is used), e2 is IPv6
    only; then every address question about e1 fails: e1 keeps its last address while
    e2 goes on, and the round is partial, not an error. A target "." adds nothing."""
    tiny.set(SRV, "SRV", Records([(0, 0, 6001, "e1.vllm.test."), (0, 0, 6002, "e2.vllm.test."),
                                  (0, 0, 6003, ".")]))
    tiny.set("e1.vllm.test", "A", Records(["127.0.0.2"]))
    tiny.set("e1.vllm.test", "AAAA", "refused")
    tiny.set("e2.vllm.test", "A", "nodata")
    tiny.set("e2.vllm.test", "AAAA", Records(["::1"]))
    src = srv_source(tiny.server, ports=PortPlan(replay=None, http=None))
    with running(src) as r:
        specs = r.wait_for(lambda s: len(s) == 2, 5)
        assert _names(specs) == ["vllm-127.0.0.2:6001", "vllm-::1:6002"]
        assert specs[1].endpoint == "tcp://[::1]:6002" and specs[1].replay_endpoint is None
        assert queries(src) == {"SRV": ("answer", None), "A": ("answer", None), "AAAA": ("failed", "refused")}
        tiny.set("e1.vllm.test", "A", "servfail")
        assert wait_until(lambda: src.status.extra["query_failures"].get("A", {}).get("servfail", 0) >= 3, 5)
        assert _names(r.sets[-1]) == ["vllm-127.0.0.2:6001", "vllm-::1:6002"]
        # e1 comes back at a new address; e2 leaves the SRV set.
        tiny.set("e1.vllm.test", "A", Records(["127.0.0.4"]))
        tiny.set(SRV, "SRV", Records([(0, 0, 6001, "e1.vllm.test.")]))
        assert _names(r.wait_for(lambda s: _names(s) == ["vllm-127.0.0.4:6001"], 5)) == ["vllm-127.0.0.4:6001"]
    assert src.status.errors == 0 and src.status.extra["partial_rounds"] >= 3


@pytest.mark.timeout(30)
def test_target_without_any_address_is_skipped_and_listed(tiny):
    tiny.set(SRV, "SRV", Records([(0, 0, 6001, "e1.vllm.test."), (0, 0, 6002, "gone.vllm.test.")]))
    tiny.set("e1.vllm.test", "A", Records(["127.0.0.2"]))
    tiny.set("e1.vllm.test", "AAAA", "nodata")
    src = srv_source(tiny.server)
    with running(src) as r:
        specs = r.wait_for(lambda s: len(s) == 1, 5)
    assert _names(specs) == ["vllm-127.0.0.2:6001"]
    assert src.status.extra["skipped"] == ["gone.vllm.test.:6002: no address"]


@pytest.mark.parametrize("name, kw, match", [
    ("vllm.test", {"replay_name": "kv-replay"}, "discover-srv-replay-name"),
    (SRV, {"http_name": "a.b"}, "discover-srv-http-name"),
    (SRV, {"http_name": "bad name"}, "discover-srv-http-name"),
    ("bad name", {}, "discover-dns-srv"),
])
def test_bad_arguments(name, kw, match):
    with pytest.raises(ValueError, match=match):
        DnsSrvSource(name, PortPlan(), **kw)
