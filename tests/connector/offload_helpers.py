"""Shared helpers: a real ZeroMQ subscriber and a replay of events into per-tier sets."""

from __future__ import annotations

import itertools
import time

import zmq

from kvevents.wire.publisher import PublisherConfig, ZmqEventPublisher
from kvevents.wire.schema import AllBlocksCleared, BatchDecoder, BlockRemoved, BlockStored, KVEventBatch, medium_of

_n = itertools.count()


class Subscribed:
    """A ZmqEventPublisher on a fresh inproc endpoint with a connected SUB socket."""

    def __init__(self) -> None:
        endpoint = f"inproc://kv-test-{next(_n)}"
        self.publisher = ZmqEventPublisher(PublisherConfig(endpoint=endpoint))
        self.sub = zmq.Context.instance().socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.decoder = BatchDecoder()
        # Slow joiner: publish empty batches until one arrives, so none is lost later.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            self.publisher.publish(KVEventBatch(ts=0.0, events=[]))
            if self.sub.poll(20):
                break
        self.drain(0.05)

    def drain(self, quiet_s: float = 0.3) -> list[KVEventBatch]:
        out = []
        while self.sub.poll(int(quiet_s * 1000)):
            frames = self.sub.recv_multipart()
            assert len(frames) == 3
            out.append(self.decoder.decode(frames[2]).batch)
        return out

    def close(self) -> None:
        self.publisher.shutdown()
        self.sub.close(linger=0)


def replay(batches: list[KVEventBatch]) -> tuple[dict[str, dict[int, int]], list[str]]:
    """Reference counts per (tier, hash) from events; problems are listed, not raised."""
    counts: dict[str, dict[int, int]] = {"GPU": {}, "CPU": {}}
    problems = []
    for b in batches:
        for e in b.events:
            if isinstance(e, AllBlocksCleared):
                counts = {"GPU": {}, "CPU": {}}
            elif isinstance(e, BlockStored):
                c = counts.setdefault(medium_of(e), {})
                for h in e.block_hashes:
                    if c.get(h):
                        problems.append(f"duplicate store {medium_of(e)} {h}")
                    c[h] = c.get(h, 0) + 1
            elif isinstance(e, BlockRemoved):
                c = counts.setdefault(medium_of(e), {})
                for h in e.block_hashes:
                    if not c.get(h):
                        problems.append(f"remove of unknown {medium_of(e)} {h}")
                        continue
                    c[h] -= 1
                    if not c[h]:
                        del c[h]
    return counts, problems
