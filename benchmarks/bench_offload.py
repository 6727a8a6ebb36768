"""P6: offload copy speed of the connector's transfer handler vs a plain torch copy.

For each KV shape, N scattered engine blocks are stored into a fresh CPU pool (rows
allocated contiguously, as the offload manager does) and loaded back into scattered
blocks, through the real handler (submit -> wait -> take_finished, so thread or stream
overhead is included). The baseline copies the same bytes with one contiguous
``Tensor.copy_`` per layer in the same run. Medians of ``--repeats`` runs. With CUDA the
same is done device <-> pinned host. Target: >= 0.8x on CPU, >= 0.9x on a GPU.

    python benchmarks/bench_offload.py [--blocks 2048] [--repeats 7] [--engine-ids scattered|contiguous] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from connector.kv_layout import KVCacheLayout
from connector.transfer import Direction, TransferJob, make_transfer_handler

SHAPES = {
    "engine-default (2L,2H,d16,bs16)": KVCacheLayout(),
    "llama-8b-like (8L,8H,d128,bs16)": KVCacheLayout(num_layers=8, num_kv_heads=8, head_dim=128),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_one(layout: KVCacheLayout, n: int, repeats: int, device: torch.device, engine_ids: str = "scattered") -> dict:
    pin = device.type == "cuda"
    engine = layout.allocate(2 * n + 1, device)
    pool = layout.allocate(n, "cpu", pin=pin)
    for t in engine.values():
        t.copy_(torch.randint(-1000, 1000, t.shape, device=device).to(t.dtype))
    handler = make_transfer_handler(engine, pool)
    try:
        return bench_tensors(engine, pool, handler, n, repeats, device, engine_ids)
    finally:
        handler.shutdown()


def _like(tensors: dict[str, torch.Tensor], n: int, device: torch.device | str, pin: bool = False) -> dict[str, torch.Tensor]:
    return {k: torch.zeros((n, *t.shape[1:]), dtype=t.dtype, device=device, pin_memory=pin) for k, t in tensors.items()}


def bench_tensors(engine: dict[str, torch.Tensor], pool: dict[str, torch.Tensor], handler, n: int, repeats: int,
                  device: torch.device, engine_ids: str = "scattered") -> dict:
    """Store ``n`` engine blocks into pool rows 0..n-1 and load them back, vs plain copies.

    ``engine`` needs at least ``2 n + 1`` blocks and ``pool`` ``n`` rows; the handler must be
    the one built over these very tensors (the caller owns and shuts it down).
    """
    pin = device.type == "cuda"
    rng = np.random.default_rng(0)
    num_engine_blocks = min(t.shape[0] for t in engine.values())
    if num_engine_blocks < 2 * n + 1 or min(t.shape[0] for t in pool.values()) < n:
        raise ValueError(f"need {2 * n + 1} engine blocks and {n} pool rows")
    # Disjoint source and load-back blocks, so stored data is never overwritten by a load.
    # "scattered": a steady-state engine whose free blocks are randomly spread (worst
    # case: no two consecutive); "contiguous": a fresh engine handing out block runs.
    # Block 0 is vLLM's null block: never used.
    perm = (rng.permutation(2 * n) if engine_ids == "scattered" else np.arange(2 * n)).astype(np.int64) + 1
    gpu_ids, back_ids = perm[:n], perm[n:]
    pool_ids = np.arange(n, dtype=np.int64)
    nbytes = n * sum(t[0].numel() * t.element_size() for t in engine.values())
    # Baseline buffers: same bytes, contiguous on both sides.
    # (separate engine-side buffers, so the baseline never touches the blocks checked below)
    src_plain = _like(engine, n, device)
    dst_plain = _like(engine, n, "cpu", pin=pin)

    def timed(fn) -> float:
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        return time.perf_counter() - t0

    def store() -> None:
        handler.submit(TransferJob(1, Direction.STORE, gpu_ids, pool_ids))
        handler.wait()
        handler.take_finished()

    def load() -> None:
        handler.submit(TransferJob(2, Direction.LOAD, pool_ids, back_ids))
        handler.wait()
        handler.take_finished()

    def plain_d2h() -> None:
        for k in engine:
            dst_plain[k].copy_(src_plain[k], non_blocking=pin)

    def plain_h2d() -> None:
        for k in engine:
            src_plain[k].copy_(dst_plain[k], non_blocking=pin)

    if True:
        for fn in (store, load, plain_d2h, plain_h2d):  # warm-up
            timed(fn)
        samples = {name: [] for name in ("store", "load", "plain_d2h", "plain_h2d")}
        for _ in range(repeats):
            # Interleaved so that drift in machine load hits both sides alike.
            samples["store"].append(timed(store))
            samples["plain_d2h"].append(timed(plain_d2h))
            samples["load"].append(timed(load))
            samples["plain_h2d"].append(timed(plain_h2d))
        med = {k: statistics.median(v) for k, v in samples.items()}
        exact = all(torch.equal(engine[k][torch.from_numpy(back_ids).to(device)], engine[k][torch.from_numpy(gpu_ids).to(device)]) for k in engine)
        res = {
            "device": device.type,
            "engine_ids": engine_ids,
            "blocks": n,
            "bytes": nbytes,
            "store_gbps": nbytes / med["store"] / 1e9,
            "load_gbps": nbytes / med["load"] / 1e9,
            "plain_store_gbps": nbytes / med["plain_d2h"] / 1e9,
            "plain_load_gbps": nbytes / med["plain_h2d"] / 1e9,
            "store_ratio": med["plain_d2h"] / med["store"],
            "load_ratio": med["plain_h2d"] / med["load"],
            "round_trip_bit_exact": exact,
        }
    return res


def bench_vllm(model: str, n: int, repeats: int, engine_ids: str) -> dict:
    """The same measurement on a real vLLM engine's registered KV caches and our pool.

    vLLM runs in this process (engine core and worker: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
    with ``connector.vllm.KVEventsOffloadingConnector``; the copies go through the very
    transfer handler the connector built over the engine's KV tensors (CPU backend layout
    ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` per layer) and its CPU pool.
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    from vllm import LLM
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    cfg = json.loads((Path(model) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    block_bytes = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * 32 * 2  # bf16 K+V
    llm = LLM(model=model, skip_tokenizer_init=True, max_model_len=256, block_size=32, enable_prefix_caching=True,
              num_gpu_blocks_override=2 * n + 1, dtype="bfloat16", enforce_eager=True,
              kv_transfer_config=KVTransferConfig(
                  kv_connector="KVEventsOffloadingConnector", kv_connector_module_path="connector.vllm",
                  kv_role="kv_both", kv_connector_extra_config={"cpu_bytes_to_use": n * block_bytes}))
    worker = get_kv_transfer_group().worker
    engine, pool = worker.engine_kv, worker.cpu_pool
    for t in engine.values():
        t.copy_(torch.randint(-1000, 1000, t.shape).to(t.dtype))
    r = bench_tensors(engine, pool, worker.handler, n, repeats, torch.device("cpu"), engine_ids)
    first = next(iter(engine.values()))
    r["shape"] = f"vLLM {cfg['num_hidden_layers']}L {tuple(first.shape[1:])} {first.dtype}"
    r["torch_threads_in_engine"] = torch.get_num_threads()
    del llm
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default="benchmarks/results/offload.json")
    ap.add_argument("--engine-ids", choices=("scattered", "contiguous"), default="scattered",
                    help="layout of the engine blocks stored from / loaded into")
    ap.add_argument("--vllm", metavar="MODEL_DIR", default=None,
                    help="measure inside a real vLLM engine (vllm extra) serving this model, with our connector")
    args = ap.parse_args()
    rows = []
    if args.vllm:
        rows.append(bench_vllm(args.vllm, args.blocks, args.repeats, args.engine_ids))
    else:
        devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
        for device in devices:
            for name, layout in SHAPES.items():
                r = bench_one(layout, args.blocks, args.repeats, device, args.engine_ids)
                r["shape"] = name
                rows.append(r)
    hdr = f"{'device':6} {'shape':34} {'MiB':>7} {'store GB/s':>10} {'plain':>7} {'ratio':>6} {'load GB/s':>10} {'plain':>7} {'ratio':>6} exact"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['device']:6} {r['shape']:34} {r['bytes'] / 2**20:7.1f} {r['store_gbps']:10.2f} {r['plain_store_gbps']:7.2f} "
              f"{r['store_ratio']:6.2f} {r['load_gbps']:10.2f} {r['plain_load_gbps']:7.2f} {r['load_ratio']:6.2f} {r['round_trip_bit_exact']}")
    machine = {
        "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    print("machine:", machine)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "P6 offload copy speed", "machine": machine, "repeats": args.repeats,
                               "target": {"cpu_ratio": 0.8, "cuda_ratio": 0.9}, "results": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
