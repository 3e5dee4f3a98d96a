"""How many batch lines are in flight, over all batches: a window that grows by one line per window
of lines answered while no other tier used the pool, and halves as soon as a line finds interactive
requests on it or is turned away (additive increase, multiplicative decrease, as TCP does with a
network): batches fill what is idle and step back at once when interactive traffic comes."""

from __future__ import annotations

import asyncio
import time


class Window:
    """How many lines may be in flight: additive increase while pools are idle, halved when busy;
    and after a line that found other tiers on its pool, no new line for as long as it took (while
    interactive traffic lasts, batches hold a slot at most half the time)."""

    def __init__(self, limit: int) -> None:
        self.max, self.size, self.in_flight = limit, 1.0, 0
        self.resume_at = 0.0  # monotonic time before which no line starts
        self._changed = asyncio.Condition()

    async def acquire(self) -> None:
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda: self.in_flight < int(self.size))
                pause = self.resume_at - time.monotonic()
                if pause <= 0:
                    self.in_flight += 1
                    return
            await asyncio.sleep(pause)

    async def release(self, idle: bool | None, held_s: float = 0.0) -> None:
        """`idle`: the pool served nobody else (grow), was busy or refused (shrink and pause for
        `held_s`, the time the line took), None: unknown."""
        async with self._changed:
            self.in_flight -= 1
            if idle is True:
                self.size = min(self.max, self.size + 1 / int(self.size))
            elif idle is False:
                self.size = max(1.0, self.size / 2)
                self.resume_at = max(self.resume_at, time.monotonic() + held_s)
            self._changed.notify_all()
