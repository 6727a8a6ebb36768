"""K8sSource against a fake API server on 127.0.0.1 (tests/discovery/k8s_api.py) that
speaks list and watch for pods as the real one does: the initial set, watch events,
410 re-lists, bookmarks, API errors and outages, stop during a blocked watch, and the
config and import errors a user meets at start-up."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("lightkube")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from support import wait_until  # noqa: E402
from k8s_api import FakeKubeAPI, make_pod, selector_matches, write_kubeconfig  # noqa: E402

from kvevents.discovery import k8s as k8s_module  # noqa: E402
from kvevents.discovery.k8s import K8sSource  # noqa: E402
from kvevents.discovery.targets import PortPlan  # noqa: E402
from kvevents.engines.spec import EngineSpec  # noqa: E402

SELECTOR = "app=vllm,tier in (serve,canary)"
SERVE = {"tier": "serve"}



class Emits:
    """What the source emitted, in order (the manager's ``emit``)."""

    def __init__(self) -> None:
        self.sets: list[list[EngineSpec]] = []
        self.lock = threading.Lock()

    def __call__(self, specs) -> None:
        with self.lock:
            self.sets.append(list(specs))

    @property
    def names(self) -> list[str] | None:
        with self.lock:
            return [s.name for s in self.sets[-1]] if self.sets else None

    def last(self) -> dict[str, EngineSpec]:
        with self.lock:
            return {s.name: s for s in self.sets[-1]}


@pytest.fixture
def api() -> Iterator[FakeKubeAPI]:
    with FakeKubeAPI() as server:
        yield server


@pytest.fixture
def kubeconfig(api, tmp_path) -> Path:
    return write_kubeconfig(tmp_path / "kubeconfig", api.url, api.token)


@contextmanager
def running(source: K8sSource, stop_within: float = 2.0) -> Iterator[Emits]:
    """``source.run`` on a thread; on exit, stop it and check it returned in time and
    left no thread of its own behind."""
    emits, stop = Emits(), threading.Event()
    before = set(threading.enumerate())
    thread = threading.Thread(target=source.run, args=(emits, stop), name="k8s-source-under-test")
    thread.start()
    try:
        yield emits
    finally:
        stop.set()
        t0 = time.monotonic()
        thread.join(10)
        took = time.monotonic() - t0
        assert not thread.is_alive() and took < stop_within, f"run() took {took:.2f} s to stop"
        left = [t for t in set(threading.enumerate()) - before if t.name.startswith("kvevents-k8s")]
        assert left == []


def fleet(api: FakeKubeAPI) -> None:
    """Two serving pods, and four that must not count."""
    api.put(make_pod("vllm-0", "127.0.0.2", labels=SERVE,
                     annotations={"kvevents.io/model": "Qwen/Qwen3-0.6B"}))
    api.put(make_pod("vllm-1", "127.0.0.3", labels={"tier": "canary"},
                     annotations={"kvevents.io/events-port": "6557", "kvevents.io/replay-port": "none",
                                  "kvevents.io/http-port": "9000", "kvevents.io/dp-size": "2"}))
    api.put(make_pod("vllm-pending", None, labels=SERVE, phase="Pending", ready=False))
    api.put(make_pod("vllm-unready", "127.0.0.5", labels=SERVE, ready=False))
    api.put(make_pod("vllm-leaving", "127.0.0.6", labels=SERVE, deleting=True))
    api.put(make_pod("other-0", "127.0.0.7", labels={"app": "other", "tier": "serve"}))


@pytest.mark.timeout(20)
def test_initial_list_emits_only_running_ready_pods(api, kubeconfig):
    fleet(api)
    source = K8sSource(SELECTOR, PortPlan(), model="default-model", kubeconfig=str(kubeconfig))
    assert source.origin == f"k8s:vllm/{SELECTOR}"
    with running(source) as emits:
        assert wait_until(lambda: emits.names is not None)
        got = emits.last()
        assert sorted(got) == ["vllm-0", "vllm-1-dp0", "vllm-1-dp1"]
        assert got["vllm-0"] == EngineSpec(name="vllm-0", endpoint="tcp://127.0.0.2:5557",
                                           replay_endpoint="tcp://127.0.0.2:5558",
                                           model="Qwen/Qwen3-0.6B", http="http://127.0.0.2:8000")
        # annotations over the flag defaults: ports, no replay, two ranks on events + r
        assert got["vllm-1-dp1"] == EngineSpec(name="vllm-1-dp1", endpoint="tcp://127.0.0.3:6558",
                                               replay_endpoint=None, model="default-model",
                                               http="http://127.0.0.3:9000", dp_rank=1)
        assert got["vllm-1-dp0"].endpoint == "tcp://127.0.0.3:6557"
        assert wait_until(lambda: api.watch_requests())
    assert source.status.first_round_done and source.status.engines == 3 and source.status.errors == 0
    first = api.requests[0]
    assert first["authorization"] == f"Bearer {api.token}"
    assert first["path"] == "/api/v1/namespaces/vllm/pods" and "watch" not in first["query"]
    assert selector_matches(first["query"]["labelSelector"], {"app": "vllm", "tier": "canary"})
    assert not selector_matches(first["query"]["labelSelector"], {"app": "vllm", "tier": "batch"})
    watch = api.watch_requests()[0]["query"]
    assert watch["resourceVersion"] == source.describe()["resource_version"]
    assert watch["allowWatchBookmarks"] == "true" and watch["timeoutSeconds"] == "60"
    assert source.describe() == {"kind": "kubernetes", "namespace": "vllm", "selector": SELECTOR,
                                 "resource_version": watch["resourceVersion"]}


@pytest.mark.timeout(20)
def test_watch_events_add_ready_pods_and_drop_deleted_ones(api, kubeconfig):
    api.put(make_pod("vllm-0", "127.0.0.2", labels=SERVE))
    source = K8sSource(SELECTOR, PortPlan(), kubeconfig=str(kubeconfig))
    with running(source) as emits:
        assert wait_until(lambda: emits.names == ["vllm-0"]) and wait_until(lambda: api.watch_requests())
        api.put(make_pod("vllm-1", None, labels=SERVE, phase="Pending", ready=False))  # ADDED, not counted
        assert wait_until(lambda: len(emits.sets) >= 2)
        assert emits.names == ["vllm-0"]
        t0 = time.monotonic()
        api.put(make_pod("vllm-1", "127.0.0.3", labels=SERVE))  # MODIFIED: Running and Ready
        assert wait_until(lambda: emits.names == ["vllm-0", "vllm-1"], 2.0), emits.names
        api.put(make_pod("vllm-1", "127.0.0.3", labels=SERVE, ready=False))  # readiness probe failing
        assert wait_until(lambda: emits.names == ["vllm-0"], 2.0), emits.names
        api.put(make_pod("vllm-1", "127.0.0.3", labels=SERVE))
        assert wait_until(lambda: emits.names == ["vllm-0", "vllm-1"], 2.0), emits.names
        api.put(make_pod("vllm-0", "127.0.0.2", labels={"tier": "batch"}))  # relabelled out: DELETED
        assert wait_until(lambda: emits.names == ["vllm-1"], 2.0), emits.names
        api.delete("vllm-1")
        assert wait_until(lambda: emits.names == [], 2.0), emits.names
        assert time.monotonic() - t0 < 6
    assert source.status.errors == 0 and source.status.extra["relists"] == 0
    assert len(api.watch_requests()) == 1  # one watch carried it all


@pytest.mark.timeout(20)
def test_410_mid_watch_relists_and_recovers_missed_changes(api, kubeconfig):
    api.put(make_pod("vllm-0", "127.0.0.2", labels=SERVE))
    api.put(make_pod("vllm-1", "127.0.0.3", labels=SERVE))
    source = K8sSource(SELECTOR, PortPlan(), kubeconfig=str(kubeconfig))
    with running(source) as emits:
        assert wait_until(lambda: emits.names == ["vllm-0", "vllm-1"]) and wait_until(lambda: api.watch_requests())
        # Changes whose events never reach the watch, then the server gives up on it.
        api.put(make_pod("vllm-2", "127.0.0.4", labels=SERVE), record=False)
        api.put(make_pod("vllm-0", "127.0.0.2", labels=SERVE, deleting=True), record=False)
        api.expire()
        assert wait_until(lambda: emits.names == ["vllm-1", "vllm-2"], 2.0), emits.names
        assert source.status.extra["relists"] == 1
        # ... and the fresh watch works: from the re-list's version
        api.put(make_pod("vllm-3", "127.0.0.5", labels=SERVE))
        assert wait_until(lambda: emits.names == ["vllm-1", "vllm-2", "vllm-3"], 2.0), emits.names
    assert source.status.errors == 0  # a 410 is routine, not a failure
    lists = [r for r in api.requests if "watch" not in r["query"]]
    assert len(lists) == 2 and len(api.watch_requests()) == 2


@pytest.mark.timeout(20)
def test_rewatch_from_a_too_old_version_gets_410_and_relists(api, kubeconfig):
    api.send_bookmarks = False  # bookmarks are best-effort: without one, the version goes stale
    api.put(make_pod("vllm-0", "127.0.0.2", labels=SERVE))
    source = K8sSource(SELECTOR, PortPlan(), kubeconfig=str(kubeconfig), watch_timeout_s=1)
    with running(source) as emits:
        assert wait_until(lambda: emits.names == ["vllm-0"]) and wait_until(lambda: api.watch_requests())
        # Other pods move the cluster on and the window past the listed version, while
        # a change of ours is never delivered; the watch times out after 1 s and its
        # re-watch from the listed version gets an ERROR 410 event.
        api.put(make_pod("other-0", "127.0.0.9", labels={"app": "other"}))
        api.compact()
        api.put(make_pod("vllm-1", "127.0.0.3", labels=SERVE), record=False)
        assert wait_until(lambda: emits.names == ["vllm-0", "vllm-1"], 4.0), emits.names
        assert source.status.extra["relists"] == 1
        assert len(api.watch_requests()) >= 2 and source.status.errors == 0


@pytest.mark.timeout(20)
def test_bookmarks_keep_the_version_fresh_across_watch_timeouts(api, kubeconfig):
    api.put(make_pod("vllm-0", "127.0.0.2", labels=SERVE))
    source = K8sSource(SELECTOR, PortPlan(), kubeconfig=str(kubeconfig), watch_timeout_s=1)
    with running(source) as emits:
        assert wait_until(lambda: emits.names == ["vllm-0"]) and wait_until(lambda: api.watch_requests())
        listed = source.describe()["resource_version"]
        for i in range(5):  # a busy cluster: other pods churn, the window moves on
            api.put(make_pod(f"other-{i}", "127.0.0.9", labels={"app": "other"}))
        newest = api.put(make_pod("other-5", "127.0.0.9", labels={"app": "other"}))["metadata"]["resourceVersion"]
        assert wait_until(lambda: len(api.watch_requests()) >= 2, 3.0)
        api.compact()  # the listed version is now too old; the bookmarked one is not
        assert wait_until(lambda: len(api.watch_requests()) >= 3, 3.0)
        rewatch = api.watch_requests()[1]["query"]["resourceVersion"]
        assert int(rewatch) > int(listed) and rewatch == newest
        api.put(make_pod("vllm-1", "127.0.0.3", labels=SERVE))
        assert wait_until(lambda: emits.names == ["vllm-0", "vllm-1"], 3.0), emits.names
    assert source.status.extra["relists"] == 0 and source.status.errors == 0


@pytest.mark.timeout(20)
def test_api_errors_keep_the_last_set_and_recover(api, kubeconfig):
    api.fail_status = 500
    api.put(make_pod("vllm-0", "127.0.0.2", labels=SERVE))
    source = K8sSource(SELECTOR, PortPlan(), kubeconfig=str(kubeconfig))
    with running(source) as emits:
        assert wait_until(lambda: source.status.errors >= 1)
        assert "500" in source.status.last_error and "etcdserver" in source.status.last_error
        assert emits.sets == [] and not source.status.first_round_done  # never an empty set
        api.fail_status = None
        assert wait_until(lambda: emits.names == ["vllm-0"], 4.0), source.status
    assert source.status.first_round_done


@pytest.mark.timeout(30)
def test_api_server_down_keeps_the_last_set_and_recovers(api, kubeconfig):
    api.put(make_pod("vllm-0", "127.0.0.2", labels=SERVE))
    api.put(make_pod("vllm-1", "127.0.0.3", labels=SERVE))
    source = K8sSource(SELECTOR, PortPlan(), kubeconfig=str(kubeconfig))
    with running(source) as emits:
        assert wait_until(lambda: emits.names == ["vllm-0", "vllm-1"]) and wait_until(lambda: api.watch_requests())
        count = len(emits.sets)
        api.stop()  # the watch is cut mid-stream, then connections are refused
        assert wait_until(lambda: source.status.errors >= 2, 4.0), source.status
        assert len(emits.sets) == count and source.status.engines == 2  # the last set stands
        api.delete("vllm-0")  # changed while down: the re-list must see it
        api.put(make_pod("vllm-2", "127.0.0.4", labels=SERVE))
        api.start()
        assert wait_until(lambda: emits.names == ["vllm-1", "vllm-2"], 6.0), (emits.names, source.status)
        assert all(s for s in emits.sets)  # no empty set was ever emitted
    assert source.status.errors >= 2 and source.status.last_error


@pytest.mark.timeout(15)
def test_stop_returns_quickly_from_a_blocked_watch(api, kubeconfig):
    api.put(make_pod("vllm-0", "127.0.0.2", labels=SERVE))
    source = K8sSource(SELECTOR, PortPlan(), kubeconfig=str(kubeconfig), watch_timeout_s=300)
    with running(source, stop_within=1.0) as emits:  # `running` times the stop
        assert wait_until(lambda: emits.names == ["vllm-0"]) and wait_until(lambda: api.watch_requests())
        time.sleep(0.3)  # blocked reading the watch: no events, no timeout for 300 s
    # ... and during a back-off after an error
    api.fail_status = 500
    with running(source, stop_within=1.0):
        assert wait_until(lambda: source.status.errors >= 1)


@pytest.mark.timeout(15)
def test_bad_annotations_skip_the_pod_and_warn_once(api, kubeconfig, caplog):
    api.put(make_pod("vllm-0", "127.0.0.2", labels=SERVE))
    api.put(make_pod("vllm-bad", "127.0.0.3", labels=SERVE, annotations={"kvevents.io/events-port": "55x7"}))
    api.put(make_pod("vllm-wide", "127.0.0.4", labels=SERVE, annotations={"kvevents.io/dp-size": "4096"}))
    source = K8sSource(SELECTOR, PortPlan(), kubeconfig=str(kubeconfig))
    with caplog.at_level(logging.WARNING, logger="kvevents.discovery.k8s"), running(source) as emits:
        assert wait_until(lambda: emits.names == ["vllm-0"]) and wait_until(lambda: api.watch_requests())
        for _ in range(3):  # more events: the bad pods are skipped again, not re-warned
            api.put(make_pod("vllm-0", "127.0.0.2", labels=SERVE))
        assert wait_until(lambda: len(emits.sets) >= 4)
        assert source.status.extra["bad_pods"] == 2
        api.put(make_pod("vllm-bad", "127.0.0.3", labels=SERVE, annotations={"kvevents.io/events-port": "5600"}))
        assert wait_until(lambda: emits.names == ["vllm-0", "vllm-bad"], 2.0)
        assert source.status.extra["bad_pods"] == 1
    warnings = [r.getMessage() for r in caplog.records if "skipping pod" in r.getMessage()]
    assert len(warnings) == 2, warnings
    assert any("vllm-bad" in w and "kvevents.io/events-port" in w for w in warnings)
    assert any("vllm-wide" in w and "dp_size" in w for w in warnings)


@pytest.mark.timeout(15)
def test_a_pods_role_label_gives_its_engines_role(api, kubeconfig):
    """Prefill/decode pools are labels: ours, else llm-d's; a bad value skips the pod."""
    api.put(make_pod("vllm-p", "127.0.0.2", labels={**SERVE, "kvevents.io/role": "prefill"}))
    api.put(make_pod("vllm-d", "127.0.0.3", labels={**SERVE, "llm-d.ai/role": "Decode"},
                     annotations={"kvevents.io/dp-size": "2"}))
    api.put(make_pod("vllm-b", "127.0.0.4", labels=SERVE))
    api.put(make_pod("vllm-x", "127.0.0.5", labels={**SERVE, "kvevents.io/role": "prefil"}))
    source = K8sSource(SELECTOR, PortPlan(), kubeconfig=str(kubeconfig))
    with running(source) as emits:
        assert wait_until(lambda: emits.names is not None and len(emits.names) == 4)
        got = emits.last()
    assert {n: s.role for n, s in got.items()} == {
        "vllm-p": "prefill", "vllm-d-dp0": "decode", "vllm-d-dp1": "decode", "vllm-b": "both"}
    assert source.status.extra["bad_pods"] == 1


@pytest.mark.timeout(10)
def test_a_pod_whose_engine_name_is_taken_is_skipped(api, kubeconfig):
    api.put(make_pod("vllm-2", "127.0.0.2", labels=SERVE, annotations={"kvevents.io/dp-size": "2"}))
    api.put(make_pod("vllm-2-dp0", "127.0.0.3", labels=SERVE))
    source = K8sSource(SELECTOR, PortPlan(), kubeconfig=str(kubeconfig))
    with running(source) as emits:
        assert wait_until(lambda: emits.names == ["vllm-2-dp0", "vllm-2-dp1"])
        assert emits.last()["vllm-2-dp0"].endpoint == "tcp://127.0.0.2:5557"  # pod vllm-2's rank 0
    assert source.status.extra["bad_pods"] == 1


@pytest.mark.timeout(10)
def test_namespace_and_config_resolution(api, tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    # KUBECONFIG (first existing file of the list) and its context's namespace
    kc = write_kubeconfig(tmp_path / "kc", api.url, api.token, namespace="inference")
    monkeypatch.setenv("KUBECONFIG", f"{tmp_path / 'missing'}:{kc}")
    assert K8sSource("app=vllm", PortPlan()).origin == "k8s:inference/app=vllm"
    assert K8sSource("app=vllm", PortPlan(), namespace="other").namespace == "other"
    # no namespace in the context: "default"
    bare = write_kubeconfig(tmp_path / "bare", api.url, api.token, namespace=None)
    assert K8sSource("app=vllm", PortPlan(), kubeconfig=str(bare)).namespace == "default"
    # in a pod: the service account, and its namespace
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text("pod-token")
    (account / "namespace").write_text("serving")
    (account / "ca.crt").write_text("")
    monkeypatch.setattr(k8s_module, "SERVICE_ACCOUNT_DIR", str(account))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    in_pod = K8sSource("app=vllm", PortPlan())
    assert in_pod.namespace == "serving" and in_pod._config.cluster.server == "https://127.0.0.1:6443"
    assert in_pod.describe()["namespace"] == "serving"
    # errors a user meets at start-up are ValueErrors that say what is wrong
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no usable cluster config.*not found"):
        K8sSource("app=vllm", PortPlan())
    with pytest.raises(ValueError, match="label selector"):
        K8sSource("app=vllm,tier in serve", PortPlan(), kubeconfig=str(kc))
    with pytest.raises(ValueError, match="namespace"):
        K8sSource("app=vllm", PortPlan(), kubeconfig=str(kc), namespace="Not_A_Namespace")


def test_selector_parsing():
    from kvevents.discovery.k8s_pods import parse_selector
    from lightkube.core.selector import build_selector

    for text, sent in [("app=vllm", "app=vllm"), ("app==vllm, tier!=canary", "app=vllm,tier!=canary"),
                       ("example.com/role in (b, a),!spot,gpu", "example.com/role in (a,b),!spot,gpu"),
                       ("env notin (dev)", "env notin (dev)")]:
        assert build_selector(parse_selector(text)) == sent
    assert parse_selector("") == []
    assert build_selector(parse_selector("app=")) == "app="  # an empty value is legal
    for bad in ("app=vllm=x", "app in (a", "a b", "app=in valid", ",", "app in ()"):
        with pytest.raises(ValueError):
            parse_selector(bad)


def test_missing_library_says_which_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "lightkube", None)  # as if not installed
    with pytest.raises(ImportError) as info:
        K8sSource("app=vllm", PortPlan(), kubeconfig=str(tmp_path / "kc"))
    assert str(info.value) == "Kubernetes discovery needs the k8s extra: pip install 'kvevents[k8s]'"
