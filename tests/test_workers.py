"""``kvevents serve --workers N`` for real: a real ``kvevents serve`` process with two
workers on one port, a real ZeroMQ publisher, real HTTP connections (each request on a
new one, so the kernel's SO_REUSEPORT hash picks its worker), real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support import free_port, wait_until
from kvevents.cli.worker_app import merge_expositions
from kvevents.wire.publisher import PublisherConfig, ZmqEventPublisher
from kvevents.wire.schema import BlockStored, KVEventBatch

ROOT = Path(__file__).resolve().parent.parent
BS = 4
PROMPT = list(range(100, 132))  # 8 blocks of 4


def _serve(port: int, *args: str, log: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvevents.cli", "serve", "--port", str(port),
                             *args], cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})})


def _get(url: str, path: str, timeout: float = 2.0) -> httpx.Response | None:
    """One request on a connection of its own (a new source port: the kernel hashes it
    to one of the workers' sockets); None when nobody answered in time."""
    try:
        with httpx.Client(timeout=timeout) as client:
            return client.get(url + path)
    except httpx.HTTPError:
        return None


def _readyz(url: str, timeout: float = 2.0) -> dict | None:
    r = _get(url, "/readyz", timeout)
    return None if r is None else {**r.json(), "code": r.status_code}


def _pids(url: str, tries: int = 40) -> set[int]:
    return {got["pid"] for got in (_readyz(url) for _ in range(tries)) if got}


def _samples(text: str, name: str) -> dict[tuple, float]:
    """Samples of metric ``name`` by their sorted label pairs."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def _per_worker(text: str, name: str, **labels: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in _samples(text, name).items():
        d = dict(key)
        if all(d.get(k) == v for k, v in labels.items()):
            out[d["worker"]] = out.get(d["worker"], 0.0) + value
    return out


def _lookup(url: str) -> list:
    with httpx.Client(timeout=5) as client:  # a new connection: any worker
        r = client.post(url + "/v1/lookup", json={"token_ids": PROMPT, "model": "m"})
    assert r.status_code == 200, r.text
    return r.json()["engines"]


def _stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(40)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A publisher and ``kvevents serve --workers 2`` following it."""
    tmp = tmp_path_factory.mktemp("workers")
    live, replay = free_port(), free_port()
    pub = ZmqEventPublisher(PublisherConfig(endpoint=f"tcp://*:{live}",
                                            replay_endpoint=f"tcp://*:{replay}"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(port, "--workers", "2", "--endpoint",
                  f"e0=tcp://127.0.0.1:{live},replay=tcp://127.0.0.1:{replay},model=m",
                  log=tmp / "serve.log")
    try:
        assert wait_until(lambda: (_readyz(url) or {}).get("code") == 200, 30), \
            (tmp / "serve.log").read_text()
        yield url, pub, proc, tmp / "serve.log"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        pub.shutdown(0.5)


def test_two_workers_answer_on_one_port_and_both_follow_the_publisher(served):
    url, pub, proc, log = served
    assert wait_until(lambda: len(_pids(url, 8)) == 2, 20), "one worker answered every connection"
    body = _readyz(url)
    assert body["workers"] == {"total": 2, "ready": 2, "not_ready": []}
    # Events: 8 blocks of PROMPT on the GPU, in two batches.
    pub.publish(KVEventBatch(time.time(), [BlockStored(list(range(1, 5)), None, PROMPT[:16], BS,
                                                       None, "GPU", None)]))
    pub.publish(KVEventBatch(time.time(), [BlockStored(list(range(5, 9)), 4, PROMPT[16:], BS,
                                                       None, "GPU", None)]))

    def both_applied() -> bool:
        r = _get(url, "/metrics")
        return r is not None and _per_worker(
            r.text, "kvevents_block_events_applied_total") == {"0": 8.0, "1": 8.0}
    assert wait_until(both_applied, 10)
    # Every connection, whichever worker takes it, sees the same index.
    for _ in range(16):
        assert _lookup(url) == [{"engine": "e0", "matched_tokens": 32, "tiers": {"GPU": 32}}]


def test_one_scrape_shows_every_worker(served):
    url, _, _, _ = served
    for _ in range(6):  # whichever worker takes the scrape
        text = _get(url, "/metrics").text
        families = {f.name: f for f in text_string_to_metric_families(text)}  # it parses
        assert _per_worker(text, "kvevents_worker_scraped") == {"0": 1.0, "1": 1.0}
        assert _per_worker(text, "kvevents_worker_ready") == {"0": 1.0, "1": 1.0}
        assert _samples(text, "kvevents_workers") == {(): 2.0}
        # The aggregator's own series, both workers', HELP/TYPE once per family.
        assert set(_per_worker(text, "kvevents_engine_up", engine="e0")) == {"0", "1"}
        assert text.count("# TYPE kvevents_engine_up ") == 1
        assert families["kvevents_lookups"].type == "counter"


def test_engines_added_at_run_time_reach_every_worker(served):
    url, _, _, _ = served
    live = free_port()
    with httpx.Client(timeout=10) as client:
        r = client.post(url + "/v1/engines", json={"name": "e1", "endpoint": f"tcp://127.0.0.1:{live}"})
    assert r.status_code == 201, r.text

    def on_both(present: bool) -> bool:
        r = _get(url, "/metrics")
        found = set(_per_worker(r.text, "kvevents_engine_up", engine="e1")) if r else None
        return found == ({"0", "1"} if present else set())
    assert wait_until(lambda: on_both(True), 5)
    with httpx.Client(timeout=10) as client:
        assert client.delete(url + "/v1/engines/e1").status_code == 204
    assert wait_until(lambda: on_both(False), 5)


def test_readyz_is_503_while_any_worker_is_not_ready(served):
    url, _, _, _ = served
    pids = _pids(url)
    assert len(pids) == 2
    victim = max(pids)
    os.kill(victim, signal.SIGSTOP)  # alive but not answering: its stamp goes stale
    try:
        def says_not_ready() -> bool:
            got = _readyz(url, timeout=0.5)  # a connection hashed to the stopped one times out
            return got is not None and got["code"] == 503 and got["pid"] != victim \
                and got["workers"]["ready"] == 1 and len(got["workers"]["not_ready"]) == 1
        assert wait_until(says_not_ready, 15, interval=0.1)
    finally:
        os.kill(victim, signal.SIGCONT)
    assert wait_until(lambda: (_readyz(url) or {}).get("code") == 200, 10)


def test_a_dead_worker_is_restarted_and_counted(served):
    url, _, proc, log = served
    # An engine added at run time: the restarted worker must follow it too.
    with httpx.Client(timeout=10) as client:
        r = client.post(url + "/v1/engines", json={"name": "e2", "endpoint": f"tcp://127.0.0.1:{free_port()}"})
    assert r.status_code == 201, r.text
    before = _pids(url)
    assert len(before) == 2
    victim = max(before)
    os.kill(victim, signal.SIGKILL)
    assert wait_until(lambda: victim not in _pids(url, 8) and len(_pids(url, 12)) == 2, 20)
    assert proc.poll() is None  # the supervisor lives on
    text = _get(url, "/metrics").text
    assert sum(_per_worker(text, "kvevents_worker_restarts_total").values()) == 1.0
    assert wait_until(lambda: (_readyz(url) or {}).get("code") == 200, 20)
    # The new worker followed the publisher again (replay from its buffer), and the
    # engine added at run time, taken from its peer before it said ready.
    for _ in range(12):
        assert _lookup(url) == [{"engine": "e0", "matched_tokens": 32, "tiers": {"GPU": 32}}]
    text = _get(url, "/metrics").text
    assert set(_per_worker(text, "kvevents_engine_up", engine="e2")) == {"0", "1"}
    assert set(_per_worker(text, "kvevents_engine_up", engine="e0")) == {"0", "1"}
    logged = log.read_text()
    assert f"(pid {victim}) exited with signal 9" in logged
    assert "engines taken from a peer (1 added, 0 removed)" in logged


def test_sigterm_stops_every_worker(served):
    url, _, proc, log = served
    pids = _pids(url)
    assert _stop(proc) == 0
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or \
            Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    assert _get(url, "/readyz", timeout=1) is None  # nothing listens any more
    assert "stopping 2 workers (SIGTERM)" in log.read_text()


def test_a_worker_that_cannot_start_stops_the_server(tmp_path):
    port = free_port()
    proc = _serve(port, "--workers", "2", "--tokenizer", f"m={tmp_path / 'missing'}",
                  log=tmp_path / "serve.log")
    assert proc.wait(60) == 2
    text = (tmp_path / "serve.log").read_text()
    assert "tokenizer for model 'm'" in text and "could not start" in text


def test_bound_endpoints_are_refused_with_several_workers(tmp_path):
    port = free_port()
    proc = _serve(port, "--workers", "2", "--endpoint", f"e0=tcp://127.0.0.1:{free_port()},bind=1",
                  log=tmp_path / "serve.log")
    assert proc.wait(30) == 2
    assert "bind their endpoint (bind=1)" in (tmp_path / "serve.log").read_text()


def test_workers_from_the_environment_and_the_config_file(tmp_path):
    from kvevents.service.cpus import usable_cpus
    from kvevents.service.settings import SettingsError, load_settings

    # (auto: tests/test_cpus.py)
    assert load_settings(env={"KVEVENTS_WORKERS": "auto"}).workers == usable_cpus()
    assert load_settings(env={"KVEVENTS_WORKERS": "3"}).workers == 3
    cfg = tmp_path / "c.toml"
    cfg.write_text("workers = 2\n")
    assert load_settings(str(cfg), env={}).workers == 2
    assert load_settings(str(cfg), env={}, workers="auto").workers == usable_cpus()
    with pytest.raises(SettingsError) as err:
        load_settings(env={"KVEVENTS_WORKERS": "0"})
    assert "environment variable KVEVENTS_WORKERS" in str(err.value)


def test_merged_expositions_keep_every_sample_once():
    a = ("# HELP x_total Things\n# TYPE x_total counter\nx_total 3.0\n"
         "# HELP y A gauge\n# TYPE y gauge\ny{k=\"v\"} 1.0\ny{} 2.0\n")
    b = "# HELP x_total Things\n# TYPE x_total counter\nx_total 4.0\n"
    merged = merge_expositions({0: a, 1: b})
    assert merged.count("# TYPE x_total counter") == 1
    assert _samples(merged, "x_total") == {(("worker", "0"),): 3.0, (("worker", "1"),): 4.0}
    assert _samples(merged, "y") == {(("k", "v"), ("worker", "0")): 1.0, (("worker", "0"),): 2.0}
    assert json.dumps(merged)  # plain text


def test_the_kubernetes_deployment_runs_one_worker_per_requested_core():
    import yaml

    from kvevents.service.settings import load_settings

    doc = yaml.safe_load((ROOT / "deploy/kubernetes/base/deployment.yaml").read_text())
    (container,) = doc["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    workers = load_settings(env=env).workers
    assert workers == int(container["resources"]["requests"]["cpu"]) == 2


def test_each_worker_gets_its_share_of_the_process_bounds(tmp_path):
    from kvevents.cli.workers import worker_settings
    from kvevents.service.settings import load_settings

    s = load_settings(env={}, workers=3, max_inflight=64, data_dir=str(tmp_path))
    w0, w2 = worker_settings(s, 0), worker_settings(s, 2)
    assert (w0.workers, w0.max_inflight, w2.max_inflight) == (1, 21, 21)
    assert w0.data_dir == str(tmp_path) and w2.data_dir == str(tmp_path / "worker-2")
    if "max_connections" in type(s).model_fields:
        assert w2.max_connections == s.max_connections // 3


def test_each_worker_snapshots_to_its_own_place(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(port, "--workers", "2", "--data-dir", str(tmp_path / "data"),
                  log=tmp_path / "serve.log")
    try:
        assert wait_until(lambda: (_readyz(url) or {}).get("code") == 200, 30)
    finally:
        assert _stop(proc) == 0
    # Each wrote its final snapshot on the way out, neither over the other's.
    assert (tmp_path / "data" / "snapshot.bin").is_file()
    assert (tmp_path / "data" / "worker-1" / "snapshot.bin").is_file()
