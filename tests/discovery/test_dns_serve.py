"""What DNS answers do to a real ``kvevents serve``: the process started with
``--discover-dns`` / ``--discover-dns-srv`` against real DNS servers on 127.0.0.1 (dnsmasq
in the configurations of test_dns_answers.py, the tests' own server for each way a
family fails), real publishers on 127.0.0.x, and its HTTP API read back.

Each case asserts what is followed (``/v1/engines``, connected, lookups) and what
``GET /v1/discovery`` says (per-family ``queries``, ``query_failures``, ``errors``), and
where it matters ``/readyz``, ``/metrics`` and the log.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from support import free_port, wait_until  # noqa: E402

from dnsmasq import Dnsmasq  # noqa: E402
from dnsserver import Records, TinyDns  # noqa: E402
from kvevents.wire.publisher import PublisherConfig, ZmqEventPublisher  # noqa: E402
from kvevents.wire.schema import BlockStored, KVEventBatch  # noqa: E402

BS = 16


class Fleet:
    """Publishers bound at (address, events port, replay port)."""

    def __init__(self) -> None:
        self.pubs: list[ZmqEventPublisher] = []

    def add(self, addr: str, events: int, replay: int, seed: int) -> None:
        pub = ZmqEventPublisher(PublisherConfig(endpoint=f"tcp://{addr}:{events}",
                                                replay_endpoint=f"tcp://{addr}:{replay}", bind=True))
        pub.publish(KVEventBatch(time.time(), [BlockStored([1000 + seed], None, [seed] * BS, BS, None, "GPU", None)]))
        self.pubs.append(pub)

    def close(self) -> None:
        for pub in self.pubs:
            pub.shutdown(0.5)


class Serve:
    """``kvevents serve`` with ``args``; its log in ``tmp_path/serve.log``."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.port = free_port()
        self.log = tmp_path / "serve.log"
        cmd = [sys.executable, "-m", "kvevents.cli", "serve", "--port", str(self.port), *args]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        if not wait_until(lambda: self.get("/healthz") is not None, 20, 0.1):
            self.stop()
            raise RuntimeError(self.log.read_text()[-2000:])

    def get(self, path: str):
        try:
            r = httpx.get(f"http://127.0.0.1:{self.port}{path}", timeout=2)
        except httpx.HTTPError:
            return None
        return r.json() if r.status_code == 200 else None

    def ready(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def engines(self) -> dict[str, dict]:
        return {e["name"]: e for e in (self.get("/v1/engines") or {"engines": []})["engines"]}

    def source(self) -> dict:
        return (self.get("/v1/discovery") or {"sources": [{}]})["sources"][0]

    def queries(self) -> dict:
        return {k: (v["state"], v.get("reason")) for k, v in self.source().get("queries", {}).items()}

    def metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=2).text

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def dns_args(name: str, server: str | None, events: int, replay: int, *extra: str) -> list[str]:
    args = ["--discover-dns", name, "--discover-interval", "0.2", "--discover-events-port", str(events),
            "--discover-replay-port", str(replay), "--discover-http-port", "0", *extra]
    return args + (["--dns-server", server] if server else [])


@pytest.mark.timeout(90)
def test_serve_follows_a_records_when_dnsmasq_refuses_aaaa_and_keeps_them_when_it_refuses_all(tmp_path):
    """dnsmasq as a forwarder without upstream (no --local): A answered, AAAA REFUSED.
    Both engines are followed and connected, /readyz is 200, the refusal is on
    /v1/discovery and /metrics and in the log once. Then the name is gone (REFUSED for
    both): the engines stay followed, errors count, the replica stays ready."""
    events, replay = free_port(), free_port()
    fleet = Fleet()
    fleet.add("127.0.0.2", events, replay, 1)
    fleet.add("127.0.0.3", events, replay, 2)
    dns = Dnsmasq(tmp_path, ["127.0.0.2 fleet.test", "127.0.0.3 fleet.test"], local=False)
    serve = Serve(tmp_path, *dns_args("fleet.test", dns.server, events, replay))
    try:
        assert wait_until(serve.ready, 10), serve.get("/v1/discovery")
        assert wait_until(lambda: all(e["connected"] for e in serve.engines().values())
                          and len(serve.engines()) == 2, 10), serve.engines()
        assert set(serve.engines()) == {"fleet-127.0.0.2", "fleet-127.0.0.3"}
        assert wait_until(lambda: serve.source()["rounds"] >= 6, 10)
        src = serve.source()
        assert src["first_round_done"] and src["errors"] == 0 and src["engines"] == sorted(serve.engines())
        assert serve.queries() == {"A": ("answer", None), "AAAA": ("failed", "refused")}
        assert src["query_failures"]["AAAA"]["refused"] >= 6 and src["partial_rounds"] >= 6
        assert ('kvevents_discovery_query_failures_total{origin="dns:fleet.test",query="AAAA",'
                'reason="refused"}') in serve.metrics()
        assert serve.log.read_text().count("AAAA questions fail") == 1

        dns.set_hosts([])
        assert wait_until(lambda: serve.source()["errors"] >= 5, 10), serve.source()
        assert set(serve.engines()) == {"fleet-127.0.0.2", "fleet-127.0.0.3"}
        assert not any(e["leaving_since"] for e in serve.engines().values())
        assert serve.queries() == {"A": ("failed", "refused"), "AAAA": ("failed", "refused")}
        assert serve.ready()
        assert 'kvevents_discovery_errors_total{origin="dns:fleet.test"}' in serve.metrics()
    finally:
        serve.stop()
        dns.close()
        fleet.close()


@pytest.mark.timeout(90)
def test_serve_with_local_dnsmasq_drops_engines_of_a_vanished_name_after_grace(tmp_path):
    """dnsmasq --local=/test/: AAAA is NODATA (nothing fails); the name gone is NXDOMAIN:
    the empty set, the engines leave (unroutable at once, dropped after the grace)."""
    events, replay = free_port(), free_port()
    fleet = Fleet()
    fleet.add("127.0.0.2", events, replay, 1)
    dns = Dnsmasq(tmp_path, ["127.0.0.2 fleet.test"], local=True)
    serve = Serve(tmp_path, *dns_args("fleet.test", dns.server, events, replay, "--discover-grace", "1"))
    try:
        assert wait_until(lambda: serve.engines().get("fleet-127.0.0.2", {}).get("connected"), 10)
        assert serve.queries() == {"A": ("answer", None), "AAAA": ("nodata", None)}
        dns.set_hosts([])
        assert wait_until(lambda: serve.source().get("leaving") == ["fleet-127.0.0.2"], 5)
        assert wait_until(lambda: serve.engines() == {}, 5)
        src = serve.source()
        assert src["engines"] == [] and src["errors"] == 0 and src["query_failures"] == {}
        assert serve.queries() == {"A": ("nxdomain", None), "AAAA": ("nxdomain", None)}
    finally:
        serve.stop()
        dns.close()
        fleet.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["refused", "servfail", "notimp", "drop"])
def test_serve_against_a_server_failing_aaaa(tmp_path, how):
    """The tests' own server answers A and fails AAAA one way: the A engines are followed;
    then A fails the same way too: an outage, the engines stay and the replica is ready."""
    events, replay = free_port(), free_port()
    fleet = Fleet()
    fleet.add("127.0.0.2", events, replay, 1)
    tiny = TinyDns()
    tiny.set("fleet.test", "A", Records(["127.0.0.2"]))
    tiny.set("fleet.test", "AAAA", how)
    serve = Serve(tmp_path, *dns_args("fleet.test", tiny.server, events, replay))
    reason = "timeout" if how == "drop" else how
    try:
        assert wait_until(lambda: serve.engines().get("fleet-127.0.0.2", {}).get("connected"), 10)
        assert wait_until(serve.ready, 5)
        assert serve.queries() == {"A": ("answer", None), "AAAA": ("failed", reason)}
        assert serve.source()["errors"] == 0
        tiny.set("fleet.test", "A", how)
        assert wait_until(lambda: serve.source()["errors"] >= 2, 15), serve.source()
        assert serve.queries() == {"A": ("failed", reason), "AAAA": ("failed", reason)}
        assert set(serve.engines()) == {"fleet-127.0.0.2"} and serve.ready()
    finally:
        serve.stop()
        tiny.close()
        fleet.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("server", ["tiny", "dnsmasq-local", "dnsmasq-no-local"])
def test_serve_aaaa_only_name(tmp_path, server):
    """An IPv6-only name: A REFUSED (the tests' own server; dnsmasq without --local) or
    NODATA (dnsmasq --local), AAAA ::1. The IPv6 engine is followed under its address,
    connected over IPv6, and its events are in the index."""
    if server == "tiny":
        dns = TinyDns()
        dns.set("fleet.test", "A", "refused")
        dns.set("fleet.test", "AAAA", Records(["::1"]))
    else:
        dns = Dnsmasq(tmp_path, ["::1 fleet.test"], local=server == "dnsmasq-local")
    events, replay = free_port(), free_port()
    fleet = Fleet()
    fleet.add("[::1]", events, replay, seed=7)
    serve = Serve(tmp_path, *dns_args("fleet.test", dns.server, events, replay))
    try:
        assert wait_until(lambda: "fleet-::1" in serve.engines(), 10), serve.source()
        assert serve.engines()["fleet-::1"]["endpoint"] == f"tcp://[::1]:{events}"
        assert wait_until(lambda: serve.engines()["fleet-::1"].get("connected"), 10), serve.engines()
        body = {"token_ids": [7] * BS}  # the batch published before we connected: by replay
        assert wait_until(lambda: [x["engine"] for x in httpx.post(
            f"http://127.0.0.1:{serve.port}/v1/lookup", json=body, timeout=5).json()["engines"]] == ["fleet-::1"], 10)
        a = ("nodata", None) if server == "dnsmasq-local" else ("failed", "refused")
        assert serve.queries() == {"A": a, "AAAA": ("answer", None)}
        assert serve.source()["errors"] == 0 and serve.source()["first_round_done"]
    finally:
        serve.stop()
        dns.close()
        fleet.close()


@pytest.mark.timeout(90)
def test_serve_without_interval_follows_the_ttl(tmp_path):
    """No --discover-interval: a record with TTL 2 s is asked again every 2 s, not every
    second; /v1/discovery shows the TTL and the wait."""
    tiny = TinyDns()
    tiny.set("fleet.test", "A", Records(["127.0.0.2"], ttl=2))
    tiny.set("fleet.test", "AAAA", "nodata")
    serve = Serve(tmp_path, "--discover-dns", "fleet.test", "--dns-server", tiny.server,
                  "--discover-http-port", "0")
    try:
        assert wait_until(lambda: "fleet-127.0.0.2" in serve.engines(), 10)
        assert wait_until(lambda: len(tiny.asked("fleet.test", "A")) >= 3, 8)
        times = [t for t, _, _ in tiny.asked("fleet.test", "A")][:3]
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert all(1.95 <= g < 2.8 for g in gaps), gaps  # never inside the TTL, soon after
        src = serve.source()
        assert src["interval_s"] is None and src["ttl_s"] == 2 and src["next_round_s"] == 2
    finally:
        serve.stop()
        tiny.close()


@pytest.mark.timeout(90)
def test_serve_srv_engines_on_their_own_ports(tmp_path):
    """dnsmasq --srv-host: two engines on one address on different ports and a third on
    another (no events port flag); replay ports from _kv-replay SRV records (one target's
    records paired in port order), the third's from the flag. All three followed,
    connected, and found by lookups."""
    a, c, b, d, e, f = sorted(free_port() for _ in range(6))  # events a < c, replays b < d
    fleet = Fleet()
    fleet.add("127.0.0.2", a, b, 1)
    fleet.add("127.0.0.2", c, d, 2)
    fleet.add("127.0.0.3", e, f, 3)
    srv = [f"_kv-events._tcp.fleet.test,e1.fleet.test,{port}" for port in (c, a)]
    srv += [f"_kv-events._tcp.fleet.test,e2.fleet.test,{e}"]
    srv += [f"_kv-replay._tcp.fleet.test,e1.fleet.test,{port}" for port in (d, b)]
    dns = Dnsmasq(tmp_path, ["127.0.0.2 e1.fleet.test", "127.0.0.3 e2.fleet.test"], local=False, srv=srv)
    serve = Serve(tmp_path, "--discover-dns-srv", "_kv-events._tcp.fleet.test", "--dns-server", dns.server,
                  "--discover-srv-replay-name", "kv-replay", "--discover-replay-port", str(f),
                  "--discover-http-port", "0", "--discover-interval", "0.2")
    names = {f"fleet-127.0.0.2:{a}", f"fleet-127.0.0.2:{c}", f"fleet-127.0.0.3:{e}"}
    try:
        assert wait_until(lambda: set(serve.engines()) == names
                          and all(x["connected"] for x in serve.engines().values()), 10), serve.source()
        engines = serve.engines()
        assert [engines[n]["replay_endpoint"] for n in sorted(names)] == [
            f"tcp://127.0.0.2:{b}", f"tcp://127.0.0.2:{d}", f"tcp://127.0.0.3:{f}"]
        src = serve.source()
        assert src["kind"] == "dns-srv" and src["origin"] == "dns-srv:_kv-events._tcp.fleet.test"
        assert serve.queries()["SRV"] == ("answer", None) and serve.queries()["replay SRV"] == ("answer", None)
        assert src["errors"] == 0
        for seed, name in ((1, f"fleet-127.0.0.2:{a}"), (2, f"fleet-127.0.0.2:{c}"), (3, f"fleet-127.0.0.3:{e}")):
            body = {"token_ids": [seed] * BS}
            assert wait_until(lambda: [x["engine"] for x in httpx.post(
                f"http://127.0.0.1:{serve.port}/v1/lookup", json=body, timeout=5).json()["engines"]] == [name], 5)
    finally:
        serve.stop()
        dns.close()
        fleet.close()


@pytest.mark.timeout(90)
def test_serve_short_name_through_resolv_conf(tmp_path):
    """No --dns-server: --resolv-conf names dnsmasq (authoritative for cluster.local) with
    a pod's search domains and ndots:5; the short name finds the Service's engines."""
    fqdn = "vllm-headless.llm.svc.cluster.local"
    events, replay = free_port(), free_port()
    fleet = Fleet()
    fleet.add("127.0.0.2", events, replay, 1)
    dns = Dnsmasq(tmp_path, [f"127.0.0.2 {fqdn}"], local=False,
                  extra=["--local=/cluster.local/", "--local=/vllm-headless/"])
    conf = tmp_path / "resolv.conf"
    conf.write_text(f"nameserver {dns.server}\nsearch llm.svc.cluster.local svc.cluster.local "
                    "cluster.local\noptions ndots:5\n")
    serve = Serve(tmp_path, *dns_args("vllm-headless", None, events, replay, "--resolv-conf", str(conf)))
    try:
        assert wait_until(lambda: serve.engines().get("vllm-headless-127.0.0.2", {}).get("connected"), 10), \
            serve.source()
        src = serve.source()
        assert src["server"] == "system" and src["resolved_name"] == f"{fqdn}."
        assert src["resolv_conf"]["path"] == str(conf) and src["resolv_conf"]["ndots"] == 5
        assert serve.queries() == {"A": ("answer", None), "AAAA": ("nodata", None)}
    finally:
        serve.stop()
        dns.close()
        fleet.close()
