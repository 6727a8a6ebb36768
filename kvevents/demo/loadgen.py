"""``kvevents loadgen``: keep a deployed fleet busy with the demo's workload.

The same router loop as ``kvevents demo`` (:class:`~kvevents.demo.driver.Driver`: each
request routed at its arrival through the aggregator's ``POST /v1/route``, sent to the
chosen engine's request socket), but against engines and an aggregator that already
run elsewhere, e.g. the services of ``docker-compose.yml``. It runs round after round
(each a fresh built-in workload, seed + round) so the dashboards keep moving.

Lifecycle and failure: waits (bounded by ``--ready-timeout``) until the aggregator
answers ``/healthz`` and every engine answers a ``load`` request; exits 1 if they never
do. A round that stalls (an engine restarted and lost its requests) is abandoned after
its deadline and the next round starts on fresh sockets; an unreachable aggregator
pauses the loop and retries. Every such event is logged; SIGTERM/Ctrl-C stop it
at once, closing every socket on the way out.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import time

import httpx
import zmq

from kvevents.demo.args import parse_engine
from kvevents.demo.driver import Driver
from kvevents.demo.fleet import EngineClient
from kvevents.demo.workload import builtin

log = logging.getLogger("kvevents.loadgen")


class RoundTimeout(RuntimeError):
    """A round did not finish by its deadline."""


class RemoteFleet:
    """The parts of :class:`~kvevents.demo.fleet.Fleet` the driver uses, for engines
    that run elsewhere: their clients, the aggregator's URL and a liveness check (here: a
    deadline for the current round, since other machines' processes cannot be polled)."""

    def __init__(self, ctx: zmq.Context, engines: list[tuple[str, str]], url: str) -> None:
        self.engines = [EngineClient(ctx, name, None, rpc_endpoint=ep) for name, ep in engines]
        self.url = url.rstrip("/")
        self.deadline = float("inf")

    def check_alive(self) -> None:
        if time.monotonic() > self.deadline:
            raise RoundTimeout("the round passed its deadline: an engine stopped answering")

    def wait_ready(self, timeout_s: float) -> bool:
        """Until the aggregator and every engine answer; False on timeout."""
        deadline = time.monotonic() + timeout_s
        pending = list(self.engines)
        healthy = False
        while time.monotonic() < deadline:
            if not healthy:
                try:
                    healthy = httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200
                except httpx.HTTPError:
                    pass
            for e in list(pending):
                try:
                    e.call({"op": "load"}, "load", 1.0)
                    pending.remove(e)
                except TimeoutError:
                    pass
            if healthy and not pending:
                return True
            time.sleep(0.5)
        log.error("not ready after %.0f s: aggregator %s, engines not answering: %s", timeout_s,
                  "up" if healthy else "down", ", ".join(e.name for e in pending) or "none")
        return False

    def close(self) -> None:
        for e in self.engines:
            e.close()


def _round_summary(driver: Driver) -> str:
    outs = [o for o in driver.state.outcomes.values() if o.finish is not None and not o.rejected]
    prompt = sum(o.prompt_tokens for o in outs) or 1
    gpu = sum(o.gpu_hit for o in outs) / prompt
    cpu = sum(o.cpu_hit for o in outs) / prompt
    return (f"{len(outs)} requests, hit GPU {gpu:.1%} CPU {cpu:.1%}, "
            f"route errors {driver.state.route_errors}")


def run_loadgen(args: argparse.Namespace) -> int:
    """Run rounds until ``--rounds`` are done (0: until SIGTERM/SIGINT). Exit status:
    0 done or stopped, 1 if the fleet never became ready."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    signal.signal(signal.SIGTERM, _interrupt)
    engines = [parse_engine(s) for s in args.engine]
    ctx = zmq.Context.instance()
    try:
        return _rounds(args, ctx, engines)
    except KeyboardInterrupt:
        log.info("stopped")
        return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM too: unwind through `finally`, closing every socket


def _rounds(args: argparse.Namespace, ctx: zmq.Context, engines: list[tuple[str, str]]) -> int:
    round_no = 0
    while args.rounds == 0 or round_no < args.rounds:
        fleet = RemoteFleet(ctx, engines, args.aggregator)  # fresh sockets every round
        try:
            if not fleet.wait_ready(args.ready_timeout):
                return 1
            requests = [dataclasses.replace(r, id=f"round{round_no}-{r.id}")
                        for r in builtin(args.requests, seed=args.seed + round_no)]
            driver = Driver(fleet, requests, args.policy, args.duration, progress=False)  # type: ignore[arg-type]
            # Generous: arrivals take --duration; completions trail by the engines' queues.
            fleet.deadline = time.monotonic() + 3 * args.duration + 120
            log.info("round %d: %d requests over %.0f s, policy %s", round_no, len(requests),
                     args.duration, args.policy)
            try:
                elapsed = driver.run()
                log.info("round %d done in %.1f s: %s", round_no, elapsed, _round_summary(driver))
            except RoundTimeout as exc:
                log.warning("round %d abandoned: %s", round_no, exc)
            except httpx.HTTPError as exc:
                log.warning("round %d: the aggregator failed (%s); retrying in 5 s", round_no, exc)
                time.sleep(5)
            finally:
                driver.close()
        finally:
            fleet.close()
        round_no += 1
    return 0
