"""Routing: where a prompt should go, from what each engine caches and how busy it is.

Files::

    policies.py   the policies (KV-aware, round robin, least loaded): pure functions of
                  a lookup and the candidates' load, usable in process
    decision.py   Router: turns a request (token ids, candidates) into a decision over
                  one aggregator (candidates checked, lookup off the loop, down engines)
    offloop.py    index lookups and tokenization from async code, the event loop never
                  blocked for more than a bound

Imports the service, the index and ``text``; the HTTP handlers (``api``) sit above it.
"""

from kvevents.routing.decision import Router
from kvevents.routing.policies import (
    POLICIES,
    Candidate,
    EngineLoad,
    EngineScore,
    KVAwarePolicy,
    KVRouterConfig,
    LeastLoadedPolicy,
    RoundRobinPolicy,
    RouteDecision,
    without_engines,
)

__all__ = ["POLICIES", "Candidate", "EngineLoad", "EngineScore", "KVAwarePolicy", "KVRouterConfig",
           "LeastLoadedPolicy", "RoundRobinPolicy", "RouteDecision", "Router", "without_engines"]
