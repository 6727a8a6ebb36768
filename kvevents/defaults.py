"""Constants needed before anything heavy is imported (the CLI's parsers, the demo).

Standard library only: ``kvevents tail`` and ``kvevents --help`` start without
importing pydantic.
"""

DEFAULT_PORT = 8090  # the aggregator's HTTP port; not 8000, `vllm serve`'s, often on the same host
