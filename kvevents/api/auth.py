"""Optional bearer-token guard for mutating endpoints.

When the aggregator has an ``auth_token``, requests to guarded routes must carry
``Authorization: Bearer <token>``; otherwise they get 401 and change nothing. Reads stay
open (routers and dashboards poll them). Comparison is constant-time.
"""

from __future__ import annotations

import hmac

from fastapi import Request

from kvevents.api.errors import ApiError


def require_token(request: Request) -> None:
    token = request.app.state.aggregator.settings.auth_token
    if not token:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise ApiError(401, "missing or wrong bearer token", "Authorization",
                       headers={"WWW-Authenticate": "Bearer"})
