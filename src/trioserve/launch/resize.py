"""Live resizing: the supervisor starts and retires replicas while the tree serves (docs/replicas.md).

``serve -dp D --max-data-parallel-size M --config FILE`` sizes the tree for M ranks (sockets, the
engine clients' tables, the least-outstanding-bytes table, the coordinator, the placement) and starts
D. A SIGHUP reads FILE again (``read_resize``); its replica count (``replicas:`` or
``data_parallel_size``) is the new desired count. Nothing else in the file is applied by a reload:
a setting that changed is named in a warning (a restart applies it).

Rules:

- **Grow** D -> D': the roster (``ReplicaRoster``, to every API server and the supervisor's own
  link) says ranks below D' are wanted, then ranks D .. D'-1 start. A new replica enters dispatch at
  its Ready, as any engine that joins: it is prepared (its model loaded, its KV cache allocated,
  its handshake done) before any request can reach it. One that fails to start is restarted with
  backoff like any replica whose processes die (never a start-up error of the whole tree).
- **Shrink** D -> D': the highest ranks retire. The roster goes out first: from the moment each API
  server reads it, it sends those ranks nothing new, and after the last add it placed there it sends
  ``ClientDone`` (so do the supervisor's link and any API server restarted meanwhile). A retiring
  engine that has heard ``ClientDone`` from every client and holds no request says
  ``EngineRetired`` and exits by itself: every admitted request finished first. The retiring
  replica is not restarted whatever happens. One still running after ``--drain-timeout`` is told to
  shut down; then its remaining requests fail with an error (logged), as with a shutdown.
- Resizes run one at a time, each to its end (every retired engine gone); a SIGHUP during one is
  served after it. A count outside 1 .. M, a file that no longer reads, or devices that differ from
  the running placement refuse the reload with a logged error: nothing changes.
- Each roster carries an ``epoch`` (1, 2, ...): a client ignores a roster older than the one it
  holds (one queued for an API server that was restarted meanwhile, say).

``read_resize`` is pure (over the file's settings); ``ReplicaSet`` is the supervisor's shell.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import trio

from trioserve.frontend.engine_client import EngineClient
from trioserve.launch.engine_supervisor import STOP_GRACE, EngineSupervisor
from trioserve.protocol.codec import engine_output_codec
from trioserve.protocol.messages import ReplicaRoster
from trioserve.runtime.placement import PlacementError, parse_device_ids
from trioserve.transport.zmq_socket import TrioZmqSocket

log = logging.getLogger("trioserve")

REPLICA_SETTINGS = ("data_parallel_size", "device_ids")  # what a reload may change (and the file sets)


@dataclass(frozen=True, slots=True)
class Resize:
    """What a reload asks: ``desired`` replicas; ``ignored``: the other settings that changed in the
    file since start (a reload does not apply them)."""

    desired: int
    ignored: tuple[str, ...] = ()


def read_resize(
    settings: Mapping[str, Any],
    baseline: Mapping[str, Any],
    *,
    capacity: int,
    placed: Sequence[str],
) -> Resize:
    """The resize that a reloaded file's ``settings`` ask of a tree sized for ``capacity`` ranks
    placed on ``placed`` (canonical device ids; empty: not placed); ``baseline``: the file's settings
    at start. Raises ``ValueError`` with a one-line reason when the reload must be refused."""
    desired = settings.get("data_parallel_size")
    if desired is None:
        raise ValueError("it names no replica count (replicas: or data_parallel_size)")
    if not isinstance(desired, int) or isinstance(desired, bool) or not 1 <= desired <= capacity:
        raise ValueError(
            f"data_parallel_size {desired!r}: this tree was started for 1 to {capacity} replicas "
            "(--max-data-parallel-size)"
        )
    if "device_ids" in settings:
        raw = settings["device_ids"]
        try:
            devices = [str(d) for d in parse_device_ids(",".join(raw) if not isinstance(raw, str) else raw)]
        except PlacementError as exc:
            raise ValueError(f"device_ids: {exc}") from None
        if not placed or devices != list(placed[: len(devices)]):
            raise ValueError(
                f"device_ids {','.join(devices)}: a reload does not move replicas (running on "
                f"{','.join(placed) or 'no placement'}); a restart places them anew"
            )
    ignored = sorted(
        name
        for name in set(settings) | set(baseline)
        if name not in REPLICA_SETTINGS and settings.get(name) != baseline.get(name)
    )
    return Resize(desired, tuple(ignored))


class ReplicaSet:
    """The supervisor's engine ranks: starts each wanted one under its own ``EngineSupervisor``, and
    grows or shrinks the set on a reload (the module's rules).

    ``make(rank, at_start)`` builds a rank's supervisor; ``notices``: a PUSH to every API server's
    output socket; ``link``: the supervisor's own engine client; ``pid(rank)``: the rank's engine
    process (0: none)."""

    def __init__(
        self,
        make: Callable[[int, bool], EngineSupervisor],
        link: EngineClient,
        notices: Sequence[TrioZmqSocket],
        *,
        desired: int,
        drain_timeout: float,
        notify_dead: Callable[[int, str], None],
    ) -> None:
        self._make = make
        self.link = link
        self._notices = notices
        self.desired = desired
        self.epoch = 0  # rosters sent so far
        self.drain_timeout = drain_timeout
        self._notify_dead = notify_dead  # (rank, reason): every API server hears the rank is dead
        self.supervisors: dict[int, EngineSupervisor] = {}
        self._gone: dict[int, trio.Event] = {}  # per running rank: set once its task ends
        self._scopes: dict[int, trio.CancelScope] = {}
        self.failed = trio.Event()  # an engine died under --engine-restart never
        self.failures: list[str] = []
        self._lock = trio.Lock()  # one resize at a time
        self._nursery: trio.Nursery | None = None
        self.stopping = False

    async def start(self, nursery: trio.Nursery, ranks: Sequence[int]) -> None:
        """Start ``ranks`` (this host's, of ``0 .. desired - 1``) in ``nursery``, each ``started`` once
        its process runs; ranks a resize adds are started there too."""
        self._nursery = nursery
        for rank in ranks:
            await nursery.start(self._run, rank, True)

    def stop(self) -> None:
        """The tree is shutting down: no engine is restarted, and no resize starts, from now on."""
        self.stopping = True
        for sup in self.supervisors.values():
            sup.stop()

    async def _run(self, rank: int, at_start: bool, *, task_status: trio.TaskStatus[None]) -> None:
        sup = self.supervisors[rank] = self._make(rank, at_start)
        gone = self._gone[rank] = trio.Event()
        try:
            with trio.CancelScope() as scope:
                self._scopes[rank] = scope
                await sup.run(task_status=task_status)
        finally:
            gone.set()
        if sup.failure is not None:
            self.failures.append(sup.failure)
            self.failed.set()

    async def resize(self, desired: int) -> None:
        """Grow or shrink to ``desired`` replicas (1 .. the tree's capacity; ``read_resize`` checked
        it), returning once new ranks run and retired ones are gone."""
        async with self._lock:
            if self.stopping:
                return
            before = self.desired
            if desired == before:
                log.info("reload: %d replicas wanted, as now", desired)
                return
            log.info("resizing from %d to %d replicas", before, desired)
            self.desired = desired
            self.epoch += 1
            frame = engine_output_codec().encode(ReplicaRoster(desired, self.epoch))
            for sock in self._notices:
                sock.try_send_multipart([frame])  # an API server not there now is started with it
            self.link.resize(desired, self.epoch)
            if desired > before:
                assert self._nursery is not None
                for rank in range(before, desired):
                    await self._nursery.start(self._run, rank, False)
                log.info("replicas %d..%d starting: each enters dispatch once ready", before, desired - 1)
                return
            async with trio.open_nursery() as retiring:
                for rank in range(desired, before):
                    retiring.start_soon(self._retire, rank)
            log.info("resized to %d replicas", desired)

    async def _retire(self, rank: int) -> None:
        """Retire ``rank``: no restart from now on; wait for its engine to drain and exit, or, after
        ``drain_timeout``, tell it to shut down (then cancel its supervisor, which kills it)."""
        sup, gone = self.supervisors[rank], self._gone[rank]
        sup.stop()
        with trio.move_on_after(self.drain_timeout):
            await gone.wait()
        if not gone.is_set():
            log.error(
                "replica %d did not drain within %g s (--drain-timeout): shutting it down; the "
                "requests still there fail",
                rank,
                self.drain_timeout,
            )
            self.link.shut_down(rank)
            with trio.move_on_after(STOP_GRACE):
                await gone.wait()
            self._scopes[rank].cancel()
            await gone.wait()
        if rank not in self.link.retired:  # it ended some other way: what it held fails
            reason = f"replica {rank} stopped before it drained"
            self.link.engine_died(rank, reason)
            self._notify_dead(rank, reason)
        del self.supervisors[rank], self._gone[rank], self._scopes[rank]
        log.info("replica %d retired", rank)
