"""A real Prometheus server scrapes the aggregator's /metrics and answers PromQL on it."""

from __future__ import annotations

import time

from support import PrometheusServer, ServerThread, free_port, require_binary, wait_until
from kvevents.api import create_app
from kvevents.wire.publisher import PublisherConfig, ZmqEventPublisher
from kvevents.wire.schema import BlockRemoved, BlockStored, KVEventBatch
from kvevents.service.settings import AggregatorSettings, EngineSpec


def test_prometheus_scrapes_aggregator_metrics(tmp_path):
    binary = require_binary("prometheus")
    live, replay = free_port(), free_port()
    pub = ZmqEventPublisher(PublisherConfig(endpoint=f"tcp://*:{live}", replay_endpoint=f"tcp://*:{replay}"))
    settings = AggregatorSettings(engines=(EngineSpec("engine-0", f"tcp://127.0.0.1:{live}",
                                                      replay_endpoint=f"tcp://127.0.0.1:{replay}"),))
    with ServerThread(create_app(settings)) as srv:
        prom = PrometheusServer(tmp_path, {"kvevents": [f"127.0.0.1:{srv.port}"]}, binary)
        try:
            prom.wait_ready()
            toks = list(range(64))
            pub.publish(KVEventBatch(time.time(), [BlockStored([1, 2, 3, 4], None, toks, 16, None, "GPU", None)]))
            pub.publish(KVEventBatch(time.time(), [BlockStored([4], 3, toks[48:], 16, None, "CPU", None),
                                                   BlockRemoved([4], "GPU")]))

            def value(q: str) -> float | None:
                res = prom.query(q)
                return float(res[0]["value"][1]) if res else None

            assert wait_until(lambda: value('kvevents_resident_blocks{engine="engine-0",tier="GPU"}') == 3.0, 30, 0.5)
            assert value('kvevents_resident_blocks{engine="engine-0",tier="CPU"}') == 1.0
            assert value('sum(kvevents_block_events_applied_total{type="BlockStored"})') == 5.0
            assert value('kvevents_engine_up{engine="engine-0"}') == 1.0
            assert value('up{job="kvevents"}') == 1.0
            assert value('kvevents_event_lag_seconds_count{engine="engine-0"}') == 2.0
        finally:
            prom.close()
    pub.shutdown(0.5)
