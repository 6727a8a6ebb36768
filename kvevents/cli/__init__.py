"""The ``kvevents`` command: ``serve`` (the aggregator over HTTP), ``tail`` (print a
publisher's events), ``demo`` and ``loadgen`` (in :mod:`kvevents.demo`).

Files::

    main.py    the argument parsers and dispatch (imports nothing heavy until a
               subcommand runs: ``kvevents --help`` starts without pydantic)
    serve.py   settings -> the FastAPI app -> uvicorn, with a clear error for a busy port
    workers.py ``serve --workers N``: the supervisor that forks, restarts and stops the
               workers, each a whole aggregator on the one port (SO_REUSEPORT)
    worker_app.py   a worker's ASGI app: /readyz and /metrics for the whole process,
               run-time engine changes repeated to every worker
    worker_board.py what the workers share (readiness, pids, restarts) and how one asks
               another (a private abstract Unix socket)
    tail.py    a subscriber that prints each event
"""

from kvevents.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
