"""The demo's processes: N engine processes and one aggregator, on this machine.

Engines are started as ``python -m kvevents.sim.process`` (the engine side, with
torch, lives only in those processes; this module never imports it) and the aggregator
as ``kvevents serve``. Every child gets its own process group so Ctrl-C in the terminal
reaches the demo only, and :meth:`Fleet.close` stops them all (SIGTERM, then SIGKILL
after a grace period): no orphans.
"""

from __future__ import annotations

import collections
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq


# Ports are drawn from [_LOW_PORT, start of the kernel's ephemeral range).
_LOW_PORT = 20000
# The ports this process handed out lately: each is free when drawn but bound only later
# (by a child), so a second draw could return it again; a fleet of two engines draws 11.
_ISSUED: collections.deque[int] = collections.deque(maxlen=1024)
_ISSUED_LOCK = threading.Lock()


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral (source port) range."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, below the kernel's ephemeral range.

    Why below: an engine binds its ports long after they are chosen (a vLLM engine
    starts in 10-70 s), and meanwhile every outgoing connection, among them the
    aggregator's and the demo's own reconnecting to the engines still starting, takes
    a source port from the ephemeral range. One landed on an engine's chosen port in
    CI and the engine failed to bind ("Address already in use"). A port this process
    handed out lately is not handed out again (it may not be bound yet). Falls back to
    a port the kernel picks when the range below is unusable or full."""
    top = _ephemeral_start()
    with _ISSUED_LOCK:
        if top - _LOW_PORT >= 1000:
            rng = random.Random()
            for _ in range(100):
                port = rng.randrange(_LOW_PORT, top)
                if port in _ISSUED:
                    continue
                with socket.socket() as s:
                    try:
                        s.bind(("127.0.0.1", port))
                    except OSError:
                        continue
                _ISSUED.append(port)
                return port
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        _ISSUED.append(port)
        return port


@dataclass(frozen=True)
class EnginePorts:
    events: int
    replay: int
    rpc: int
    metrics: int
    http: int = 0  # its OpenAI server (0: none)


class EngineClient:
    """RPC to one engine process over a DEALER socket (see kvevents/sim/process.py).

    ``rpc_endpoint`` overrides ``tcp://127.0.0.1:{ports.rpc}`` (an engine elsewhere,
    e.g. another container, driven by ``kvevents loadgen``)."""

    def __init__(self, ctx: zmq.Context, name: str, ports: EnginePorts | None,
                 rpc_endpoint: str | None = None) -> None:
        if rpc_endpoint is None:
            if ports is None:
                raise ValueError(f"{name}: give the engine's ports or its rpc_endpoint")
            rpc_endpoint = f"tcp://127.0.0.1:{ports.rpc}"
        self.name = name
        self.ports = ports
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(rpc_endpoint)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(dict)

    def send(self, msg: dict[str, Any]) -> None:
        self.sock.send(self._enc.encode(msg))

    def recv(self, timeout_ms: int | None = None) -> dict[str, Any] | None:
        if timeout_ms is not None and not self.sock.poll(timeout_ms):
            return None
        return self._dec.decode(self.sock.recv())

    def call(self, msg: dict[str, Any], reply_op: str, timeout_s: float,
             on_other=None) -> dict[str, Any]:
        """Send ``msg`` and wait for the reply ``reply_op``; other messages (request
        completions) go to ``on_other``. Raises ``TimeoutError``."""
        self.send(msg)
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name}: no {reply_op!r} reply in {timeout_s:g}s")
            reply = self.recv(int(left * 1000))
            if reply is None:
                continue
            if reply.get("op") == reply_op:
                return reply
            if reply.get("op") == "error":
                raise RuntimeError(f"{self.name}: {reply.get('error')}")
            if on_other is not None:
                on_other(self, reply)

    def close(self) -> None:
        self.sock.close(0)


class Fleet:
    """Starts and stops the demo's child processes."""

    def __init__(self, n_engines: int, port: int, cpu_tier: bool, *, gpu_blocks: int,
                 cpu_blocks: int, offloaded_block_size: int, log_dir: str,
                 vllm_model: str | None = None, openai_model: str | None = None,
                 tokenizer: str | None = None) -> None:
        """``vllm_model``: a model directory; the engines are then real vLLM engines
        (``python -m kvevents.demo.vllm_engine``) instead of simulated ones.
        ``openai_model``: simulated engines serve OpenAI requests for this model name
        on an HTTP port each (``EnginePorts.http``), and the aggregator is their gateway
        (its ``/v1/chat/completions`` and ``/v1/completions``); ``tokenizer``: a tokenizer
        directory for text prompts, given to the engines and the gateway."""
        self.procs: dict[str, subprocess.Popen] = {}
        self.ctx = zmq.Context.instance()
        self.engines: list[EngineClient] = []
        self.port = port
        self.url = f"http://127.0.0.1:{port}"  # the aggregator, for the driver
        self.log_dir = log_dir
        os.makedirs(log_dir, exist_ok=True)
        self._logs = []
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        for i in range(n_engines):
            name = f"engine-{i}"
            if vllm_model is not None:
                # No /metrics on a vLLM engine run in process (port 0: not listed).
                ports = EnginePorts(free_port(), free_port(), free_port(), 0)
                cmd = [sys.executable, "-m", "kvevents.demo.vllm_engine", "--name", name,
                       "--model", vllm_model, "--events", f"tcp://127.0.0.1:{ports.events}",
                       "--replay", f"tcp://127.0.0.1:{ports.replay}", "--rpc-port", str(ports.rpc),
                       "--gpu-blocks", str(gpu_blocks), "--cpu-blocks", str(cpu_blocks),
                       "--offloaded-block-size", str(offloaded_block_size)]
                self._spawn(name, cmd, {**env, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
                                        "VLLM_HOST_IP": "127.0.0.1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
                self.engines.append(EngineClient(self.ctx, name, ports))
                continue
            ports = EnginePorts(free_port(), free_port(), free_port(), free_port(),
                                free_port() if openai_model else 0)
            cmd = [sys.executable, "-m", "kvevents.sim.process", "--name", name,
                   "--bind", "127.0.0.1", "--events-port", str(ports.events),
                   "--replay-port", str(ports.replay), "--rpc-port", str(ports.rpc),
                   "--metrics-port", str(ports.metrics), "--metrics-addr", "127.0.0.1",
                   "--gpu-blocks", str(gpu_blocks),
                   "--cpu-blocks", str(cpu_blocks if cpu_tier else 0),
                   "--offloaded-block-size", str(offloaded_block_size)]
            if openai_model:
                cmd += ["--http-port", str(ports.http), "--model", openai_model]
                cmd += ["--tokenizer", tokenizer] if tokenizer else []
            self._spawn(name, cmd, env)
            self.engines.append(EngineClient(self.ctx, name, ports))
        # The aggregator keeps snapshots next to the logs: restarted, it resumes.
        cmd = [sys.executable, "-m", "kvevents.cli", "serve", "--host", "127.0.0.1",
               "--port", str(port), "--data-dir", os.path.join(log_dir, "data")]
        # vLLM's publisher connects to an explicit address: the aggregator binds there.
        bind = ",bind=1" if vllm_model is not None else ""
        for e in self.engines:
            http = (f",model={openai_model},http=http://127.0.0.1:{e.ports.http}"
                    if e.ports.http else "")
            cmd += ["--endpoint", f"{e.name}=tcp://127.0.0.1:{e.ports.events},"
                                  f"replay=tcp://127.0.0.1:{e.ports.replay}{bind}{http}"]
        if tokenizer and openai_model:
            cmd += ["--tokenizer", f"{openai_model}={tokenizer}"]
        self._spawn("aggregator", cmd, env)

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        log = open(os.path.join(self.log_dir, f"{name}.log"), "w")
        self._logs.append(log)
        self.procs[name] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                path = os.path.join(self.log_dir, name + ".log")
                try:  # the log's last lines: a test's temporary log dir is gone afterwards
                    with open(path, errors="replace") as f:
                        tail = "".join(f.readlines()[-8:]).strip()
                except OSError:
                    tail = ""
                raise RuntimeError(f"{name} exited with status {p.returncode}; see {path}"
                                   + (f":\n{tail}" if tail else ""))

    def wait_engines_ready(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        for e in self.engines:
            while True:
                self.check_alive()
                try:
                    e.call({"op": "load"}, "load", 1.0)
                    break
                except TimeoutError:
                    if time.monotonic() > deadline:
                        raise

    def close(self, grace_s: float = 5.0) -> None:
        for e in self.engines:
            e.close()
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(5)
        for log in self._logs:
            log.close()
