"""What the engine-core shell (``engine/core.py``) drives: one step at a time, a core decides which
work to do, does it, and says what came of it.

Two cores implement it: ``engine/scheduler_core.py`` (the scheduler and its KV ledger, with an
executor that runs the model: a worker process, or the in-process reference executor) and
``mock/core.py`` (seed 000's frontend-stress tool: instant prefill, a fixed step clock, random
tokens). The shell owns everything around them: joining the API servers, the input pumps, the aborts'
fast path, refused requests' outputs, sending outputs, heartbeats and the step watch, shutdown and
failure. A core does no socket I/O.

Rules (the shell keeps them; a core may rely on them):

1. **One step at a time, in order**: ``schedule()``, then ``await execute()``, then ``update()``.
   ``schedule`` returns ``None`` when there is nothing to compute now; then neither of the others
   follows, and the shell waits for work (``add``) or the next heartbeat.
2. **Only ``execute`` awaits.** While it does, the input pumps run and may call ``add`` and
   ``abort`` (a request that arrives mid-step is the core's to place: the scheduler's next
   ``schedule``, or the mock's admission at ``update``), and the beat task may call ``stats``.
3. **Aborts**: the shell calls ``abort`` as soon as one arrives, between steps or while ``execute``
   is awaited. The core makes it land before the running step's ``update`` (the scheduler's core
   right after the forward, the mock at once), so an aborted request yields nothing from the step
   that was running when its abort arrived, nor after. Unknown ids (finished already) are ignored.
4. ``add`` returns the error output that refuses a request (it keeps nothing then); the shell sends
   it with the next outputs to the request's API server.
5. ``update`` returns the step's outputs grouped by ``client_index`` (the API server that owns each
   request); it does not reuse the lists it returns.
6. **Failure**: ``execute`` raises ``ExecutorFailed`` when the model can no longer run; a core that
   finds out while idle (a worker died) sets ``failure`` and calls the function the shell gave it
   with ``wake_on_failure`` (it wakes the busy loop). Either ends the engine: every API server gets
   ``EngineDead`` with the reason.
7. ``ready`` describes the core (its kind, limits and KV pool) as the handshake's ``EngineReady``;
   the shell gives the engine index and process id.
8. A core meets this interface structurally: it need not import this module (the mock, below the
   engine in the layering, does not).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from trioserve.engine.executor import ExecutorFailed
from trioserve.protocol.messages import AddRequest, EngineReady, EngineStats, RequestOutput


class Core(Protocol):
    """The small interface the engine-core shell runs (see the module's rules)."""

    def ready(self, engine_index: int, pid: int) -> EngineReady:
        """What the handshake tells every API server about this core (rule 7)."""

    @property
    def has_work(self) -> bool:
        """Requests waiting or running (an idle report is owed when this turns false)."""

    @property
    def failure(self) -> ExecutorFailed | None:
        """Set once the core can no longer run steps (rule 6)."""

    def wake_on_failure(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` whenever ``failure`` is set outside ``execute`` (rule 6)."""

    def add(self, add: AddRequest) -> RequestOutput | None: ...

    def abort(self, request_ids: list[str]) -> None: ...

    def client_requests(self, client_index: int) -> list[str]:
        """The ids of the unfinished requests ``client_index`` owns (a ``ClientReset`` aborts them)."""

    def schedule(self) -> int | None:
        """Choose the next step: the number of tokens it computes (the step watch's measure of its
        size), or ``None`` when there is nothing to compute now."""

    async def execute(self) -> None:
        """Run the scheduled step (the forward, or the mock's step clock)."""

    def update(self) -> dict[int, list[RequestOutput]]:
        """Apply the executed step's results: the outputs per client index."""

    def stats(self) -> EngineStats: ...
