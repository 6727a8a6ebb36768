"""``kvevents serve``: run the aggregator's HTTP server (uvicorn) until stopped."""

from __future__ import annotations

import logging
import sys

import uvicorn

from kvevents.api import create_app
from kvevents.settings import AggregatorSettings
from kvevents.text import TokenizerLoadError

log = logging.getLogger(__name__)


def run_server(settings: AggregatorSettings) -> int:
    """Serve until SIGINT/SIGTERM; the app's lifespan starts and stops the aggregator."""
    try:
        app = create_app(settings)
    except TokenizerLoadError as exc:  # one line naming the model and file, no traceback
        print(f"kvevents serve: error: {exc}", file=sys.stderr)
        return 2
    for pod in settings.pods:
        log.info("following %s at %s%s", pod.name, pod.endpoint,
                 f" (replay {pod.replay_endpoint})" if pod.replay_endpoint else "")
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                access_log=False)
    return 0
