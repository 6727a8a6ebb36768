"""A peer aggregator's current snapshot over HTTP (``GET /v1/snapshot``), for bootstrap."""

from __future__ import annotations

import urllib.request

from kvevents.service.snapshot.format import Snapshot, decode


def fetch_peer(url: str, token: str | None, timeout: float = 30.0) -> Snapshot:
    """A peer aggregator's current snapshot from ``GET {url}/v1/snapshot``.
    Raises ``OSError`` (unreachable, HTTP error) or :class:`SnapshotError`."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"bootstrap URL must be http(s)://HOST:PORT, got {url!r}")
    req = urllib.request.Request(url.rstrip("/") + "/v1/snapshot")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (checked scheme)
        return decode(resp.read())
