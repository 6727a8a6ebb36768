"""Errors in OpenAI's shape, as every OpenAI client expects them.

``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`` with a 4xx for
input the gateway refuses (``param`` names the field) and a 5xx only for what the
engines could not do (none up: 503 with ``Retry-After``; an engine that failed before
its first byte on every try: 502). An engine's own error answer is passed through
unchanged, not rewritten.
"""

from __future__ import annotations

import msgspec
from starlette.responses import Response

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
          502: "upstream_error", 503: "service_unavailable", 504: "timeout_error"}
_json = msgspec.json.Encoder()


class OpenAIError(Exception):
    """Raised by the gateway; answered by :meth:`response`."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> Response:
        return Response(self.body(), status_code=self.status, headers=self.headers,
                        media_type="application/json")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> bytes:
    return _json.encode({"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                                   "param": param, "code": code}})
