"""Content keys: the index's own chained hash over each block's tokens.

A block's content key identifies "this block's tokens, after exactly this prefix, in
this namespace" without any parity with the engine's hash (see DESIGN.md: index keyed
by content). The same function serves ingest (an event's blocks, continuing from the
parent block's key) and lookup (a prompt's full blocks, from the namespace root).

The chain, on uint64 with wrapping arithmetic:

* row hash of block i: ``r_i = mix64(sum_j (t_ij + 1) * P^(j+1) ^ extra_i)``, where
  ``extra_i`` is a 64-bit digest of the block's extra keys (0 for none);
* chain state: ``S_i = S_{i-1} * M + r_i`` with ``S_0`` the namespace root (a digest
  of model, block size and LoRA name) or the parent block's key. Because ``M`` is odd
  it is invertible mod 2^64, so the whole run vectorises as a prefix sum:
  ``S_i = M^i * (S_0 + sum_{j<=i} r_j * M^-j)``.

The content key *is* ``S_i``: the row hashes are already finalised, so ``S_i`` is
well mixed, and keeping the state (rather than a finalised copy) is what lets a child
event continue the chain from its parent's key. Two prefixes collide with probability
~2^-64 per pair; namespaces differ in ``S_0`` so equal-length prefixes of different
namespaces never collide (``M^i`` is invertible).

Stateless apart from cached power tables and namespace digests; thread-safe for
concurrent readers (the caches are only ever extended with equal values).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

_M = 0x9E3779B97F4A7C15  # odd: invertible mod 2^64
_M_INV = pow(_M, -1, 1 << 64)
_P = 0xD6E8FEB86659FD93  # per-position multiplier for the row hash
_MASK64 = (1 << 64) - 1

_encoder = msgspec.msgpack.Encoder()


def digest64(*parts: Any) -> int:
    """A stable 64-bit digest of msgpack-encodable values (never Python's ``hash``,
    which is salted per process)."""
    data = _encoder.encode(parts)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix64_inplace(x: np.ndarray) -> np.ndarray:
    """:func:`mix64` overwriting ``x`` (a fresh temporary): no intermediate arrays."""
    x ^= x >> _S30
    x *= _M1
    x ^= x >> _S27
    x *= _M2
    x ^= x >> _S31
    return x


def _powers(base: int, n: int) -> np.ndarray:
    out = np.empty(n, dtype=np.uint64)
    v = 1
    for i in range(n):
        out[i] = v
        v = (v * base) & _MASK64
    return out


class ContentHasher:
    """Computes content keys for runs of blocks, vectorised with numpy."""

    def __init__(self) -> None:
        self._pow = _powers(_M, 4097)  # M^0 .. M^4096
        self._ipow = _powers(_M_INV, 4097)
        self._rowpow: dict[int, tuple[np.ndarray, np.uint64]] = {}
        self._roots: dict[tuple[str | None, int, str | None], int] = {}

    def root(self, model: str | None, block_size: int, lora_name: str | None) -> int:
        """``S_0`` of a namespace: model, block size and LoRA adapter keep blocks apart."""
        key = (model, block_size, lora_name)
        r = self._roots.get(key)
        if r is None:
            r = digest64("kvevents-root", model, block_size, lora_name)
            self._roots[key] = r
        return r

    def _ensure(self, n: int) -> None:
        if n + 1 > self._pow.shape[0]:
            size = max(n + 1, 2 * self._pow.shape[0])
            self._pow = _powers(_M, size)
            self._ipow = _powers(_M_INV, size)

    def row_hashes(self, tokens: np.ndarray, extra: np.ndarray | None = None) -> np.ndarray:
        """Finalised per-block hashes of a (n_blocks, block_size) token matrix."""
        bs = tokens.shape[1]
        got = self._rowpow.get(bs)
        if got is None:
            rp = _powers(_P, bs + 1)[1:]
            got = (rp, np.uint64(int(sum(rp.tolist())) & _MASK64))
            self._rowpow[bs] = got
        rp, const = got
        # sum_j (t_j + 1) * P^(j+1) = (tokens @ P-powers) + sum_j P^(j+1), all wrapping
        # mod 2^64 on uint64 (one matmul instead of add, multiply and sum passes). int64
        # tokens reinterpret as uint64 bit for bit, as astype would convert them.
        u = tokens.view(np.uint64) if tokens.dtype == np.int64 else tokens.astype(np.uint64)
        r = u @ rp
        r += const
        if extra is not None:
            r ^= extra
        return _mix64_inplace(r)

    def chain(self, start: int, rows: np.ndarray) -> np.ndarray:
        """Content keys of consecutive blocks with row hashes ``rows``, after ``start``."""
        n = rows.shape[0]
        self._ensure(n)
        acc = rows * self._ipow[1 : n + 1]
        np.cumsum(acc, out=acc)
        acc += np.uint64(start)
        acc *= self._pow[1 : n + 1]
        return acc

    def keys(
        self,
        start: int,
        token_ids: np.ndarray,
        block_size: int,
        extra: np.ndarray | None = None,
    ) -> np.ndarray:
        """Content keys of the full blocks in ``token_ids`` (a trailing partial block is
        ignored), chained from ``start``."""
        n = token_ids.shape[0] // block_size
        if n == 0:
            return np.empty(0, dtype=np.uint64)
        mat = token_ids[: n * block_size].reshape(n, block_size)
        return self.chain(start, self.row_hashes(mat, extra))


def extra_digests(extra_keys: Sequence[Any] | None, n_blocks: int) -> np.ndarray | None:
    """Per-block 64-bit digests of an event's ``extra_keys`` (None when all are None).

    Extra keys (LoRA name, multimodal ids, cache salt) make blocks with equal tokens
    different blocks. Digested through msgpack so list vs tuple does not matter.
    """
    if not extra_keys or all(e is None for e in extra_keys):
        return None
    out = np.zeros(n_blocks, dtype=np.uint64)
    for i, e in enumerate(extra_keys[:n_blocks]):
        if e is not None:
            out[i] = digest64("extra", e)
    return out


def hash64(h: int | bytes) -> int:
    """An engine block hash reduced to 64 bits for the translation tables.

    Ints are already the low 64 bits of the engine's digest; bytes digests are reduced
    to their last 8 bytes (a digest's bits are uniform, so any 8 will do).
    """
    if isinstance(h, bytes):
        return int.from_bytes(h[-8:].rjust(8, b"\0"), "little")
    return h & _MASK64
