"""Constants needed before anything heavy is imported (the CLI's parsers, the demo).

Standard library only: ``kvevents tail`` and ``kvevents --help`` start without
importing pydantic.
"""

DEFAULT_PORT = 8090  # the aggregator's HTTP port; not 8000, `vllm serve`'s, often on the same host

# The KV-aware routing policy's trade of cache against load (kvevents.routing.policies:
# KVRouterConfig; the serve settings route_* take them as defaults).
ROUTE_LOAD_WEIGHT = 0.5
ROUTE_MAX_IMBALANCE = 8.0  # requests
ROUTE_AFFINITY_WEIGHT = 0.15
# A gateway's pull toward the engines it sent less than their share of its recent
# requests: what keeps a hot shared prefix (one system prompt behind 40% of the traffic)
# from holding one engine's share of requests above the others' (issue 20).
ROUTE_BALANCE_WEIGHT = 3.0
