"""The KV cache event wire schema, byte-compatible with vLLM's KV events.

This module is the only definition of the wire format in the project (see
``shared/docs/WIRE.md``); it does no I/O. Everything else encodes and decodes through
:func:`encode_batch` and :class:`BatchDecoder`.

Two event encodings exist in the field:

* **map** (vLLM >= 0.26, the default here): each event is a msgpack map with its tag
  under ``"type"``; default-valued optional fields are omitted.
* **array** (vLLM <= 0.25, "legacy"): each event is a msgpack array ``[tag, *fields]``
  with trailing default fields omitted; the oldest releases stop before ``medium``.

The batch itself is always an array ``[ts, events, data_parallel_rank?]``.

SGLang (0.5.x) sends the map encoding with every field left at None omitted (so every
field after ``block_size`` is optional here), signed int64 hashes, and for bigram-keyed
caches ``token_ids`` as ``[a, b]`` pairs: those events decode (through the per-event
fallback, keeping the typed fast path for everything else) and
:func:`tokens_are_pairs` tells them apart.

Consumers only ever see the canonical structs (:class:`BlockStored`,
:class:`BlockRemoved`, :class:`AllBlocksCleared`): legacy payloads are converted on
decode. Unknown extra fields are ignored (engines keep appending fields); an unknown
event type is skipped and counted, without losing the rest of its batch.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

# An engine block hash: the low 64 bits of the digest (int) or the raw digest (bytes).
BlockHash = Union[int, bytes]

# msgspec raises DecodeError/ValidationError for bad structure, but a corrupted string
# surfaces as UnicodeDecodeError (a ValueError): the fuzz tests found it.
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, ValueError)

#: Tier names as vLLM's ``medium`` field carries them. ``None`` on the wire means GPU.
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"


class KVCacheEvent(
    msgspec.Struct, tag=True, tag_field="type", omit_defaults=True, gc=False
):
    """Base of the map-encoded events (tag under ``"type"``)."""


class BlockStored(KVCacheEvent, tag="BlockStored"):
    """Consecutive blocks became cached in ``medium``.

    ``token_ids`` holds the tokens of all blocks (``block_size`` each for GPU events);
    block i's parent is block i-1, the first block's parent is ``parent_block_hash``
    (None = start of sequence). ``extra_keys`` has one entry per block.
    """

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    # Optional on decode: SGLang omits them when None. Encoding still writes them
    # (see _WireBlockStored): vLLM's decoders require them.
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: Any = None
    ownership: Any = None
    session_id: str | None = None
    # SGLang: the salt of the request that stored the blocks (on every event of a salted
    # sequence). vLLM sends its salt inside the first block's extra key instead.
    cache_salt: str | None = None


class BlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    """Blocks were evicted from ``medium`` (None = GPU)."""

    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: Any = None
    ownership: Any = None


class AllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    """The engine reset its prefix cache: everything this publisher announced is gone."""


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published message: ``[ts, events, data_parallel_rank?]`` (SGLang calls the
    third element ``attn_dp_rank``)."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


def _variant(cls: type, name: str, *, types: dict[str, Any] | None = None,
             required: tuple[str, ...] = (), upto: str | None = None) -> type:
    """A struct with ``cls``'s fields, tag and encoding, some field types replaced
    (``types``), some defaulted fields made required (``required``), or the fields
    after ``upto`` left out: the variants below are derived, so the wire schema is
    written once, in the classes above."""
    types = types or {}
    fields: list[tuple[Any, ...]] = []
    names = [f.name for f in msgspec.structs.fields(cls)]
    for f in msgspec.structs.fields(cls)[:names.index(upto) + 1 if upto else None]:
        typ = types.get(f.name, f.type)
        fields.append((f.name, typ) if f.required or f.name in required
                      else (f.name, typ, f.default))
    cfg = cls.__struct_config__
    return msgspec.defstruct(
        name, fields, tag=cfg.tag, tag_field=cfg.tag_field, array_like=cfg.array_like,
        omit_defaults=cfg.omit_defaults, gc=False, module=__name__,
    )


# ---------------------------------------------------------------------------
# Encode side of the map encoding: the shape vLLM writes, where lora_id, medium and
# lora_name are required and so always present (even when None). Separate classes
# because msgspec has one omit_defaults rule per class for both directions.


_WireBlockStored = _variant(BlockStored, "_WireBlockStored",
                            required=("lora_id", "medium", "lora_name"))
# vLLM's fields only (SGLang's cache_salt left out): vLLM writes a fixmap of at most 15
# entries, and a struct of 16 fields or more makes msgspec write a map16 header instead,
# the same map in other bytes. Used for every event without a salt.
_VllmBlockStored = _variant(BlockStored, "_VllmBlockStored",
                            required=("lora_id", "medium", "lora_name"), upto="session_id")
_VLLM_FIELDS = len(msgspec.structs.fields(_VllmBlockStored))
_WireBlockRemoved = _variant(BlockRemoved, "_WireBlockRemoved", required=("medium",))


_TO_WIRE: dict[type, type] = {BlockStored: _WireBlockStored, BlockRemoved: _WireBlockRemoved}


# SGLang's bigram-keyed pages (EAGLE): ``token_ids`` are ``[a, b]`` pairs. Only the
# per-event fallback tries it, so normal batches keep the typed fast path.
_PairsBlockStored = _variant(BlockStored, "_PairsBlockStored",
                             types={"token_ids": list[tuple[int, int]]})


def tokens_are_pairs(event: BlockStored) -> bool:
    """True for a bigram page: its ``token_ids`` are pairs, not token ids, so it
    cannot be matched against prompts (the index counts it as unsupported)."""
    return bool(event.token_ids) and not isinstance(event.token_ids[0], int)


# ---------------------------------------------------------------------------
# Legacy array encoding (vLLM <= 0.25). Same field order; fields that the oldest
# releases lack get defaults so the short shapes decode too.


class _ArrayEvent(msgspec.Struct, array_like=True, tag=True, omit_defaults=True, gc=False):
    pass


class _ArrayBlockStored(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: Any = None
    ownership: Any = None
    session_id: str | None = None


class _ArrayBlockRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: Any = None
    ownership: Any = None


class _ArrayAllBlocksCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


_ArrayEventT = Union[_ArrayBlockStored, _ArrayBlockRemoved, _ArrayAllBlocksCleared]


class _ArrayBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[_ArrayEventT]
    data_parallel_rank: int | None = None


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    """A batch whose events are left undecoded, for the per-event fallback path."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _BatchTs(msgspec.Struct, array_like=True, gc=False):
    """Only the timestamp of a batch; the rest of the array is skipped unparsed."""

    ts: float


_TS_DECODER = msgspec.msgpack.Decoder(_BatchTs)


def peek_batch_ts(payload: bytes) -> float | None:
    """The ``ts`` of an encoded batch without decoding its events; None if invalid."""
    try:
        return _TS_DECODER.decode(payload).ts
    except _DECODE_ERRORS:
        return None


# ---------------------------------------------------------------------------
# Ingest variants: the same events with ``token_ids`` left as raw msgpack, for the
# aggregator's index, whose compiled core reads the token array straight from those
# bytes (no Python int per token). Derived from the structs above, so the wire schema
# is still written once; only BatchDecoder(raw_tokens=True) produces them.


#: ``BlockStored`` whose ``token_ids`` is the raw msgpack array (``msgspec.Raw``).
RawTokensBlockStored = _variant(BlockStored, "RawTokensBlockStored",
                                types={"token_ids": msgspec.Raw})
_ArrayRawTokensBlockStored = _variant(_ArrayBlockStored, "_ArrayRawTokensBlockStored",
                                      types={"token_ids": msgspec.Raw})
_RawEvent = Union[RawTokensBlockStored, BlockRemoved, AllBlocksCleared]  # type: ignore[valid-type]
_ArrayRawEvent = Union[_ArrayRawTokensBlockStored, _ArrayBlockRemoved, _ArrayAllBlocksCleared]  # type: ignore[valid-type]
_RawBatchMap = msgspec.defstruct(
    "_RawBatchMap", [("ts", float), ("events", list[_RawEvent]),
                     ("data_parallel_rank", Union[int, None], None)],
    array_like=True, omit_defaults=True, gc=False, module=__name__)
_RawBatchArray = msgspec.defstruct(
    "_RawBatchArray", [("ts", float), ("events", list[_ArrayRawEvent]),
                       ("data_parallel_rank", Union[int, None], None)],
    array_like=True, omit_defaults=True, gc=False, module=__name__)


_CANONICAL = {
    _ArrayBlockStored: BlockStored,
    _ArrayBlockRemoved: BlockRemoved,
    _ArrayAllBlocksCleared: AllBlocksCleared,
    _ArrayRawTokensBlockStored: RawTokensBlockStored,
}
_TO_ARRAY = {v: k for k, v in _CANONICAL.items() if v is not RawTokensBlockStored}


def _from_array(ev: _ArrayEventT) -> Event:
    cls = _CANONICAL[type(ev)]
    return cls(*(getattr(ev, f) for f in ev.__struct_fields__))


class PayloadError(ValueError):
    """A payload that is not a KV event batch in either encoding."""


class DecodeResult(msgspec.Struct, gc=False):
    """A decoded batch plus how many of its events had to be skipped."""

    batch: KVEventBatch
    skipped_events: int = 0


class BatchDecoder:
    """Decodes msgpack payloads of either encoding into :class:`KVEventBatch`.

    Typed decoders are built once per instance. The fast path decodes the whole batch
    with one typed call (map encoding first, then array). If both fail, each event is
    decoded on its own so that one unknown or malformed event only costs itself; the
    result says how many were skipped. A payload that is not a batch at all raises
    :class:`PayloadError`. Not thread-safe only in the sense that msgspec decoders are
    not shared across threads by design; use one per thread.
    """

    def __init__(self, raw_tokens: bool = False) -> None:
        """``raw_tokens``: stored events come as :data:`RawTokensBlockStored` (token ids
        left as raw msgpack, for the index's compiled core); otherwise as
        :class:`BlockStored`."""
        self.raw_tokens = raw_tokens
        self._map = msgspec.msgpack.Decoder(_RawBatchMap if raw_tokens else KVEventBatch)
        self._array = msgspec.msgpack.Decoder(_RawBatchArray if raw_tokens else _ArrayBatch)
        self._raw = msgspec.msgpack.Decoder(_RawBatch)
        self._map_event = msgspec.msgpack.Decoder(_RawEvent if raw_tokens else Event)
        self._array_event = msgspec.msgpack.Decoder(_ArrayRawEvent if raw_tokens else _ArrayEventT)
        self._pairs_event = msgspec.msgpack.Decoder(_PairsBlockStored)

    def decode(self, payload: bytes) -> DecodeResult:
        try:
            b = self._map.decode(payload)
            if type(b) is not KVEventBatch:
                b = KVEventBatch(b.ts, b.events, b.data_parallel_rank)
            return DecodeResult(b)
        except _DECODE_ERRORS:
            pass
        try:
            b = self._array.decode(payload)
            return DecodeResult(
                KVEventBatch(b.ts, [_from_array(e) for e in b.events], b.data_parallel_rank)
            )
        except _DECODE_ERRORS:
            pass
        try:
            raw = self._raw.decode(payload)
        except _DECODE_ERRORS as exc:
            raise PayloadError(f"not a KV event batch: {exc}") from None
        events: list[Event] = []
        skipped = 0
        for item in raw.events:
            ev = self._decode_event(item)
            if ev is None:
                skipped += 1
            else:
                events.append(ev)
        return DecodeResult(KVEventBatch(raw.ts, events, raw.data_parallel_rank), skipped)

    def _decode_event(self, item: msgspec.Raw) -> Event | None:
        try:
            return self._map_event.decode(item)
        except _DECODE_ERRORS:
            pass
        try:
            return _from_array(self._array_event.decode(item))
        except _DECODE_ERRORS:
            pass
        try:
            # Same fields, so the canonical struct holds it; token_ids stay pairs.
            pairs = self._pairs_event.decode(item)
        except _DECODE_ERRORS:
            return None
        return BlockStored(*(list(v) if f == "token_ids" else v for f, v in zip(
            pairs.__struct_fields__, msgspec.structs.astuple(pairs))))


class BatchEncoder:
    """Encodes batches in the current vLLM map encoding, or the legacy array encoding.

    Arrays (the batch, and legacy events) omit their trailing default-valued fields, as
    the engines' encoders do; msgspec's ``array_like`` always writes every field, so the
    trimming is done here, generically from each struct's declared defaults. One
    msgspec encoder is built per instance and reused.
    """

    def __init__(self, legacy: bool = False) -> None:
        self.legacy = legacy
        self._enc = msgspec.msgpack.Encoder()

    def encode(self, batch: KVEventBatch) -> bytes:
        events: list[Any] = batch.events
        if self.legacy:
            events = [_array_fields(e) for e in events]
        else:
            events = [_to_wire(e) for e in events]
        if batch.data_parallel_rank is None:
            return self._enc.encode((batch.ts, events))
        return self._enc.encode((batch.ts, events, batch.data_parallel_rank))


def _to_wire(ev: Event) -> Any:
    wire = _TO_WIRE.get(type(ev))
    if wire is _WireBlockStored and ev.cache_salt is None:
        return _VllmBlockStored(*msgspec.structs.astuple(ev)[:_VLLM_FIELDS])
    return ev if wire is None else wire(*msgspec.structs.astuple(ev))


def _array_fields(ev: Event) -> list[Any]:
    """``[tag, *fields]`` of a legacy array event, trailing defaults omitted."""
    arr = _TO_ARRAY[type(ev)]
    values = [getattr(ev, f) for f in arr.__struct_fields__]
    n_required = len(arr.__struct_fields__) - len(arr.__struct_defaults__)
    end = len(values)
    while end > n_required and values[end - 1] == arr.__struct_defaults__[end - 1 - n_required]:
        end -= 1
    return [arr.__struct_config__.tag, *values[:end]]


def medium_of(event: BlockStored | BlockRemoved) -> str:
    """The event's medium with the wire's ``None`` read as GPU."""
    return event.medium or MEDIUM_GPU


def hash_to_str(h: BlockHash) -> str:
    """A block hash as users see it: decimal for ints, hex for digests."""
    return h.hex() if isinstance(h, bytes) else str(h)
