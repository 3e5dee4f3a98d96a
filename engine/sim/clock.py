"""The simulated engine's time. A step starts at `now()` and ends at `sleep_until(start + step time)`.

`RealClock` sleeps (the GIL released, so the serving threads run meanwhile) for what is left of the step
after the engine's own CPU work; a step whose CPU work took longer than its simulated time ends late,
as a GPU engine whose host falls behind does. `VirtualClock` only adds: a test or a what-if run steps
through hours of simulated serving in the CPU time of the bookkeeping.
"""

import threading
import time


class RealClock:
    def now(self) -> float:
        return time.monotonic()

    def sleep_until(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left > 0:
            time.sleep(left)


class VirtualClock:
    def __init__(self, start: float = 0.0):
        self._now = start
        self._lock = threading.Lock()

    def now(self) -> float:
        return self._now

    def sleep_until(self, deadline: float) -> None:
        with self._lock:
            self._now = max(self._now, deadline)

    def advance(self, seconds: float) -> None:
        """Let time pass with the engine idle (arrivals spread over time in a test)."""
        self.sleep_until(self._now + seconds)
