"""The aggregator's payload decoder: common batches stay bytes, the rest decode.

Most batches an engine publishes have one shape (map-encoded events, int hashes, int
token ids, no LoRA or extra keys): for those, ``_core.scan`` checks the bytes and
returns a :class:`WireBatch` that the core applies in place, with no Python object per
event. Every other payload is decoded by :class:`~kvevents.wire.schema.BatchDecoder` (token
ids left raw), which defines what a payload means: the scan only accepts bytes that
decode there to the same events (``tests/index/test_wire.py``).
"""

from __future__ import annotations

from ..wire.schema import BatchDecoder, DecodeResult
from ._core import WireBatch, scan

__all__ = ["IngestDecoder", "WireBatch"]


class IngestDecoder:
    """``decode(payload) -> DecodeResult``, like :class:`BatchDecoder` (same errors),
    whose ``batch`` is a :class:`WireBatch` when the payload is of the common shape.
    Only for feeding :class:`~kvevents.index.PrefixIndex` (other consumers want real
    events). One per thread, like :class:`BatchDecoder`."""

    def __init__(self) -> None:
        self._general = BatchDecoder(raw_tokens=True)

    def decode(self, payload: bytes) -> DecodeResult:
        batch = scan(payload)
        if batch is not None:
            return DecodeResult(batch)  # type: ignore[arg-type]  # reads like a batch
        return self._general.decode(payload)
