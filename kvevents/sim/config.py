"""Typed settings of the paged-KV engine and its time model."""

from __future__ import annotations

from dataclasses import dataclass, field

from connector.kv_layout import KVCacheLayout


@dataclass(frozen=True)
class TimeModel:
    """Simulated step cost: what TTFT is computed from (seconds)."""

    step_overhead_s: float = 0.002
    prefill_s_per_token: float = 50e-6  # per uncached prompt token computed
    decode_s_per_step: float = 0.015  # a step with any decoding request
    load_s_per_token: float = 2e-6  # per token loaded from the CPU tier

    def __post_init__(self) -> None:
        if min(vars(self).values()) < 0:
            raise ValueError("time model costs must be >= 0")


@dataclass(frozen=True)
class EngineConfig:
    num_gpu_blocks: int = 2048
    layout: KVCacheLayout = field(default_factory=KVCacheLayout)
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    vocab_size: int = 32000
    device: str | None = None  # None: cuda when available, else cpu
    time_model: TimeModel = field(default_factory=TimeModel)
    verify_loads: bool = True  # check every CPU-tier load against recomputation
    data_parallel_rank: int | None = None
    # Wait for each step's copies before collecting them: events then come in the same
    # steps whatever the transfer handler's speed (to compare handlers and devices).
    sync_transfers: bool = False

    def __post_init__(self) -> None:
        for name in ("num_gpu_blocks", "max_num_batched_tokens", "max_num_seqs", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
