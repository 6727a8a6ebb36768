"""What can go wrong talking to an engine (:mod:`kvevents.gateway.upstream` raises
these; importable from there too)."""

from __future__ import annotations

__all__ = ["UpstreamAborted", "UpstreamClosed", "UpstreamConnectError", "UpstreamError",
           "UpstreamProtocolError", "UpstreamTimeout"]


class UpstreamError(Exception):
    """Any failure talking to an engine."""


class UpstreamConnectError(UpstreamError):
    """The connection could not be opened (refused, unreachable, timed out)."""


class UpstreamProtocolError(UpstreamError):
    """A malformed answer, or a connection that closed before the answer's end."""


class UpstreamTimeout(UpstreamError):
    """No (more of the) answer within the caller's time limit."""


class UpstreamClosed(UpstreamError):
    """The answer was closed by the gateway (its client left) before its end."""


class UpstreamAborted(UpstreamError):
    """The caller stopped waiting for the answer's head (its client left)."""
