"""Property-based fuzzing of the decoder and of the subscriber's handling of bad input."""

from __future__ import annotations

import time

import msgspec
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support import free_port, wait_until
from kvevents.wire.schema import BatchDecoder, BatchEncoder, BlockRemoved, BlockStored, KVEventBatch, PayloadError
from kvevents.ingest.subscriber import BatchReceived, SourceConfig, Subscriber
from kvevents.wire.framing import pack_seq

DECODER = BatchDecoder()

hashes = st.one_of(st.integers(0, 2**64 - 1), st.binary(min_size=1, max_size=32))
events = st.one_of(
    st.builds(
        lambda hs, toks, medium, lora: BlockStored(hs, None, toks, 4, None, medium, lora),
        st.lists(hashes, min_size=1, max_size=4),
        st.lists(st.integers(0, 2**31), max_size=16),
        st.sampled_from([None, "GPU", "CPU"]),
        st.one_of(st.none(), st.text(max_size=5)),
    ),
    st.builds(lambda hs, m: BlockRemoved(hs, m), st.lists(hashes, min_size=1, max_size=4),
              st.sampled_from([None, "GPU", "CPU"])),
)
batches = st.builds(lambda ts, evs: KVEventBatch(ts, evs), st.floats(0, 2e9), st.lists(events, max_size=4))
# Arbitrary msgpack-able values, for structurally wrong payloads.
junk = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False),
              st.text(max_size=8), st.binary(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=5), inner, max_size=5)),
    max_leaves=20,
)


def decode_or_reject(payload: bytes) -> None:
    """The decoder's whole contract: a batch, or PayloadError; nothing else escapes."""
    try:
        result = DECODER.decode(payload)
    except PayloadError:
        return
    assert isinstance(result.batch, KVEventBatch)
    assert result.skipped_events >= 0


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_escape(payload):
    decode_or_reject(payload)


@settings(max_examples=300, deadline=None)
@given(junk)
def test_wrong_structures_never_escape(value):
    decode_or_reject(msgspec.msgpack.encode(value))


@settings(max_examples=200, deadline=None)
@given(batches, st.booleans(), st.data())
def test_truncated_and_corrupted_payloads_never_escape(batch, legacy, data):
    payload = BatchEncoder(legacy=legacy).encode(batch)
    assert DECODER.decode(payload).batch == batch
    cut = data.draw(st.integers(0, max(len(payload) - 1, 0)))
    decode_or_reject(payload[:cut])
    if payload:
        pos = data.draw(st.integers(0, len(payload) - 1))
        flipped = payload[:pos] + bytes([payload[pos] ^ 0xFF]) + payload[pos + 1:]
        decode_or_reject(flipped)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=64), min_size=1, max_size=30))
def test_subscriber_counts_every_bad_payload_and_keeps_going(bad_payloads):
    port = free_port()
    raw = zmq.Context.instance().socket(zmq.PUB)
    raw.bind(f"tcp://127.0.0.1:{port}")
    got: list = []
    sub = Subscriber(got.append)
    sub.add_source(SourceConfig("p", f"tcp://127.0.0.1:{port}"))
    sub.start()
    try:
        time.sleep(0.3)  # slow joiner
        good = BatchEncoder().encode(KVEventBatch(1.0, []))
        n_bad = 0
        for i, payload in enumerate(bad_payloads):
            try:
                DECODER.decode(payload)
            except PayloadError:
                n_bad += 1
            raw.send_multipart([b"", pack_seq(i), payload])
        raw.send_multipart([b"", pack_seq(len(bad_payloads)), good])
        assert wait_until(lambda: sub.stats()["p"].last_seq == len(bad_payloads), 5)
        stats = sub.stats()["p"]
        assert stats.decode_errors == n_bad
        assert stats.batches == len(bad_payloads) + 1 - n_bad
        assert isinstance([g for g in got if isinstance(g, BatchReceived)][-1], BatchReceived)
    finally:
        sub.stop()
        raw.close(0)
