"""One JSON error shape for every 4xx/5xx: ``{"error": message, "field": name|null}``,
and one error type to raise for it: :class:`~kvevents.text.prompt.InputError` (also
named :data:`ApiError` here), whether a handler, the router or the prompt's limits
refuse the request.

``field`` names the offending request field (``token_ids``, ``token_ids[3]``, ``name``,
``limit``...) so a client can tell what to fix. A rejected request changes nothing:
validation happens before any handler touches state. (The gateway's OpenAI endpoints
answer in OpenAI's shape instead: :mod:`kvevents.gateway.errors`.)
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvevents.api.http_head import error_bytes
from kvevents.text.prompt import InputError


#: The API's error: raise it from a handler to answer ``status`` with a named field.
ApiError = InputError


def error_response(status: int, message: str, field: str | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    return Response(error_bytes(status, message, field, openai=False), status_code=status,
                    headers=headers, media_type="application/json")


def _field_of(loc: tuple) -> str | None:
    """("body", "token_ids", 3) -> "token_ids[3]"; ("query", "limit") -> "limit"."""
    parts = [p for p in loc if p not in ("body", "query", "path", "header")]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(InputError)  # a handler's, the router's, the prompt's limits'
    async def _input_error(_: Request, exc: InputError) -> Response:
        return error_response(exc.status, exc.message, exc.field, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        first = errors[0] if errors else {}
        field = _field_of(tuple(first.get("loc", ())))
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            field, msg = None, "request body is not valid JSON"
        elif first.get("type") == "missing":
            msg = f"missing required field {field!r}"
        else:
            msg = f"{field}: {msg}" if field else msg
        return error_response(422, msg, field)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail), None, getattr(exc, "headers", None))
