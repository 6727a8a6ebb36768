"""The aggregator without HTTP: settings at the edge, binding mode, loss and restart."""

from __future__ import annotations

import json
import time

import pytest

from support import LossyForwarder, free_port, wait_until
from kvevents.service.aggregator import Aggregator
from kvevents.wire.publisher import PublisherConfig, ZmqEventPublisher
from kvevents.wire.schema import BlockStored, KVEventBatch
from kvevents.service.settings import AggregatorSettings, EngineSpec, load_settings

TOKS = list(range(32))


def stored(h, parent=None, toks=TOKS[:16]):
    return KVEventBatch(time.time(), [BlockStored([h], parent, toks, 16, None, "GPU", None)])


def test_engine_spec_parsing_and_errors():
    p = EngineSpec.parse("vllm-0=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558,model=m,topic=t")
    assert (p.name, p.endpoint, p.replay_endpoint, p.model, p.topic, p.bind) == (
        "vllm-0", "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558", "m", "t", False)
    assert EngineSpec.parse("a=tcp://*:5557,bind=1").bind
    for bad in ("novalue", "a=", "a=udp://x:1", "a=tcp://h:1,replay", "a=tcp://h:1,colour=red",
                "bad name=tcp://h:1"):
        with pytest.raises(ValueError):
            EngineSpec.parse(bad)


def test_settings_from_file_env_and_flags(tmp_path):
    cfg = tmp_path / "kv.json"
    cfg.write_text(json.dumps({"engines": ["a=tcp://h:1"], "port": 9001, "stale_after_s": 5}))
    s = load_settings(str(cfg), env={})
    assert s.port == 9001 and s.stale_after_s == 5 and [p.name for p in s.engines] == ["a"]
    s = load_settings(str(cfg), env={"KVEVENTS_PORT": "9002", "KVEVENTS_ENDPOINTS": "b=tcp://h:2; c=tcp://h:3"})
    assert s.port == 9002 and [p.name for p in s.engines] == ["b", "c"]
    s = load_settings(str(cfg), env={"KVEVENTS_PORT": "9002"}, port=9003, auth_token="t")
    assert s.port == 9003 and s.auth_token == "t"
    toml = tmp_path / "kv.toml"
    toml.write_text('port = 9100\nengines = ["x=tcp://h:1,replay=tcp://h:2"]\n')
    assert load_settings(str(toml), env={}).engines[0].replay_endpoint == "tcp://h:2"
    with pytest.raises(ValueError, match="KVEVENTS_PORT"):
        load_settings(None, env={"KVEVENTS_PORT": "eighty"})
    with pytest.raises(ValueError, match="unknown setting"):
        cfg.write_text(json.dumps({"prot": 1}))
        load_settings(str(cfg), env={})
    with pytest.raises(ValueError, match="unique"):
        AggregatorSettings(engines=(EngineSpec("a", "tcp://h:1"), EngineSpec("a", "tcp://h:2")))


def test_binding_mode_publishers_connect_to_the_aggregator():
    port, rport = free_port(), free_port()
    agg = Aggregator(AggregatorSettings(engines=(
        EngineSpec("p", f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{rport}", bind=True),)))
    agg.start()
    # No "*": by vLLM's rule the publisher connects to the bound aggregator.
    pub = ZmqEventPublisher(PublisherConfig(endpoint=f"tcp://127.0.0.1:{port}",
                                            replay_endpoint=f"tcp://*:{rport}"))
    try:
        assert wait_until(lambda: agg.engine_statuses()[0]["connected"], 5)
        time.sleep(0.3)
        pub.publish(stored(1))
        pub.publish(stored(2, 1, TOKS[16:]))
        assert wait_until(lambda: agg.lookup(TOKS).engines and agg.lookup(TOKS).engines[0].tokens == 32, 5)
    finally:
        pub.shutdown(0.5)
        agg.stop()


def test_unrecoverable_loss_is_counted_and_drops_the_engines_state():
    live, rport = free_port(), free_port()
    pub = ZmqEventPublisher(PublisherConfig(endpoint=f"tcp://*:{live}", replay_endpoint=f"tcp://*:{rport}",
                                            buffer_steps=2))
    fwd = LossyForwarder(f"tcp://127.0.0.1:{live}", drop={1, 2, 3})
    agg = Aggregator(AggregatorSettings(engines=(
        EngineSpec("p", fwd.endpoint, replay_endpoint=f"tcp://127.0.0.1:{rport}"),)))
    agg.start()
    try:
        time.sleep(0.4)
        pub.publish(stored(1))  # seq 0: applied
        assert wait_until(lambda: bool(agg.lookup(TOKS).engines), 5)
        for h in (2, 3, 4):  # seqs 1-3 dropped on the wire; the buffer keeps only 2
            pub.publish(stored(h, h - 1, TOKS[16:]))
        time.sleep(0.2)
        pub.publish(KVEventBatch(time.time(), []))  # seq 4 reveals the gap
        assert wait_until(lambda: agg.engine_statuses()[0]["last_seq"] == 4, 5)
        status = agg.engine_statuses()[0]
        # The buffer held seqs 3-4 when seq 4 arrived: 1-2 are lost, counted once.
        assert status["lost_batches"] == 2 and status["resyncs"] == 1 and status["gaps"] == 1
        # The state from before the loss (block 1) was dropped; seq 3's block 4 came by
        # replay after it but its parent is unknown now: held, never matched from the root.
        assert agg.index.engine_block_counts("p") == {"GPU": 1}
        assert agg.lookup(TOKS).engines == []
    finally:
        fwd.close()
        pub.shutdown(0.5)
        agg.stop()
