"""The KV-aware OpenAI gateway: ``kvevents serve`` in front of the engines.

Files::

    proxy.py    Gateway: a request's whole life, top to bottom: parse, targets, identity
                and tokens, choose (index + load + session), send (retry before the
                first byte), answer (streamed back unchanged, or whole)
    lifecycle.py  the request's state (Call): its slot, its send's load, its engine
                connection and its count, given back and counted once however it ends
    disagg.py   prefill/decode disaggregation: the pools, the skip, the prefill hop and
                its fallbacks (engines' roles)
    relay.py    a streamed answer as one response owning the engine's stream and the
                request's slot to its last byte; chunks written to the client's socket
                as the engine sends them (kvevents serve), else through ASGI send
    server_ext.py  what the gateway may ask of the HTTP server beyond ASGI (the
                connection, a disconnect watch, the body already read), with plain
                ASGI where the server offers none
    flow.py     backpressure from the engine's socket to the client's: the watermarks,
                and what pauses and resumes the engine
    endpoints.py  the OpenAI endpoints, one row per path (parser, prompt field, routing,
                streaming, end marker, usage): what every list of paths reads
    prompt.py   what the gateway reads of a body (model, stream, prompt) and the
                prompt's token ids (local tokenizer, else the engine's /tokenize)
    responses.py  the Responses API: its input as the chat vLLM renders, and the engine
                that stored each response (previous_response_id follow-ups go there)
    load.py     each engine's load: first-hand in-flight requests and uncomputed prompt
                tokens, plus the engine's own /metrics (polled for three gauges by
                name; more often while routing, if so set); reachability
    metrics.py  the gateway's Prometheus metrics (requests, TTFT, latency, in flight,
                predicted against reported cached tokens)
    errors.py   OpenAI-shaped errors

Sits above ``routing`` (the decision) and below ``api`` (the handlers).
"""

from kvevents.gateway.errors import OpenAIError
from kvevents.gateway.metrics import GatewayMetrics
from kvevents.gateway.proxy import Gateway

__all__ = ["Gateway", "GatewayMetrics", "OpenAIError"]
