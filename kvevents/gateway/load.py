"""Each gateway target's load: what this gateway has in flight there, first hand, and
what the engine itself reports on its ``/metrics``.

First hand (exact, instant): requests in flight from this gateway and the prompt tokens
they still had to compute (their prompt minus the cached prefix the index predicted),
counted from the moment a request is sent until its answer ends.

From the engine (polled by one task on the event loop): ``vllm:num_requests_waiting``,
``vllm:num_requests_running`` and ``vllm:kv_cache_usage_perc``, summed over the engine's
label sets, asked for by name (:data:`FILTERED`) where the engine serves such a page.
They include other clients' and other gateway replicas' requests, which is how several
replicas balance without talking to each other: at each poll the engine's
total minus what this gateway had in flight then (less those sent in the last
:data:`SETTLE_S`, which the engine's gauges do not show yet) is the rest of the world's
load, carried until the next poll. How old that figure is decides how well replicas balance:
another replica's requests are invisible here until the next poll, so replicas that see
the same stale figures send the same way. Hence two cadences: every
``busy_interval_s`` while this gateway is routing (requests in flight, or one ended
within the last ``interval_s``), every ``interval_s`` when it is idle; the first
request after an idle spell wakes the poller at once. A poll's timeout is tied to the
idle interval, so the fast cadence never makes a slow engine look unreachable sooner.

:meth:`EngineLoads.load` combines them into the policy's
:class:`~kvevents.routing.EngineLoad`: ``running`` = ours in flight now, ``waiting`` =
the others' plus our uncomputed prompt tokens in request units
(``prefill_tokens_per_request``), so a few long prefills weigh as much as many short
ones. ``kv_usage`` is the engine's. :meth:`EngineLoads.shares`: the fraction of this
gateway's recent requests it sent to each engine, which the policy's balance term
evens out (requests per engine, not time in flight).

Health: a refused connection (to a poll or a request), or two failed polls in a row,
mark the engine *unreachable* until a poll succeeds again; the gateway does not choose it
meanwhile. Failure here never raises into a request: a poll that fails is counted.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from dataclasses import dataclass, field

import httpx

from kvevents.routing import Candidate, EngineLoad

log = logging.getLogger(__name__)

#: Seconds a request sent to an engine takes to show in its gauges: the engine's HTTP
#: front renders and tokenizes it, then its scheduler takes it in at the next step, and
#: the gauges are those of the last step done. A poll subtracts from the engine's total
#: only this gateway's requests older than this (measured on vLLM 0.32 CPU engines:
#: 0.1-0.2 s; on a GPU less, and then a request counts as another's a little too long).
SETTLE_S = 0.15

#: How many of this gateway's latest requests its per-engine shares weigh (an
#: exponential decay of ``1 - 1 / SHARE_WINDOW`` per request sent anywhere): long enough
#: to even out a workload's sessions, short enough to follow an engine that joins.
SHARE_WINDOW = 32

#: What a poll asks for: the three gauges only, by the Prometheus client's ``name[]``
#: filter. vLLM serves it under ``/metrics/`` (its ``/metrics`` route ignores the filter
#: and renders every series, ~50 KB against ~0.5 KB: cheap enough to poll often). An
#: engine whose ``/metrics/`` does not answer 200 with those gauges is read whole from
#: then on.
FILTERED = "/?" + "&".join("name%5B%5D=" + n.replace(":", "%3A") for n in (
    "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"))

_GAUGES = {b"vllm:num_requests_waiting": "waiting", b"vllm:num_requests_running": "running",
           b"vllm:kv_cache_usage_perc": "kv_usage"}


def parse_engine_metrics(text: bytes, rank: int | None = None) -> dict[str, float]:
    """The three vLLM gauges from a Prometheus text page, each summed over its label
    sets (a data-parallel engine reports one set per rank; ``kv_usage`` is averaged).
    ``rank``: only that data-parallel rank's sets (vLLM labels them ``engine="R"``; sets
    without the label count for every rank). Missing gauges are absent; unparsable
    lines are skipped."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    mine = None if rank is None else (b'{engine="%d"' % rank, b',engine="%d"' % rank)
    for line in text.splitlines():
        if not line.startswith(b"vllm:"):
            continue
        if mine is not None and b'engine="' in line and mine[0] not in line and mine[1] not in line:
            continue  # another rank's
        name, _, rest = line.partition(b"{") if b"{" in line.split(b" ", 1)[0] else line.partition(b" ")
        key = _GAUGES.get(name.strip())
        if key is None:
            continue
        value = rest.rsplit(b"}", 1)[-1].split() if b"}" in rest else rest.split()
        try:
            v = float(value[0])
        except (IndexError, ValueError):
            continue
        if math.isfinite(v):
            sums[key] = sums.get(key, 0.0) + v
            counts[key] = counts.get(key, 0) + 1
    if "kv_usage" in sums:
        sums["kv_usage"] /= counts["kv_usage"]
    return sums


@dataclass
class TargetLoad:
    """One engine's load as the gateway knows it."""

    inflight: int = 0  # requests from this gateway, sent and not finished
    # Monotonic send times of this gateway's requests of the last SETTLE_S seconds: the
    # engine's gauges do not count them yet (see EngineLoads.poll).
    recent: collections.deque = field(default_factory=collections.deque)
    prefill_tokens: int = 0  # their prompt tokens the index did not predict as cached
    others: float = 0.0  # the engine's waiting + running at the last poll, minus ours then
    kv_usage: float = 0.0
    polled_at: float | None = None  # monotonic time of the last good poll
    filtered: bool | None = None  # whether its /metrics/ serves the filtered page (None: not tried)
    reachable: bool = True
    poll_failures: int = 0
    failed_in_row: int = 0  # polls failed since the last good one
    last_error: str | None = None
    # Routing accuracy: cached tokens predicted and reported, over answers that reported.
    predicted_cached: int = 0
    reported_cached: int = 0
    usage_reports: int = 0
    sent: float = 0.0  # this gateway's requests sent here, decayed per request (see shares)
    dp_rank: int | None = None  # the engine is this rank of a data-parallel server (see poll)

    def count_cached(self, reported: int, predicted: int) -> None:
        """An answer from this engine that reported its cached tokens."""
        self.predicted_cached += predicted
        self.reported_cached += reported
        self.usage_reports += 1


class EngineLoads:
    """Load of every gateway target; the event loop's thread only (no locks needed)."""

    def __init__(self, prefill_tokens_per_request: int = 2048) -> None:
        self.prefill_unit = max(1, prefill_tokens_per_request)
        self.targets: dict[str, TargetLoad] = {}
        self._last_activity = -math.inf  # monotonic time a request last started or ended
        self._wake: asyncio.Event | None = None  # set by a request start while the poller idles

    def busy(self, within_s: float) -> bool:
        """Whether this gateway is routing: a request in flight, or one started or ended
        within the last ``within_s`` seconds."""
        return (any(t.inflight for t in self.targets.values())
                or time.monotonic() - self._last_activity < within_s)

    def of(self, engine: str) -> TargetLoad:
        t = self.targets.get(engine)
        if t is None:
            # A new engine starts at the others' mean (the first at a full window), as if
            # the history were even: the shares of a young gateway, or of an engine just
            # discovered, do not swing on their first few requests.
            sent = [o.sent for o in self.targets.values()]
            t = self.targets[engine] = TargetLoad(
                sent=sum(sent) / len(sent) if sent else float(SHARE_WINDOW))
        return t

    def forget(self, keep: set[str]) -> None:
        """Drop engines no longer targets (their series too)."""
        for name in [n for n in self.targets if n not in keep]:
            del self.targets[name]

    def started(self, engine: str, prefill_tokens: int) -> None:
        t = self.of(engine)
        self._decay_sent()
        t.sent += 1.0
        t.inflight += 1
        t.prefill_tokens += prefill_tokens
        now = self._last_activity = time.monotonic()
        t.recent.append(now)
        while t.recent and now - t.recent[0] > SETTLE_S:
            t.recent.popleft()
        if self._wake is not None:
            self._wake.set()

    def finished(self, engine: str, prefill_tokens: int) -> None:
        t = self.of(engine)
        t.inflight = max(0, t.inflight - 1)
        t.prefill_tokens = max(0, t.prefill_tokens - prefill_tokens)
        self._last_activity = time.monotonic()

    def unreachable(self, engine: str, why: str) -> None:
        t = self.of(engine)
        t.reachable = False
        t.last_error = why

    def _decay_sent(self) -> None:
        keep = 1.0 - 1.0 / SHARE_WINDOW
        for o in self.targets.values():
            o.sent *= keep

    def shares(self, engines: list[str]) -> dict[str, float]:
        """Each engine's fraction of this gateway's recent requests among ``engines``
        (about the last :data:`SHARE_WINDOW`, the newest weighing most, over a prior of
        even shares: see :meth:`of`). Each replica behind a Service gets an even part of
        the traffic, so replicas that each even out their own shares even out the
        fleet's without talking to each other."""
        return dict(zip(engines, self._shares([self.of(n) for n in engines])))

    @staticmethod
    def _shares(targets: list[TargetLoad]) -> list[float]:
        total = sum([t.sent for t in targets])  # > 0: every engine starts above 0 (see ``of``)
        return [t.sent / total for t in targets]

    def candidates(self, engines: list[str], inflight_tokens: dict[str, int],
                   balance: bool = True) -> list[Candidate]:
        """The policy's candidates as this gateway knows them: each engine's load, its
        share of the recent requests (``balance`` False: none, so the policy does not
        even the request counts out), and the tokens of the prompt in flight there
        (``inflight_tokens``, from :class:`~kvevents.gateway.inflight.InflightPrompts`)."""
        targets = [self.of(n) for n in engines]
        load, flying = self._load, inflight_tokens.get
        shares = self._shares(targets) if balance else [None] * len(targets)
        return [Candidate(n, load(t), flying(n, 0), share) for n, t, share in zip(engines, targets, shares)]

    def load(self, engine: str) -> EngineLoad:
        return self._load(self.of(engine))

    def _load(self, t: TargetLoad) -> EngineLoad:
        return EngineLoad(waiting=t.others + t.prefill_tokens / self.prefill_unit,
                          running=float(t.inflight), kv_usage=min(1.0, max(0.0, t.kv_usage)))

    def set_ranks(self, specs) -> None:
        """Learn which targets (engine specs) are ranks of a data-parallel server: their
        ranks share one ``/metrics``, and each reads its own rank's gauges there."""
        for s in specs:
            if s.http and (s.dp_rank is not None or s.name in self.targets):
                self.of(s.name).dp_rank = s.dp_rank

    async def poll(self, client: httpx.AsyncClient, engine: str, url: str, timeout: float) -> bool:
        """One poll of ``url`` (the engine's ``/metrics``; a data-parallel rank's: its
        own rank's gauges there); True when it answered."""
        t = self.of(engine)
        # Ours that the engine counts: those in flight now less those sent too recently
        # to show in its gauges (the rest would be taken for others' and then missed).
        started = time.monotonic()
        inflight_then = max(0, t.inflight - sum(started - s <= SETTLE_S for s in t.recent))
        try:
            gauges = None
            if t.filtered is not False and url.endswith("/metrics"):
                resp = await client.get(url + FILTERED, timeout=timeout)
                if resp.status_code == 200:
                    gauges = parse_engine_metrics(resp.content, t.dp_rank)
                if gauges is None or ("waiting" not in gauges and "running" not in gauges):
                    gauges = None
                    if resp.status_code < 500:  # no such page, or it ignores the names
                        # (a 5xx is the engine's trouble of the moment: asked again next time)
                        t.filtered = False
                        log.info("engine %s: %s%s is not a filtered metrics page (HTTP %s); "
                                 "reading the whole page", engine, url, FILTERED,
                                 resp.status_code)
                else:
                    t.filtered = True
            if gauges is None:
                resp = await client.get(url, timeout=timeout)
                resp.raise_for_status()
                gauges = parse_engine_metrics(resp.content, t.dp_rank)
        except (httpx.HTTPError, OSError) as exc:
            t.poll_failures += 1
            t.failed_in_row += 1
            # A refused connection is final; a slow or failed answer counts only the
            # second time in a row (one slow scrape under load must not flap the engine).
            if not isinstance(exc, httpx.ConnectError) and t.failed_in_row < 2:
                return False
            if t.reachable:
                log.warning("engine %s: %s unreachable (%s); not routed to until it answers",
                            engine, url, exc)
            t.reachable, t.last_error = False, f"{type(exc).__name__}: {exc}"
            return False
        total = gauges.get("waiting", 0.0) + gauges.get("running", 0.0)
        t.others = max(0.0, total - inflight_then)
        t.kv_usage = gauges.get("kv_usage", 0.0)
        t.polled_at = time.monotonic()
        t.failed_in_row = 0
        if not t.reachable:
            log.info("engine %s answers again", engine)
        t.reachable, t.last_error = True, None
        return True

    async def poll_forever(self, client: httpx.AsyncClient, targets, interval: float,
                           busy_interval: float | None = None) -> None:
        """Poll every target's ``/metrics``, concurrently, each bounded by ``interval``
        (at least 0.2 s): every ``busy_interval`` seconds while :meth:`busy`, else every
        ``interval`` seconds or as soon as a request starts; ``busy_interval`` None (or
        not shorter than ``interval``): always every ``interval``. ``targets()`` ->
        {engine: metrics URL} now. Runs until cancelled; survives its own errors (logged)."""
        fast = busy_interval if busy_interval is not None and 0 < busy_interval < interval else None
        self._wake = asyncio.Event()
        while True:
            started = time.monotonic()
            self._wake.clear()
            try:
                urls = targets()
                self.forget(set(urls))
                await asyncio.gather(*(self.poll(client, e, u, max(0.2, interval))
                                       for e, u in urls.items()))
            except asyncio.CancelledError:
                raise
            except Exception:  # a poll bug must not end the loop: health would lie
                log.exception("engine load poll failed; continuing")
            spent = time.monotonic() - started
            if fast is not None and self.busy(interval):
                # A short pause even when the polls took longer than the cadence: a
                # loaded engine's /metrics must not be asked back to back.
                await asyncio.sleep(max(min(0.05, fast / 2), fast - spent))
                continue
            if fast is None:
                await asyncio.sleep(max(0.05, interval - spent))
                continue
            try:  # idle: the next poll in ``interval``, or at once when a request starts
                await asyncio.wait_for(self._wake.wait(), max(0.05, interval - spent))
            except asyncio.TimeoutError:
                pass
