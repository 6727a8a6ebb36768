"""``kvevents tail`` as a user runs it: a real process against a real publisher."""

from __future__ import annotations

import subprocess
import sys
import time

from support import LossyForwarder, free_port
from kvevents.wire.publisher import PublisherConfig, ZmqEventPublisher
from kvevents.wire.schema import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


def test_tail_shows_a_lost_live_batch_recovered_through_replay():
    live, replay = free_port(), free_port()
    pub = ZmqEventPublisher(PublisherConfig(endpoint=f"tcp://*:{live}", replay_endpoint=f"tcp://*:{replay}"))
    fwd = LossyForwarder(f"tcp://127.0.0.1:{live}", drop={2})
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvevents.cli", "tail", "--endpoint", fwd.endpoint,
         "--replay", f"tcp://127.0.0.1:{replay}", "--max-batches", "4", "--duration", "20"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        # The process has imported everything and is about to subscribe once it prints
        # its header (EOF if it died); then give the subscription time to land. A fixed
        # sleep alone was flaky on a loaded machine (imports took over a second).
        first = proc.stdout.readline()
        time.sleep(1.0)
        pub.publish(KVEventBatch(1.0, [BlockStored([11, 12], None, list(range(32)), 16, None, "GPU", None)]))
        pub.publish(KVEventBatch(2.0, [BlockStored([13], 12, list(range(32, 48)), 16, None, "CPU", "lora-x")]))
        pub.publish(KVEventBatch(3.0, [BlockRemoved([11, 12], "GPU")]))  # dropped on the live hop
        pub.publish(KVEventBatch(4.0, [AllBlocksCleared()]))
        out, _ = proc.communicate(timeout=25)
        out = first + out
    finally:
        proc.kill()
        fwd.close()
        pub.shutdown()
    lines = out.splitlines()
    assert any(l.startswith("seq=0 BlockStored tier=GPU blocks=2 block_size=16 tokens=32 first=[0, 1, 2")
               for l in lines), out
    assert any("seq=1 BlockStored tier=CPU blocks=1" in l and "lora=lora-x" in l for l in lines), out
    assert any(l.startswith("GAP expected seq=2, received seq=3") for l in lines), out
    assert any(l.startswith("seq=2 (replayed) BlockRemoved tier=GPU blocks=2") for l in lines), out
    # The replay answers everything from seq 2 on, so seq 3 may come either way.
    assert any(l.startswith("seq=3") and l.endswith("AllBlocksCleared") for l in lines), out
    assert not any(l.startswith("LOST") for l in lines), out
    summary = [l for l in lines if l.startswith("# batches=")]
    assert summary and summary[0].startswith("# batches=4 ") and " gaps=1 lost=0 " in summary[0], out
