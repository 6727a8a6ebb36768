"""``kvevents demo``: the end-to-end path on one machine.

Until the fleet demo lands this runs the foundation's path: a publisher with a replay
socket -> a subscriber that follows it -> every decoded event printed.
"""

from __future__ import annotations

import random
import socket
import sys
import time

from kvevents.publisher import PublisherConfig, ZmqEventPublisher
from kvevents.schema import BlockRemoved, BlockStored, KVEventBatch
from kvevents.subscriber import BatchesLost, SourceConfig, Subscriber
from kvevents.tail import format_signal


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_demo(batches: int = 20, block_size: int = 16, seed: int = 0) -> int:
    rng = random.Random(seed)
    live, replay = _free_port(), _free_port()
    pub = ZmqEventPublisher(
        PublisherConfig(endpoint=f"tcp://*:{live}", replay_endpoint=f"tcp://*:{replay}")
    )
    lost = 0

    def show(sig) -> None:
        nonlocal lost
        lost += sig.count if isinstance(sig, BatchesLost) else 0
        for line in format_signal(sig):
            print(line, flush=True)

    sub = Subscriber(show)
    sub.add_source(
        SourceConfig("demo", f"tcp://127.0.0.1:{live}", replay_endpoint=f"tcp://127.0.0.1:{replay}")
    )
    sub.start()
    time.sleep(0.3)
    parent = None
    for i in range(batches):
        h = rng.getrandbits(64)
        tokens = [rng.randrange(32_000) for _ in range(block_size)]
        events = [BlockStored([h], parent, tokens, block_size, None, "GPU", None)]
        if parent is not None and i % 5 == 0:
            events.append(BlockRemoved([parent], "GPU"))
        parent = h
        pub.publish(KVEventBatch(time.time(), events))
        time.sleep(0.02)
    time.sleep(0.5)
    sub.stop()
    pub.shutdown()
    stats = sub.stats()["demo"]
    print(f"# {stats.batches} batches received, {stats.lost_batches} lost", flush=True)
    return 0 if stats.batches == batches and lost == 0 else 1


if __name__ == "__main__":
    sys.exit(run_demo())
