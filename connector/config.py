"""Typed configuration of the offloading connector, validated once on construction."""

from __future__ import annotations

from dataclasses import dataclass

from connector.offload.manager import POLICIES


@dataclass(frozen=True)
class OffloadConfig:
    """Settings of :class:`connector.CPUOffloadCore`.

    Exactly one of ``cpu_capacity_bytes`` / ``cpu_capacity_blocks`` (offloaded blocks)
    sizes the CPU pool. ``offloaded_block_size`` (tokens; None = the engine's block size)
    must be a multiple of the engine block size, which is checked when the connector is
    built for an engine (:meth:`blocks_per_chunk`). With ``self_describing_events`` off
    the CPU-tier events are vLLM's old style (no tokens, no parent, block_size 0).
    """

    cpu_capacity_bytes: int | None = None
    cpu_capacity_blocks: int | None = None
    offloaded_block_size: int | None = None
    eviction_policy: str = "lru"
    self_describing_events: bool = True

    def __post_init__(self) -> None:
        if (self.cpu_capacity_bytes is None) == (self.cpu_capacity_blocks is None):
            raise ValueError("set exactly one of cpu_capacity_bytes and cpu_capacity_blocks")
        for name in ("cpu_capacity_bytes", "cpu_capacity_blocks", "offloaded_block_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.eviction_policy not in POLICIES:
            raise ValueError(
                f"eviction_policy must be one of {sorted(POLICIES)}, got {self.eviction_policy!r}"
            )

    def blocks_per_chunk(self, engine_block_size: int) -> int:
        """k: engine blocks per offloaded block; raises if not a whole multiple."""
        size = self.offloaded_block_size or engine_block_size
        if size % engine_block_size:
            raise ValueError(
                f"offloaded_block_size {size} is not a multiple of the engine block size {engine_block_size}"
            )
        return size // engine_block_size

    def num_slots(self, bytes_per_offloaded_block: int) -> int:
        """CPU pool size in offloaded blocks; raises if it holds none."""
        if self.cpu_capacity_blocks is not None:
            return self.cpu_capacity_blocks
        assert self.cpu_capacity_bytes is not None
        n = self.cpu_capacity_bytes // bytes_per_offloaded_block
        if n < 1:
            raise ValueError(
                f"cpu_capacity_bytes {self.cpu_capacity_bytes} holds no offloaded block of {bytes_per_offloaded_block} bytes"
            )
        return n
