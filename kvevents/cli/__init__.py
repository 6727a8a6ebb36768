"""The ``kvevents`` command: ``serve`` (the aggregator over HTTP), ``tail`` (print a
publisher's events), ``demo`` and ``loadgen`` (in :mod:`kvevents.demo`).

Files::

    main.py    the argument parsers and dispatch (imports nothing heavy until a
               subcommand runs: ``kvevents --help`` starts without pydantic)
    serve.py   settings -> the FastAPI app -> uvicorn, with a clear error for a busy port
    tail.py    a subscriber that prints each event
"""

from kvevents.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
