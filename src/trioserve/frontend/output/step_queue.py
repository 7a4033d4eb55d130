"""The hop from the output pump to the output handler: a bounded queue with a named policy.

- ``coalesce`` (default): when full, the newest step is folded into the last queued one, per request.
  Memory stays bounded and the engine never waits on this process; a backlog shows up as several
  tokens per event (and in ``coalesced``), not as a growing queue.
- ``block``: when full, the pump waits, ZMQ's high-water mark fills, and the engine's output pump feels
  the backpressure (its policy decides whether the engine then stalls or folds).
- ``unbounded``: vLLM's behaviour; the queue grows in memory without limit.
"""

from __future__ import annotations

from collections import deque
from typing import Literal

import trio

from trioserve.protocol.fold import fold_outputs
from trioserve.protocol.messages import EngineOutputs

QueuePolicy = Literal["coalesce", "block", "unbounded"]


class StepQueue:
    def __init__(self, size: int, policy: QueuePolicy) -> None:
        self.size = size
        self.policy = policy
        self._steps: deque[EngineOutputs] = deque()
        self._not_empty = trio.lowlevel.ParkingLot()
        self._not_full = trio.lowlevel.ParkingLot()
        self.coalesced = 0  # counter: steps folded into a queued step
        self.max_depth = 0  # gauge: the most steps ever queued at once (the high-water mark)

    @property
    def depth(self) -> int:
        """Gauge: steps queued now."""
        return len(self._steps)

    async def put(self, step: EngineOutputs) -> None:
        steps = self._steps
        if len(steps) >= self.size and self.policy != "unbounded":
            if self.policy == "coalesce":
                fold_outputs(steps[-1], step)
                self.coalesced += 1
                return
            while len(steps) >= self.size:
                await self._not_full.park()
        steps.append(step)
        self.max_depth = max(self.max_depth, len(steps))
        self._not_empty.unpark()

    async def get(self) -> EngineOutputs:
        if self._steps:
            # Yield even when a step is ready, so a backlog of small steps cannot run back to back
            # while connections and the pump wait (the clumping seed 000 traces to asyncio.Queue).
            await trio.lowlevel.checkpoint()
        while not self._steps:
            await self._not_empty.park()
        self._not_full.unpark()
        return self._steps.popleft()
