"""The DP coordinator process (``trioserve::DPCoordinator``): a thin Trio shell around ``CoordinatorCore``.

Two sockets, one owner task each (a ZMQ FD is edge-triggered: two tasks on one socket lose wakeups):

- a PULL bound at ``engines_address``: every engine core PUSHes its ``LoadReport``s and ``KvEvents``
  here. The collector task decodes them (a bad frame is logged, counted and dropped), hands them to
  the core and wakes the publisher;
- a PUB bound at ``publish_address``: every API server SUBscribes. The publisher task sends each
  snapshot the core says is due, then the KV events due with it (``take_kv``), and sleeps until the
  next one is (``next_due``) or a report wakes it. PUB never blocks: a subscriber that does not read
  loses messages at its high-water mark. For snapshots that is what it wants (only the newest
  matters, and the next one is at most a second away); for KV events it means a stale index until
  the next re-sync (``KV_RESYNC_INTERVAL``), which a gap in ``KvEvents.seq`` tells it.

The process exits on SIGINT or SIGTERM, or when the supervisor that started it is gone.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import msgspec
import trio
import zmq

from trioserve.coordinator.core import CoordinatorCore
from trioserve.protocol.codec import ProtocolError, coordinator_input_codec, coordinator_output_codec
from trioserve.protocol.messages import KvEvents, LoadReport, LoadSnapshot
from trioserve.runtime.process import (
    exit_on_signals,
    exit_when_parent_dies,
    set_title,
    setup_logging,
    until_first,
)
from trioserve.runtime.sync import Waker
from trioserve.transport.security import SECRET_ENV, configure_security, configured, serve_zap
from trioserve.transport.zmq_socket import TrioZmqSocket

log = logging.getLogger("trioserve.coordinator")

# Snapshots are a few dozen bytes per engine (subscribers only want the newest); KV events come in
# bursts of up to a few dozen messages per engine at a re-sync, which a subscriber should not lose.
PUBLISH_HWM = 256


class CoordinatorLaunch(msgspec.Struct, frozen=True):
    """What the supervisor tells the coordinator process (its only argument)."""

    engines_address: str  # bound PULL: engines push LoadReports
    publish_address: str  # bound PUB: API servers subscribe
    num_engines: int
    log_level: str


async def publish_loop(
    core: CoordinatorCore, wake: Waker, send: Callable[[LoadSnapshot | KvEvents], None]
) -> None:
    """Sends every snapshot ``core`` says is due, each followed by the KV events due with it, on the
    trio clock; ``wake`` cuts a sleep short when a report arrived (the change may be due sooner than
    the keep-alive). ``send`` must not block."""
    while True:
        now = trio.current_time()
        snapshot = core.due(now)
        if snapshot is not None:
            send(snapshot)
            for events in core.take_kv(now):
                send(events)
            continue
        with trio.move_on_at(core.next_due()):
            await wake.wait()


class Coordinator:
    """The shell: owns the two sockets (see the module docstring)."""

    def __init__(self, launch: CoordinatorLaunch, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.launch = launch
        self._ctx = ctx
        self.core = CoordinatorCore(launch.num_engines)
        self._wake = Waker()
        self.bad_frames = 0  # undecodable frames on the PULL (invalid reports: ``core.bad_reports``)
        self.published = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Binds both sockets (``started`` once bound), then runs until cancelled."""
        pull = TrioZmqSocket.create(self._ctx, zmq.PULL, bind=self.launch.engines_address)
        try:
            pub = TrioZmqSocket.create(
                self._ctx, zmq.PUB, bind=self.launch.publish_address, sndhwm=PUBLISH_HWM
            )
        except BaseException:
            pull.close()
            raise
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._collect, pull)
                nursery.start_soon(self._publish, pub)
                log.info(
                    "DP coordinator for %d engines: reports at %s, publishing at %s",
                    self.launch.num_engines,
                    self.launch.engines_address,
                    self.launch.publish_address,
                )
                task_status.started()
        finally:
            pub.close()
            pull.close()

    async def _collect(self, pull: TrioZmqSocket) -> None:
        codec = coordinator_input_codec()
        while True:
            frame = (await pull.recv_multipart())[-1]
            try:
                message = codec.decode(frame)
            except ProtocolError as exc:
                self.bad_frames += 1
                log.warning("dropping engine frame: %s", exc)
                continue
            if isinstance(message, LoadReport):
                if self.core.report(message):
                    self._wake.set()
                else:
                    log.warning("dropping invalid load report %r", message)
            elif self.core.kv(message):
                self._wake.set()
            else:
                log.warning("dropping invalid KV events from engine %d", message.engine_index)

    async def _publish(self, pub: TrioZmqSocket) -> None:
        codec = coordinator_output_codec()

        def send(message: LoadSnapshot | KvEvents) -> None:
            pub.try_send_multipart([codec.encode(message)])  # PUB drops for a full subscriber
            self.published += 1

        await publish_loop(self.core, self._wake, send)


async def serve_coordinator(launch: CoordinatorLaunch) -> None:
    """The process's top level: the coordinator with a fresh ZMQ context, until a SIGINT or SIGTERM
    arrives or the supervisor that started it is gone."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        coordinator = Coordinator(launch, ctx)

        async def run() -> None:
            async with trio.open_nursery() as nursery:
                if configured() is not None:  # engines on other hosts: the PULL is tcp:// (CURVE)
                    await nursery.start(serve_zap, ctx)
                await coordinator.run()
                nursery.cancel_scope.cancel()

        await until_first(run, exit_on_signals, exit_when_parent_dies)
    finally:
        ctx.destroy(linger=0)


def run_coordinator(launch: CoordinatorLaunch) -> int:
    """The DP coordinator process's main: title, logging, then the coordinator until told to stop.
    Returns the exit code: 0 after a signal or the parent's exit, 1 when a socket cannot be bound."""
    set_title("DPCoordinator")
    setup_logging(launch.log_level)
    configure_security(os.environ.get(SECRET_ENV))  # set by the supervisor when engines may be remote
    failed = False
    try:
        trio.run(serve_coordinator, launch)
    except* zmq.ZMQError as group:
        failed = True
        for exc in _leaves(group):
            log.error("DP coordinator cannot start: %s", exc)  # noqa: TRY400  (the reason says it all)
    return 1 if failed else 0


def _leaves(group: BaseExceptionGroup[zmq.ZMQError]) -> list[BaseException]:
    return [
        e
        for sub in group.exceptions
        for e in (_leaves(sub) if isinstance(sub, BaseExceptionGroup) else [sub])
    ]
