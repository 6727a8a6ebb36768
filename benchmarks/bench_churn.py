"""Churn: engines come and go through discovery, and the aggregator keeps nothing of them.

The target (issue: churn): 1,000 engine add/remove cycles, 50 engines followed at a time,
publishers really started and stopped: RSS growth < 20 MB, open file descriptors and
threads back to their start, metric series back to their start, and the index exact
against the publishers' truth at the end.

In process: an :class:`~kvevents.service.aggregator.Aggregator` and a
:class:`~kvevents.discovery.Discovery` manager (grace period ``--grace``) with one real
:class:`~kvevents.discovery.Source` whose listing the benchmark sets, so every add and
remove goes through the manager's reconcile and grace period. Each engine is a real
:class:`~kvevents.wire.publisher.ZmqEventPublisher` bound on 127.0.0.1 (live + replay)
in front of a vLLM-like LRU block pool (``--capacity`` 16-token blocks) serving requests
made of shared system prompts, shared documents and unique tails: one ``BlockStored``
per request for the blocks it misses (parent = the last cached block), one
``BlockRemoved`` per evicted leaf, a request or two per batch. The pool is the truth the
index is checked against.

One wave: the ``--wave`` oldest engines' publishers are shut down and dropped from the
listing, as many new engines under new names are started (their first requests
published before they are listed, so the aggregator recovers them by replay) and listed,
and every engine publishes ``--batches`` more batches. Half the engines replaced are shut
down before their source stops listing them, half are delisted while they still publish
(shut down at the next wave). Every ``--restart-every`` cycles one engine comes back
under the SAME name as a new process, alternately at its old ports (the old one exits
first; seq starts over: caught by stream continuity) and at new ports while the old one
still publishes (a new spec: re-followed, its state dropped, never merged). A cycle is one
engine removed and one new engine added; ``--cycles`` of them take ``cycles / wave``
waves. Every engine is replaced once (a warm-up) before the baseline.

Measured at the baseline and at the end, each after the grace period has passed and
everything published is applied (quiescence), after ``gc.collect()``: RSS (VmRSS), open
fds (/proc/self/fd), threads (``threading.active_count()`` and the OS count, which
includes ZeroMQ's IO threads), metric series (sample lines of the registry's
exposition: engine-labelled and all), and the index: every engine followed holds exactly
the blocks its pool holds (``PrefixIndex.engine_hashes``, what ``GET
/v1/engines/{name}/blocks`` shows), lookups of the shared prompts match the pools, and
the index knows no engine but those followed; and nothing (index blocks or counters,
metrics, writer, subscriber, registry, discovery) keeps state of a removed engine. Each
restarted engine is also checked right after its restart: rebuilt from its new process
alone. Publishers are shut down (and their threads joined) as they are replaced, so only
the aggregator can account for growth.

    .venv/bin/python benchmarks/bench_churn.py [--cycles 1000 --engines 50 --wave 1]

Exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import logging
import os
import random
import shlex
import sys
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zmq  # noqa: E402
from prometheus_client import generate_latest  # noqa: E402

from common import machine, print_table, write_json  # noqa: E402
from kvevents.demo.fleet import free_port  # noqa: E402
from kvevents.discovery import Discovery, Source  # noqa: E402
from kvevents.engines import EngineSpec  # noqa: E402
from kvevents.service.aggregator import Aggregator  # noqa: E402
from kvevents.service.settings import AggregatorSettings  # noqa: E402
from kvevents.wire.publisher import PublisherConfig, ZmqEventPublisher  # noqa: E402
from kvevents.wire.schema import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402

BS = 16
VOCAB = 32_000
ORIGIN = "bench:churn"


# ---- the engines' side: a vLLM-like block pool behind a real publisher --------------------


def block_hashes(tokens: list[int], parent: int | None = None) -> list[int]:
    """Chained 64-bit hashes of (parent, block tokens), the same on every engine (as with
    vLLM's common hash seed): a shared prefix has the same hashes everywhere."""
    out = []
    prev = parent or 0
    for i in range(0, len(tokens) - len(tokens) % BS, BS):
        h = hashlib.blake2b(prev.to_bytes(8, "little")
                            + b"".join(t.to_bytes(2, "little") for t in tokens[i:i + BS]),
                            digest_size=8)
        prev = int.from_bytes(h.digest(), "little") >> 1  # 63 bits: positive everywhere
        out.append(prev)
    return out


class Corpus:
    """Shared system prompts and documents (deterministic), and requests drawn from them:
    a system prompt, a document half the time, and a unique tail."""

    def __init__(self, seed: int = 0, prompts: int = 12, docs: int = 24) -> None:
        rng = random.Random(seed)
        self.systems = [[rng.randrange(VOCAB) for _ in range(BS * rng.randint(6, 24))]
                        for _ in range(prompts)]
        self.docs = [[rng.randrange(VOCAB) for _ in range(BS * rng.randint(4, 16))]
                     for _ in range(docs)]
        self._heads: dict[tuple[int, int], tuple[list[int], list[int]]] = {}

    def head(self, s: int, d: int) -> tuple[list[int], list[int]]:
        """(tokens, hashes) of system prompt ``s`` followed by document ``d`` (-1: none)."""
        key = (s, d)
        if key not in self._heads:
            toks = self.systems[s] + (self.docs[d] if d >= 0 else [])
            self._heads[key] = (toks, block_hashes(toks))
        return self._heads[key]

    def request(self, rng: random.Random) -> tuple[list[int], list[int]]:
        s = min(int(rng.paretovariate(1.2)) - 1, len(self.systems) - 1)  # Zipf-like
        d = rng.randrange(len(self.docs)) if rng.random() < 0.5 else -1
        toks, hashes = self.head(s, d)
        tail = [rng.randrange(VOCAB) for _ in range(BS * rng.randint(1, 6) + rng.randrange(BS))]
        return toks + tail, hashes + block_hashes(tail, hashes[-1])


class Pool:
    """An engine's prefix cache: LRU over leaves (a block with no cached child), so what
    is resident is always closed under parents. The truth the index must equal."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.parent: dict[int, int | None] = {}
        self.children: dict[int, int] = {}

    def serve(self, tokens: list[int], hashes: list[int]) -> list:
        """The events of serving one request: its missing blocks stored, evictions."""
        k = 0
        while k < len(hashes) and hashes[k] in self.lru:
            self.lru.move_to_end(hashes[k])  # a hit refreshes the block
            k += 1
        events: list = []
        if k < len(hashes):
            parent = hashes[k - 1] if k else None
            new = hashes[k:]
            events.append(BlockStored(new, parent, tokens[k * BS:len(hashes) * BS], BS,
                                      None, "GPU", None))
            for h in new:
                self.lru[h] = None
                self.parent[h] = parent
                self.children[h] = 0
                if parent is not None:
                    self.children[parent] += 1
                parent = h
        while len(self.lru) > self.capacity:
            victim = next(h for h in self.lru if self.children[h] == 0)
            del self.lru[victim]
            del self.children[victim]
            p = self.parent.pop(victim)
            if p is not None:
                self.children[p] -= 1
            events.append(BlockRemoved([victim], "GPU"))
        return events

    def resident(self) -> set[int]:
        return set(self.lru)

    def matched_tokens(self, hashes: list[int]) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self.lru:
            n += 1
        return n * BS


def _publisher(live: int, replay: int) -> ZmqEventPublisher:
    return ZmqEventPublisher(PublisherConfig(endpoint=f"tcp://127.0.0.1:{live}",
                                             replay_endpoint=f"tcp://127.0.0.1:{replay}",
                                             bind=True))


class Engine:
    """One engine process: a pool and the publisher that announces it."""

    def __init__(self, name: str, corpus: Corpus, rng: random.Random, capacity: int,
                 ports: tuple[int, int] | None = None) -> None:
        self.name = name
        self.corpus = corpus
        self.rng = rng
        self.pool = Pool(capacity)
        self.pub, self.live, self.replay = self._start(ports)
        self.removals = 0

    @staticmethod
    def _start(ports: tuple[int, int] | None) -> tuple[ZmqEventPublisher, int, int]:
        """A publisher at ``ports`` (retried while the previous process's sockets close)
        or at fresh ports (others may take a port between its choice and the bind:
        chosen again)."""
        deadline = time.monotonic() + 10
        while True:
            live, replay = ports or (free_port(), free_port())
            if live == replay:
                continue
            try:
                return _publisher(live, replay), live, replay
            except zmq.ZMQError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02 if ports else 0)

    @property
    def spec(self) -> EngineSpec:
        return EngineSpec(self.name, f"tcp://127.0.0.1:{self.live}",
                          replay_endpoint=f"tcp://127.0.0.1:{self.replay}")

    def publish(self, batches: int) -> None:
        """``batches`` engine steps of one or two requests each (steps that evict emit
        BlockRemoved after their BlockStored)."""
        for _ in range(batches):
            events: list = []
            for _ in range(self.rng.randint(1, 2)):
                events += self.pool.serve(*self.corpus.request(self.rng))
            if events:
                self.removals += sum(isinstance(e, BlockRemoved) for e in events)
                self.pub.publish(KVEventBatch(time.time(), events))

    def warm(self) -> None:
        """Publish until the pool is full and has evicted (every engine then has the
        same metric series: stored and removed events)."""
        while self.removals == 0:
            self.publish(1)

    def stop(self) -> None:
        self.pub.shutdown(0.5)
        thread = getattr(self.pub, "_thread", None)
        if thread is not None and thread.is_alive():
            raise RuntimeError(f"publisher of {self.name} did not stop")

    def restart(self, same_ports: bool) -> None:
        """A new process under the same name: empty pool, seq from 0; at the same ports
        or at new ones."""
        self.stop()
        self.pool = Pool(self.pool.capacity)
        self.removals = 0
        self.pub, self.live, self.replay = self._start((self.live, self.replay) if same_ports
                                                       else None)


class Listing(Source):
    """Lists what the benchmark sets, every 50 ms (a DNS source's rhythm, faster)."""

    origin = ORIGIN

    def __init__(self) -> None:
        super().__init__()
        self._specs: list[EngineSpec] = []
        self._lock = threading.Lock()
        self._changed = threading.Event()

    def set(self, specs: list[EngineSpec]) -> None:
        with self._lock:
            self._specs = list(specs)
        self._changed.set()

    def run(self, emit, stop: threading.Event) -> None:
        while not stop.is_set():
            with self._lock:
                specs = list(self._specs)
            emit(specs)
            self.status.succeeded(len(specs))
            self._changed.wait(0.05)
            self._changed.clear()

    def describe(self) -> dict:
        return {"kind": "benchmark listing"}


class _CountingHandler(logging.Handler):
    """Counts warnings and errors by logger (the churn should raise none unexpected)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: Counter[str] = Counter()
        self.samples: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        key = f"{record.levelname} {record.name}"
        self.counts[key] += 1
        self.samples.setdefault(key, record.getMessage()[:200])


# ---- measurements ------------------------------------------------------------------------


def _status_field(name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1])
    raise KeyError(name)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _stable(read, settle_s: float = 0.3, timeout_s: float = 10.0) -> int:
    """``read()`` once it gives the same value three times ``settle_s / 3`` apart
    (ZeroMQ closes sockets and joins its reaper asynchronously)."""
    deadline = time.monotonic() + timeout_s
    last, same = read(), 0
    while same < 2 and time.monotonic() < deadline:
        time.sleep(settle_s / 3)
        now = read()
        same = same + 1 if now == last else 0
        last = now
    return last


def series(registry) -> tuple[int, int, Counter]:
    """(engine-labelled sample lines, all sample lines, engine-labelled lines per family)."""
    engine, total, per = 0, 0, Counter()
    for line in generate_latest(registry).decode().splitlines():
        if not line or line.startswith("#"):
            continue
        total += 1
        if 'engine="' in line:
            engine += 1
            per[line.split("{", 1)[0]] += 1
    return engine, total, per


def _size(obj, *path: str) -> int | None:
    """len() of an internal structure, None where it is not there (others may rename)."""
    for name in path:
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    try:
        return len(obj)
    except TypeError:
        return None


@dataclass
class Snapshot:
    rss_kb: int
    fds: int
    py_threads: int
    os_threads: int
    engine_series: int
    all_series: int
    per_family: Counter
    followed: int
    index_exact: bool
    index_problems: list[str] = field(default_factory=list)
    leftovers: dict[str, list[str]] = field(default_factory=dict)
    internals: dict[str, int | None] = field(default_factory=dict)
    types: Counter = field(default_factory=Counter)  # gc-tracked objects by type


# ---- the run ------------------------------------------------------------------------------


class Churn:
    """The aggregator, its discovery manager, and the fleet the listing names."""

    def __init__(self, engines: int = 50, wave: int = 10, grace_s: float = 0.2,
                 capacity: int = 128, batches: int = 2, restart_every: int = 50,
                 seed: int = 0, settle_s: float = 60.0) -> None:
        """``settle_s``: how long quiescence may take (and a restarted engine's rebuild,
        a sixth of it) before what still differs is reported."""
        if not 1 <= wave <= engines:
            raise ValueError("wave must be within 1..engines")
        self.n_engines, self.wave_size, self.grace_s = engines, wave, grace_s
        self.capacity, self.batches, self.restart_every = capacity, batches, restart_every
        self.settle_s = settle_s
        self.rng = random.Random(seed)
        self.corpus = Corpus(seed)
        self.agg = Aggregator(AggregatorSettings(recovery_timeout_s=30))
        self.source = Listing()
        self.disc = Discovery(self.agg, [self.source], grace_s=grace_s)
        self.live: OrderedDict[str, Engine] = OrderedDict()  # oldest first
        # Delisted (or replaced) but still publishing: stopped at the next wave.
        self.retiring: list[Engine] = []
        self._next_name = 0
        self.waves = 0
        self.cycles = 0
        self.restarts = {"same ports": 0, "new ports": 0}
        self.slow_follows = 0  # waves whose new engines took > 10 s to be followed
        self.restart_problems: list[str] = []  # restarted engines not rebuilt exactly

    # -- lifecycle --

    def start(self) -> None:
        self.agg.start()
        self.disc.start()
        for _ in range(self.n_engines):
            self._add()
        self.source.set([e.spec for e in self.live.values()])
        self._wait_followed(list(self.live))

    def stop(self) -> None:
        self.disc.stop()
        self.agg.stop()
        self.retire()
        for e in self.live.values():
            e.stop()
        self.live.clear()

    def retire(self) -> None:
        """Stop the publishers delisted or replaced while still publishing."""
        for e in self.retiring:
            e.stop()
        self.retiring = []

    # -- churn --

    def _add(self) -> Engine:
        name = f"churn-{self._next_name:05d}"
        self._next_name += 1
        eng = Engine(name, self.corpus, random.Random(self.rng.random()), self.capacity)
        eng.warm()  # published before it is listed: recovered by the first replay
        self.live[name] = eng
        return eng

    def _wait_followed(self, names: list[str], timeout: float = 10.0) -> None:
        def done() -> bool:
            stats = self.agg.source_stats()
            for n in names:
                state = self.agg.engines.get(n)
                if (state is None or state.spec != self.live[n].spec or n not in stats
                        or not stats[n].initial_replay_done):
                    return False
            return True
        if not _wait(done, timeout):
            self.slow_follows += 1

    def wave(self) -> None:
        """``wave`` engines replaced by new ones (see the module docstring)."""
        self.retire()
        victims = list(self.live)[:self.wave_size]
        for i, name in enumerate(victims):
            eng = self.live.pop(name)
            if (self.cycles + i) % 2:
                eng.stop()  # gone before its source stops listing it
            else:
                self.retiring.append(eng)  # delisted while it still publishes
        added = [self._add().name for _ in victims]
        old = restarted = None
        self.waves += 1
        before, self.cycles = self.cycles, self.cycles + len(victims)
        if self.restart_every and self.cycles // self.restart_every > before // self.restart_every:
            n = self.cycles // self.restart_every
            same = n % 2 == 1
            # One followed a while (not one added just now).
            name = list(self.live)[len(self.live) // 2]
            eng = self.live[name]
            if same:  # the old process exits, the new one binds the same ports
                eng.restart(same_ports=True)
            else:  # the new process is listed while the old one still publishes
                old = eng
                self.retiring.append(eng)
                eng = self.live[name] = Engine(name, self.corpus, random.Random(self.rng.random()),
                                               self.capacity)
            eng.warm()
            added.append(name)
            restarted = name
            self.restarts["same ports" if same else "new ports"] += 1
        self.source.set([e.spec for e in self.live.values()])
        if old is not None:
            self._keep_publishing(old, self.live[old.name])
        for eng in [*self.live.values(), *self.retiring]:
            eng.publish(self.batches)
        self._wait_followed(added)
        if restarted is not None:
            self._check_rebuilt(restarted)

    def _check_rebuilt(self, name: str) -> None:
        """A restarted engine's state is its new process's, exactly (checked now: it may
        be replaced before the end)."""
        eng = self.live[name]
        if not _wait(lambda: not self._engine_problem(name, eng), self.settle_s / 6):
            self.restart_problems.append(f"restarted {self._engine_problem(name, eng)}")

    def _engine_problem(self, name: str, eng: Engine) -> str | None:
        """What differs between the index's view of ``name`` and ``eng`` (None: exact)."""
        state = self.agg.engines.get(name)
        if state is None or state.spec != eng.spec:
            return f"{name}: not followed at {eng.spec.endpoint}"
        want_seq = eng.pub.stats().next_seq - 1
        st = self.agg.source_stats().get(name)
        if st is None or st.last_seq != want_seq:
            return f"{name}: last seq {st and st.last_seq}, published {want_seq}"
        truth = eng.pool.resident()
        got = self.agg.index.engine_hashes(name)
        if got != ({"GPU": truth} if truth else {}):
            have = got.get("GPU", set())
            return (f"{name}: index {len(have)} blocks, pool {len(truth)} "
                    f"({len(have - truth)} extra, {len(truth - have)} missing)")
        return None

    def _keep_publishing(self, old: Engine, new: Engine) -> None:
        """The old process of a name keeps publishing (a batch every 2 ms) until the new
        one is followed in its place, and a little after: none of it may end up in the
        new engine's state."""
        def switched() -> bool:
            state = self.agg.engines.get(new.name)
            return state is not None and state.spec == new.spec
        deadline = time.monotonic() + 10
        after = 20
        while time.monotonic() < deadline and after > 0:
            if switched():
                after -= 1
            old.publish(1)
            time.sleep(0.002)

    # -- quiescence and truth --

    def index_problems(self) -> list[str]:
        """What differs between the index and the pools (empty: exact)."""
        agg, problems = self.agg, []
        followed = set(agg.engines.names())
        if followed != set(self.live):
            problems.append(f"followed != listed: +{sorted(followed - set(self.live))[:5]} "
                            f"-{sorted(set(self.live) - followed)[:5]}")
        in_index = set(agg.index.engines())
        if in_index != set(self.live):
            problems.append(f"index engines != listed: +{sorted(in_index - set(self.live))[:5]} "
                            f"-{sorted(set(self.live) - in_index)[:5]}")
        for name, eng in self.live.items():
            problem = self._engine_problem(name, eng)
            if problem:
                problems.append(problem)
        return problems + self.restart_problems

    def leftovers(self) -> dict[str, list[str]]:
        """Engines not followed that something still keeps state of, by what keeps it:
        the index (blocks, counters), the metrics, the writer, the subscriber, the
        registry, discovery."""
        agg, live = self.agg, set(self.live)
        c = agg.index.counters()
        kept = {
            "index blocks": agg.index.engines(),
            "index counters": [r.engine for r in c.applied] + [
                *c.unknown_removals, *c.orphan_blocks, *c.ignored_events, *c.refused_events],
            "writer anchors": list(getattr(agg.writer, "anchors", {})),
            "writer apply errors": [e for e, _ in getattr(agg.writer, "apply_errors", {})],
            "lag series": list(getattr(agg.metrics.event_lag, "_series", {})),
            "subscriber sources": list(agg.source_stats()),
            "registry": agg.engines.names(),
            "discovery": [n for st in self.disc.status() for n in st["engines"] + st["leaving"]],
        }
        return {what: sorted(set(names) - live) for what, names in kept.items()
                if set(names) - live}

    def lookup_problems(self) -> list[str]:
        """Lookups of every shared head (system prompt, and with each of a few documents)
        against the pools' leading runs."""
        problems = []
        for s in range(len(self.corpus.systems)):
            for d in (-1, s % len(self.corpus.docs)):
                toks, hashes = self.corpus.head(s, d)
                want = {n: m for n, e in self.live.items() if (m := e.pool.matched_tokens(hashes))}
                got = {m.engine: m.tokens for m in self.agg.lookup(toks).engines}
                if got != want:
                    diff = sorted(n for n in set(got) | set(want) if got.get(n) != want.get(n))
                    problems.append(f"lookup(system {s}, doc {d}): {len(diff)} engines differ, "
                                    f"e.g. {diff[:3]}")
        return problems

    def settle(self, timeout: float | None = None) -> list[str]:
        """Wait past the grace period until everything published is applied and the index
        equals the pools; returns what still differs then (empty: exact)."""
        time.sleep(self.grace_s + 0.25)  # the ticker runs every 0.2 s
        deadline = time.monotonic() + (self.settle_s if timeout is None else timeout)
        while True:
            problems = self.index_problems()
            if not problems or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        return problems + (self.lookup_problems() if not problems else [])

    def measure(self) -> Snapshot:
        self.retire()
        problems = self.settle()
        gc.collect()
        fds = _stable(_fds)
        os_threads = _stable(lambda: _status_field("Threads"))
        gc.collect()
        engine_series, all_series, per = series(self.agg.registry)
        agg = self.agg
        sub = agg._subscriber
        internals = {
            "registry engines": len(agg.engines),
            "subscriber sources": _size(sub, "_sources"),
            "subscriber sockets": _size(sub, "_by_socket"),
            "poller sockets": _size(sub, "_poller", "sockets"),
            "index engine ids": _size(agg.index, "_engines", "names"),
            "index past-life counters": _size(agg.index, "_counts", "applied"),
            "index refusal log": _size(agg.index, "_refusal_logged"),
            "writer anchors": _size(agg.writer, "anchors"),
            "writer apply errors": _size(agg.writer, "apply_errors"),
            "lag series": _size(agg.metrics, "event_lag", "_series"),
            "feed items": _size(agg.feed, "_items"),
            "Python objects (gc)": len(gc.get_objects()),
        }
        return Snapshot(
            rss_kb=_status_field("VmRSS"), fds=fds, py_threads=threading.active_count(),
            os_threads=os_threads, engine_series=engine_series, all_series=all_series,
            per_family=per, followed=len(agg.engines), index_exact=not problems,
            index_problems=problems, leftovers=self.leftovers(), internals=internals,
            types=Counter(type(o).__name__ for o in gc.get_objects()))


def _wait(pred, timeout: float, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def verdict(start: Snapshot, end: Snapshot,
            rss_limit_mb: float) -> list[tuple[str, str, str, str, bool]]:
    """(what, start, end, target, met) rows."""
    growth = (end.rss_kb - start.rss_kb) / 1024
    left = [len({n for names in snap.leftovers.values() for n in names}) for snap in (start, end)]
    return [
        ("RSS MB", f"{start.rss_kb / 1024:.1f}", f"{end.rss_kb / 1024:.1f} ({growth:+.1f})",
         f"growth < {rss_limit_mb:g}", growth < rss_limit_mb),
        ("open fds", str(start.fds), str(end.fds), "back to start", end.fds == start.fds),
        ("threads (Python)", str(start.py_threads), str(end.py_threads), "back to start",
         end.py_threads == start.py_threads),
        ("threads (OS, incl. ZeroMQ IO)", str(start.os_threads), str(end.os_threads),
         "back to start", end.os_threads == start.os_threads),
        ("metric series, engine-labelled", str(start.engine_series), str(end.engine_series),
         "back to start", end.engine_series == start.engine_series),
        ("metric series, all", str(start.all_series), str(end.all_series), "back to start",
         end.all_series == start.all_series),
        ("engines followed", str(start.followed), str(end.followed), "the listing",
         start.followed == end.followed),
        ("index exact vs publishers' truth", "yes" if start.index_exact else "NO",
         "yes" if end.index_exact else "NO", "exact", start.index_exact and end.index_exact),
        ("removed engines with state left", str(left[0]), str(left[1]), "0",
         not left[0] and not left[1]),
    ]


def run(a) -> int:
    info = machine()
    info["load_average"] = os.getloadavg()
    command = shlex.join([os.path.relpath(sys.executable), *sys.argv])
    print(f"machine: {info['cpu']}, {info['cores']} cores, Python {info['python']}, "
          f"load average {' '.join(f'{x:.2f}' for x in info['load_average'])}")
    print(f"command: {command}")
    print(f"churn: {a.cycles} add/remove cycles in waves of {a.wave}, {a.engines} engines "
          f"followed at a time, grace {a.grace:g} s, pools of {a.capacity} blocks, "
          f"{a.batches} batches per engine per wave, a same-name restart every "
          f"{a.restart_every} cycles")
    sys.stdout.flush()
    counting = _CountingHandler()
    logging.getLogger().addHandler(counting)
    logging.getLogger().setLevel(logging.WARNING)

    churn = Churn(a.engines, a.wave, a.grace, a.capacity, a.batches, a.restart_every, a.seed)
    t0 = time.monotonic()
    churn.start()
    for _ in range(-(-a.engines // a.wave)):  # warm-up: every engine replaced once
        churn.wave()
    warm_cycles = churn.cycles
    start = churn.measure()
    print(f"warm-up: {warm_cycles} cycles in {time.monotonic() - t0:.1f} s; baseline taken")
    sys.stdout.flush()
    t1 = time.monotonic()
    waves = -(-a.cycles // a.wave)
    for i in range(waves):
        churn.wave()
        if a.progress and (i + 1) % max(1, waves // 10) == 0:
            print(f"  {churn.cycles - warm_cycles} cycles, {time.monotonic() - t1:.0f} s, "
                  f"RSS {_status_field('VmRSS') / 1024:.1f} MB, fds {_fds()}, "
                  f"followed {len(churn.agg.engines)}")
            sys.stdout.flush()
    churn_s = time.monotonic() - t1
    end = churn.measure()
    measured_cycles = churn.cycles - warm_cycles
    stats = churn.agg.source_stats()
    restarts_seen = sum(st.restarts for st in stats.values())
    churn.stop()

    rows = verdict(start, end, a.rss_limit_mb)
    print()
    print(f"{measured_cycles} cycles ({churn.waves - -(-a.engines // a.wave)} waves) in "
          f"{churn_s:.1f} s ({measured_cycles / churn_s:.1f} cycles/s), plus "
          f"{sum(churn.restarts.values())} same-name restarts ({churn.restarts['same ports']} "
          f"at the same ports, {churn.restarts['new ports']} at new ports); discovery added "
          f"{churn.disc.added}, removed {churn.disc.removed} engines in all")
    print_table(["measure", "start", "end", "target", "result"],
                [[w, s, e, t, "PASS" if ok else "FAIL"] for w, s, e, t, ok in rows])
    print()
    print("internals (diagnostic):")
    print_table(["structure", "start", "end"],
                [[k, start.internals[k], end.internals[k]] for k in start.internals])
    grown = (end.types - start.types).most_common(6)
    if grown:
        print("gc-tracked objects that grew most: "
              + ", ".join(f"{t} +{n}" for t, n in grown))
    changed = sorted(set(start.per_family) | set(end.per_family))
    changed = [f for f in changed if start.per_family[f] != end.per_family[f]]
    if changed:
        print("\nengine-labelled series that changed, per family:")
        print_table(["family", "start", "end"],
                    [[f, start.per_family[f], end.per_family[f]] for f in changed])
    for label, snap in (("baseline", start), ("end", end)):
        for p in snap.index_problems[:10]:
            print(f"index ({label}): {p}")
        for what, names in snap.leftovers.items():
            print(f"state left ({label}): {what}: {len(names)} removed engines, e.g. {names[:3]}")
    if counting.counts:
        print("\nwarnings and errors logged:")
        for key, n in counting.counts.most_common():
            print(f"  {n:6d}  {key}: {counting.samples[key]}")
    print(f"publisher restarts detected by the aggregator (engines followed at the end): "
          f"{restarts_seen}; waves whose new engines took > 10 s to be followed: "
          f"{churn.slow_follows}")
    ok = all(r[-1] for r in rows)
    print(f"\n{'PASS' if ok else 'FAIL'}: churn target "
          f"({'met' if ok else 'missed: ' + ', '.join(r[0] for r in rows if not r[-1])})")
    if a.json:
        write_json(a.json, {
            "benchmark": "churn", "machine": info, "command": command, "args": vars(a),
            "cycles": measured_cycles, "seconds": churn_s, "restarts": churn.restarts,
            "rows": [{"measure": w, "start": s, "end": e, "target": t, "met": m}
                     for w, s, e, t, m in rows],
            "internals": {"start": start.internals, "end": end.internals},
            "problems": {"start": start.index_problems, "end": end.index_problems},
            "leftovers": {"start": start.leftovers, "end": end.leftovers},
            "logged": dict(counting.counts), "pass": ok})
    return 0 if ok else 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=1000, help="add/remove cycles measured")
    ap.add_argument("--engines", type=int, default=50, help="engines followed at a time")
    ap.add_argument("--wave", type=int, default=1, help="engines replaced at once")
    ap.add_argument("--grace", type=float, default=0.2, help="discovery grace period, s")
    ap.add_argument("--capacity", type=int, default=128, help="blocks per engine pool")
    ap.add_argument("--batches", type=int, default=2, help="batches per engine per wave")
    ap.add_argument("--restart-every", type=int, default=50,
                    help="cycles between same-name restarts (0: none)")
    ap.add_argument("--rss-limit-mb", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--progress", action="store_true", help="a line every tenth of the run")
    ap.add_argument("--json", default="benchmarks/results/churn.json")
    sys.exit(run(ap.parse_args()))


if __name__ == "__main__":
    main()
