"""An engine process: the paged-KV engine with its CPU tier, serving requests.

    python -m kvevents.sim.process --name engine-0 --events-port 5557 \
        --replay-port 5558 --rpc-port 5560 --metrics-port 9100

What it does, like an inference server would:

* publishes its KV events (GPU tier from the block pool, CPU tier from the offloading
  connector, self-describing) on a PUB socket ``tcp://BIND:events-port`` with a replay
  ROUTER on ``replay-port`` — exactly what a vLLM engine started with
  ``--kv-events-config`` exposes, so any aggregator can follow it;
* serves ``/metrics`` on ``metrics-port`` (see :mod:`kvevents.sim.metrics`);
* with ``--http-port`` (0, the default: off), an OpenAI-compatible HTTP front like
  ``vllm serve``'s (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
  ``/tokenize``, ``/health``, ``/metrics``) serving ``--model`` (default ``sim``, the
  same on every engine so a gateway can route one model across a fleet); text prompts
  and chat need ``--tokenizer DIR`` (a Hugging Face tokenizer directory). It submits
  over this same RPC (see :mod:`kvevents.sim.openai_front`);
* takes requests on a ROUTER socket (``rpc-port``; clients use DEALER) — msgpack maps:

  ``{"op": "submit", "id", "token_ids", "max_new_tokens", "arrival"}`` -> later
  ``{"op": "done", "id", "ttft", "prompt_tokens", "gpu_hit_tokens", "cpu_hit_tokens",
  "computed_tokens", "finish"}``; ``{"op": "load"}`` -> ``{"op": "load", waiting,
  running, kv_usage}``; ``{"op": "drain"}`` -> runs until idle and every copy landed,
  then ``{"op": "drained", "last_seq", "published", "dropped", "kv_mismatches",
  "verified_blocks", "offload": {...}}``; ``{"op": "contents"}`` -> the true resident
  engine block hashes per tier; ``{"op": "stop"}`` -> ``{"op": "stopped"}``, then exit.

A malformed request is answered ``{"op": "error", "error": ...}`` and changes nothing.
SIGTERM/SIGINT stop the loop; sockets, publisher and transfer threads are closed in
``finally``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from prometheus_client import CollectorRegistry

from connector.config import OffloadConfig
from kvevents.sim.config import EngineConfig
from kvevents.sim.engine import PagedEngine
from kvevents.sim.metrics import CountingPublisher, EngineMetrics, serve_metrics
from kvevents.sim.openai_front import DEFAULT_MODEL, RPC_INPROC, OpenAIFront
from kvevents.wire.publisher import PublisherConfig, ZmqEventPublisher
from kvevents.sim.rpc import EngineRpc

log = logging.getLogger("kvevents.engine")


class EngineServer(EngineRpc):
    """Owns the engine, its publisher, the RPC socket, the metrics endpoint and the
    OpenAI front (when ``--http-port`` is set)."""

    def __init__(self, args: argparse.Namespace, tokenizer: Any = None) -> None:
        self.name = args.name
        # Bound first: a taken port fails the process before any engine thread exists.
        self.front = OpenAIFront(args.http_addr, args.http_port, args.model or DEFAULT_MODEL,
                                 tokenizer, args.tokenizer, args.http_token_interval) \
            if args.http_port else None
        self.publisher = CountingPublisher(ZmqEventPublisher(PublisherConfig(
            endpoint=f"tcp://{args.bind}:{args.events_port}",
            replay_endpoint=f"tcp://{args.bind}:{args.replay_port}",
            topic=args.topic,
            bind=True,  # an engine owns its endpoints, whatever address it is given
        )))
        offload = None
        if args.cpu_blocks > 0:
            offload = OffloadConfig(cpu_capacity_blocks=args.cpu_blocks,
                                    offloaded_block_size=args.offloaded_block_size,
                                    eviction_policy=args.eviction_policy)
        self.engine = PagedEngine(
            EngineConfig(num_gpu_blocks=args.gpu_blocks,
                         max_num_batched_tokens=args.max_batched_tokens),
            offload=offload, publisher=self.publisher,
        )
        self.registry = CollectorRegistry()
        self.metrics = EngineMetrics(self.name, self.engine, self.publisher, self.registry,
                                     model_name=args.model or "")
        if args.metrics_port:
            serve_metrics(args.metrics_port, args.metrics_addr, self.registry)
        self._clients: dict[str, bytes] = {}  # request id -> client identity
        super().__init__(f"tcp://{args.bind}:{args.rpc_port}")
        if self.front is not None:
            try:
                self.rpc.bind(RPC_INPROC)
                self.front.start(self.ctx, self.registry, self.name,
                                 args.gpu_blocks * self.engine.config.layout.block_size,
                                 model_label=args.model or "")
            except BaseException:
                self.close()
                self.rpc.close(0)
                raise

    def on_request(self, ident: bytes, op: str, msg: dict[str, Any]) -> bool:
        if op == "submit":
            self.engine.add_request(str(msg["id"]), msg["token_ids"],
                                    int(msg.get("max_new_tokens", 1)), msg.get("arrival"))
            self._clients[str(msg["id"])] = ident
        elif op == "load":
            self.reply(ident, {"op": "load", **self.engine.load()})
        elif op == "drain":
            for result in self.engine.run_until_idle():
                self.done(result)
            stats = self.publisher.stats()
            self.reply(ident, {
                "op": "drained", "last_seq": stats.next_seq - 1, "published": stats.published,
                "dropped": stats.dropped, "kv_mismatches": self.engine.kv_mismatches,
                "verified_blocks": self.engine.verified_blocks,
                "offload": self.engine.offload_stats(),
            })
        elif op == "contents":
            self.reply(ident, {"op": "contents", "tiers": {
                tier: sorted(hashes) for tier, hashes in self.engine.cache_contents().items()}})
        else:
            return False
        return True

    def done(self, result) -> None:
        self.metrics.observe(result)
        ident = self._clients.pop(result.request_id, None)
        if ident is not None:
            self.reply(ident, {
                "op": "done", "id": result.request_id, "ttft": result.ttft,
                "prompt_tokens": result.num_prompt_tokens,
                "gpu_hit_tokens": result.num_gpu_cached_tokens,
                "cpu_hit_tokens": result.num_cpu_loaded_tokens,
                "computed_tokens": result.num_computed_prompt_tokens,
                "finish": result.finish_time,
            })

    def has_work(self) -> bool:
        return self.engine.has_work()

    def step(self) -> None:
        for result in self.engine.step():
            self.done(result)

    def close(self) -> None:
        if self.front is not None:
            self.front.stop()
        self.engine.shutdown()
        self.publisher.shutdown(2.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", required=True)
    p.add_argument("--bind", default="*", help="address to bind sockets on (default all)")
    p.add_argument("--events-port", type=int, default=5557)
    p.add_argument("--replay-port", type=int, default=5558)
    p.add_argument("--rpc-port", type=int, default=5560)
    p.add_argument("--metrics-port", type=int, default=9100, help="0 disables /metrics")
    p.add_argument("--metrics-addr", default="0.0.0.0")
    p.add_argument("--topic", default="")
    p.add_argument("--gpu-blocks", type=int, default=2048)
    p.add_argument("--cpu-blocks", type=int, default=2048,
                   help="CPU tier capacity in offloaded blocks; 0 disables the CPU tier")
    p.add_argument("--offloaded-block-size", type=int, default=None,
                   help="tokens per offloaded block (a multiple of the engine block size)")
    p.add_argument("--eviction-policy", choices=["lru", "arc"], default="lru")
    p.add_argument("--max-batched-tokens", type=int, default=8192)
    p.add_argument("--http-port", type=int, default=0,
                   help="OpenAI-compatible HTTP front's port; 0 (default) disables it")
    p.add_argument("--http-addr", default="127.0.0.1", help="its listen address")
    p.add_argument("--http-token-interval", type=float, default=0.0, metavar="SECONDS",
                   help="pause between a streamed answer's chunks, like an engine's decode "
                        "rate (default 0: as fast as the client reads)")
    p.add_argument("--model", default=None,
                   help=f"served model name (default {DEFAULT_MODEL!r}); also the metrics' "
                        "model_name label (default empty)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="a Hugging Face tokenizer directory: text prompts, chat, /tokenize")
    args = p.parse_args(argv)
    if not 0 <= args.http_port <= 65535:
        p.error("--http-port must be 0-65535")
    if not 0 <= args.http_token_interval <= 10:
        p.error("--http-token-interval must be 0-10 seconds")
    if args.tokenizer is not None and not args.http_port:
        p.error("--tokenizer needs --http-port")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    tokenizer = None
    try:
        if args.tokenizer is not None:
            from kvevents.text import TokenizerRegistry
            model = args.model or DEFAULT_MODEL
            tokenizer = TokenizerRegistry.load([(model, args.tokenizer)]).get(model)
        server = EngineServer(args, tokenizer)
    except (ValueError, OSError) as exc:  # TokenizerLoadError is a ValueError
        print(f"kvevents.sim.process: error: {exc}", file=sys.stderr)
        return 2
    return server.serve_until_signalled(f"READY {server.name}")


if __name__ == "__main__":
    sys.exit(main())
