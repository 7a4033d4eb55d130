"""``trioserve::Supervisor``: the process tree of ``serve --api-server-count N`` (N > 1) or ``-dp D``
(D > 1), as seed 000 draws it (docs/processes.md has the formula).

It binds the one listening socket (``SO_REUSEPORT``), starts the engine cores (and, with D > 1, the DP
coordinator), then the API servers ``APIServer_0 … _{N-1}``, each handed the same socket; it serves no
HTTP itself. Each API server is its own engine client with its own ``client_index`` and sockets
(``ipc://<folder>/input_<i>``, ``output_<i>``); the supervisor greets every engine (it owns the
handshake) and welcomes it to all of them, and to itself: it is one more engine client (index N) with
no requests, so it hears every engine's heartbeats and death reports exactly as an API server does,
which is all ``EngineSupervisor`` needs to watch an engine.

Faults:

- **An API server dies**: its clients' connections end with it (their requests fail: the kernel resets
  them); the others keep serving. It is started again after ``RestartBackoff``'s delay (0.5 s doubling
  to 30 s; a run ends once one has been up for 60 s), at the same addresses; the engines reconnect by
  themselves and say Ready again, and the new process's first ``ClientReset`` makes each engine drop
  what it still ran for the dead one.
- **An engine core dies**: every API server hears it (its ``EngineDead``, or, when its process died
  without a word, the same message from the supervisor in its name) and fails the requests it had
  there; with others up they keep serving, else 503 until it is back. ``--engine-restart`` decides
  what follows, as with one API server (``launch/engine_supervisor.py``); ``never`` drains the whole
  tree and exits 1.
- **SIGTERM/SIGINT**: every API server gets SIGTERM and drains (``--shutdown-timeout``); once they
  have exited, the engines are told to shut down, then the coordinator is stopped.
- **The supervisor dies**: its children notice (each polls its parent) and exit; the next start
  sweeps its IPC folder (launch/ipc_dir.py).
"""

from __future__ import annotations

import logging
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import trio
import zmq

from trioserve.config import ServeConfig
from trioserve.config_file import load_config_file
from trioserve.frontend.dispatch import RoundRobin
from trioserve.frontend.edge.accept_balance import ConnectionLoads
from trioserve.frontend.engine_client import EngineClient
from trioserve.frontend.output.step_queue import StepQueue
from trioserve.frontend.replica_slots import ReplicaSlots
from trioserve.launch.addresses import AddressLayout
from trioserve.launch.children import ChildCommand, child_command
from trioserve.launch.engine_supervisor import (
    SILENCE_CHECK,
    EngineFailed,
    EngineSupervisor,
    RestartBackoff,
    exit_text,
)
from trioserve.launch.resize import ReplicaSet, read_resize
from trioserve.protocol.codec import engine_output_codec
from trioserve.protocol.messages import EngineDead
from trioserve.runtime.process import until_first, watch_signals
from trioserve.runtime.reaper import TERM_GRACE, reap
from trioserve.transport.security import SECRET_ENV, serve_zap
from trioserve.transport.zmq_socket import TrioZmqSocket

log = logging.getLogger("trioserve")

DRAIN_GRACE = 2.0  # seconds an API server gets beyond --shutdown-timeout to finish its drain and exit


class ApiServerLaunch(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What an API server under a supervisor is started with (``trioserve api-server --launch``)."""

    config: ServeConfig
    client_index: int
    listen_fd: int  # the listening socket, inherited (``pass_fds``)
    ipc_dir: str  # its sockets' folder, shared with the supervisor
    layout: AddressLayout  # where its own sockets listen (``layout.client(client_index)``)
    coordinator_address: str = ""  # the coordinator's PUB ("": no coordinator)
    connection_loads: str = ""  # the accept balance's shared file ("": one API server)
    replica_slots: str = ""  # least-outstanding-bytes: the shared in-flight table ("": another policy)
    incarnation: int = 0  # 0 first; n: the n-th restart of this index
    desired: int = 0  # the replicas wanted when it starts (a resize changes it); 0: -dp
    roster_epoch: int = 0  # the roster that said so (launch/resize.py); 0: none yet


@dataclass(slots=True)
class _Tree:
    """What the supervisor's tasks share."""

    stopping: bool = False  # shutdown began: a child that exits now is not started again
    loads: ConnectionLoads | None = None  # the accept balance's shared counts (several API servers)
    slots: ReplicaSlots | None = None  # least-outstanding-bytes: every API server's in-flight requests


class KeepRunning:
    """Runs one child (an API server, the coordinator) for the tree's whole life: starts it, and
    starts it again after ``RestartBackoff``'s delay whenever it exits, until the tree stops.

    ``command(restarts)`` gives the child's command and the descriptors it inherits; ``on_exit`` runs
    after each exit; ``stop_grace``: seconds it may take to exit once SIGTERMed (``terminate``) before
    it is SIGTERMed again and then killed."""

    def __init__(
        self,
        tree: _Tree,
        name: str,
        command: Callable[[int], tuple[ChildCommand, tuple[int, ...]]],
        *,
        stop_grace: float = 0.0,
        on_exit: Callable[[], None] = lambda: None,
    ) -> None:
        self.tree = tree
        self.name = name
        self.command = command
        self.stop_grace = stop_grace
        self.on_exit = on_exit
        self.backoff = RestartBackoff()
        self.restarts = 0
        self.proc: trio.Process | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        started = False
        while True:
            command, pass_fds = self.command(self.restarts)
            proc = self.proc = await command.spawn(pass_fds=pass_fds)
            self.backoff.joined(trio.current_time())  # up once it runs
            if not started:
                task_status.started()
                started = True
            try:
                await proc.wait()
            finally:
                # Cancelled: the tree is stopping (SIGTERM asked an API server to drain already).
                await reap(proc, grace=self.stop_grace, term_grace=TERM_GRACE)
            self.on_exit()
            if self.tree.stopping:
                return
            delay = self.backoff.failed(trio.current_time())
            log.error(
                "%s (pid %d) %s; starting it again in %.1f s",
                self.name,
                proc.pid,
                exit_text(proc.returncode),
                delay,
            )
            await trio.sleep(delay)
            self.restarts += 1

    def terminate(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)


async def supervise(config: ServeConfig, listener: socket.socket, ipc_dir: str) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    tree = _Tree()
    count, dp = config.api_server_count, config.engine.data_parallel_size
    capacity = config.engine.capacity  # the ranks a resize may reach (launch/resize.py)
    layout = AddressLayout.of(config.engine.handshake_address, ipc_dir)
    apis = [layout.client(i) for i in range(count)]
    own = layout.client(count)
    handshake = layout.handshake
    coord_in, coord_out = layout.coordinator(count) if capacity > 1 else ("", "")
    link = EngineClient(
        ctx,
        handshake_address=handshake,
        input_address=own.input_address,
        output_address=own.output_address,
        num_engines=capacity,
        client_index=count,
        welcome=[*apis, own],
        coordinator_address=coord_in,
        policy=RoundRobin(capacity) if capacity > 1 else None,  # it sends no requests
        desired=dp,
    )
    loads_path = ""
    if count > 1:
        loads_path = f"{ipc_dir}/connections"
        tree.loads = ConnectionLoads.create(loads_path, count)
    slots_path = ""
    if capacity > 1 and config.frontend.dispatch.dispatch == "least-outstanding-bytes":
        slots_path = f"{ipc_dir}/replica_slots"
        tree.slots = ReplicaSlots.create(slots_path, count, capacity)

    def make_launch(index: int, incarnation: int) -> ApiServerLaunch:
        return ApiServerLaunch(
            config=config,
            client_index=index,
            listen_fd=listener.fileno(),
            ipc_dir=ipc_dir,
            layout=layout,
            coordinator_address=coord_out,
            connection_loads=loads_path,
            replica_slots=slots_path,
            incarnation=incarnation,
            desired=replicas.desired,
            roster_epoch=replicas.epoch,
        )

    # Death notices in an engine's name, to every API server (the engine that died said nothing).
    notices = [TrioZmqSocket.create(ctx, zmq.PUSH, connect=api.output_address) for api in apis]
    pids: dict[int, int] = {}
    local = local_ranks(config)

    def make(index: int, at_start: bool) -> EngineSupervisor:
        return _engine_supervisor(config, link, index, handshake, pids, notices, startup_error=at_start)

    replicas = ReplicaSet(
        make,
        link,
        notices,
        desired=dp,
        drain_timeout=config.supervisor.drain_timeout,
        notify_dead=lambda index, reason: _notify(notices, index, reason, pids.get(index, 0)),
    )
    remote = [index for index in range(dp) if index not in local]

    def api_server(index: int) -> KeepRunning:
        def command(restarts: int) -> tuple[ChildCommand, tuple[int, ...]]:
            launch = make_launch(index, restarts)
            return child_command("api-server", "--launch", launch), (launch.listen_fd,)

        def retire() -> None:  # nobody defers to it until its successor publishes
            if tree.loads is not None:
                tree.loads.retire(index)
            if tree.slots is not None:  # its requests died with it: they hold no replica's slot
                tree.slots.forget_server(index)

        grace = config.supervisor.shutdown_timeout + DRAIN_GRACE
        return KeepRunning(tree, f"API server {index}", command, stop_grace=grace, on_exit=retire)

    watches = [api_server(i) for i in range(count)]
    heartbeats = StepQueue(1, "coalesce")  # what engines tell the supervisor: only their health counts
    try:
        async with trio.open_nursery() as nursery:
            stop = trio.Event()
            await nursery.start(watch_signals, stop)
            if layout.tcp_host is not None:
                await nursery.start(serve_zap, ctx)  # before the TCP sockets bind
            if capacity > 1:
                from trioserve.coordinator.main import CoordinatorLaunch

                launch = CoordinatorLaunch(
                    engines_address=coord_in,
                    publish_address=coord_out,
                    num_engines=capacity,
                    log_level=config.log_level,
                )
                coordinator = child_command("dp-coordinator", "--launch", launch)
                if config.engine.engine_secret:  # for its TCP socket, in its environment
                    coordinator.env[SECRET_ENV] = config.engine.engine_secret
                await nursery.start(KeepRunning(tree, "the DP coordinator", lambda _: (coordinator, ())).run)
            async with trio.open_nursery() as engines:
                await replicas.start(engines, local)
                if config.supervisor.config_file is not None:
                    await engines.start(_reload_on_sighup, config, replicas)
                with trio.fail_after(config.supervisor.engine_ready_timeout):
                    await engines.start(link.run, heartbeats, lambda *_: None)
                engines.start_soon(_discard, heartbeats)
                for index in remote:
                    engines.start_soon(_watch_remote, config, link, index, notices)
                async with trio.open_nursery() as api_servers:
                    for watch in watches:
                        await api_servers.start(watch.run)
                    host, port = listener.getsockname()[:2]
                    log.info(
                        "trioserve on http://%s:%d: %d API servers starting (each says when it is "
                        "ready), %d engine cores ready (model names: %s)",
                        host,
                        port,
                        count,
                        dp,
                        ", ".join(config.model.model_names),
                    )
                    await until_first(stop.wait, replicas.failed.wait)
                    log.info("shutting down: draining %d API servers", count)
                    tree.stopping = True
                    replicas.stop()
                    for watch in watches:
                        watch.terminate()
                    # Each API server drains and exits by itself; its watch reaps it.
                # Every API server is gone: the engines may go (the link's exit tells them).
                engines.cancel_scope.cancel()
            nursery.cancel_scope.cancel()
    finally:
        for sock in notices:
            sock.close()
        if tree.loads is not None:
            tree.loads.close()
        if tree.slots is not None:
            tree.slots.close()
        ctx.destroy(linger=0)
    if replicas.failures:
        raise EngineFailed(replicas.failures[0])


def local_ranks(config: ServeConfig) -> list[int]:
    """The engine ranks this host starts: ``--data-parallel-size-local`` of them from rank 0 (all by
    default; none with ``--engine external``). The others join over TCP (docs/remote_engines.md)."""
    engine = config.engine
    if engine.kind == "external":
        return []
    local = (
        engine.data_parallel_size
        if engine.data_parallel_size_local is None
        else engine.data_parallel_size_local
    )
    return list(range(min(local, engine.data_parallel_size)))


def _notify(notices: list[TrioZmqSocket], index: int, reason: str, pid: int) -> None:
    """Every API server hears that engine ``index`` (process ``pid``, 0: not known) is dead."""
    frame = engine_output_codec().encode(EngineDead(index, reason, pid))
    for sock in notices:
        sock.try_send_multipart([frame])  # an API server that is not there now hears it when it joins


async def _watch_remote(
    config: ServeConfig, link: EngineClient, index: int, notices: list[TrioZmqSocket]
) -> None:
    """An engine on another host is nobody's here to kill or restart; one silent for longer than
    ``--worker-step-timeout`` (its host or network is gone) is declared dead, so the requests it held
    fail instead of waiting for it (it rejoins by itself when it can)."""
    view = link.link(index)
    timeout = config.worker.worker_step_timeout
    while True:
        await trio.sleep(SILENCE_CHECK)
        stall = view.stall()
        if view.dead_report is None and stall is not None and not stall.overdue and stall.silence > timeout:
            reason = f"engine {index} on another host has sent nothing for {stall.silence:.0f} s"
            log.error("%s; its requests fail until it joins again", reason)
            link.engine_died(index, reason)
            pid = link.engines[index].pid if index in link.engines else 0
            _notify(notices, index, reason, pid)


def _engine_supervisor(
    config: ServeConfig,
    link: EngineClient,
    index: int,
    handshake: str,
    pids: dict[int, int],
    notices: list[TrioZmqSocket],
    *,
    startup_error: bool = True,
) -> EngineSupervisor:
    from trioserve.launch.serve import engine_command

    command = engine_command(config, handshake, index)

    async def spawn() -> trio.Process:
        proc = await command.spawn()
        pids[index] = proc.pid
        return proc

    def dead(reason: str, retry_after: int) -> None:
        link.engine_died(index, reason, retry_after)
        _notify(notices, index, reason, pids.get(index, 0))

    return EngineSupervisor(
        spawn,
        link.link(index),
        dead,
        restart=config.supervisor.engine_restart,
        ready_timeout=config.supervisor.engine_ready_timeout,
        silence_timeout=config.worker.worker_step_timeout,
        startup_error=startup_error,
    )


async def _reload_on_sighup(
    config: ServeConfig,
    replicas: ReplicaSet,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """SIGHUP: read ``--config`` again and resize to its replica count (``launch/resize.py``); a file
    that cannot be read or asks what a reload cannot do is refused with a logged error."""
    path = config.supervisor.config_file
    assert path is not None
    baseline = load_config_file(path)  # what the settings were at start (cli.py read it just now)
    with trio.open_signal_receiver(signal.SIGHUP) as signals:
        task_status.started()
        async for _ in signals:
            try:
                settings = await trio.to_thread.run_sync(load_config_file, path)
                resize = read_resize(
                    settings, baseline, capacity=config.engine.capacity, placed=config.engine.device_ids
                )
            except ValueError as exc:  # ConfigFileError is one
                log.error("reload of %s refused: %s", path, exc)  # noqa: TRY400  (one line says it)
                continue
            if resize.ignored:
                log.warning(
                    "reload of %s: %s changed; a reload applies only the replica count (a restart the rest)",
                    path,
                    ", ".join(resize.ignored),
                )
            await replicas.resize(resize.desired)


async def _discard(queue: StepQueue) -> None:
    while True:
        await queue.get()
