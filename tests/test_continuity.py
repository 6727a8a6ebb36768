"""The continuity digest (kvevents.ingest.continuity): a replayed payload must digest the
same, any other payload (one byte changed, words moved, zero padding) differently; the
ring remembers the last few seqs."""

from __future__ import annotations

import random

from kvevents.ingest.continuity import DigestRing, digest


def _payloads() -> list[bytes]:
    rng = random.Random(7)
    # Lengths around the 32-byte step and the 8-byte tail, and a batch-sized one.
    return [bytes(rng.getrandbits(8) for _ in range(n)) for n in (0, 1, 7, 8, 31, 32, 33, 40, 63,
                                                                 64, 65, 1150)]


def test_equal_payloads_digest_equal_and_every_byte_counts() -> None:
    for p in _payloads():
        assert digest(p) == digest(bytes(p))
        seen = {digest(p)}
        for i in range(len(p)):
            flipped = bytearray(p)
            flipped[i] ^= 0x01
            seen.add(digest(bytes(flipped)))
        # One bit of any byte, in the four lanes and in the tail alike, changes it.
        assert len(seen) == len(p) + 1, len(p)


def test_moved_words_and_padding_change_the_digest() -> None:
    p = bytes(range(64))
    # Two 8-byte words of one 32-byte step swapped (lanes 0 and 1), and two whole steps.
    swapped = p[8:16] + p[0:8] + p[16:]
    steps = p[32:64] + p[0:32]
    assert len({digest(p), digest(swapped), digest(steps)}) == 3
    # Zero bytes appended are not nothing: the length is part of the digest.
    assert len({digest(b"abc"), digest(b"abc\x00"), digest(b"abc" + bytes(29)),
                digest(b"abc" + bytes(61))}) == 4
    assert digest(b"") != digest(b"\x00")


def test_ring_checks_the_last_seqs_it_was_given() -> None:
    ring = DigestRing()
    payloads = _payloads()
    for seq, p in enumerate(payloads):
        ring.add(seq, p)
    n = len(ring)
    assert 0 < n < len(payloads)
    last = len(payloads) - 1
    assert ring.oldest() == last - n + 1
    assert ring.check(last, payloads[last]) is True
    assert ring.check(last, payloads[last] + b"x") is False
    assert ring.check(last - n, payloads[last - n]) is None  # forgotten
    ring.clear()
    assert len(ring) == 0 and ring.oldest() is None
