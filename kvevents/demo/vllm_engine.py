"""One real vLLM engine (``vllm.LLM``, CPU build) with our offloading connector, hosted in process.

Two users, one implementation:

* :class:`VllmEngine` builds the engine (token-id prompts, prefix caching, our
  ``connector.vllm.KVEventsOffloadingConnector`` with a CPU tier, KV events on vLLM's own
  ZeroMQ publisher) and reads its true contents: the GPU prefix cache's block hashes and
  the connector's CPU-tier block hashes, as the engine publishes them (int hashes). The
  real-engine tests' scenario driver (``tests/vllm_engine/driver.py``) uses it.
* ``python -m kvevents.demo.vllm_engine`` serves it over the same small RPC as the
  simulated engine process (:mod:`kvevents.sim.process`: a ROUTER socket, msgpack maps
  ``submit`` / ``load`` / ``drain`` / ``contents`` / ``stop``), for ``kvevents demo
  --engine vllm``.

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so its
scheduler, block pool, connector and publisher can be read; those reads use vLLM
internals of 0.32 (named where used). vLLM's publisher *connects* to an explicit
``tcp://127.0.0.1:P`` endpoint, so the aggregator binds the live endpoint; the replay
ROUTER is bound by vLLM. Importing this module needs no vLLM; building an engine does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from kvevents.sim.rpc import EngineRpc

BLOCK = 32  # engine block size (tokens)


def _engine_env() -> None:
    # Set before vLLM is imported: engine core in this process, CPU device, loopback only.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_HOST_IP"] = "127.0.0.1"


def block_bytes(model: str | Path, block_size: int = BLOCK) -> int:
    """Bytes of one engine block of KV (all layers, K and V, bf16) for ``model``'s config."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * kv_heads * head_dim * block_size * 2


class VllmEngine:
    """A ``vllm.LLM`` with our connector (``cpu_bytes`` > 0) and KV events (``events``).

    Construction starts the engine (10-70 s on 2 cores; raises what vLLM raises).
    ``close()`` shuts the publisher down. Not thread-safe: one caller steps it.
    """

    def __init__(self, model: str | Path, *, cpu_bytes: int = 0, offloaded_block_size: int | None = None,
                 events: str | None = None, replay: str | None = None, gpu_blocks: int = 16,
                 max_model_len: int = 256, max_num_seqs: int = 4) -> None:
        _engine_env()
        from vllm import LLM
        from vllm.config import KVEventsConfig, KVTransferConfig

        kw: dict[str, Any] = {}
        if cpu_bytes > 0:
            extra: dict[str, Any] = {"cpu_bytes_to_use": cpu_bytes}
            if offloaded_block_size:
                extra["block_size"] = offloaded_block_size
            kw["kv_transfer_config"] = KVTransferConfig(
                kv_connector="KVEventsOffloadingConnector", kv_connector_module_path="connector.vllm",
                kv_role="kv_both", kv_connector_extra_config=extra)
        if events:
            kw["kv_events_config"] = KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint=events,
                replay_endpoint=replay, topic="")
        t0 = time.monotonic()
        self.llm = LLM(model=str(model), skip_tokenizer_init=True, max_model_len=max_model_len,
                       block_size=BLOCK, enable_prefix_caching=True, num_gpu_blocks_override=gpu_blocks,
                       max_num_seqs=max_num_seqs, dtype="bfloat16", seed=0, enforce_eager=True, **kw)
        self.startup_s = time.monotonic() - t0
        self.max_model_len = max_model_len
        self._external: dict[str, str] = {}  # vLLM's internal request id -> the caller's
        # vLLM 0.32 internals: the in-process engine core and its scheduler.
        self.core = self.llm.llm_engine.engine_core.engine_core
        self.sched = self.core.scheduler
        self.conn = self.sched.connector  # our scheduler-role connector, or None
        self.pool = self.sched.kv_cache_manager.block_pool

    # -- running -------------------------------------------------------------------------

    def params(self, max_tokens: int):
        from vllm import SamplingParams

        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def generate(self, token_ids: list[int], max_tokens: int = 16) -> dict[str, Any]:
        """One greedy completion, then :meth:`settle`: ``{"tokens", "cached"}``."""
        from vllm.inputs import TokensPrompt

        out = self.llm.generate([TokensPrompt(prompt_token_ids=token_ids)], self.params(max_tokens),
                                use_tqdm=False)[0]
        self.settle()
        return {"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens or 0}

    def add_request(self, req_id: str, token_ids: list[int], max_tokens: int) -> None:
        from vllm.inputs import TokensPrompt

        internal = self.llm.llm_engine.add_request(req_id, TokensPrompt(prompt_token_ids=token_ids),
                                                   self.params(max_tokens))
        self._external[str(internal)] = req_id

    def forget(self, req_id: str) -> None:
        """Drops a finished request's id mapping (the caller's id)."""
        for k in [k for k, v in self._external.items() if v == req_id]:
            del self._external[k]

    def busy(self) -> bool:
        """Requests to run, or connector copies in flight (their completions, CPU-tier
        events and delayed block frees arrive only with further steps)."""
        return self.sched.has_requests() or self.llm.llm_engine.has_unfinished_requests()

    def step(self) -> list:
        return self.llm.llm_engine.step()

    def settle(self, timeout: float = 60.0) -> None:
        """Step until idle; ``TimeoutError`` past ``timeout``."""
        deadline = time.monotonic() + timeout
        while self.busy():
            if time.monotonic() > deadline:
                raise TimeoutError("engine did not go idle")
            self.step()
            time.sleep(0.005)

    def loading_external_tokens(self) -> dict[str, int]:
        """Requests (the caller's ids) now waiting for a CPU-tier load, with the tokens it brings.

        Our loads are always asynchronous, so a request served from the CPU tier spends
        at least one step in WAITING_FOR_REMOTE_KVS; its ``prefill_stats`` (vLLM 0.32) hold
        the local/external split from its scheduling until its first token."""
        out = {}
        for r in self.sched.requests.values():
            st = r.prefill_stats
            if st is not None and r.status.name == "WAITING_FOR_REMOTE_KVS":
                # vLLM suffixes the caller's id internally; outputs carry the caller's.
                out[self._external.get(r.request_id, r.request_id)] = st.num_external_cached_tokens
        return out

    # -- truth -------------------------------------------------------------------------

    def gpu_hashes(self) -> set[int]:
        from vllm.v1.core.kv_cache_utils import get_block_hash, maybe_convert_block_hash

        return {maybe_convert_block_hash(get_block_hash(k)) for k in self.pool.cached_block_hash_to_block._cache}

    def cpu_hashes(self) -> set[int]:
        return set(self.conn.cpu_block_hashes()) if self.conn is not None else set()

    def offload_stats(self) -> dict[str, Any]:
        return dict(vars(self.conn.scheduler.stats)) if self.conn is not None else {}

    def published(self, timeout: float = 30.0) -> int:
        """Waits until vLLM's publisher thread sent every queued batch; returns the last
        sequence number sent (-1: none). vLLM 0.32's ``ZmqEventPublisher`` internals."""
        pub = self.sched.kv_event_publisher
        queue, buffer = getattr(pub, "_event_queue", None), getattr(pub, "_buffer", None)
        if queue is None or buffer is None:
            return -1  # no ZeroMQ publisher configured
        deadline = time.monotonic() + timeout
        while queue.unfinished_tasks:
            if time.monotonic() > deadline:
                raise TimeoutError("vLLM's publisher did not drain its queue")
            time.sleep(0.01)
        return buffer[-1][0] if buffer else -1

    def close(self) -> None:
        pub = getattr(self.sched, "kv_event_publisher", None)
        if pub is not None:
            pub.shutdown()


class EngineServer(EngineRpc):
    """The RPC of :mod:`kvevents.sim.process` in front of a :class:`VllmEngine`.

    ``done`` replies carry real figures: ``ttft`` in wall seconds, GPU hits from vLLM's
    prefix cache, CPU hits loaded by our connector; ``finish`` is in the caller's time
    (``arrival`` plus the wall time taken, times the ``time_scale`` sent with ``submit``).
    """

    def __init__(self, engine: VllmEngine, rpc_endpoint: str) -> None:
        self.engine = engine
        self._reqs: dict[str, dict[str, Any]] = {}  # id -> client, submit time, figures
        super().__init__(rpc_endpoint)

    def on_request(self, ident: bytes, op: str, msg: dict[str, Any]) -> bool:
        # (vLLM's own input checks raise ValueError: the request is rejected, named.)
        if op == "submit":
            rid, tokens = str(msg["id"]), list(msg["token_ids"])
            n = int(msg.get("max_new_tokens", 1))
            if len(tokens) + n > self.engine.max_model_len:
                raise ValueError(f"{len(tokens)} prompt + {n} new tokens exceed the engine's "
                                 f"max_model_len {self.engine.max_model_len}")
            self.engine.add_request(rid, tokens, n)
            self._reqs[rid] = {"ident": ident, "t0": time.monotonic(), "ttft": None, "cpu": 0,
                               "arrival": float(msg.get("arrival") or 0.0),
                               "scale": float(msg.get("time_scale") or 1.0), "prompt": len(tokens)}
        elif op == "load":
            s = self.engine.sched
            self.reply(ident, {"op": "load", "waiting": len(s.waiting), "running": len(s.running),
                               "kv_usage": float(self.engine.sched.kv_cache_manager.usage)})
        elif op == "drain":
            self.run_until_idle(120.0)
            last = self.engine.published()
            off = self.engine.offload_stats()
            self.reply(ident, {
                # vLLM's publisher queue blocks when full instead of dropping.
                "op": "drained", "last_seq": last, "published": last + 1, "dropped": 0,
                "kv_mismatches": 0, "verified_blocks": 0,  # vLLM has no byte check
                "offload": {k: off.get(k, 0) for k in ("stored_bytes", "loaded_bytes",
                                                       "stored_seconds", "loaded_seconds")},
            })
        elif op == "contents":
            self.reply(ident, {"op": "contents", "tiers": {
                "GPU": sorted(self.engine.gpu_hashes()), "CPU": sorted(self.engine.cpu_hashes())}})
        else:
            return False
        return True

    def step(self) -> None:
        outputs = self.engine.step()
        now = time.monotonic()
        for rid, ext in self.engine.loading_external_tokens().items():
            if rid in self._reqs:
                self._reqs[rid]["cpu"] = ext
        for out in outputs:
            st = self._reqs.get(out.request_id)
            if st is None:
                continue
            if st["ttft"] is None and out.outputs and out.outputs[0].token_ids:
                st["ttft"] = now - st["t0"]
            if out.finished:
                del self._reqs[out.request_id]
                self.engine.forget(out.request_id)
                cached = out.num_cached_tokens or 0
                cpu = min(st["cpu"], cached)
                self.reply(st["ident"], {
                    "op": "done", "id": out.request_id, "ttft": st["ttft"] or now - st["t0"],
                    "prompt_tokens": st["prompt"], "gpu_hit_tokens": cached - cpu, "cpu_hit_tokens": cpu,
                    "computed_tokens": st["prompt"] - cached,
                    "finish": st["arrival"] + (now - st["t0"]) * st["scale"],
                })

    def run_until_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.engine.busy():
            if time.monotonic() > deadline:
                raise ValueError(f"the engine did not go idle in {timeout:g}s")
            self.step()

    def has_work(self) -> bool:
        return self.engine.busy()

    def close(self) -> None:
        self.engine.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", required=True)
    p.add_argument("--model", required=True, help="model directory (e.g. made by kvevents.demo.tiny_model)")
    p.add_argument("--events", required=True, help="vLLM's PUB endpoint, tcp://127.0.0.1:P (it connects)")
    p.add_argument("--replay", required=True, help="vLLM's replay ROUTER endpoint (it binds)")
    p.add_argument("--rpc-port", type=int, required=True)
    p.add_argument("--gpu-blocks", type=int, default=20, help=f"engine KV blocks of {BLOCK} tokens")
    p.add_argument("--cpu-blocks", type=int, default=256,
                   help=f"CPU tier capacity in engine blocks ({BLOCK} tokens); 0: no connector")
    p.add_argument("--offloaded-block-size", type=int, default=None,
                   help=f"tokens per offloaded chunk (a multiple of {BLOCK}; default {BLOCK})")
    p.add_argument("--max-model-len", type=int, default=512)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    engine = VllmEngine(args.model, cpu_bytes=args.cpu_blocks * block_bytes(args.model),
                        offloaded_block_size=args.offloaded_block_size, events=args.events,
                        replay=args.replay, gpu_blocks=args.gpu_blocks, max_model_len=args.max_model_len)
    server = EngineServer(engine, f"tcp://127.0.0.1:{args.rpc_port}")
    return server.serve_until_signalled(
        f"READY {args.name} (engine started in {engine.startup_s:.1f} s)")


if __name__ == "__main__":
    sys.exit(main())
