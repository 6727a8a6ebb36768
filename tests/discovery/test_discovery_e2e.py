"""Discovery end to end, with real processes and sockets: ``kvevents serve`` replicas that
find their engines through a real DNS server (dnsmasq), publishers bound on several
127.0.0.x addresses, and the records changing while they run.

* a new engine is followed within 2 s of appearing in DNS; one that disappears is not
  routable within 1 s and is gone (state, series) after the grace period;
* two replicas that each follow every engine answer every lookup identically at
  quiescence;
* a replica started during load (``--bootstrap-from`` a peer) is not ready before its
  view has caught up with what the engines had published when it started.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from support import free_port, wait_until  # noqa: E402

from dnsmasq import Dnsmasq  # noqa: E402
from kvevents.wire.publisher import PublisherConfig, ZmqEventPublisher  # noqa: E402
from kvevents.wire.schema import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402

NAME = "vllm.test"
BS = 16


class Publishers:
    """One publisher per address, all on the same events/replay ports (as pods behind a
    headless Service), with each one's resident blocks tracked as truth."""

    def __init__(self, addresses: list[str]) -> None:
        self.events, self.replay = free_port(), free_port()
        self.pubs: dict[str, ZmqEventPublisher] = {}
        self.truth: dict[str, dict[int, list[int]]] = {}  # address -> hash -> tokens
        self.lock = threading.Lock()
        for addr in addresses:
            self.start(addr)

    def start(self, addr: str) -> None:
        self.pubs[addr] = ZmqEventPublisher(PublisherConfig(
            endpoint=f"tcp://{addr}:{self.events}", replay_endpoint=f"tcp://{addr}:{self.replay}",
            bind=True, buffer_steps=100_000))
        self.truth[addr] = {}

    def store_chain(self, addr: str, chain: list[int]) -> None:
        """Blocks of ``chain`` (a list of block seeds): each block's tokens come from
        its seed, parents chain them, so two engines storing a prefix share hashes."""
        events, parent = [], None
        with self.lock:
            held = self.truth[addr]
            for seed in chain:
                h = hash(("blk", parent, seed)) & 0x7FFF_FFFF_FFFF_FFFF
                if h not in held:
                    held[h] = [seed * 7 + i for i in range(BS)]
                    events.append(BlockStored([h], parent, held[h], BS, None, "GPU", None))
                parent = h
            if len(held) > 40:  # evict the oldest, as a full cache does
                old = list(held)[:8]
                for h in old:
                    del held[h]
                events.append(BlockRemoved(old, "GPU"))
            if events:
                self.pubs[addr].publish(KVEventBatch(time.time(), events))

    def seqs(self) -> dict[str, int]:
        return {addr: pub.stats().next_seq - 1 for addr, pub in self.pubs.items()}

    def close(self) -> None:
        for pub in self.pubs.values():
            pub.shutdown(0.5)


def serve(port: int, dns_server: str, pubs: Publishers, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvevents.cli", "serve", "--port", str(port),
           "--discover-dns", NAME, "--dns-server", dns_server, "--discover-interval", "0.3",
           "--discover-events-port", str(pubs.events), "--discover-replay-port", str(pubs.replay),
           "--discover-http-port", "0", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if not wait_until(lambda: get(port, "/healthz") is not None, 20, 0.1):
        proc.kill()
        raise RuntimeError(proc.stderr.read().decode()[-2000:])
    return proc


def get(port: int, path: str, ok_only: bool = True):
    try:
        r = httpx.get(f"http://127.0.0.1:{port}{path}", timeout=2)
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 or not ok_only else None


def ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def engines(port: int) -> dict[str, dict]:
    body = get(port, "/v1/engines") or {"engines": []}
    return {e["name"]: e for e in body["engines"]}


def lookup(port: int, tokens: list[int]) -> list:
    r = httpx.post(f"http://127.0.0.1:{port}/v1/lookup", json={"token_ids": tokens}, timeout=5)
    r.raise_for_status()
    return sorted((e["engine"], e["matched_tokens"], e.get("down", False)) for e in r.json()["engines"])


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def hosts(*addrs: str) -> list[str]:
    return [f"{a} {NAME}" for a in addrs]


def blocks_of(port: int, engine: str) -> set:
    body = get(port, f"/v1/engines/{engine}/blocks")
    return set() if body is None else set(body["tiers"].get("GPU", []))


@pytest.mark.timeout(120)
def test_dns_discovery_follows_the_records_as_they_change(tmp_path):
    dns = Dnsmasq(tmp_path, hosts("127.0.0.2", "127.0.0.3"))
    pubs = Publishers(["127.0.0.2", "127.0.0.3", "127.0.0.4"])
    port = free_port()
    proc = serve(port, dns.server, pubs, "--discover-grace", "1.5")
    try:
        assert wait_until(lambda: ready(port), 10), get(port, "/readyz", ok_only=False)
        assert set(engines(port)) == {"vllm-127.0.0.2", "vllm-127.0.0.3"}
        e = engines(port)["vllm-127.0.0.2"]
        assert e["origin"] == f"dns:{NAME}"
        assert e["endpoint"] == f"tcp://127.0.0.2:{pubs.events}"
        assert e["replay_endpoint"] == f"tcp://127.0.0.2:{pubs.replay}"
        chain = list(range(4))
        tokens = [t for seed in chain for t in (seed * 7 + i for i in range(BS))]
        for addr in ("127.0.0.2", "127.0.0.3", "127.0.0.4"):
            pubs.store_chain(addr, chain)
        assert wait_until(lambda: [x[0] for x in lookup(port, tokens)] == ["vllm-127.0.0.2", "vllm-127.0.0.3"], 5)

        # A new address in DNS: followed (connected, its history replayed) within 2 s.
        t0 = time.monotonic()
        dns.set_hosts(hosts("127.0.0.2", "127.0.0.3", "127.0.0.4"))
        assert wait_until(lambda: engines(port).get("vllm-127.0.0.4", {}).get("connected"), 2.0, 0.02)
        assert wait_until(lambda: ("vllm-127.0.0.4", 64, False) in lookup(port, tokens), 2.0, 0.02)
        followed_s = time.monotonic() - t0
        assert followed_s < 2.0

        # An address gone from DNS: unroutable within 1 s (lookups mark it down), its
        # blocks and metric series gone after the grace period.
        t0 = time.monotonic()
        dns.set_hosts(hosts("127.0.0.3", "127.0.0.4"))
        assert wait_until(lambda: not engines(port)["vllm-127.0.0.2"]["routable"], 1.0, 0.02)
        assert time.monotonic() - t0 < 1.0
        assert ("vllm-127.0.0.2", 64, True) in lookup(port, tokens)
        assert wait_until(lambda: "vllm-127.0.0.2" not in engines(port), 4.0, 0.05)
        assert time.monotonic() - t0 >= 1.5
        assert [x[0] for x in lookup(port, tokens)] == ["vllm-127.0.0.3", "vllm-127.0.0.4"]
        assert 'engine="vllm-127.0.0.2"' not in httpx.get(f"http://127.0.0.1:{port}/metrics").text

        status = get(port, "/v1/discovery")["sources"][0]
        assert status["origin"] == f"dns:{NAME}" and status["kind"] == "dns"
        assert status["engines"] == ["vllm-127.0.0.3", "vllm-127.0.0.4"] and status["errors"] == 0

        # The DNS server dies: the last set stands (an outage of DNS is not one of the
        # engines), errors are counted, the replica stays ready.
        dns.close()
        assert wait_until(lambda: get(port, "/v1/discovery")["sources"][0]["errors"] > 0, 5)
        assert set(engines(port)) == {"vllm-127.0.0.3", "vllm-127.0.0.4"} and ready(port)
    finally:
        stop(proc)
        dns.close()
        pubs.close()


@pytest.mark.timeout(180)
def test_replicas_agree_and_a_late_replica_is_ready_only_once_caught_up(tmp_path):
    addrs = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    dns = Dnsmasq(tmp_path, hosts(*addrs))
    pubs = Publishers(addrs)
    a_port, b_port, c_port = free_port(), free_port(), free_port()
    a = serve(a_port, dns.server, pubs)
    b = serve(b_port, dns.server, pubs)
    c = None
    rng = random.Random(7)
    convs = [[rng.randrange(50)] + [rng.randrange(10**6) for _ in range(rng.randrange(1, 6))]
             for _ in range(60)]
    stop_load = threading.Event()

    def load() -> None:
        r = random.Random(11)
        while not stop_load.is_set():
            conv = r.choice(convs)
            pubs.store_chain(r.choice(addrs), conv[: r.randrange(1, len(conv) + 1)])
            time.sleep(0.001)

    loader = threading.Thread(target=load, daemon=True)
    try:
        assert wait_until(lambda: ready(a_port) and ready(b_port), 15)
        loader.start()
        time.sleep(1.0)
        # A third replica joins during load, bootstrapping from a peer.
        seqs_at_start = pubs.seqs()
        c = serve(c_port, dns.server, pubs, "--bootstrap-from", f"http://127.0.0.1:{a_port}")
        assert wait_until(lambda: ready(c_port), 20, 0.02)
        # At its first ready answer its view holds at least what every engine had
        # published when it started: a Service never routes to it before.
        at_ready = engines(c_port)
        assert set(at_ready) == {f"vllm-{x}" for x in addrs}
        for addr in addrs:
            assert at_ready[f"vllm-{addr}"]["last_seq"] >= seqs_at_start[addr], (addr, at_ready)
        time.sleep(1.0)
    finally:
        stop_load.set()
        loader.join(5)

    try:
        # Quiescence: every replica's view equals the publishers' truth and each other's.
        def same_blocks() -> bool:
            for addr in addrs:
                want = set(pubs.truth[addr])
                for port in (a_port, b_port, c_port):
                    if blocks_of(port, f"vllm-{addr}") != want:
                        return False
            return True

        assert wait_until(same_blocks, 10, 0.1)
        for conv in convs:
            tokens = [t for seed in conv for t in (seed * 7 + i for i in range(BS))]
            answers = [lookup(p, tokens) for p in (a_port, b_port, c_port)]
            assert answers[0] == answers[1] == answers[2], (conv, answers)
    finally:
        for proc in (a, b, c):
            if proc is not None:
                stop(proc)
        dns.close()
        pubs.close()
