"""Shape of the engine's paged KV cache, shared by the engine, connector and benchmarks.

Each layer is one tensor ``[num_blocks, block_size, 2, num_kv_heads, head_dim]``: the
block dimension first, so that a block is one contiguous row and moving a batch of
blocks is a single index operation along dim 0 (the same for the CPU pool).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def default_device() -> str:
    """Where an engine without a configured device keeps its KV cache: CUDA when present."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class KVCacheLayout:
    num_layers: int = 2
    block_size: int = 16
    num_kv_heads: int = 2
    head_dim: int = 16
    dtype: torch.dtype = torch.float16

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.block_size, 2, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block_layer(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.block_size * 2 * self.num_kv_heads * self.head_dim * elem

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one engine block over all layers."""
        return self.bytes_per_block_layer * self.num_layers

    def layer_names(self) -> list[str]:
        return [f"layer.{i}" for i in range(self.num_layers)]

    def allocate(
        self, num_blocks: int, device: torch.device | str | None = None, pin: bool = False
    ) -> dict[str, torch.Tensor]:
        """Zeroed per-layer tensors on ``device`` (None: :func:`default_device`);
        ``pin`` asks for page-locked host memory."""
        device = default_device() if device is None else device
        return {
            name: torch.zeros(self.layer_shape(num_blocks), dtype=self.dtype, device=device, pin_memory=pin)
            for name in self.layer_names()
        }


def block_major_views(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> dict[str, torch.Tensor]:
    """Per-layer tensors as views whose dim 0 is the block id (no copy).

    The layouts vLLM's attention backends register: block-major tensors are kept as
    they are (vLLM's CPU backend ``[num_blocks, kv_heads, block_size, 2 * head_dim]``,
    FlashInfer's ``(num_blocks, 2, ...)``); FlashAttention's ``(2, num_blocks, ...)``
    is split into its K and V views (``NAME.k``, ``NAME.v``). Any other shape is a
    ``ValueError`` naming the layer.
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in kv_caches.items():
        if t.shape[0] == num_blocks:
            out[name] = t
        elif t.dim() >= 2 and t.shape[0] == 2 and t.shape[1] == num_blocks:
            out[f"{name}.k"], out[f"{name}.v"] = t[0], t[1]
        else:
            raise ValueError(f"KV cache {name} has shape {tuple(t.shape)}; no block dimension of size {num_blocks}")
    return out
