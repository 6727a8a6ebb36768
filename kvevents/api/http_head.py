"""The bytes of an answer written by kvevents' own HTTP code rather than by uvicorn's
request cycle: one head writer (:func:`response_head`) and one error body per surface
(:func:`error_bytes`).

Why one: the server protocol (:mod:`~kvevents.api.server_protocol`) answers lookups
itself, its :class:`~kvevents.api.exchange.Exchange` writes the gateway's answers, and
both write a 500 or an oversized body's 413 in the surface's error shape; each answer must
carry what uvicorn's own would (its default headers: ``server``, ``date``), frame its
body the same way and say ``connection: close`` when the connection ends after it.

Lifecycle: plain functions, called on the event loop's thread per answer. Failure: none
raise on valid input (an unknown status gets an empty reason phrase).
"""

from __future__ import annotations

import http
import json
from collections.abc import Iterable

from kvevents.gateway.errors import error_body

__all__ = ["JSON", "error_bytes", "response_head", "status_line"]

#: The headers of a JSON answer whose length is known (pass its body to
#: :func:`response_head`, which adds ``content-length``).
JSON = ((b"content-type", b"application/json"),)

_STATUS: dict[int, bytes] = {}
#: The last default-header list seen and its bytes. uvicorn replaces the list (it holds
#: the ``date``) once a second and never changes one in place, so the headers are encoded
#: once per list, not once per answer; one tuple, so a reader never sees a list paired
#: with another list's bytes.
_defaults: tuple[list | tuple, bytes] = ((), b"")


def status_line(status: int) -> bytes:
    """``HTTP/1.1 <status> <phrase>\\r\\n``, built once per status."""
    line = _STATUS.get(status)
    if line is None:
        try:
            phrase = http.HTTPStatus(status).phrase.encode()
        except ValueError:
            phrase = b""
        line = _STATUS[status] = b"HTTP/1.1 %d %s\r\n" % (status, phrase)
    return line


def response_head(status: int, defaults: list[tuple[bytes, bytes]],
                  headers: Iterable[tuple[bytes, bytes]], keep_alive: bool,
                  body: bytes | None = None) -> tuple[bytes, bool, bool]:
    """``(data, chunked, keep_alive)`` for an answer: its head (the status line, the
    server's ``defaults``, ``headers`` as given, then its framing, then
    ``connection: close`` when the connection ends after it, once), followed by ``body`` when
    the body is given whole (its ``content-length`` is then added). Without ``body`` the
    answer is framed by a ``content-length`` in ``headers``, else chunked
    (``transfer-encoding: chunked`` is added). ``keep_alive`` comes back false when it
    was, or when ``headers`` say ``connection: close``."""
    global _defaults
    seen, encoded = _defaults
    if defaults is not seen:
        encoded = b"".join([b"%s: %s\r\n" % pair for pair in defaults])
        _defaults = (defaults, encoded)
    line = _STATUS.get(status) or status_line(status)
    out = [line, encoded]
    chunked = body is None
    said_close = False
    for name, value in headers:
        lname = name.lower()
        if lname == b"content-length":
            chunked = False
        elif lname == b"connection" and value.lower() == b"close":
            keep_alive, said_close = False, True
        out += (name, b": ", value, b"\r\n")
    if body is not None:
        out.append(b"content-length: %d\r\n" % len(body))
    elif chunked:
        out.append(b"transfer-encoding: chunked\r\n")
    out.append(b"\r\n" if keep_alive or said_close else b"connection: close\r\n\r\n")
    if body:
        out.append(body)
    return b"".join(out), chunked, keep_alive


def error_bytes(status: int, message: str, field: str | None = None, *, openai: bool) -> bytes:
    """An error answer's JSON body in its surface's shape: OpenAI's on the gateway's
    endpoints (``{"error": {"message", "type", "param", "code"}}``, ``field`` as
    ``param``: :func:`kvevents.gateway.errors.error_body`), else the API's
    (``{"error": message, "field": field}``: :mod:`kvevents.api.errors`)."""
    if openai:
        return error_body(status, message, field)
    return json.dumps({"error": message, "field": field}, ensure_ascii=False,
                      separators=(",", ":")).encode()
