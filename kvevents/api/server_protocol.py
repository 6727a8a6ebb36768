"""The HTTP protocol class ``kvevents serve`` runs uvicorn with: connection limits
(:mod:`~kvevents.api.conn_guard`), common lookups answered in the protocol
(:mod:`~kvevents.api.lookup_protocol`) and the gateway's OpenAI requests handed to it
from the protocol (:mod:`~kvevents.api.openai_protocol`), each switchable."""

from __future__ import annotations

from kvevents.api.conn_guard import ConnLimits, guarded_class
from kvevents.api.lookup_protocol import LookupHttpProtocol, uvicorn_fits
from kvevents.api.openai_protocol import OpenAIHttpProtocol


def protocol_class(app, limits: ConnLimits | None = None, *, lookup: bool = True,
                   openai: bool = True) -> type | None:
    """The class for ``app`` (its state is read per request) under ``limits`` (default:
    :class:`ConnLimits`' defaults): ``lookup`` false: every lookup through the app;
    ``openai`` false: every OpenAI request through the app; both false: the limits only.
    None when the installed uvicorn is not one these were written against (uvicorn's own
    protocol then runs, and the app answers everything)."""
    limits = limits or ConnLimits()
    if not lookup and not openai:
        return guarded_class(app, limits)
    if not uvicorn_fits():
        return None
    cls = guarded_class(app, limits, OpenAIHttpProtocol if openai else LookupHttpProtocol)
    if cls is not None:
        cls.lookup_app = app if lookup else None
        if openai:
            cls.openai_app = app
    return cls
