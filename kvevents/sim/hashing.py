"""The engine's block hash chain (vLLM style, with blake2b).

``hash_i = low64(blake2b(parent_i || tokens_i || extra_keys_i))`` where the first block's
parent is ``NONE_HASH``. Deterministic across processes (no PYTHONHASHSEED coupling).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

NONE_HASH = 0
_MASK = (1 << 64) - 1


def block_hash(parent: int | None, tokens: Sequence[int] | np.ndarray, extra_keys: Any = None) -> int:
    h = hashlib.blake2b(digest_size=16)
    h.update((NONE_HASH if parent is None else parent).to_bytes(8, "little"))
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    if extra_keys is not None:
        h.update(repr(extra_keys).encode())
    return int.from_bytes(h.digest(), "big") & _MASK


def extend_hashes(hashes: list[int], tokens: Sequence[int], block_size: int, extra_keys: Any = None) -> None:
    """Append the hashes of every newly full block of ``tokens`` to ``hashes``."""
    arr = None
    for i in range(len(hashes), len(tokens) // block_size):
        if arr is None:
            arr = np.asarray(tokens, dtype=np.int64)
        parent = hashes[i - 1] if i > 0 else None
        hashes.append(block_hash(parent, arr[i * block_size : (i + 1) * block_size], extra_keys))
