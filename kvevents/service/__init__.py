"""The aggregator service: one process that follows engines, keeps the index and
answers for it (HTTP handlers live in ``kvevents.api``, above this package).

Files::

    aggregator.py  Aggregator: the lifecycle (start, stop, housekeeping), engines
                   followed (add, remove, reconcile), health and readiness, lookups
    apply.py       IndexWriter: the subscriber's signals applied to the index, with
                   each engine's anchor (seq, ts) for snapshots; failed applies rebuilt
    snapshot/      durable restarts: the file format, the data dir and a peer's
                   snapshot, and restore with a continuity check per engine
    metrics/       the aggregator's Prometheus metrics (index and stream state read at
                   scrape time through view.py; lookups and lag observed as they happen)
    view.py        the narrow, read-only view of the aggregator the metrics read
    feed.py        the bounded event feed behind ``/v1/events`` (server-sent events)
    settings.py    typed settings: flags > environment > config file > defaults
    cpus.py        the cores this process may use (``--workers auto``): CPU affinity
                   and the cgroup's CPU quota

Nothing is imported here: ``kvevents.service.settings`` loads without the service.
"""
