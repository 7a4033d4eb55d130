"""``trioserve serve``: the API server process, the engine core process it starts, and shutdown.

Shutdown (SIGINT/SIGTERM): stop accepting, let in-flight requests finish for ``--shutdown-timeout``,
then cancel everything; the engine client tells each engine to shut down, and the engine process is
terminated (then killed) if it has not exited a few seconds later.

Faults (docs/faults.md): ``EngineSupervisor`` (launch/engine_supervisor.py) starts the engine process
and restarts it with backoff when it dies, or, under ``--engine-restart never``, makes this process drain
and exit with code 1. The engine process exits by itself if this process disappears: it polls its parent
pid (``PR_SET_PDEATHSIG`` would not do: trio starts processes from a worker thread, and that signal
fires when the starting *thread* exits). A SIGKILL leaves this process's IPC folder behind; the next API
server to start removes it (launch/ipc_dir.py).
"""

from __future__ import annotations

import gc
import logging
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING

import trio
import zmq

from trioserve.config import ServeConfig, override
from trioserve.launch.addresses import AddressLayout
from trioserve.launch.children import ChildCommand, child_command
from trioserve.launch.engine_supervisor import EngineFailed, EngineStartupError, EngineSupervisor
from trioserve.launch.ipc_dir import ipc_dir as make_ipc_dir
from trioserve.launch.ipc_dir import sweep_stale
from trioserve.models.geometry import KVGeometry
from trioserve.runtime.placement import on_cpu
from trioserve.runtime.process import (
    raise_open_file_limit,
    set_title,
    setup_logging,
    until_first,
    watch_signals,
)
from trioserve.runtime.reaper import TERM_GRACE, reap
from trioserve.transport.security import configure_security, serve_zap

if TYPE_CHECKING:  # the API server's modules (transformers' tokenizer, torch under it) load after the
    # engine process is started: see ``serve``
    from trioserve.frontend.api_server import ApiServer, EngineAddresses
    from trioserve.frontend.text.tokenizer import Tokenizer

log = logging.getLogger("trioserve")


def open_listener(host: str, port: int, backlog: int = 4096, *, reuse_port: bool = False) -> socket.socket:
    """The listening socket; ``reuse_port``: with ``SO_REUSEPORT`` (the supervisor's, shared by its
    API servers, as vLLM's is)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


def engine_command(config: ServeConfig, handshake: str, engine_index: int = 0) -> ChildCommand:
    """Engine core ``engine_index``'s process to spawn, with its part of the tree as one value."""
    return child_command("engine-core", "--config-json", config.engine_process(handshake, engine_index))


def api_server(
    config: ServeConfig,
    tokenizer: Tokenizer,
    ctx: zmq.Context[zmq.Socket[bytes]],
    addresses: EngineAddresses,
    *,
    client_index: int = 0,
    ipc_dir: str | None = None,
    coordinator_address: str = "",
    connection_loads: str = "",
    replica_slots: str = "",
    incarnation: int = 0,
    desired: int = 0,
    roster_epoch: int = 0,
) -> ApiServer:
    """An API server, given its sections of ``config``; under a supervisor, its place in the tree
    (``launch/api_server_main.py``; ``incarnation`` > 0: it replaces one that died; ``desired``: the
    replicas wanted at its start, 0: ``-dp``, as roster ``roster_epoch`` said)."""
    from trioserve.frontend.api_server import ApiServer

    count = config.api_server_count
    balance = None
    if connection_loads:
        from trioserve.frontend.edge.accept_balance import AcceptBalance, ConnectionLoads

        balance = AcceptBalance(ConnectionLoads.open(connection_loads, count), client_index)
    slots = None
    if replica_slots:
        from trioserve.frontend.replica_slots import ReplicaSlots

        slots = ReplicaSlots.open(replica_slots, api_servers=count)
    engine = config.engine
    return ApiServer(
        config.model,
        config.frontend,
        tokenizer,
        ctx,
        addresses,
        engine_output_hwm=config.engine.engine_output_hwm,
        engine_ready_timeout=config.supervisor.engine_ready_timeout,
        num_engines=engine.capacity,
        client_index=client_index,
        api_server_count=count,
        ipc_dir=ipc_dir,
        coordinator_address=coordinator_address,
        accept_balance=balance,
        restarted=incarnation > 0,
        replica_slots=slots,
        devices=engine.device_ids,
        batch_limits=(engine.max_num_seqs, engine.max_num_batched_tokens),
        desired=desired or engine.data_parallel_size,
        roster_epoch=roster_epoch,
    )


async def until_stop(stop: trio.Event, supervisor: EngineSupervisor | None) -> None:
    """Returns once ``stop`` is set (a signal), or once the engine died under ``--engine-restart never``."""
    if supervisor is None:
        await stop.wait()
    else:
        await until_first(stop.wait, supervisor.failed.wait)


def _load_frontend(config: ServeConfig) -> Tokenizer:
    """The API server's modules and its tokenizer (seconds: transformers, and torch under it); run
    in a thread while the engine process starts."""
    from trioserve.frontend import api_server as _  # noqa: F401  (imported here, not on the loop)
    from trioserve.frontend.text.tokenizer import load_tokenizer

    return load_tokenizer(config.model.tokenizer or config.model.model)


async def serve(config: ServeConfig, listener: socket.socket, ipc_dir: str) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    layout = AddressLayout.of(config.engine.handshake_address, ipc_dir)
    handshake = layout.handshake
    # Start-up is the longer of two paths, not their sum: the engine process starts first (its worker
    # imports torch and loads the model) while this one imports the API server and loads the
    # tokenizer. The engine's sockets connect before ours bind; ZMQ retries until they do.
    early: trio.Process | None = None
    command = engine_command(config, handshake)
    if config.engine.kind != "external":
        early = await command.spawn()
    try:
        began = time.perf_counter()
        tokenizer = await trio.to_thread.run_sync(_load_frontend, config)
        log.info("API server modules and tokenizer loaded in %.1f s", time.perf_counter() - began)
        from trioserve.frontend.api_server import EngineAddresses

        own = layout.client(0)
        addresses = EngineAddresses(handshake, own.input_address, own.output_address)
        api = api_server(config, tokenizer, ctx, addresses)
    except BaseException:
        if early is not None:
            await reap(early, grace=0.0, term_grace=TERM_GRACE)
        ctx.destroy(linger=0)
        raise
    # Everything built so far (tokenizer tables, modules) lives for the whole process: move it out of
    # the collector's generations so full collections stop re-walking it (vLLM does the same).
    gc.collect()
    gc.freeze()
    supervisor: EngineSupervisor | None = None
    if early is not None:  # an external engine is its operator's to restart

        async def spawn() -> trio.Process:
            nonlocal early
            if early is not None:  # the first one, started above
                proc, early = early, None
                return proc
            return await command.spawn()

        def dead(reason: str, retry_after: int) -> None:
            api.engine.engine_died(0, reason, retry_after)

        def restarted() -> None:
            api.engine_restarts += 1

        supervisor = EngineSupervisor(
            spawn,
            api.engine.link(0),
            dead,
            restart=config.supervisor.engine_restart,
            ready_timeout=config.supervisor.engine_ready_timeout,
            on_restart=restarted,
            silence_timeout=config.worker.worker_step_timeout,
        )
    try:
        async with trio.open_nursery() as nursery:
            stop = trio.Event()
            await nursery.start(watch_signals, stop)
            if layout.tcp_host is not None:
                await nursery.start(serve_zap, ctx)  # before the TCP sockets bind
            if supervisor is not None:
                await nursery.start(supervisor.run)
            await nursery.start(api.run, listener)
            host, port = listener.getsockname()[:2]
            log.info(
                "trioserve ready on http://%s:%d (model names: %s)",
                host,
                port,
                ", ".join(config.model.model_names),
            )
            await until_stop(stop, supervisor)
            log.info("shutting down: draining %d requests", len(api.serving.active))
            if supervisor is not None:
                supervisor.stop()
            await api.drain(config.supervisor.shutdown_timeout)
            nursery.cancel_scope.cancel()
    finally:
        ctx.destroy(linger=0)
    if supervisor is not None and supervisor.failure is not None:
        raise EngineFailed(supervisor.failure)


def resolve_model(config: ServeConfig) -> ServeConfig:
    """For ``--engine model``: the model folder (converting the embedded default on first use), the
    model's vocabulary, and ``max_model_len`` capped at what the model's positions allow."""
    model = config.model.model
    names = config.model.served_model_name
    if model is None:
        from trioserve.models.embedded_model import MODEL_NAME, ensure_default_model

        converted: list[str] = []

        def progress(message: str) -> None:
            converted.append(message)
            log.info("%s", message)

        model = str(ensure_default_model(progress=progress))
        names = names or (MODEL_NAME,)
        if converted and packs_for_cpu_kernels(config):
            pack_weights(model)
    geometry = KVGeometry.from_model_dir(model)
    max_len = config.model.max_model_len
    if geometry.max_position_embeddings:
        max_len = min(max_len, geometry.max_position_embeddings)
    return override(
        config, model=model, served_model_name=names, max_model_len=max_len, vocab_size=geometry.vocab_size
    )


def packs_for_cpu_kernels(config: ServeConfig) -> bool:
    """The workers will pack the model's linears for the native CPU kernels (one rank each, float32
    on the CPU): what ``worker/packed_store.py`` keeps."""
    worker = config.worker
    return (
        on_cpu(worker.device)
        and worker.dtype in ("auto", "float32")
        and worker.cpu_kernels != "torch"
        and worker.tensor_parallel_size == 1
    )


def pack_weights(folder: str) -> None:
    """Pack and store a just-converted model's weights in a child (this process imports no torch), so
    the first start after the conversion is as fast as the later ones; a failure costs only that."""
    log.info("packing the weights for the CPU kernels (first run only)...")
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "trioserve.worker.pack_main", folder], stdin=subprocess.DEVNULL, check=False
    )
    if done.returncode == 0:
        log.info("packed in %.1f s", time.perf_counter() - started)
    else:
        log.warning("packing the weights failed (exit code %d): the workers pack them", done.returncode)


def run_serve(config: ServeConfig) -> int:
    """``serve``: one API server with its engine core (this process), or, with several API servers or
    engine cores, the supervisor's tree (``launch/supervisor.py``)."""
    set_title("Supervisor" if config.supervised else "APIServer")
    setup_logging(config.log_level)
    configure_security(config.engine.engine_secret)  # the address and secret were checked in cli.py
    if config.engine.kind == "model":
        try:
            config = resolve_model(config)
        except (ValueError, RuntimeError) as exc:
            print(f"trioserve serve: error: {exc}", file=sys.stderr)
            return 1
    try:
        raise_open_file_limit(log)
        http = config.frontend.http
        listener = open_listener(http.host, http.port, reuse_port=config.supervised)
    except OSError as exc:
        print(f"trioserve serve: error: cannot listen on {http.host}:{http.port}: {exc}", file=sys.stderr)
        return 1
    for name in sweep_stale():
        log.info("removed %s, the IPC folder of an API server that was killed", name)
    with make_ipc_dir() as ipc_dir:
        main = serve
        if config.supervised:
            from trioserve.launch.supervisor import supervise as main
        failed = False
        try:
            trio.run(main, config, listener, ipc_dir)
        except* (EngineStartupError, EngineFailed) as group:
            failed = True
            for error in group.exceptions:
                log.error("%s", error)  # noqa: TRY400  (the message says it all; no traceback)
        finally:
            listener.close()
    return 1 if failed else 0
