"""The compiled wire reader (``kvevents/index/_wire.pxi``) against the general path.

``IngestDecoder`` hands the index a ``WireBatch`` (bytes, applied in place) for batches
of the common shape, and decodes everything else with ``BatchDecoder``. What must hold:

* the shapes real engines send (vLLM's own structs, SGLang's, ours) take the wire path;
* everything else is left to the general decoder (never misread);
* a batch the scan accepts builds exactly the index the general path builds from it:
  same answers, counters, refusals, per-engine hashes (generated workloads, and every
  truncation and thousands of byte mutations of real payloads).
"""

from __future__ import annotations

import itertools
import random
import struct

import msgspec
import pytest

from kvevents.index import PrefixIndex
from kvevents.index.wire import IngestDecoder, WireBatch
from kvevents.index._core import scan
from kvevents.wire.schema import (
    AllBlocksCleared,
    BatchDecoder,
    BatchEncoder,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    PayloadError,
)

BS = 4
ENC = BatchEncoder()
GENERAL = BatchDecoder(raw_tokens=True)
PACK = msgspec.msgpack.Encoder()


def chain(seq: int, n: int, start: int = 0, *, neg: bool = False, medium=None, **kw) -> BlockStored:
    """``n`` blocks of sequence ``seq`` from block ``start``: int hashes shared by every
    engine, tokens derived from (seq, position)."""
    h = [(seq * 1000 + i + 1) * (-1 if neg else 1) for i in range(start, start + n)]
    parent = None if start == 0 else (seq * 1000 + start) * (-1 if neg else 1)
    toks = [(seq * 7919 + i) % 50_000 for i in range(start * BS, (start + n) * BS)]
    return BlockStored(block_hashes=h, parent_block_hash=parent, token_ids=toks,
                       block_size=BS, medium=medium, **kw)


def prompt(seq: int, n: int) -> list[int]:
    return [(seq * 7919 + i) % 50_000 for i in range(n * BS)]


def same_index(a: PrefixIndex, b: PrefixIndex, prompts: list[list[int]]) -> None:
    """Two indexes are the same to every reader (their raw tables may differ in
    uninitialised padding, so the export bytes are not compared)."""
    assert a.counters() == b.counters()
    assert a.engines() == b.engines()
    for e in a.engines():
        assert a.engine_hashes(e) == b.engine_hashes(e)
        assert a.engine_block_counts(e) == b.engine_block_counts(e)
    for p in prompts:
        for model in (None, "m"):
            assert a.lookup(p, model=model) == b.lookup(p, model=model)
    assert a.top_prefixes(limit=50) == b.top_prefixes(limit=50)


def apply_both(batches: list[tuple[str, bytes]], **index_kw) -> tuple[PrefixIndex, PrefixIndex, int]:
    """Apply payloads through the aggregator's decoder and through the general one;
    returns both indexes and how many payloads took the wire path."""
    wire, general = PrefixIndex(**index_kw), PrefixIndex(**index_kw)
    ingest = IngestDecoder()
    n_wire = 0
    for engine, payload in batches:
        try:
            want = GENERAL.decode(payload)
        except PayloadError:
            with pytest.raises(PayloadError):
                ingest.decode(payload)
            assert scan(payload) is None
            continue
        got = ingest.decode(payload)
        if isinstance(got.batch, WireBatch):
            n_wire += 1
            assert want.skipped_events == 0
            assert got.batch.ts == want.batch.ts
        assert got.skipped_events == want.skipped_events
        sw = wire.apply_batch(engine, got.batch, model="m")
        sg = general.apply_batch(engine, want.batch, model="m")
        assert sw == sg
    return wire, general, n_wire


def random_workload(rng: random.Random, n_batches: int) -> list[tuple[str, bytes]]:
    """Stores (chains, extensions, unknown parents, signed hashes), removals (known
    and unknown), clears, other attention groups, several tiers: the common shape."""
    out = []
    for _ in range(n_batches):
        events = []
        for _ in range(rng.randrange(0, 6)):
            r = rng.random()
            seq = rng.randrange(12)
            medium = rng.choice([None, None, "GPU", "CPU", "CPU_PINNED", "DISK"])
            neg = seq % 5 == 4
            if r < 0.55:
                start = rng.choice([0, 0, rng.randrange(6)])
                extra = {}
                if rng.random() < 0.2:
                    extra = rng.choice([{"group_idx": 1}, {"group_idx": 0},
                                        {"kv_cache_spec_kind": "sliding_window"},
                                        {"kv_cache_spec_kind": "full_attention", "group_idx": 3},
                                        {"extra_keys": [None] * 3}, {"session_id": "s1"},
                                        {"locality": "local", "ownership": "own"}])
                events.append(chain(seq, rng.randrange(0, 5), start, neg=neg, medium=medium,
                                    **extra))
            elif r < 0.9:
                hashes = [(seq * 1000 + rng.randrange(1, 9)) * (-1 if neg else 1)
                          for _ in range(rng.randrange(0, 4))]
                if rng.random() < 0.1:
                    hashes.append(rng.randrange(1 << 64))  # unknown, above int64
                events.append(BlockRemoved(block_hashes=hashes, medium=medium,
                                           group_idx=rng.choice([None, None, 0, 1])))
            else:
                events.append(AllBlocksCleared())
        engine = f"e{rng.randrange(3)}"
        batch = KVEventBatch(rng.random() * 1e9, events,
                             rng.choice([None, 0, 1]))
        out.append((engine, ENC.encode(batch)))
    return out


def prompts() -> list[list[int]]:
    return [prompt(s, n) for s in range(12) for n in (1, 3, 6)] + [[1, 2, 3, 4]]


@pytest.mark.parametrize("seed", range(12))
def test_wire_and_general_paths_build_the_same_index(seed):
    rng = random.Random(seed)
    batches = random_workload(rng, 150)
    # Tight caps too, so that tier refusals happen on both paths.
    kw = {"max_tiers": 2} if seed % 3 == 0 else {}
    wire, general, n_wire = apply_both(batches, **kw)
    assert n_wire == len(batches)  # all of the common shape: the wire path was tested
    assert wire.counters().resident_entries > 0
    same_index(wire, general, prompts())
    if kw:
        assert sum(sum(r.values()) for r in wire.counters().refused_events.values()) > 0


def test_namespace_refusals_match():
    """Beyond the block-size cap both paths refuse the same events, counted alike."""
    batches = [("e0", ENC.encode(KVEventBatch(1.0, [BlockStored(
        block_hashes=[bs], parent_block_hash=None, token_ids=list(range(bs)), block_size=bs,
        medium=None)]))) for bs in range(1, 12)]
    wire, general, n_wire = apply_both(batches, max_block_sizes=3)
    assert n_wire == len(batches)
    assert wire.counters().refused_events == {"e0": {"namespace_limit": 8}}
    same_index(wire, general, [list(range(n)) for n in range(1, 12)])


def test_mixed_groups_apply_in_order():
    """A group mixing wire and decoded batches (as the aggregator's are) applies in
    stream order: a legacy-encoded removal between two wire stores."""
    legacy = BatchEncoder(legacy=True)
    payloads = [ENC.encode(KVEventBatch(1.0, [chain(1, 3)])),
                legacy.encode(KVEventBatch(2.0, [BlockRemoved(block_hashes=[1003])])),
                ENC.encode(KVEventBatch(3.0, [chain(1, 1, 2)]))]
    ingest = IngestDecoder()
    batches = [ingest.decode(p).batch for p in payloads]
    assert [type(b) is WireBatch for b in batches] == [True, False, True]
    idx = PrefixIndex()
    idx.apply_batches("e0", batches, model="m")
    assert idx.engine_hashes("e0") == {"GPU": {1001, 1002, 1003}}
    assert idx.lookup(prompt(1, 3)).engines[0].tokens == 3 * BS


def test_real_vllm_structs_take_the_wire_path():
    """Batches encoded from vLLM's own structs (as its ZmqEventPublisher does)."""
    kv = pytest.importorskip("vllm.distributed.kv_events")
    enc = msgspec.msgpack.Encoder()
    stored = kv.BlockStored(block_hashes=[11, 12], parent_block_hash=None,
                            token_ids=list(range(2 * BS)), block_size=BS, lora_id=None,
                            medium="GPU", lora_name=None, extra_keys=[None, None], group_idx=0,
                            kv_cache_spec_kind="full_attention")
    ext = kv.BlockStored(block_hashes=[13], parent_block_hash=12,
                         token_ids=list(range(2 * BS, 3 * BS)), block_size=BS, lora_id=None,
                         medium=None, lora_name=None)
    removed = kv.BlockRemoved(block_hashes=[13], medium="GPU")
    payloads = [enc.encode(kv.KVEventBatch(ts=1.5, events=[stored, ext], data_parallel_rank=0)),
                enc.encode(kv.KVEventBatch(ts=2.5, events=[removed, kv.AllBlocksCleared()]))]
    for p in payloads:
        assert scan(p) is not None, p
    wire, general, n_wire = apply_both([("e0", p) for p in payloads[:1]])
    assert n_wire == 1
    assert wire.lookup(list(range(3 * BS))).engines[0].tokens == 3 * BS
    same_index(wire, general, [list(range(3 * BS))])


def test_sglang_shape_takes_the_wire_path():
    """SGLang 0.5's encoding: optional fields omitted, signed int64 hashes, dp rank."""
    events = [{"type": "BlockStored", "block_hashes": [-5, 7], "parent_block_hash": None,
               "token_ids": list(range(2 * BS)), "block_size": BS},
              {"type": "BlockRemoved", "block_hashes": [7], "medium": "CPU_PINNED"}]
    payload = PACK.encode([3.25, events, 2])
    assert scan(payload) is not None
    wire, general, _ = apply_both([("e0", payload)])
    assert wire.engine_hashes("e0") == {"GPU": {-5, 7}}
    same_index(wire, general, [list(range(2 * BS))])


def _ev(**fields):
    base = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
            "token_ids": [1, 2, 3, 4], "block_size": 4}
    base.update(fields)
    return base


LEFT_TO_THE_GENERAL_PATH = {
    "legacy array events": BatchEncoder(legacy=True).encode(KVEventBatch(1.0, [chain(1, 2)])),
    "bytes hashes": PACK.encode([1.0, [_ev(block_hashes=[b"\x01" * 32])]]),
    "bytes parent": PACK.encode([1.0, [_ev(parent_block_hash=b"\x02" * 32)]]),
    "LoRA name": PACK.encode([1.0, [_ev(lora_name="adapter")]]),
    "LoRA id": PACK.encode([1.0, [_ev(lora_id=3)]]),
    "extra keys": PACK.encode([1.0, [_ev(extra_keys=[["mm", 1]])]]),
    "token-less store": PACK.encode([1.0, [_ev(token_ids=[], block_size=0)]]),
    "too few tokens": PACK.encode([1.0, [_ev(token_ids=[1, 2])]]),
    "bigram tokens": PACK.encode([1.0, [_ev(token_ids=[[1, 2], [3, 4], [5, 6], [7, 8]])]]),
    "token above int64": PACK.encode([1.0, [_ev(token_ids=[1, 2, 3, 1 << 63])]]),
    "unknown event type": PACK.encode([1.0, [{"type": "BlockMoved", "block_hashes": [1]}]]),
    "type not first": PACK.encode([1.0, [{"block_hashes": [1], "type": "BlockRemoved"}]]),
    "missing field": PACK.encode([1.0, [{"type": "BlockStored", "block_hashes": [1]}]]),
    "non-ASCII medium": PACK.encode([1.0, [_ev(medium="GPÜ")]]),
    "int ts": PACK.encode([1, [_ev()]]),
    "four items": PACK.encode([1.0, [_ev()], 0, 0]),
    "one item": PACK.encode([1.0]),
    "trailing bytes": PACK.encode([1.0, [_ev()]]) + b"\x00",
    "ext in an Any field": PACK.encode([1.0, [_ev(locality=msgspec.msgpack.Ext(1, b"x"))]]),
    "map": PACK.encode({"ts": 1.0, "events": []}),
    "more events than bytes": b"\x92" + PACK.encode(1.0) + b"\xdc\x00\x28" + PACK.encode(_ev()),
    "not msgpack": b"\xc1\xc1",
    "empty": b"",
}


@pytest.mark.parametrize("name", sorted(LEFT_TO_THE_GENERAL_PATH))
def test_other_shapes_are_left_to_the_general_path(name):
    payload = LEFT_TO_THE_GENERAL_PATH[name]
    assert scan(payload) is None
    ingest = IngestDecoder()
    try:
        want = GENERAL.decode(payload)
    except PayloadError:
        with pytest.raises(PayloadError):
            ingest.decode(payload)
        return
    got = ingest.decode(payload)
    assert not isinstance(got.batch, WireBatch)
    assert got == want


def test_duplicate_keys_are_left_to_the_general_path():
    # msgpack allows repeated map keys; which one wins is the general decoder's call.
    body = PACK.encode(_ev())
    n = body[0] & 0x0F
    dup = bytes([0x80 | (n + 1)]) + body[1:] + PACK.encode("block_size") + PACK.encode(8)
    payload = b"\x92" + PACK.encode(1.0) + b"\x91" + dup
    assert scan(payload) is None


def test_truncated_and_mutated_payloads_never_misread():
    """Every truncation, and 5,000 random byte edits, of real payloads: when the scan
    accepts bytes, the general path decodes them without skipping anything and builds
    the same index; when the general path refuses, so does the scan."""
    rng = random.Random(7)
    seeds = [p for _, p in random_workload(rng, 30) if len(p) > 20][:10]
    vllm_like = ENC.encode(KVEventBatch(5.0, [chain(2, 3, medium="CPU"),
                                              BlockRemoved(block_hashes=[2001], medium="CPU")], 0))
    seeds.append(vllm_like)
    cases = []
    for p in seeds:
        cases += [p[:k] for k in range(len(p))]
    for _ in range(5000):
        p = bytearray(rng.choice(seeds))
        for _ in range(rng.randrange(1, 4)):
            i = rng.randrange(len(p))
            op = rng.random()
            if op < 0.6:
                p[i] = rng.randrange(256)
            elif op < 0.8:
                del p[i]
            else:
                p.insert(i, rng.randrange(256))
        cases.append(bytes(p))
    accepted = 0
    for payload in cases:
        if scan(payload) is not None:
            accepted += 1
            # The prefix of the stream first, so mutated events meet known blocks.
            wire, general, _ = apply_both([("e0", vllm_like), ("e0", payload)])
            same_index(wire, general, [prompt(2, 3), prompt(1, 2)])
        else:
            apply_both([("e0", payload)])  # refused alike, or decoded alike
    assert accepted > 250  # the mutations did reach the wire path


class CountingLock:
    """A lock that counts how often it was taken (``PrefixIndex.lock`` is public: an
    embedding router may hold it around several calls)."""

    def __init__(self) -> None:
        import threading
        self._lock = threading.Lock()
        self.taken = 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self._lock.acquire(blocking, timeout)
        self.taken += got
        return got

    def release(self) -> None:
        self._lock.release()

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self.release()


def test_a_large_group_releases_the_lock_between_parts():
    """A lookup never waits behind a whole ingest group: apply_batches gives the lock
    back every ~16 KiB of batches, and the parts add up to what one call per batch
    does."""
    ingest = IngestDecoder()
    payloads = [ENC.encode(KVEventBatch(float(i), [chain(i, 100)])) for i in range(40)]
    assert sum(map(len, payloads)) > 3 * (16 << 10)
    grouped, single = PrefixIndex(), PrefixIndex()
    grouped.lock = CountingLock()  # type: ignore[assignment]
    stats = grouped.apply_batches("e0", [ingest.decode(p).batch for p in payloads], model="m")
    assert grouped.lock.taken >= 3
    total = [single.apply_batch("e0", ingest.decode(p).batch, model="m") for p in payloads]
    assert stats.stored_blocks == sum(s.stored_blocks for s in total) == 4000
    assert stats.events == 40
    same_index(grouped, single, [prompt(i, 100) for i in range(40)])


def _int(v: int, fmt: int) -> bytes:
    """``v`` in msgpack format byte ``fmt`` (0 = fixint), whichever width the byte names."""
    if fmt == 0:
        return struct.pack("b" if v < 0 else "B", v)
    width = {0xCC: "B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD0: "b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q"}
    return bytes([fmt]) + struct.pack(width[fmt], v)


def _ints(values: list[tuple[int, int]]) -> bytes:
    n = len(values)
    head = bytes([0x90 | n]) if n < 16 else b"\xdc" + struct.pack(">H", n)
    return head + b"".join(_int(v, f) for v, f in values)


def _hand_event(hashes: list[tuple[int, int]], tokens: list[tuple[int, int]]) -> bytes:
    return (b"\x85" + PACK.encode("type") + PACK.encode("BlockStored")
            + PACK.encode("block_hashes") + _ints(hashes) + PACK.encode("parent_block_hash") + b"\xc0"
            + PACK.encode("block_size") + PACK.encode(BS) + PACK.encode("token_ids") + _ints(tokens))


def test_every_int_encoding_reads_alike():
    """Hashes and tokens in every msgpack int format (positive values in the signed
    formats too, which msgspec never writes), in the middle of a payload and in its last
    bytes (the fast reader's bounds-checked tail): the wire path reads what the general
    one does, and a token above int64 still leaves the batch to the general path."""
    fmts = [(5, 0), (-3, 0), (200, 0xCC), (40_000, 0xCD), (3_000_000_000, 0xCE), (2**63 + 5, 0xCF),
            (-100, 0xD0), (100, 0xD0), (-30_000, 0xD1), (30_000, 0xD1), (-2**31, 0xD2), (7, 0xD2),
            (-2**62, 0xD3), (2**62, 0xD3)]
    tokens = list(itertools.islice(itertools.cycle([t for t in fmts if t[0] < 2**63]), len(fmts) * BS))
    for at_end in (False, True):
        events = [_hand_event(fmts, tokens)] + ([] if at_end else [PACK.encode(_ev(block_hashes=[99]))])
        payload = b"\x92" + PACK.encode(1.0) + bytes([0x90 | len(events)]) + b"".join(events)
        assert scan(payload) is not None
        wire, general, n_wire = apply_both([("e0", payload)])
        assert n_wire == 1
        same_index(wire, general, [[v for v, _ in tokens[:BS * k]] for k in (1, 2, len(fmts))])
        assert len(wire.engine_hashes("e0")["GPU"]) == len(fmts) + (0 if at_end else 1)
    above = _hand_event([(1, 0)], [(1, 0)] * (BS - 1) + [(2**63, 0xCF)])
    assert scan(b"\x92" + PACK.encode(1.0) + b"\x91" + above) is None


def test_runs_of_uint16_tokens_read_alike():
    """Token ids of a vocabulary under 65,536 are runs of msgpack uint16 (0xCD), which the
    reader takes five at a time where the CPU can: runs of every length up to 23, broken
    by each other format at every offset, the whole range of values (0x0100, 0x8000,
    0xFFFF), and the array both in the middle of a payload and at its very end (where
    fewer than 16 bytes remain): the wire path reads what the general one does."""
    rng = random.Random(11)
    breakers = [(5, 0), (200, 0xCC), (3_000_000_000, 0xCE), (40_000, 0xCE), (-7, 0), (2**40, 0xCF)]
    edge = [0x0100, 0x8000, 0xFFFF, 0x7FFF, 0x80FF]
    for run in range(24):
        for breaker in breakers:
            toks: list[tuple[int, int]] = []
            while len(toks) < 3 * BS * 8:
                toks += [(rng.choice(edge) if rng.random() < 0.3 else rng.randrange(256, 65536), 0xCD)
                         for _ in range(run)]
                toks.append(breaker)
            toks = toks[:len(toks) - len(toks) % BS]
            n_blocks = len(toks) // BS
            hashes = [(run * 10_000 + 100 * breakers.index(breaker) + i + 1, 0xCF) for i in range(n_blocks)]
            for at_end in (False, True):
                events = [_hand_event(hashes, toks)] + ([] if at_end else [PACK.encode(_ev(block_hashes=[99]))])
                payload = b"\x92" + PACK.encode(1.0) + bytes([0x90 | len(events)]) + b"".join(events)
                wire, general, n_wire = apply_both([("e0", payload)])
                assert n_wire == 1, (run, breaker, at_end)
                same_index(wire, general, [[v for v, _ in toks[:BS * k]] for k in (1, n_blocks // 2, n_blocks)])
                # The whole prompt matches: every token was read as written.
                hit = wire.lookup([v for v, _ in toks]).engines
                assert [m.tokens for m in hit] == [len(toks)], (run, breaker, at_end)
