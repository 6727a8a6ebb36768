"""The ``kvevents`` command: ``tail``, ``serve`` and ``demo``.

Arguments are parsed and validated here, at the edge; each subcommand hands typed
values to the module that does the work.
"""

from __future__ import annotations

import argparse
import logging
import sys


def _add_tail(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tail", help="print decoded events from a publisher endpoint")
    p.add_argument("--endpoint", required=True, help="live endpoint, e.g. tcp://HOST:5557")
    p.add_argument("--replay", default=None, help="replay endpoint, e.g. tcp://HOST:5558")
    p.add_argument("--topic", default="", help="topic to subscribe to (default: all)")
    p.add_argument("--from-start", action="store_true",
                   help="on first contact, replay the publisher's buffer from seq 0")
    p.add_argument("--bind", action="store_true",
                   help="bind the endpoint (publishers connect to us)")
    p.add_argument("--max-batches", type=int, default=None, help="exit after N batches")
    p.add_argument("--duration", type=float, default=None, help="exit after S seconds")


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="run the aggregator (HTTP API, metrics, live page)",
        description="Follow KV event publishers and serve the prefix index over HTTP. "
                    "Settings also come from KVEVENTS_* environment variables and --config.",
    )
    p.add_argument("--endpoint", action="append", default=None, metavar="NAME=tcp://HOST:PORT[,replay=tcp://HOST:PORT]",
                   help="a publisher to follow (repeatable); options: replay=, model=, topic=, bind=1")
    p.add_argument("--host", default=None, help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="listen port (default 8000)")
    p.add_argument("--auth-token", default=None,
                   help="bearer token required on mutating endpoints (or KVEVENTS_AUTH_TOKEN)")
    p.add_argument("--stale-after", type=float, default=None, dest="stale_after_s",
                   help="seconds of silence after which a pod is 'stale' (default 30)")
    p.add_argument("--tokenizer", action="append", default=None, metavar="MODEL=PATH",
                   help="tokenizer directory (Hugging Face layout) for lookups by prompt text "
                        "or chat messages of MODEL (repeatable; or KVEVENTS_TOKENIZERS)")
    p.add_argument("--config", default=None, help="JSON or TOML file with the same settings")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvevents", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_tail(sub)
    _add_serve(sub)
    from kvevents.demo import add_arguments

    add_arguments(sub.add_parser("demo", help="run a live KV-aware fleet on this machine"))
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command == "tail":
        from kvevents.tail import run_tail

        try:
            return run_tail(
                args.endpoint, args.replay, args.topic, from_start=args.from_start,
                bind=args.bind, max_batches=args.max_batches, duration=args.duration,
            )
        except ValueError as exc:
            parser.error(str(exc))
    if args.command == "serve":
        from kvevents.serve import run_server
        from kvevents.settings import PodSpec, load_settings, parse_tokenizer

        try:
            pods = tuple(PodSpec.parse(e) for e in args.endpoint) if args.endpoint else None
            tokenizers = tuple(parse_tokenizer(t) for t in args.tokenizer) if args.tokenizer else None
            settings = load_settings(
                args.config, pods=pods, host=args.host, port=args.port,
                auth_token=args.auth_token, stale_after_s=args.stale_after_s,
                tokenizers=tokenizers,
            )
        except (ValueError, OSError) as exc:
            parser.error(str(exc))
        return run_server(settings)
    if args.command == "demo":
        from kvevents.demo import run_demo

        return run_demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
