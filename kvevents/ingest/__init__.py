"""Ingest: following publishers (many engines' KV event streams, in seq order).

Files, one concept each::

    subscriber.py  Subscriber: construction, public API, loop thread, watchdog,
                   poll_once, housekeeping; its docstring holds the delivery contracts
    stream.py      seq tracking of the live stream: gaps, jumps, restarts, hold-back
    replay.py      the replay client: requests, replies, deadlines, continuity checks
    delivery.py    decode and hand batches and signals to the consumer, in order
    sockets.py     opening, monitoring, retrying and closing the sockets of a source
    drain.py       receiving: whole messages from one socket per poll, bounded
    _zmqrecv.pyx   the compiled drain, straight through libzmq (pyzmq is the fallback)
    _lane.pxi      (in _zmqrecv) each source's stream Cursor and DigestRing, and the
                   lane: the drain that hands in-order batches to a compiled sink
                   without the GIL
    lane_abi.pxd   the lane's C interface to a consumer's sink (declarations only)
    gilmeter.py    how long the loop thread runs Python between two GIL releases
    signals.py     what the subscriber tells its consumer (BatchReceived, BatchesLost ...)
    source.py      one followed publisher: config, counters, per-source state
    continuity.py  digests of the last batches applied, to tell a restarted publisher
                   (the compiled DigestRing)
    budget.py      how many engines fit in the sockets and files we may open
    ratelog.py     rate limiting of repeated log lines
    memory.py      giving freed heap memory back to the OS after a flood

    SUB ─► drain ─► stream ─┬────────────► delivery ─► consumer
                            └─► replay ─(DEALER)─┘
    SUB ─► lane (no GIL) ─► consumer's sink; BatchesApplied ─► consumer
       └─ (anything else) ─► stream ...
"""
