"""The demo as an OpenAI client: its workload sent through the aggregator's gateway.

``--policy gateway`` (the default with simulated engines): the engines serve OpenAI
requests (their HTTP front, like ``vllm serve``) and the aggregator (``kvevents
serve``) is their gateway, routing each request by its index and the engines' load.
The demo does not route; it is a plain client. Each request is sent at its arrival
(the workload's simulated time scaled to ``--duration``) as ``POST /v1/completions``
to the aggregator: the prompt as token ids, ``max_tokens`` = the request's new tokens,
streamed with ``stream_options.include_usage``. At most ``clients`` requests are in
flight (one asyncio loop, one ``httpx.AsyncClient``); a request due while all are busy
waits for one.

Per request, at the client: the engine that served it (the gateway's
``x-kvevents-engine`` header), wall-clock TTFT (sent to first streamed chunk) and e2e
(sent to the end of the stream), and the engine-reported
``usage.prompt_tokens_details.cached_tokens`` (the final usage chunk). A request
*fails* when its answer is not a 200 stream carrying the header, a usage chunk and
``[DONE]``, or when the connection fails; failures are counted by reason and make the
demo exit 1. A prompt longer than the engines' context (400
``context_length_exceeded``) is *rejected*, as the RPC mode reports it.

The end is the RPC mode's (:class:`~kvevents.demo.driver.Driver`): drain every engine,
wait until the aggregator applied each last batch, compare index and caches. The
summary's GPU/CPU split of hit tokens is what the engines report on their
``/metrics`` (``vllm:prompt_tokens_by_source_total``), or the engine-reported cached
tokens in total when an engine's metrics cannot be read (said in the summary); and it
adds the gateway's predicted vs reported cached tokens (``kvevents_gateway_*`` on the
aggregator's ``/metrics``): the live accuracy of the routing signal.
"""

from __future__ import annotations

import asyncio
import collections
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from kvevents.demo.driver import Driver
from kvevents.demo.fleet import Fleet
from kvevents.demo.workload import DemoRequest

MODEL = "sim"  # the model name every simulated engine serves in the demo
_SOURCES = {"GPU": "local_cache_hit", "CPU": "external_kv_transfer", "computed": "local_compute"}


@dataclass
class ClientOutcome:
    engine: str | None = None  # from x-kvevents-engine
    prompt_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens
    ttft: float | None = None  # wall seconds, sent -> first streamed chunk
    e2e: float | None = None  # wall seconds, sent -> end of the stream
    failed: str | None = None  # why (the summary counts these by reason)
    rejected: str | None = None  # the prompt does not fit the engines' context
    done: bool = False


def metric_sum(text: str, name: str, **labels: str) -> float | None:
    """Sum of the samples of ``name`` whose labels include ``labels`` in a Prometheus
    text page; None when the page has no sample of ``name`` at all."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            seen = True
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total if seen else None


def gateway_ready(url: str, n_engines: int) -> bool:
    """Whether the gateway at ``url`` follows every engine's event stream and can reach
    every engine's OpenAI server."""
    try:
        engines = httpx.get(url + "/v1/engines", timeout=2).json()["engines"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return False
    return len(engines) == n_engines and all(
        (e.get("status") == "live" or e.get("connected")) and (e.get("gateway") or {}).get("reachable")
        for e in engines)


class GatewayDriver(Driver):
    """Sends the workload to the gateway (see the module docstring); the end of the run
    (:meth:`quiesce`, :meth:`index_mismatches`) is :class:`Driver`'s."""

    def __init__(self, fleet: Fleet, requests: list[DemoRequest], wall_seconds: float,
                 progress: bool = True, clients: int = 64, request_timeout_s: float = 300.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        """``transport``: the HTTP client's (tests answer from a function with it)."""
        super().__init__(fleet, requests, "gateway", wall_seconds, progress)
        self.clients = clients
        self.transport = transport
        self.request_timeout_s = request_timeout_s
        self.results: dict[str, ClientOutcome] = {}
        self.inflight = 0
        self.done = 0

    # -- the run -------------------------------------------------------------------------

    def run(self) -> float:
        """Sends every request and waits for every answer; returns the wall seconds."""
        return asyncio.run(self._run())

    async def _run(self) -> float:
        t0 = time.monotonic()
        total = len(self.requests)
        client = httpx.AsyncClient(
            base_url=self.fleet.url, timeout=httpx.Timeout(self.request_timeout_s, connect=10.0),
            # a few more connections than requests in flight: the progress line's too
            limits=httpx.Limits(max_connections=self.clients + 4,
                                max_keepalive_connections=self.clients + 4),
            transport=self.transport)
        sender = asyncio.create_task(self._send_all(client, t0))
        try:
            next_alive_check = t0 + 2.0
            while True:
                finished, _ = await asyncio.wait({sender}, timeout=0.5)
                if finished:
                    sender.result()  # raises what stopped it
                    break
                if time.monotonic() > next_alive_check:  # a crashed process must not hang the run
                    self.fleet.check_alive()
                    next_alive_check = time.monotonic() + 2.0
                await self._show_progress(client, total, force=False)
            await self._show_progress(client, total, force=True)
            if self.progress:
                print(file=sys.stderr)
            return time.monotonic() - t0
        finally:
            if not sender.done():
                sender.cancel()
                await asyncio.gather(sender, return_exceptions=True)
            await client.aclose()

    async def _send_all(self, client: httpx.AsyncClient, t0: float) -> None:
        slots = asyncio.Semaphore(self.clients)
        tasks: list[asyncio.Task] = []
        try:
            for req in self.requests:
                delay = req.arrival / self.time_scale - (time.monotonic() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                await slots.acquire()
                tasks.append(asyncio.create_task(self._one(client, req, slots)))
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _one(self, client: httpx.AsyncClient, req: DemoRequest, slots: asyncio.Semaphore) -> None:
        out = self.results[req.id] = ClientOutcome()
        body = json.dumps({"model": MODEL, "prompt": req.token_ids, "max_tokens": req.max_new_tokens,
                           "stream": True, "stream_options": {"include_usage": True}})
        self.inflight += 1
        t_sent = time.perf_counter()
        try:
            async with client.stream("POST", "/v1/completions", content=body,
                                     headers={"content-type": "application/json"}) as r:
                out.engine = r.headers.get("x-kvevents-engine")
                if r.status_code != 200:
                    self._refused(out, r.status_code, await r.aread())
                    return
                usage, ended = None, False
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    if out.ttft is None:
                        out.ttft = time.perf_counter() - t_sent
                    data = line[5:].strip()
                    if data == "[DONE]":
                        ended = True  # read on to the end, so the connection is reused
                    elif not ended:
                        chunk = json.loads(data)
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                out.e2e = time.perf_counter() - t_sent
            if not ended:
                out.failed = "stream ended before [DONE]"
            elif usage is None:
                out.failed = "no usage chunk"
            elif out.engine is None:
                out.failed = "no x-kvevents-engine header"
            else:
                out.prompt_tokens = int(usage["prompt_tokens"])
                out.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        except httpx.HTTPError as exc:
            out.failed = f"{type(exc).__name__}"
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            out.failed = f"unreadable answer ({type(exc).__name__})"
        finally:
            out.done = True
            self.inflight -= 1
            self.done += 1
            slots.release()

    @staticmethod
    def _refused(out: ClientOutcome, status: int, raw: bytes) -> None:
        try:
            error = json.loads(raw)["error"]
            message, code = str(error.get("message")), error.get("code")
        except (ValueError, KeyError, TypeError, AttributeError):
            message, code = raw[:200].decode(errors="replace"), None
        if status == 400 and code == "context_length_exceeded":
            out.rejected = message
        else:
            out.failed = f"HTTP {status}" + (f" {code}" if code else "")

    async def _show_progress(self, client: httpx.AsyncClient, total: int, force: bool) -> None:
        if not self.progress_due(force):
            return
        served = [o for o in self.results.values() if o.done and o.failed is None and o.rejected is None]
        prompt = sum(o.prompt_tokens for o in served) or 1
        cached = sum(o.cached_tokens for o in served) / prompt
        try:
            engines = (await client.get("/v1/engines", timeout=2)).json()["engines"]
        except (httpx.HTTPError, ValueError, KeyError):
            engines = []
        failed = sum(1 for o in self.results.values() if o.failed)
        hits = f"cached {cached:5.1%} | {self.inflight:3d} in flight" + (f" | {failed} FAILED" if failed else "")
        self.print_progress(self.done, total, hits, engines, force)

    # -- the end ---------------------------------------------------------------------------

    def engine_prompt_sources(self) -> dict[str, dict[str, float]] | None:
        """Per engine, prompt tokens by source (``GPU``, ``CPU``, ``computed``) from its
        ``/metrics``; None when any engine's cannot be read."""
        out = {}
        for e in self.fleet.engines:
            port = (e.ports.metrics or e.ports.http) if e.ports else 0
            if not port:
                return None
            try:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            except httpx.HTTPError:
                return None
            per = {k: metric_sum(text, "vllm:prompt_tokens_by_source_total", source=src)
                   for k, src in _SOURCES.items()}
            if any(v is None for v in per.values()):
                return None
            out[e.name] = per  # type: ignore[assignment]
        return out

    def gateway_accuracy(self) -> dict[str, Any]:
        """The gateway's predicted and reported cached tokens, summed over engines."""
        text = self.http.get("/metrics").text
        predicted = metric_sum(text, "kvevents_gateway_predicted_cached_tokens_total") or 0.0
        reported = metric_sum(text, "kvevents_gateway_reported_cached_tokens_total") or 0.0
        return {"predicted_cached_tokens": int(predicted), "reported_cached_tokens": int(reported),
                "predicted_over_reported": predicted / reported if reported else None,
                "usage_reports": int(metric_sum(text, "kvevents_gateway_usage_reports_total") or 0)}

    def summary(self, drained: dict[str, dict], mismatches: dict[str, dict[str, int]],
                wall: float, cpu_tier: bool) -> dict[str, Any]:
        outcomes = list(self.results.values())
        served = [o for o in outcomes if o.done and o.failed is None and o.rejected is None]
        failures = collections.Counter(o.failed for o in outcomes if o.failed)
        never_done = len(self.requests) - len(outcomes) + sum(1 for o in outcomes if not o.done)
        if never_done:
            failures["never sent or not finished"] += never_done
        per_engine = {e.name: 0 for e in self.fleet.engines}
        for o in served:
            per_engine[o.engine] = per_engine.get(o.engine, 0) + 1  # type: ignore[index]
        counts = list(per_engine.values())
        prompt = sum(o.prompt_tokens for o in served)
        cached = sum(o.cached_tokens for o in served)
        sources = self.engine_prompt_sources()
        if sources is not None:
            hit = {"GPU": int(sum(s["GPU"] for s in sources.values())),
                   "CPU": int(sum(s["CPU"] for s in sources.values()))}
            hit_source = "engine /metrics"
            computed = int(sum(s["computed"] for s in sources.values()))
        else:
            hit, hit_source, computed = {"total": cached}, "usage cached_tokens", prompt - cached
        ttft = np.array([o.ttft for o in served if o.ttft is not None] or [0.0])
        e2e = np.array([o.e2e for o in served if o.e2e is not None] or [0.0])
        fleet = self.fleet_summary(drained, mismatches, wall, cpu_tier)
        return {
            **{k: fleet.pop(k) for k in ("engines", "policy", "cpu_tier")},
            "requests": len(served),
            "failed_requests": sum(failures.values()),
            "failures": dict(failures),
            "rejected_requests": sum(1 for o in outcomes if o.rejected),
            "clients": self.clients,
            "prompt_tokens": prompt,
            "hit_tokens": hit,
            "hit_tokens_source": hit_source,
            "computed_prefill_tokens": computed,
            "reported_cached_tokens": cached,  # usage at the client, all engines
            "ttft_seconds": {"p50": float(np.percentile(ttft, 50)), "p99": float(np.percentile(ttft, 99))},
            "e2e_seconds": {"p50": float(np.percentile(e2e, 50)), "p99": float(np.percentile(e2e, 99))},
            "latency_measured": "wall, at the client, through the gateway",
            "gateway": self.gateway_accuracy(),
            "requests_per_engine": per_engine,
            "load_balance_max_over_min": max(counts) / max(min(counts), 1),
            **fleet,
        }
