"""Real vLLM OpenAI servers on CPU (``vllm serve`` equivalents), started as subprocesses.

Used by the gateway's real-engine tests (``tests/test_gateway_vllm.py``), the benchmark
and the demo. Each :class:`VllmServer` is ``python -m vllm.entrypoints.openai.api_server``
on one model directory (e.g. :func:`kvevents.demo.tiny_model.make_tiny_model` with
``tokenizer=True``) with: its own HTTP port on 127.0.0.1, ``--block-size 32``, prefix
caching, ``cached_tokens`` in the usage (``--enable-prompt-tokens-details``), a fixed
KV pool (``--num-gpu-blocks-override``), ``--enforce-eager``, bf16, and KV events on
vLLM's ZeroMQ publisher when the caller gives an ``endpoint`` (vLLM *connects* its PUB
socket to a ``tcp://127.0.0.1:P`` endpoint, so the subscriber, e.g. ``kvevents serve``
with ``bind=1``, binds it; vLLM binds ``replay_endpoint``). Environment: one CPU core per
engine (``VLLM_CPU_OMP_THREADS_BIND``: the ``core``-th core this process may use, modulo
their number), ``VLLM_SERVER_DEV_MODE=1`` (``POST /reset_prefix_cache``), the CPU
device, a 1 GiB KV space, vLLM's internal sockets on loopback, this repository on
``PYTHONPATH`` (our connector, for ``--kv-transfer-config``).

Lifecycle: :meth:`VllmServer.start` spawns the server in its own process group (the API
server and its EngineCore child) with stdout+stderr in ``log``, and returns at once;
:meth:`~VllmServer.wait_ready` polls ``GET /health`` until 200 (10-70 s on 2 cores),
raising :class:`VllmServerError` with the log's tail if the process exits or the
timeout passes first; :meth:`~VllmServer.kill` SIGKILLs the group (a crash, for tests);
:meth:`~VllmServer.stop` sends SIGTERM to the group, then SIGKILL after ``timeout``.
:class:`VllmFleet` starts N servers in parallel and waits for all; a failure stops them
all. Both are context managers (enter: started and ready; exit: stopped). Importing this
module needs no vLLM; starting a server does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from kvevents.demo.fleet import free_port

ROOT = Path(__file__).resolve().parents[2]  # the repository: connector/ and kvevents/
BLOCK_SIZE = 32


class VllmServerError(RuntimeError):
    """A server that died or did not become ready; the message ends with its log tail."""


def server_env(core: int = 0, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a server pinned to the ``core``-th usable CPU (see the module)."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["VLLM_HOST_IP"] = "127.0.0.1"  # vLLM's internal sockets stay on loopback
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        list(range(os.cpu_count() or 1))
    env["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[core % len(cores)])
    env["VLLM_SERVER_DEV_MODE"] = "1"
    return env


class VllmServer:
    """One OpenAI server process (see the module docstring). Not thread-safe."""

    def __init__(self, model: str | Path, *, port: int | None = None, endpoint: str | None = None,
                 replay_endpoint: str | None = None, served_model_name: str = "tiny",
                 num_gpu_blocks: int = 48, max_model_len: int = 512, core: int = 0,
                 log: str | Path | None = None, extra_args: Sequence[str] = (),
                 env: dict[str, str] | None = None) -> None:
        self.model = Path(model)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.served_model_name = served_model_name
        self.num_gpu_blocks, self.max_model_len, self.core = num_gpu_blocks, max_model_len, core
        self.log = Path(log) if log else self.model.parent / f"vllm-{self.port}.log"
        self.extra_args = list(extra_args)
        self.env = server_env(core, env)
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
               "--served-model-name", self.served_model_name, "--host", "127.0.0.1",
               "--port", str(self.port), "--max-model-len", str(self.max_model_len),
               "--block-size", str(BLOCK_SIZE), "--enable-prefix-caching",
               "--enable-prompt-tokens-details", "--num-gpu-blocks-override", str(self.num_gpu_blocks),
               "--enforce-eager", "--dtype", "bfloat16"]
        if self.endpoint:
            events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.endpoint,
                      "replay_endpoint": self.replay_endpoint, "topic": ""}
            cmd += ["--kv-events-config", json.dumps(events)]
        return cmd + self.extra_args

    def start(self) -> VllmServer:
        """Spawn the server (returns at once; see :meth:`wait_ready`)."""
        if self.proc is not None:
            raise VllmServerError(f"server on port {self.port} already started")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(self.command(), cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def healthy(self, timeout: float = 2.0) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout: float = 300.0) -> VllmServer:
        """Until ``/health`` answers 200; :class:`VllmServerError` if the process exits or
        ``timeout`` seconds pass first."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.alive():
                rc = None if self.proc is None else self.proc.returncode
                raise VllmServerError(f"vLLM server on port {self.port} exited (rc={rc}); "
                                      f"log {self.log}:\n{self.log_tail()}")
            if self.healthy():
                return self
            if time.monotonic() > deadline:
                raise VllmServerError(f"vLLM server on port {self.port} not ready after {timeout:g} s; "
                                      f"log {self.log}:\n{self.log_tail()}")
            time.sleep(0.5)

    def reset_prefix_cache(self, timeout: float = 10.0) -> bool:
        """Empty the engine's prefix cache (vLLM refuses while blocks are held: False).
        The engine publishes ``AllBlocksCleared``."""
        resp = httpx.post(self.url + "/reset_prefix_cache", timeout=timeout)
        resp.raise_for_status()
        return bool(resp.json().get("success", True))

    def _signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)  # its own session: the group is the server's
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        """SIGKILL the server and its engine core at once (a crash)."""
        if self.proc is not None and self.proc.returncode is None:
            self._signal_group(signal.SIGKILL)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def freeze(self) -> None:
        """SIGSTOP the server and its engine core: nothing more is computed or written
        until :meth:`thaw` (or :meth:`kill`, which ends a frozen server too). Tests use it
        to hold an answer provably unfinished before they kill its engine."""
        if self.proc is not None and self.proc.returncode is None:
            self._signal_group(signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT after :meth:`freeze`."""
        if self.proc is not None and self.proc.returncode is None:
            self._signal_group(signal.SIGCONT)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` s; idempotent (a server already ended,
        by :meth:`kill` say, is not signalled again)."""
        if self.proc is None or self.proc.returncode is not None:
            return
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        self._signal_group(signal.SIGKILL)  # also an engine core left behind by its API server
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def __enter__(self) -> VllmServer:
        try:
            return self.start().wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


class VllmFleet:
    """N servers of one model, started in parallel, engine ``i`` pinned to core ``i``.

    ``events``: per engine, ``(endpoint, replay_endpoint)`` or None (no KV events);
    ``log_dir``: where ``vllm-<i>.log`` go; ``**server``: :class:`VllmServer` options.
    """

    def __init__(self, model: str | Path, events: Sequence[tuple[str, str | None] | None], *,
                 log_dir: str | Path, ports: Sequence[int] | None = None, **server) -> None:
        ports = list(ports) if ports else [free_port() for _ in events]
        self.servers = [
            VllmServer(model, port=ports[i], endpoint=ev[0] if ev else None,
                       replay_endpoint=ev[1] if ev else None, core=i,
                       log=Path(log_dir) / f"vllm-{i}.log", **server)
            for i, ev in enumerate(events)]

    def __getitem__(self, i: int) -> VllmServer:
        return self.servers[i]

    def __len__(self) -> int:
        return len(self.servers)

    def start(self) -> VllmFleet:
        for s in self.servers:
            s.start()
        return self

    def wait_ready(self, timeout: float = 420.0) -> VllmFleet:
        """All ready within one shared deadline; on a failure every server is stopped."""
        deadline = time.monotonic() + timeout
        try:
            for s in self.servers:
                s.wait_ready(max(1.0, deadline - time.monotonic()))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for s in self.servers:
            if s.alive():
                s._signal_group(signal.SIGTERM)  # all at once, then each waited for
        for s in self.servers:
            s.stop()

    def __enter__(self) -> VllmFleet:
        try:
            return self.start().wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
