"""Dynamo's side of the side-by-side benchmarks: feeding its ``RadixTree`` binding.

Dynamo 1.6.1's Python ``RadixTree.apply_event(worker_id, bytes)`` takes one KV cache
event as JSON (``{"event_id", "data": {"stored": {"parent_hash", "blocks": [{"block_hash",
"tokens_hash"}]}}}`` or ``{"removed": {"block_hashes"}}``), and ``find_matches`` takes
Dynamo's per-block content hashes ("local" hashes, from ``compute_block_hash_for_seq``),
not token ids. So both directions include a conversion that a Python user of the binding
pays, counted on Dynamo's side:

* ingest from the same msgpack bytes: a typed msgspec decode (the fastest decoder we
  know: our ``BatchDecoder``), ``compute_block_hash_for_seq`` once per stored event
  (Dynamo's own token hashing, which its ZMQ listener also does), one msgspec JSON
  encode and one ``apply_event`` per event;
* lookup from token ids: ``compute_block_hash_for_seq`` + ``find_matches``.

Workers are numbered from the engine names (``engine-07`` -> worker 8).
"""

from __future__ import annotations

import msgspec

from kvevents.wire.schema import BatchDecoder, BlockStored

from kvtrace import BS

try:  # optional: the bench venv has it, the project's own venv does not
    from dynamo._core import RadixTree, compute_block_hash_for_seq
except ImportError:  # pragma: no cover - reported by available()
    RadixTree = None
    compute_block_hash_for_seq = None


def available() -> bool:
    return RadixTree is not None


def worker_id(engine: str) -> int:
    return int(engine.rsplit("-", 1)[1]) + 1


def engine_name(worker: int) -> str:
    return f"engine-{worker - 1:02d}"


class DynamoFeeder:
    """Converts msgpack payloads into ``apply_event`` calls on one ``RadixTree``."""

    def __init__(self) -> None:
        self.tree = RadixTree()
        self._dec = BatchDecoder()
        self._enc = msgspec.json.Encoder()
        self._eid = 0

    def convert(self, payload: bytes) -> list[bytes]:
        """The JSON events of one payload (conversion only)."""
        out = []
        for ev in self._dec.decode(payload).batch.events:
            self._eid += 1
            if type(ev) is BlockStored:
                local = compute_block_hash_for_seq(ev.token_ids, BS)
                data = {"stored": {"parent_hash": ev.parent_block_hash, "blocks": [
                    {"block_hash": h, "tokens_hash": t} for h, t in zip(ev.block_hashes, local)]}}
            else:
                data = {"removed": {"block_hashes": ev.block_hashes}}
            out.append(self._enc.encode({"event_id": self._eid, "data": data}))
        return out

    def apply(self, engine: str, payload: bytes) -> None:
        """Decode, convert and apply one payload."""
        w = worker_id(engine)
        apply = self.tree.apply_event
        for ev in self.convert(payload):
            apply(w, ev)

    def barrier(self) -> None:
        """Returns once every event applied so far is visible to lookups."""
        self.tree.find_matches([1])

    def lookup(self, tokens: list[int]) -> dict[str, int]:
        """Matched blocks per engine for a token-id prompt (hashing included)."""
        scores = self.tree.find_matches(compute_block_hash_for_seq(tokens, BS)).scores
        return {engine_name(w): n for (w, _rank), n in scores.items() if n}

    def lookup_raw(self, tokens: list[int]):
        """The timed form of :meth:`lookup`: hashing + find_matches, no conversion."""
        return self.tree.find_matches(compute_block_hash_for_seq(tokens, BS))
