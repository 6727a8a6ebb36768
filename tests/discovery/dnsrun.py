"""A discovery source's ``run`` on a thread, with every set it emits collected: the
harness of the DNS source tests."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from kvevents.discovery.source import Source

from dnsmasq import wait_until  # noqa: E402  (dnsmasq puts tests/ on the path)


class Running:
    """``source.run`` on a thread, with every emitted set collected."""

    def __init__(self, source: Source) -> None:
        self.source, self.sets, self.stop = source, [], threading.Event()
        self.thread = threading.Thread(target=source.run, args=(self.sets.append, self.stop), daemon=True)

    def last(self, count: int = 1) -> list | None:
        return self.sets[-1] if len(self.sets) >= count else None

    def wait_for(self, pred: Callable[[list], bool], timeout: float) -> list:
        start = len(self.sets)  # only sets emitted from now on count
        assert wait_until(lambda: len(self.sets) > start and pred(self.sets[-1]), timeout), \
            f"last set: {self.sets[-1] if self.sets else None}; status: {self.source.status}"
        return self.sets[-1]

    def stop_and_join(self) -> float:
        self.stop.set()
        t = time.monotonic()
        self.thread.join(5)
        assert not self.thread.is_alive(), "run() did not return after stop"
        return time.monotonic() - t


@contextlib.contextmanager
def running(source: Source) -> Iterator[Running]:
    r = Running(source)
    r.thread.start()
    try:
        yield r
    finally:
        r.stop_and_join()


def _names(specs) -> list[str]:
    return [s.name for s in specs]


