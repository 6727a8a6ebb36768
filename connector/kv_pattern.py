"""Deterministic KV contents: a model-free engine's forward pass, and its check.

A host without a model (the simulated engine in :mod:`kvevents.sim`, which imports no
torch) writes this pattern where a forward pass would write KV, then verifies that what
the CPU tier loaded back is bit-exact. It lives here, with the tensors, so that the
simulator only hands numpy index arrays and the opaque KV tensors across.

The KV of a token depends only on (token id, position, layer), so any block can be
recomputed and compared bit-exactly with what the CPU tier loaded back. Values are
``(r + offset) mod 2039 - 1019`` over 64, exact in fp16, bf16 and fp32; with
``r = (131*token + 31*position + 17*layer) mod 2039`` they come from one table lookup
(``index_select``) per layer, so writing n tokens costs one gather and one scatter.
"""

from __future__ import annotations

import numpy as np
import torch

from connector.kv_layout import KVCacheLayout

_MOD = 2039


class KVPattern:
    """The pattern for one layout on one device (a small value table there).

    Raises nothing beyond torch's own errors; both methods are whole-batch tensor ops.
    """

    def __init__(self, layout: KVCacheLayout, device: torch.device | str) -> None:
        device = torch.device(device)
        self.layout = layout
        self.device = device
        width = 2 * layout.num_kv_heads * layout.head_dim
        # Spread offsets so that K/V, heads and dims all differ.
        offsets = torch.arange(width, dtype=torch.int64) * 7
        table = (torch.arange(_MOD, dtype=torch.int64)[:, None] + offsets[None, :]) % _MOD - 1019
        self._table = (table.to(torch.float32) / 64).to(layout.dtype).to(device)
        self.width = width

    def _rows(self, tokens: np.ndarray, positions: np.ndarray, layer: int) -> torch.Tensor:
        r = (tokens * 131 + positions * 31 + layer * 17) % _MOD
        return self._table.index_select(0, torch.from_numpy(r).to(self.device))

    def write(self, kv: dict[str, torch.Tensor], tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> None:
        """Write the KV of ``tokens`` at ``positions`` into flat ``slots`` of every layer."""
        if tokens.size == 0:
            return
        slot_idx = torch.from_numpy(slots).to(self.device)
        for layer, t in enumerate(kv.values()):
            t.view(-1, self.width).index_copy_(0, slot_idx, self._rows(tokens, positions, layer))

    def count_mismatched_blocks(
        self, kv: dict[str, torch.Tensor], tokens: np.ndarray, first_position: int, block_ids: np.ndarray
    ) -> int:
        """Blocks (of ``len(tokens) / block_size`` full blocks) whose KV differs from recomputation."""
        bs = self.layout.block_size
        n_blocks = block_ids.size
        positions = np.arange(first_position, first_position + n_blocks * bs, dtype=np.int64)
        idx = torch.from_numpy(block_ids).to(self.device)
        bad = torch.zeros(n_blocks, dtype=torch.bool, device=self.device)
        for layer, t in enumerate(kv.values()):
            expect = self._rows(tokens, positions, layer).view(n_blocks, -1)
            got = t.index_select(0, idx).reshape(n_blocks, -1)
            bad |= (got.view(torch.int16 if got.element_size() == 2 else torch.int32)
                    != expect.view(torch.int16 if got.element_size() == 2 else torch.int32)).any(dim=1)
        return int(bad.sum())
