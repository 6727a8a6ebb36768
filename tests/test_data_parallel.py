"""Data-parallel servers: ``dp=N`` on an endpoint (and discovery's dp count) makes one
engine per rank, ``NAME-dpR``, following rank R's stream on the ports + R as vLLM's
publisher offsets them; the gateway sends ``X-data-parallel-rank`` for the rank it
chose; a batch stamped with another rank than its stream's is counted.

End to end with two ranks of vLLM's own ``ZmqEventPublisher`` (``data_parallel_rank``
0 and 1, offsetting their ports themselves), a real ``kvevents serve``, and a fake
OpenAI engine (:mod:`hostile_engine`) that records the rank header of each request.
A real ``vllm serve --data-parallel-size 2`` is not started here. On this CPU machine
it took about 90 s to start, with a tiny random model, and only with
``VLLM_CPU_OMP_THREADS_BIND=0|1`` (one core per rank; with one core listed rank 1 fails
at start-up). By hand it honoured ``X-data-parallel-rank: 1``: the request's blocks were
published on port base + 1, stamped ``data_parallel_rank`` 1.
"""

from __future__ import annotations

import contextlib
import socket
import time

import httpx
import msgspec
import pytest

from hostile_engine import EngineThread
from hostile_support import GatewayProcess, wait_for
from support import free_port
from kvevents.engines import EngineSpec
from kvevents.engines.spec import dp_endpoint
from kvevents.gateway.headers import RANK_HEADER, with_rank
from kvevents.gateway.load import parse_engine_metrics
from kvevents.index import PrefixIndex
from kvevents.index._core import scan
from kvevents.wire.framing import EndpointError

BS = 16


# -- the option --------------------------------------------------------------------------


def test_dp_option_makes_one_engine_per_rank_on_the_offset_ports():
    specs = EngineSpec.parse_all("srv=tcp://10.0.0.7:5557,replay=tcp://10.0.0.7:5600,model=m,"
                                 "http=http://10.0.0.7:8000,dp=3")
    assert [(s.name, s.endpoint, s.replay_endpoint, s.http, s.model, s.dp_rank) for s in specs] == [
        ("srv-dp0", "tcp://10.0.0.7:5557", "tcp://10.0.0.7:5600", "http://10.0.0.7:8000", "m", 0),
        ("srv-dp1", "tcp://10.0.0.7:5558", "tcp://10.0.0.7:5601", "http://10.0.0.7:8000", "m", 1),
        ("srv-dp2", "tcp://10.0.0.7:5559", "tcp://10.0.0.7:5602", "http://10.0.0.7:8000", "m", 2)]
    one = EngineSpec.parse("srv=tcp://h:5557,dp=1")  # a server of one rank: as before
    assert (one.name, one.dp_rank) == ("srv", None)
    assert EngineSpec.from_table_all({"name": "t", "endpoint": "tcp://h:7000", "dp": 2})[1] == \
        EngineSpec("t-dp1", "tcp://h:7001", dp_rank=1)


@pytest.mark.parametrize("text, message", [
    ("a=tcp://h:1,dp=0", "dp must be"),
    ("a=tcp://h:1,dp=two", "dp must be"),
    ("a=tcp://h:1,dp=2000", "dp must be"),
    ("a=tcp://h:5557,replay=tcp://h:5558,dp=2", "replay port at least 2 above"),  # vLLM's defaults
    ("a=ipc:///tmp/x,dp=2", "dp: a data-parallel server's endpoint"),
    ("a=tcp://h:1,dp=2", "use EngineSpec.parse_all"),  # parse() is one engine
])
def test_bad_dp_is_refused_naming_it(text, message):
    with pytest.raises(ValueError, match=message):
        EngineSpec.parse(text)


def test_settings_and_table_expand_dp():
    from kvevents.service.settings import AggregatorSettings

    s = AggregatorSettings(engines=["a=tcp://h:6000,dp=2", {"name": "b", "endpoint": "tcp://h:7000", "dp": 2}])
    assert [(e.name, e.endpoint, e.dp_rank) for e in s.engines] == [
        ("a-dp0", "tcp://h:6000", 0), ("a-dp1", "tcp://h:6001", 1),
        ("b-dp0", "tcp://h:7000", 0), ("b-dp1", "tcp://h:7001", 1)]
    with pytest.raises(ValueError, match="dp"):
        AggregatorSettings(engines=[{"name": "b", "endpoint": "tcp://h:7000", "dp": True}])


def test_ports_are_vllms():
    """The same endpoints as vLLM 0.32's own publisher computes for each rank (port 0,
    left to the OS, stays 0; rank 0 is the endpoint itself)."""
    kv = pytest.importorskip("vllm.distributed.kv_events")
    offset = kv.ZmqEventPublisher.offset_endpoint_port
    for endpoint in ("tcp://*:5557", "tcp://10.1.2.3:6000", "tcp://[::1]:7000", "tcp://h:0",
                     "inproc://cache"):
        for rank in range(4):
            assert dp_endpoint(endpoint, rank) == offset(endpoint, rank), (endpoint, rank)
    with pytest.raises(EndpointError):
        dp_endpoint("udp://h:1", 1)


def test_discovered_ranks_know_their_rank():
    from kvevents.discovery.targets import PortPlan, engine_specs

    two = engine_specs("pod", "10.0.0.5", PortPlan(events=5557, replay=5600, dp_size=2))
    assert [(s.name, s.endpoint, s.dp_rank, s.http) for s in two] == [
        ("pod-dp0", "tcp://10.0.0.5:5557", 0, "http://10.0.0.5:8000"),
        ("pod-dp1", "tcp://10.0.0.5:5558", 1, "http://10.0.0.5:8000")]
    assert engine_specs("pod", "10.0.0.5", PortPlan())[0].dp_rank is None


def test_kubernetes_annotation_gives_the_ranks():
    from types import SimpleNamespace

    from kvevents.discovery.k8s_pods import pod_specs
    from kvevents.discovery.targets import PortPlan

    pod = SimpleNamespace(metadata=SimpleNamespace(name="vllm-a", annotations={
        "kvevents.io/dp-size": "2", "kvevents.io/replay-port": "5600"}),
        status=SimpleNamespace(podIP="10.0.0.9"))
    specs = pod_specs(pod, PortPlan(), "m")
    assert [(s.name, s.dp_rank, s.endpoint, s.replay_endpoint) for s in specs] == [
        ("vllm-a-dp0", 0, "tcp://10.0.0.9:5557", "tcp://10.0.0.9:5600"),
        ("vllm-a-dp1", 1, "tcp://10.0.0.9:5558", "tcp://10.0.0.9:5601")]


# -- the header, the gauges -------------------------------------------------------------------


def test_rank_header_only_for_a_rank():
    headers = [(b"content-type", b"application/json")]
    assert with_rank(headers, EngineSpec("e", "tcp://h:1")) is headers
    assert with_rank(headers, EngineSpec("e-dp1", "tcp://h:2", dp_rank=1)) == [*headers, (RANK_HEADER, b"1")]
    assert with_rank(headers, EngineSpec("e-dp70", "tcp://h:2", dp_rank=70))[-1] == (RANK_HEADER, b"70")
    assert headers == [(b"content-type", b"application/json")]  # (shared by the tries: not changed)


def test_a_rank_reads_its_own_gauges():
    page = (b'vllm:num_requests_running{engine="0",model_name="m"} 3\n'
            b'vllm:num_requests_running{engine="1",model_name="m"} 5\n'
            b'vllm:num_requests_waiting{engine="1",model_name="m"} 2\n'
            b'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
            b'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.1\n')
    assert parse_engine_metrics(page) == {"running": 8.0, "waiting": 2.0, "kv_usage": 0.3}
    assert parse_engine_metrics(page, 1) == {"running": 5.0, "waiting": 2.0, "kv_usage": 0.1}
    assert parse_engine_metrics(page, 0) == {"running": 3.0, "kv_usage": 0.5}
    plain = b"vllm:num_requests_running 4\n"  # no engine label: the server's, for every rank
    assert parse_engine_metrics(plain, 1) == {"running": 4.0}


# -- the batch's rank --------------------------------------------------------------------------


def test_scan_keeps_the_batch_rank():
    enc = msgspec.msgpack.Encoder()
    assert scan(enc.encode([1.0, []])).data_parallel_rank is None
    assert scan(enc.encode([1.0, [], None])).data_parallel_rank is None
    assert scan(enc.encode([1.0, [], 3])).data_parallel_rank == 3
    assert scan(enc.encode([1.0, [], -1])) is None  # (not a rank: the general decoder's)


# -- end to end ---------------------------------------------------------------------------------


def _consecutive_ports(n: int) -> int:
    """A base port with ``n`` free ports from it."""
    for _ in range(50):
        base = free_port()
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no consecutive free ports")


def _stored(kv, tokens: list[int], first_hash: int):
    n = len(tokens) // BS
    return kv.BlockStored(block_hashes=[first_hash + i for i in range(n)], parent_block_hash=None,
                          token_ids=tokens, block_size=BS, lora_id=None, medium="GPU",
                          lora_name=None)


@contextlib.contextmanager
def _vllm_ranks(kv, events: int, replay: int, n: int):
    """``n`` ranks of vLLM's publisher, each offsetting the base ports by its rank."""
    pubs = [kv.ZmqEventPublisher(data_parallel_rank=r, endpoint=f"tcp://*:{events}",
                                 replay_endpoint=f"tcp://*:{replay}") for r in range(n)]
    try:
        yield pubs
    finally:
        for p in pubs:
            p.shutdown()


def _complete(g: GatewayProcess, ids: list[int]) -> httpx.Response:
    return httpx.post(g.url + "/v1/completions", timeout=20,
                      json={"model": "fake", "prompt": ids, "max_tokens": 2})


def test_gateway_sends_the_chosen_rank_and_mismatched_batches_are_counted():
    kv = pytest.importorskip("vllm.distributed.kv_events")
    events, replay = _consecutive_ports(2), _consecutive_ports(2)
    a = list(range(1000, 1000 + 4 * BS))  # cached on rank 1 only
    b = list(range(5000, 5000 + 4 * BS))  # cached on rank 0 only
    eng = EngineThread([free_port()])
    try:
        with _vllm_ranks(kv, events, replay, 2) as pubs:
            assert pubs[1].get_publisher_config().endpoint == f"tcp://*:{events + 1}"
            g = GatewayProcess([], "--endpoint", f"srv=tcp://127.0.0.1:{events},"
                               f"replay=tcp://127.0.0.1:{replay},model=fake,http={eng.urls[0]},dp=2")
            g.n_engines = 2
            with g:
                names = {e["name"]: e for e in httpx.get(g.url + "/v1/engines").json()["engines"]}
                assert set(names) == {"srv-dp0", "srv-dp1"}
                assert names["srv-dp1"]["endpoint"] == f"tcp://127.0.0.1:{events + 1}"
                assert names["srv-dp1"]["http"] == names["srv-dp0"]["http"] == eng.urls[0]

                def held(ids: list[int]) -> dict[str, int]:
                    got = httpx.post(g.url + "/v1/lookup", json={"token_ids": ids, "model": "fake"}).json()
                    return {e["engine"]: e["matched_tokens"] for e in got["engines"]}

                # Each rank announces its blocks (its batches stamped with its own rank).
                def announce() -> bool:
                    pubs[1].publish(kv.KVEventBatch(ts=time.time(), events=[_stored(kv, a, 100)]))
                    pubs[0].publish(kv.KVEventBatch(ts=time.time(), events=[_stored(kv, b, 200)]))
                    return wait_for(lambda: held(a) == {"srv-dp1": len(a)} and held(b) == {"srv-dp0": len(b)}, 2)
                assert wait_for(announce, 20), (held(a), held(b))
                assert g.metric("kvevents_dp_rank_mismatches_total") == 0

                # The gateway runs each prompt on the rank that holds it, and says which.
                eng.stats.ranks.clear()
                for ids in (a, b, a, b):
                    resp = _complete(g, ids)
                    assert resp.status_code == 200, resp.text
                    assert resp.headers["x-kvevents-engine"] == ("srv-dp1" if ids is a else "srv-dp0")
                assert eng.stats.ranks == [b"1", b"0", b"1", b"0"]

                # A client's own rank header is not the one sent: the gateway's choice is.
                resp = httpx.post(g.url + "/v1/completions", timeout=20, headers={"X-data-parallel-rank": "0"},
                                  json={"model": "fake", "prompt": a, "max_tokens": 2})
                assert resp.status_code == 200 and eng.stats.ranks[-1] == b"1"

                # A batch stamped rank 1 on rank 0's stream: applied, and counted once.
                c = list(range(9000, 9000 + 2 * BS))
                pubs[0].publish(kv.KVEventBatch(ts=time.time(), events=[_stored(kv, c, 300)],
                                                data_parallel_rank=1))
                assert wait_for(lambda: g.metric("kvevents_dp_rank_mismatches_total", engine="srv-dp0") == 1, 10)
                assert held(c) == {"srv-dp0": len(c)}
                assert g.metric("kvevents_dp_rank_mismatches_total", engine="srv-dp1") == 0
                assert "is data-parallel rank 0, but its stream carries batches of rank 1" in g.log_text()
    finally:
        eng.close()


def test_sink_rank_is_settable():
    """The engine's sink knows the rank it takes batches of (-1: any)."""
    sink = PrefixIndex().sink("e-dp0", "m")
    assert sink.dp_rank == -1
    sink.dp_rank = 1
    assert sink.dp_rank == 1


def test_sglang_ranks_are_checked_by_attn_dp_rank():
    """SGLang's own publisher at attn_dp_rank 1 offsets its ports by 1 and stamps its
    batches ``attn_dp_rank``: followed as ``NAME-dp1`` by ``dp=2``, its batches are that
    rank's; one stamped with rank 0 on that stream is counted, and applied."""
    try:
        from sglang.srt.disaggregation import kv_events as sgl
    except Exception as exc:  # ImportError, or a missing transitive module
        pytest.skip(f"sglang not importable ({type(exc).__name__}: {exc})")
    from support import wait_until

    from kvevents.service.aggregator import Aggregator
    from kvevents.service.settings import AggregatorSettings

    events, replay = _consecutive_ports(2), _consecutive_ports(2)
    pub = sgl.ZmqEventPublisher(attn_dp_rank=1, endpoint=f"tcp://127.0.0.1:{events}",
                                replay_endpoint=f"tcp://127.0.0.1:{replay}", bind=True, buffer_steps=100)
    agg = Aggregator(AggregatorSettings(engines=[
        f"sg=tcp://127.0.0.1:{events},replay=tcp://127.0.0.1:{replay},dp=2"]))
    agg.start()
    try:
        def page(h: int, first: int):
            return sgl.BlockStored(block_hashes=[h], parent_block_hash=None,
                                   token_ids=list(range(first, first + BS)), block_size=BS, lora_id=None)

        def on_dp1(first: int) -> bool:
            return [(m.engine, m.tokens) for m in agg.lookup(list(range(first, first + BS))).engines] == \
                [("sg-dp1", BS)]

        assert wait_until(lambda: (pub.publish(sgl.KVEventBatch(ts=time.time(), events=[page(1, 0)]))
                                   or wait_until(lambda: on_dp1(0), 1)), 15)
        assert agg.rank_mismatches == {}
        pub.publish(sgl.KVEventBatch(ts=time.time(), events=[page(2, 500)], attn_dp_rank=0))
        assert wait_until(lambda: agg.rank_mismatches == {"sg-dp1": 1}, 10), agg.rank_mismatches
        assert on_dp1(500)
    finally:
        agg.stop()
        pub.shutdown()
