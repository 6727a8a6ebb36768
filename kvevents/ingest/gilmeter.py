"""How long the ingest loop thread runs Python between two GIL releases.

Why: every stretch of Python on the loop thread holds the GIL that the event loop needs
to answer lookups and stream proxied responses, and a thread that never releases it is
only made to by the interpreter's switch interval (5 ms). The loop releases it in
``zmq_poll`` and in the lane (the compiled receive-and-apply pass); the meter times each
stretch between the end of one release and the start of the next, on the loop thread.

Method and its bias: the stretch is wall time from ``resumed()`` to ``releasing()``, so
anything else that gives the GIL up in between (a compiled call that releases it, the
interpreter's forced switch, the OS descheduling the thread) makes a stretch look longer
than the GIL was held: an upper bound. A stretch is only counted once it ends, so the
first one after start (no ``resumed()`` yet) is not.

Written by the loop thread only; read by scrapes (a racing read may see one stretch in
the counts and not yet in the sum: harmless for a histogram).
"""

from __future__ import annotations

from bisect import bisect_left
from time import perf_counter

#: Histogram bounds, seconds.
HOLD_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)


class HoldMeter:
    """Stretches of the loop thread holding the GIL: a histogram (per bucket, the last
    one +Inf), their sum and the longest one."""

    __slots__ = ("counts", "total", "longest", "_since")

    def __init__(self) -> None:
        self.counts = [0] * (len(HOLD_BUCKETS) + 1)
        self.total = 0.0
        self.longest = 0.0
        self._since: float | None = None

    def resumed(self) -> None:
        """The thread has the GIL again (a release just ended)."""
        self._since = perf_counter()

    def releasing(self) -> None:
        """The thread is about to release the GIL: the stretch since :meth:`resumed` ends."""
        since = self._since
        if since is None:
            return
        held = perf_counter() - since
        self._since = None
        self.counts[bisect_left(HOLD_BUCKETS, held)] += 1
        self.total += held
        if held > self.longest:
            self.longest = held
