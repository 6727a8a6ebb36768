"""The gateway's Prometheus metrics (registered on the aggregator's registry).

=============================================  =============================================
kvevents_gateway_requests_total                requests answered {engine, model_name, status}
                                               (engine "" when none was chosen)
kvevents_gateway_ttft_seconds                  time to the first streamed byte {model_name}
kvevents_gateway_request_seconds               time to the last byte {model_name}
kvevents_gateway_inflight_requests             requests in flight {engine}
kvevents_gateway_retries_total                 requests sent again to another engine {reason}
kvevents_gateway_predicted_cached_tokens_total the index's predicted cached prefix of the
                                               chosen engine {engine, model_name}
kvevents_gateway_reported_cached_tokens_total  what the engine reported
                                               (usage.prompt_tokens_details.cached_tokens)
                                               for the same requests {engine, model_name}
kvevents_gateway_usage_reports_total           requests whose answer carried cached_tokens
kvevents_gateway_untokenized_total             prompts routed by load alone (no ids)
kvevents_gateway_partial_prompts_total         prompts routed by less than their whole cache
                                               identity {reason: image, audio, video (not
                                               rendered: by the text before the first
                                               media part),
                                               prompt_embeds (by load alone)}
kvevents_gateway_token_parity_checks_total     the gateway's ids against the engine's
                                               /tokenize {engine, model_name, result, reason}
kvevents_gateway_pd_decisions_total            a disaggregated model's requests {reason:
                                               disaggregated, decode_cached, short_uncached,
                                               no_prefill, prefill_failed}
kvevents_gateway_pd_prefill_seconds            prefill hop, sent to whole answer {model_name}
kvevents_gateway_pd_decode_ttft_seconds        decode hop, sent to first byte {model_name}
kvevents_gateway_connections_closed_total      HTTP connections the server closed on a
                                               hostile client {reason: header_timeout,
                                               body_timeout, evicted, over_capacity,
                                               early_answer (a lingering close)}
=============================================  =============================================

Labels as on every per-engine series: ``engine`` (the followed engine's name, "" when
none was chosen) and ``model_name`` (the request's model, as vLLM labels its own, when a
followed engine serves it; ``unknown`` for any other name, "" for none: see
:mod:`kvevents.service.metrics.labels`). No label takes its value from a request: the
methods here map the request's model themselves, so no call site can mint a series.
Predicted and reported are
counted only for requests whose answer reported cached
tokens (vLLM's ``--enable-prompt-tokens-details``; streamed answers with
``stream_options.include_usage``), so their ratio is the live accuracy of the routing
signal per engine.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvevents.gateway.media import REASONS

#: Why a disaggregated model's request took one hop or two (see kvevents.gateway.disagg).
PD_REASONS = ("disaggregated", "decode_cached", "short_uncached", "no_prefill", "prefill_failed")

from kvevents.service.metrics.labels import UNKNOWN, ModelLabels

# TTFT and request latency: from a few ms (cached, one token) to minutes (long generations).
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class GatewayMetrics:
    """The gateway's families on ``registry``. ``models``: the rule for ``model_name``
    (without one, every named model is counted as ``unknown``)."""

    def __init__(self, registry: CollectorRegistry, models: ModelLabels | None = None) -> None:
        self._models = models
        self.requests = Counter("kvevents_gateway_requests_total", "OpenAI requests answered by the "
                                "gateway", ["engine", "model_name", "status"], registry=registry)
        self.ttft = Histogram("kvevents_gateway_ttft_seconds", "Time to the first streamed byte, "
                              "measured at the gateway", ["model_name"], buckets=_BUCKETS, registry=registry)
        self.latency = Histogram("kvevents_gateway_request_seconds", "Time to the last byte, "
                                 "measured at the gateway", ["model_name"], buckets=_BUCKETS, registry=registry)
        self.inflight = Gauge("kvevents_gateway_inflight_requests", "Requests in flight per engine",
                              ["engine"], registry=registry)
        self.retries = Counter("kvevents_gateway_retries_total", "Requests sent again to another "
                               "engine before their first byte", ["reason"], registry=registry)
        for reason in ("connect", "5xx"):  # present from the start: a rate of 0 is an answer
            self.retries.labels(reason)
        self.predicted = Counter("kvevents_gateway_predicted_cached_tokens_total", "Cached prompt "
                                 "tokens the index predicted on the chosen engine",
                                 ["engine", "model_name"], registry=registry)
        self.reported = Counter("kvevents_gateway_reported_cached_tokens_total", "Cached prompt "
                                "tokens the engine reported for the same requests",
                                ["engine", "model_name"], registry=registry)
        self.usage_reports = Counter("kvevents_gateway_usage_reports_total", "Answers that "
                                     "reported cached tokens", ["engine", "model_name"], registry=registry)
        self.connections_closed = Counter(
            "kvevents_gateway_connections_closed_total", "HTTP connections closed by the server: "
            "a request head or body too slow, too many connections, or an answer sent before "
            "the body (closed lingering)", ["reason"], registry=registry)
        for reason in ("header_timeout", "body_timeout", "evicted", "over_capacity", "early_answer"):
            self.connections_closed.labels(reason)
        self._children: dict[tuple, object] = {}  # see of()
        self.untokenized = Counter("kvevents_gateway_untokenized_total", "Prompts routed by load "
                                   "alone: no token ids", registry=registry)
        self.partial = Counter(
            "kvevents_gateway_partial_prompts_total", "Prompts routed by less than their whole "
            "cache identity: image, audio, video (a chat with media that no engine rendered: "
            "by the ids of its text before the first media part), prompt_embeds (a completion "
            "of prompt embeddings: no ids, by load alone)", ["reason"], registry=registry)
        for reason in REASONS:
            self.partial.labels(reason)
        self.pd_decisions = Counter(
            "kvevents_gateway_pd_decisions_total", "Requests for a disaggregated model (one with "
            "prefill engines): disaggregated (two hops); decode_cached, short_uncached (the "
            "decode engine held enough of the prompt, or lacked too little: one hop); no_prefill, "
            "prefill_failed (no prefill engine reachable, or every one tried failed: the decode "
            "engine computed the prompt)", ["reason"], registry=registry)
        for reason in PD_REASONS:
            self.pd_decisions.labels(reason)
        self.pd_prefill_seconds = Histogram(
            "kvevents_gateway_pd_prefill_seconds", "A disaggregated request's prefill hop, sent to "
            "whole answer", ["model_name"], buckets=_BUCKETS, registry=registry)
        self.pd_decode_ttft = Histogram(
            "kvevents_gateway_pd_decode_ttft_seconds", "A disaggregated request's decode hop, sent "
            "to first byte (the decode engine's TTFT, the transfer included)", ["model_name"],
            buckets=_BUCKETS, registry=registry)
        self.parity = Counter("kvevents_gateway_token_parity_checks_total", "The gateway's ids for a "
                              "request compared with the engine's /tokenize ids for it (result: match, "
                              "mismatch; reason of a mismatch: special_tokens, tools, content_format, "
                              "template)", ["engine", "model_name", "result", "reason"], registry=registry)

    def model(self, model: str | None) -> str:
        """The ``model_name`` label of a request's model (never the client's own string
        unless a followed engine serves that model)."""
        if not model:
            return ""
        return self._models.label(model) if self._models is not None else UNKNOWN

    def of(self, metric, *labels: str):
        """``metric.labels(*labels)``, kept: the series every answered request updates
        (prometheus_client checks and converts the labels on every ``labels`` call).
        Labels from closed sets only (engine names, :meth:`model`, enums)."""
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            if len(self._children) >= 4096:  # (engines come and go: bounded all the same)
                self._children.clear()
            child = self._children[key] = metric.labels(*labels)
        return child

    def unscored(self, partial: str | None) -> None:
        """A prompt routed without its whole identity: ``partial`` its reason (see
        :mod:`kvevents.gateway.media`), None when it simply has no ids (untokenized)."""
        if partial is not None:
            self.of(self.partial, partial).inc()
        else:
            self.untokenized.inc()

    def refused(self, model: str | None, status: int) -> None:
        """A request answered by the gateway itself, before any engine was chosen."""
        self.of(self.requests, "", self.model(model), str(status)).inc()

    def first_byte(self, model: str | None, seconds: float) -> None:
        """A streamed answer's first byte, ``seconds`` after its request came."""
        self.of(self.ttft, self.model(model)).observe(seconds)

    def answered(self, engine: str, model: str | None, status: int, seconds: float,
                 usage: tuple[int, int] | None) -> None:
        """A request's end on ``engine``: its status, latency and, when its answer
        reported cached tokens, (reported, predicted)."""
        m = self.model(model)
        self.of(self.requests, engine, m, str(status)).inc()
        self.of(self.latency, m).observe(seconds)
        if usage is not None:
            self.hop_cached(engine, model, *usage)

    def hop_cached(self, engine: str, model: str | None, reported: int, predicted: int) -> None:
        """An answer (a whole request's, or a disaggregated request's prefill hop) that
        reported its cached tokens, against the index's prediction for ``engine``."""
        m = self.model(model)
        self.of(self.predicted, engine, m).inc(predicted)
        self.of(self.reported, engine, m).inc(reported)
        self.of(self.usage_reports, engine, m).inc()

    def pd_decided(self, reason: str) -> None:
        """A disaggregated model's request: two hops, or why one engine did it all."""
        self.of(self.pd_decisions, reason).inc()

    def pd_prefill(self, model: str | None, seconds: float) -> None:
        """A prefill hop's time, sent to whole answer."""
        self.of(self.pd_prefill_seconds, self.model(model)).observe(seconds)

    def pd_decode_first_byte(self, model: str | None, seconds: float) -> None:
        """A disaggregated request's decode engine: its first byte after the decode hop
        was sent (the time to its answer's head for a whole answer)."""
        self.of(self.pd_decode_ttft, self.model(model)).observe(seconds)

    def parity_checked(self, engine: str, model: str | None, result: str, reason: str) -> None:
        """One token-parity check (see :mod:`kvevents.gateway.parity`)."""
        self.of(self.parity, engine, self.model(model), result, reason).inc()

    def forget_engine(self, engine: str) -> None:
        """Drop an engine's series (it left the fleet)."""
        self._children.clear()  # (kept ones may be an engine's that goes now)
        for metric in (self.requests, self.predicted, self.reported, self.usage_reports, self.parity):
            for labels in [k for k in list(metric._metrics) if k[0] == engine]:  # noqa: SLF001
                metric.remove(*labels)
        try:
            self.inflight.remove(engine)
        except KeyError:
            pass
