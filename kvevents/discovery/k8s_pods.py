"""Kubernetes pods -> engines, for :mod:`kvevents.discovery.k8s`: which pods count,
what their annotations override, and label selectors checked before any request.

Pure functions over the attributes of a pod object (lightkube's ``Pod`` model, or
anything shaped like it), so this module needs no client library.

A pod counts (:func:`pod_ready`) only when it is Running, its ``Ready`` condition is
``"True"``, it has a pod IP and is not being deleted: anything less is not a server that
answers yet (or still), and the manager's grace period covers a brief not-Ready.

Per-pod overrides of the source's port plan (:data:`ANNOTATIONS`)::

    kvevents.io/events-port: "5557"     # rank r publishes on events-port + r
    kvevents.io/replay-port: "5558"     # or "none": no replay socket
    kvevents.io/http-port: "8000"       # or "none": no OpenAI server (not a gateway target)
    kvevents.io/dp-size: "2"            # data-parallel ranks: engines POD-dp0, POD-dp1
    kvevents.io/model: "meta-llama/Llama-3.1-8B-Instruct"

A pod's gateway role (prefill/decode disaggregation) is a label, so that the pools are
selectors too: ``kvevents.io/role: prefill`` (or ``decode``, ``both``; llm-d's
``llm-d.ai/role`` is read where ours is absent). None: ``both``.

A bad value raises ``ValueError`` naming the annotation or label; the source skips that pod.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from kvevents.discovery.targets import PortPlan, engine_specs
from kvevents.engines.spec import ROLES, EngineSpec

__all__ = ["ANNOTATIONS", "ROLE_LABELS", "annotated_plan", "parse_selector", "pod_ready", "pod_role",
           "pod_specs"]

_PREFIX = "kvevents.io/"
EVENTS_PORT, REPLAY_PORT, HTTP_PORT = _PREFIX + "events-port", _PREFIX + "replay-port", _PREFIX + "http-port"
DP_SIZE, MODEL = _PREFIX + "dp-size", _PREFIX + "model"
ANNOTATIONS = (EVENTS_PORT, REPLAY_PORT, HTTP_PORT, DP_SIZE, MODEL)
#: Labels that give a pod's role, ours first.
ROLE_LABELS = (_PREFIX + "role", "llm-d.ai/role")


def pod_ready(pod: Any) -> bool:
    """Running, Ready, with an IP and no deletion under way."""
    meta, status = pod.metadata, pod.status
    if meta is None or status is None or meta.deletionTimestamp is not None:
        return False
    if status.phase != "Running" or not status.podIP:
        return False
    return any(c.type == "Ready" and c.status == "True" for c in status.conditions or ())


def _number(annotations: Mapping[str, str], key: str, *, none_ok: bool) -> int | None:
    """The annotation as an int (``none`` -> None where allowed); absent -> KeyError."""
    text = annotations[key].strip()
    if none_ok and text.lower() == "none":
        return None
    if not re.fullmatch(r"[0-9]{1,5}", text):  # int() would also take "+5", "1_0", " 5"
        raise ValueError(f"annotation {key}={annotations[key]!r}: expected a number"
                         + (" or 'none'" if none_ok else ""))
    return int(text)


def annotated_plan(annotations: Mapping[str, str] | None, ports: PortPlan,
                   model: str | None) -> tuple[PortPlan, str | None]:
    """``ports`` and ``model`` with the pod's annotations applied (``ValueError`` if bad)."""
    annotations = annotations or {}
    changes: dict[str, int | None] = {}
    for key, field, none_ok in ((EVENTS_PORT, "events", False), (REPLAY_PORT, "replay", True),
                                (HTTP_PORT, "http", True), (DP_SIZE, "dp_size", False)):
        if key in annotations:
            changes[field] = _number(annotations, key, none_ok=none_ok)
    if MODEL in annotations:
        model = annotations[MODEL].strip()
        if not model:
            raise ValueError(f"annotation {MODEL} is empty")
    try:
        return dataclasses.replace(ports, **changes), model
    except ValueError as exc:  # PortPlan's own range checks, named as annotations
        raise ValueError(f"annotations {sorted(k for k in annotations if k in ANNOTATIONS)}: {exc}") from None


def pod_specs(pod: Any, ports: PortPlan, model: str | None) -> list[EngineSpec]:
    """The engines of one pod (it must be :func:`pod_ready`), named after the pod.
    ``ValueError`` for a bad annotation (or a pod name too long for an engine name)."""
    plan, model = annotated_plan(pod.metadata.annotations, ports, model)
    return engine_specs(pod.metadata.name, pod.status.podIP, plan, model, pod_role(getattr(pod.metadata, "labels", None)))


def pod_role(labels: Mapping[str, str] | None) -> str:
    """The role its :data:`ROLE_LABELS` give (``both`` without one); ``ValueError``."""
    for key in ROLE_LABELS:
        if labels and key in labels:
            role = labels[key].strip().lower()
            if role not in ROLES:
                raise ValueError(f"label {key}={labels[key]!r}: expected one of {', '.join(ROLES)}")
            return role
    return "both"


# Label selectors, as kubectl takes them: `app=vllm,tier!=canary`, `env in (a,b)`,
# `gpu`, `!spot`. Parsed here (not sent raw) so a typo fails at start-up, not as an API
# error every back-off, and because lightkube wants the requirements, not a string.
_KEY = r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?/)?[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_VALUE = r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?"
_REQUIREMENT = re.compile(
    rf"(?P<not>!)\s*(?P<nkey>{_KEY})"
    rf"|(?P<key>{_KEY})\s*(?:(?P<op>==|=|!=)\s*(?P<value>{_VALUE})"
    rf"|\s+(?P<set>in|notin)\s*\((?P<values>[^()]*)\))?")


def _split(selector: str) -> list[str]:
    """Split on the commas outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(selector):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(selector[start:i])
            start = i + 1
    parts.append(selector[start:])
    return parts


def parse_selector(selector: str) -> list[tuple[str, Any]]:
    """A label selector as lightkube's ``labels`` pairs (``ValueError`` if malformed);
    ``[]`` for an empty selector (every pod of the namespace)."""
    from lightkube import operators as op  # only K8sSource calls this, after its import check

    if not selector.strip():
        return []
    pairs: list[tuple[str, Any]] = []
    for part in _split(selector):
        m = _REQUIREMENT.fullmatch(part.strip())
        if m is None:
            raise ValueError(f"label selector {selector!r}: cannot parse {part.strip()!r}")
        if m["not"]:
            pairs.append((m["nkey"], op.not_exists()))
        elif m["set"]:
            values = [v.strip() for v in m["values"].split(",")]
            if not all(re.fullmatch(_VALUE, v) and v for v in values):
                raise ValueError(f"label selector {selector!r}: bad value list in {part.strip()!r}")
            pairs.append((m["key"], op.in_(values) if m["set"] == "in" else op.not_in(values)))
        elif m["op"]:
            pairs.append((m["key"], op.not_equal(m["value"]) if m["op"] == "!=" else op.equal(m["value"])))
        else:
            pairs.append((m["key"], op.exists()))
    return pairs
