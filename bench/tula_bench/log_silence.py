"""How long a run said nothing: issue 56 wants no stage waiting more than 5 minutes past a fault without ending or
saying why. A thread notes each moment the run's logs grew; the longest silence is read from those moments
afterwards, over the span that matters (from the fault's landing to the run's end)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def growth_times(size: Callable[[], int], poll_s: float) -> Iterator[list[float]]:
    """The moments (epoch seconds) at which `size()` changed, polled every `poll_s` while the block runs; the list
    fills as the block runs and opens with the block's start."""
    times, done, initial = [time.time()], threading.Event(), size()  # read now: the block may write at once

    def watch() -> None:
        last = initial
        while not done.wait(poll_s):
            if (now := size()) != last:
                times.append(time.time())
                last = now

    watcher = threading.Thread(target=watch, name="log-silence", daemon=True)
    watcher.start()
    try:
        yield times
    finally:
        done.set()
        watcher.join()


def longest_silence(times: list[float], begin: float, end: float) -> float:
    """The longest span within [begin, end] in which nothing grew (`times`: the moments something did)."""
    marks = [begin, *sorted(t for t in times if begin < t < end), end]
    return round(max(0.0, *(b - a for a, b in zip(marks, marks[1:]))), 1)
