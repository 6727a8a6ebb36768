"""A prompt's multimodal items as the index keys its blocks: vLLM 0.32's extra keys.

vLLM keys every block a multimodal item (an image, an audio clip, a video) covers by the
item's *identifier* and its offset from the block's start
(``vllm.v1.core.kv_cache_utils._gen_mm_extra_hash_keys``): per block, the
``(identifier, offset - block_start)`` pairs of the items whose placeholder range
``[offset, offset + length)`` overlaps it, in prompt order, then (first block only) the
request's ``cache_salt``. Its ``BlockStored`` events carry the same keys, untagged
(``to_event_extra_keys``): after the LoRA name, those pairs and that salt. The index keys
a stored block by them (less the LoRA name: the namespace carries it), and a lookup of a
prompt with items chains the same digests (:func:`block_extras`), so it matches exactly
the blocks vLLM would reuse: the same tokens under the same images at the same places.

The identifier is the item's ``mm_hash`` (the engine's processor hash of the item and its
processor options, or the content part's ``uuid`` when no such option is set). An engine
started with ``--enable-tower-connector-lora`` prefixes it with the LoRA name for adapter
requests (:func:`tower_items`); the render endpoint answers it bare. An adapter's prompt
is therefore looked up under both forms, each engine matching under the one it keys by.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np

from ._core import extra_digest

__all__ = ["MediaItem", "block_extras", "media_items", "tower_items"]


class MediaItem(NamedTuple):
    """One multimodal item of a prompt: its identifier and where its placeholder tokens
    are (``offset``, ``length`` tokens), as vLLM's ``MultiModalFeatureSpec``."""

    identifier: str
    offset: int
    length: int


def media_items(items: Iterable[tuple[str, int, int]]) -> tuple[MediaItem, ...]:
    """``items`` checked and in prompt order (vLLM sorts them by offset). Raises
    ValueError for an empty identifier, a negative offset, a length under 1, or ranges
    that overlap."""
    out = sorted((MediaItem(str(i), int(o), int(n)) for i, o, n in items), key=lambda m: m.offset)
    end = 0
    for m in out:
        if not m.identifier:
            raise ValueError("a multimodal item's identifier must not be empty")
        if m.offset < 0 or m.length < 1:
            raise ValueError(f"placeholder range ({m.offset}, {m.length}) is not an offset >= 0 "
                             "and a length >= 1")
        if m.offset < end:
            raise ValueError("placeholder ranges must not overlap")
        end = m.offset + m.length
    return tuple(out)


def tower_items(items: Sequence[MediaItem], lora_name: str) -> tuple[MediaItem, ...]:
    """``items`` as an engine started with ``--enable-tower-connector-lora`` keys them
    for an adapter's request: each identifier prefixed with ``"<lora_name>:"``
    (vLLM 0.32 ``InputProcessor._get_mm_identifier``)."""
    return tuple(MediaItem(f"{lora_name}:{m.identifier}", m.offset, m.length) for m in items)


def block_extras(items: Sequence[MediaItem], block_size: int, n_blocks: int,
                 cache_salt: str | None = None) -> np.ndarray:
    """Per whole block of the prompt (``n_blocks`` of ``block_size`` tokens), the digest
    of its extra keys as the index keys a stored block (0: none): the items' pairs, then
    the salt on the first block. ``items``: (identifier, offset, length), checked
    (:func:`media_items`). Costs one digest per block an item covers."""
    keys: dict[int, list] = {}
    for ident, offset, length in sorted(items, key=lambda m: m[1]):
        first = offset // block_size
        last = min((offset + length - 1) // block_size, n_blocks - 1)
        for b in range(first, last + 1):
            keys.setdefault(b, []).append((ident, offset - b * block_size))
    if cache_salt and n_blocks:
        keys.setdefault(0, []).append(cache_salt)
    out = np.zeros(n_blocks, dtype=np.uint64)
    for b, k in keys.items():
        out[b] = extra_digest(tuple(k))
    return out
