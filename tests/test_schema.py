"""Golden-bytes tests of the wire schema against payloads built by hand from WIRE.md.

The payloads here are written with a tiny msgpack writer of the test's own (minimal
int widths, float64, str/bin/array/map headers), independent of msgspec, in the field
order WIRE.md gives. Decoding them must give the expected structs, and our encoder must
produce exactly the same bytes.
"""

from __future__ import annotations

import struct

import msgspec
import pytest

from kvevents.wire.schema import (
    AllBlocksCleared,
    BatchDecoder,
    BatchEncoder,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    PayloadError,
    hash_to_str,
    medium_of,
)

# -- a minimal msgpack writer (the spec's smallest encodings, as msgspec/vLLM write) --


class Map(list):
    """Ordered key/value pairs, so key order is explicit in the golden payload."""


def mp(x) -> bytes:  # noqa: C901 - a flat switch over msgpack types reads best
    if x is None:
        return b"\xc0"
    if x is True:
        return b"\xc3"
    if x is False:
        return b"\xc2"
    if isinstance(x, int):
        if 0 <= x < 0x80:
            return bytes([x])
        if x < 0:
            assert x >= -32
            return struct.pack("b", x)
        for code, fmt, lim in ((0xCC, ">B", 1 << 8), (0xCD, ">H", 1 << 16), (0xCE, ">I", 1 << 32), (0xCF, ">Q", 1 << 64)):
            if x < lim:
                return bytes([code]) + struct.pack(fmt, x)
    if isinstance(x, float):
        return b"\xcb" + struct.pack(">d", x)
    if isinstance(x, str):
        b = x.encode()
        assert len(b) < 32
        return bytes([0xA0 | len(b)]) + b
    if isinstance(x, bytes):
        return b"\xc4" + bytes([len(x)]) + x
    if isinstance(x, Map):
        assert len(x) < 16
        return bytes([0x80 | len(x)]) + b"".join(mp(k) + mp(v) for k, v in x)
    if isinstance(x, list):
        assert len(x) < 16
        return bytes([0x90 | len(x)]) + b"".join(mp(i) for i in x)
    raise TypeError(type(x))


BIG = 11290800355336220572  # a real vLLM uint64 block hash (needs uint64 encoding)
DIGEST = bytes(range(32))  # a raw sha256-sized digest


def stored_map(**over) -> Map:
    fields = Map([
        ("type", "BlockStored"),
        ("block_hashes", [BIG, 7]),
        ("parent_block_hash", None),
        ("token_ids", [1, 2, 3, 4]),
        ("block_size", 2),
        ("lora_id", None),
        ("medium", "GPU"),
        ("lora_name", None),
        ("extra_keys", [None, None]),
        ("group_idx", 0),
        ("kv_cache_spec_kind", "full_attention"),
    ])
    return fields


EXPECTED_STORED = BlockStored(
    block_hashes=[BIG, 7], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2,
    lora_id=None, medium="GPU", lora_name=None, extra_keys=[None, None], group_idx=0,
    kv_cache_spec_kind="full_attention",
)


def test_map_encoding_golden_bytes_both_ways():
    payload = mp([1.5, [stored_map(), Map([("type", "BlockRemoved"), ("block_hashes", [DIGEST]), ("medium", "CPU")]), Map([("type", "AllBlocksCleared")])]])
    expected = KVEventBatch(1.5, [EXPECTED_STORED, BlockRemoved([DIGEST], "CPU"), AllBlocksCleared()])
    assert BatchDecoder().decode(payload).batch == expected
    assert BatchEncoder().encode(expected) == payload


def test_batch_rank_is_third_element_only_when_set():
    payload = mp([2.0, [Map([("type", "AllBlocksCleared")])], 3])
    batch = KVEventBatch(2.0, [AllBlocksCleared()], data_parallel_rank=3)
    assert BatchEncoder().encode(batch) == payload
    assert BatchDecoder().decode(payload).batch == batch


def test_literal_bytes_of_smallest_batch():
    # [0.0, [{"type": "AllBlocksCleared"}]] spelled out byte by byte.
    literal = bytes.fromhex("92" "cb0000000000000000" "91" "81" "a474797065" "b0") + b"AllBlocksCleared"
    batch = KVEventBatch(0.0, [AllBlocksCleared()])
    assert BatchEncoder().encode(batch) == literal
    assert BatchDecoder().decode(literal).batch == batch


def test_array_encoding_golden_bytes_both_ways():
    legacy = [
        "BlockStored", [BIG, 7], None, [1, 2, 3, 4], 2, None, "GPU", None, [None, None], 0,
        "full_attention",
    ]
    payload = mp([1.5, [legacy, ["BlockRemoved", [DIGEST], "CPU"], ["AllBlocksCleared"]]])
    expected = KVEventBatch(1.5, [EXPECTED_STORED, BlockRemoved([DIGEST], "CPU"), AllBlocksCleared()])
    assert BatchDecoder().decode(payload).batch == expected
    assert BatchEncoder(legacy=True).encode(expected) == payload


@pytest.mark.parametrize(
    "event, expected",
    [
        # Oldest releases: BlockStored stops after lora_id, BlockRemoved has no medium.
        (["BlockStored", [5], 4, [9, 9], 2, None], BlockStored([5], 4, [9, 9], 2, None, None, None)),
        (["BlockStored", [5], None, [9, 9], 2, 3, "CPU"], BlockStored([5], None, [9, 9], 2, 3, "CPU", None)),
        (["BlockRemoved", [5]], BlockRemoved([5], None)),
        (["BlockRemoved", [DIGEST], "GPU"], BlockRemoved([DIGEST], "GPU")),
    ],
)
def test_short_legacy_shapes(event, expected):
    got = BatchDecoder().decode(mp([0.5, [event]])).batch.events
    assert got == [expected]
    assert medium_of(got[0]) == (expected.medium or "GPU")


def test_unknown_future_fields_are_ignored_in_both_encodings():
    future = stored_map()
    future.append(("brand_new_field", [1, 2]))
    legacy = ["BlockRemoved", [5], "GPU", None, None, None, "future", 17]
    dec = BatchDecoder()
    assert dec.decode(mp([1.5, [future]])).batch.events == [EXPECTED_STORED]
    assert dec.decode(mp([1.5, [legacy]])).batch.events == [BlockRemoved([5], "GPU")]
    # An unknown element after data_parallel_rank in the batch is ignored too.
    assert dec.decode(mp([1.5, [], 0, "x"])).batch == KVEventBatch(1.5, [], 0)


def test_unknown_event_type_skips_only_that_event():
    payload = mp([1.0, [Map([("type", "BlockUpdated"), ("x", 1)]), Map([("type", "AllBlocksCleared")])]])
    result = BatchDecoder().decode(payload)
    assert result.batch.events == [AllBlocksCleared()]
    assert result.skipped_events == 1


@pytest.mark.parametrize("payload", [b"", b"\xc1", mp([1.0]), mp("x"), mp([None, []]), mp(Map([("a", 1)]))])
def test_not_a_batch_raises_payload_error(payload):
    with pytest.raises(PayloadError):
        BatchDecoder().decode(payload)


def test_round_trip_every_shape_both_encodings():
    events = [
        EXPECTED_STORED,
        BlockStored([DIGEST], DIGEST, [1] * 16, 16, None, "CPU", "adapter", extra_keys=[["salt"]],
                    session_id="s1"),
        BlockStored([1, 2, 3], 9, [], 0, None, "CPU", None),  # old-style offload event
        BlockRemoved([1, DIGEST], None, group_idx=1),
        AllBlocksCleared(),
    ]
    for legacy in (False, True):
        batch = KVEventBatch(3.25, events, data_parallel_rank=1)
        decoded = BatchDecoder().decode(BatchEncoder(legacy=legacy).encode(batch)).batch
        # extra_keys tuples come back as lists: msgpack has no tuple type.
        assert msgspec.to_builtins(decoded) == msgspec.to_builtins(batch)


def test_hash_to_str():
    assert hash_to_str(BIG) == str(BIG)
    assert hash_to_str(b"\x01\xff") == "01ff"
