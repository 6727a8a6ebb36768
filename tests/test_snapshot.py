"""Durable restarts: the snapshot file format, and a real aggregator process killed and
restarted with --data-dir while the publisher's small replay buffer wrapped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from support import free_port, wait_until
from kvevents.service import snapshot
from kvevents.ingest import ratelog
from kvevents.service.aggregator import Aggregator
from kvevents.index import PrefixIndex
from kvevents.wire.publisher import PublisherConfig, ZmqEventPublisher
from kvevents.wire.schema import BlockRemoved, BlockStored, KVEventBatch
from kvevents.service.settings import AggregatorSettings

BS = 4


def stored(hashes, parent, first_token):
    toks = list(range(first_token, first_token + BS * len(hashes)))
    return BlockStored(hashes, parent, toks, BS, None, "GPU", None)


def sample_snapshot() -> snapshot.Snapshot:
    idx = PrefixIndex()
    idx.apply_batch("p", KVEventBatch(1.0, [stored([1, 2], None, 0)]))
    spec = {"name": "p", "endpoint": "tcp://127.0.0.1:1", "replay_endpoint": None,
            "model": None, "topic": "", "bind": False}
    return snapshot.Snapshot(123.0, {"p": snapshot.EngineAnchor(spec, 7, 1.0)}, idx.export_state())


def test_round_trip_and_every_corruption_is_detected(tmp_path):
    snap = sample_snapshot()
    data = snapshot.encode(snap)
    back = snapshot.decode(data)
    assert back.engines["p"].last_seq == 7 and back.state == snap.state
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x01
    wrong_version = bytearray(data)
    wrong_version[8:12] = (99).to_bytes(4, "big")
    for bad in (data[:10], data[:-1], data + b"x", bytes(flipped), bytes(wrong_version),
                b"NOTASNAP" + data[8:], b""):
        with pytest.raises(snapshot.SnapshotError):
            snapshot.decode(bad)


def test_snapshot_written_before_the_engine_rename_still_loads():
    """Snapshots of earlier versions key engines as "pods" (in the meta and the index
    state): the same format version, so they must still restore."""
    import hashlib
    import json

    import msgspec

    snap = sample_snapshot()
    doc = msgspec.msgpack.decode(snap.state)
    doc["pods"] = doc.pop("engines")
    old_state = msgspec.msgpack.encode(doc)
    meta = json.dumps({"created": 123.0, "pods": {"p": {
        "spec": snap.engines["p"].spec, "last_seq": 7, "last_ts": 1.0}}}).encode()
    digest = hashlib.blake2b(meta + old_state, digest_size=32).digest()
    data = snapshot._HEADER.pack(snapshot.MAGIC, snapshot.VERSION, len(meta), len(old_state),
                                 digest) + meta + old_state
    back = snapshot.decode(data)
    assert back.engines["p"].last_seq == 7
    idx = PrefixIndex()
    idx.import_state(back.state)
    assert idx.engines() == ["p"] and idx.engine_block_counts("p") == {"GPU": 2}


def test_state_keeps_engine_hashes_as_sent_and_its_buckets_load_back():
    """The engine tables hold mixed hashes in memory (their buckets are those of the raw
    hashes); a saved state holds the raw hashes, as states of earlier versions do, so
    states move between versions both ways: the buckets carry exactly the engine's
    hashes, and the state loads back with every one of them findable and removable."""
    import msgspec
    import numpy as np

    idx = PrefixIndex()
    hashes = [1, 2, 3, 2**64 - 1, 2**63, 12345678901234567]
    idx.apply_batch("p", KVEventBatch(1.0, [stored(hashes, None, 0)]))
    doc = msgspec.msgpack.decode(idx.export_state())
    ((_pid, raw),) = doc["core"]["pmaps"]
    buckets = np.frombuffer(raw, dtype=np.dtype([("key", "<u8"), ("val", "<i4")]))
    assert sorted(int(k) for k in buckets["key"][buckets["val"] >= 0]) == sorted(hashes)
    back = PrefixIndex()
    back.import_state(msgspec.msgpack.encode(doc))
    assert back.engine_hashes("p") == {"GPU": set(hashes)}
    for h in hashes:
        assert [x.engine for x in back.blocks_by_engine_hash(h).holders] == ["p"]
    back.apply_batch("p", KVEventBatch(2.0, [BlockRemoved(hashes, "GPU")]))
    assert back.engine_block_counts("p") == {}


def test_atomic_write_keeps_one_previous_and_falls_back_to_it(tmp_path):
    first, second = sample_snapshot(), sample_snapshot()
    snapshot.write(tmp_path, snapshot.encode(first))
    snapshot.write(tmp_path, snapshot.encode(second))
    snapshot.write(tmp_path, snapshot.encode(second))
    assert sorted(p.name for p in tmp_path.iterdir()) == [snapshot.CURRENT, snapshot.PREVIOUS]
    cur = tmp_path / snapshot.CURRENT
    cur.write_bytes(cur.read_bytes()[:-5])  # a partial write
    assert snapshot.read_latest(tmp_path) is not None  # the previous one
    (tmp_path / snapshot.PREVIOUS).write_bytes(b"garbage")
    assert snapshot.read_latest(tmp_path) is None


@pytest.mark.parametrize("damage", ["truncate", "flip", "version"])
def test_corrupt_snapshot_is_ignored_never_half_loaded(tmp_path, damage, caplog):
    data = bytearray(snapshot.encode(sample_snapshot()))
    if damage == "truncate":
        data = data[: len(data) - 3]
    elif damage == "flip":
        data[-1] ^= 0xFF
    else:
        data[8:12] = (2).to_bytes(4, "big")
    (tmp_path / snapshot.CURRENT).write_bytes(bytes(data))
    # The process-wide log rate limiter may have used up this message's burst in the
    # tests before; start it afresh so the log line is there to check.
    if ratelog._installed is not None:
        ratelog._installed._windows.clear()
    agg = Aggregator(AggregatorSettings(data_dir=str(tmp_path)))
    assert not list(agg.index.engines())
    assert agg.index.counters().resident_entries == 0
    assert "ignored" in caplog.text


# -- a real aggregator process, killed and restarted -------------------------------------


class Fleet:
    """One publisher with a 20-batch replay buffer, and its truth."""

    def __init__(self) -> None:
        self.live, self.replay = free_port(), free_port()
        self.pub = ZmqEventPublisher(PublisherConfig(
            endpoint=f"tcp://127.0.0.1:{self.live}", replay_endpoint=f"tcp://127.0.0.1:{self.replay}",
            buffer_steps=20, bind=True))
        self.truth: set[int] = set()
        self.churn = 1000

    def send(self, *events) -> None:
        self.pub.publish(KVEventBatch(time.time(), list(events)))
        for ev in events:
            if isinstance(ev, BlockStored):
                self.truth.update(ev.block_hashes)
            else:
                self.truth.difference_update(ev.block_hashes)

    def churn_batches(self, n: int) -> None:
        """n batches, each storing a fresh block and evicting the previous one."""
        for _ in range(n):
            prev, self.churn = self.churn, self.churn + 1
            events = [stored([self.churn], None, self.churn * 10)]
            if prev in self.truth:
                events.append(BlockRemoved([prev], "GPU"))
            self.send(*events)
            time.sleep(0.002)

    def engine_arg(self) -> str:
        return f"p=tcp://127.0.0.1:{self.live},replay=tcp://127.0.0.1:{self.replay}"


def start_server(port: int, engine: str, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvevents.cli", "serve", "--port", str(port),
           "--endpoint", engine, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ok = wait_until(lambda: _get(port, "/v1/engines") is not None, 20, 0.1)
    if not ok:
        proc.kill()
        raise RuntimeError(proc.stderr.read().decode()[-2000:])
    return proc


def _get(port: int, path: str):
    try:
        r = httpx.get(f"http://127.0.0.1:{port}{path}", timeout=2)
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 else None


def indexed(port: int) -> set[int] | None:
    body = _get(port, "/v1/engines/p/blocks")
    return None if body is None else set(body["tiers"].get("GPU", []))


def stop(proc: subprocess.Popen, sig: int) -> None:
    proc.send_signal(sig)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


@pytest.fixture
def fleet():
    f = Fleet()
    yield f
    f.pub.shutdown(0.5)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_restart_with_data_dir_keeps_long_lived_blocks_after_the_buffer_wrapped(
        tmp_path, fleet, sig):
    port = free_port()
    data = ["--data-dir", str(tmp_path), "--snapshot-interval", "0.3"]
    agg = start_server(port, fleet.engine_arg(), *data)
    try:
        assert wait_until(lambda: (_get(port, "/v1/engines") or {"engines": [{}]})["engines"][0].get("connected"), 10)
        time.sleep(0.3)
        long_lived = [1, 2, 3, 4]  # a system prompt: announced once, cached for good
        fleet.send(stored(long_lived, None, 0))
        fleet.churn_batches(60)  # 3x the replay buffer
        assert wait_until(lambda: indexed(port) == fleet.truth, 10), (indexed(port), fleet.truth)
        time.sleep(1.0)  # a periodic snapshot covers it (SIGKILL gets no final one)
    finally:
        stop(agg, sig)
    fleet.churn_batches(10)  # while the aggregator is down: fewer than the buffer holds

    # Control: a fresh aggregator without the data dir cannot rebuild the long-lived blocks.
    fresh_port = free_port()
    fresh = start_server(fresh_port, fleet.engine_arg())
    try:
        assert wait_until(lambda: indexed(fresh_port) not in (None, set()), 10)
        assert not set(long_lived) & indexed(fresh_port)
    finally:
        stop(fresh, signal.SIGTERM)

    agg = start_server(port, fleet.engine_arg(), *data)
    try:
        assert wait_until(lambda: indexed(port) == fleet.truth, 10), (indexed(port), fleet.truth)
        assert set(long_lived) <= indexed(port)
        engine = _get(port, "/v1/engines")["engines"][0]
        assert engine["restore"] == "resumed" and engine["lost_batches"] == 0
        # The stream goes on exactly after the restore.
        fleet.churn_batches(5)
        assert wait_until(lambda: indexed(port) == fleet.truth, 10)

        # Down again, and this time the buffer wraps past our anchor: the restored
        # state cannot be vouched for and is dropped (counted), never kept stale.
    finally:
        stop(agg, signal.SIGTERM)
    fleet.churn_batches(50)
    agg = start_server(port, fleet.engine_arg(), *data)
    try:
        assert wait_until(lambda: indexed(port) not in (None, set()), 10)
        time.sleep(0.5)
        got = indexed(port)
        assert got <= fleet.truth and not set(long_lived) & got
        health = _get(port, "/healthz")
        assert health["snapshots"]["dropped_engines"] == 1
    finally:
        stop(agg, signal.SIGTERM)
    assert sorted(os.listdir(tmp_path)) == [snapshot.CURRENT, snapshot.PREVIOUS]


def test_bootstrap_from_a_peer(tmp_path, fleet):
    port, peer_port = free_port(), free_port()
    peer = start_server(peer_port, fleet.engine_arg(), "--auth-token", "tok")
    try:
        assert wait_until(lambda: (_get(peer_port, "/v1/engines") or {"engines": [{}]})["engines"][0].get("connected"), 10)
        time.sleep(0.3)
        fleet.send(stored([1, 2, 3, 4], None, 0))
        fleet.churn_batches(40)
        assert wait_until(lambda: indexed(peer_port) == fleet.truth, 10)
        assert httpx.get(f"http://127.0.0.1:{peer_port}/v1/snapshot").status_code == 401
        replica = start_server(port, fleet.engine_arg(), "--auth-token", "tok",
                               "--bootstrap-from", f"http://127.0.0.1:{peer_port}")
        try:
            assert wait_until(lambda: indexed(port) == fleet.truth, 10)
            fleet.churn_batches(5)  # then it follows the publisher itself
            assert wait_until(lambda: indexed(port) == fleet.truth == indexed(peer_port), 10)
        finally:
            stop(replica, signal.SIGTERM)
    finally:
        stop(peer, signal.SIGTERM)
