"""``trioserve serve``: the API server process, the engine core process it starts, and shutdown.

Shutdown (SIGINT/SIGTERM): stop accepting, let in-flight requests finish for ``--shutdown-timeout``,
then cancel everything; the engine client tells each engine to shut down, and the engine process is
terminated (then killed) if it has not exited a few seconds later. The engine process also exits by
itself if this process disappears.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable

import trio
import zmq

from trioserve.config import ServeConfig
from trioserve.frontend.api_server import ApiServer, EngineAddresses
from trioserve.frontend.tokenizer import load_tokenizer
from trioserve.launch.process import exit_on_signals, set_title, setup_logging
from trioserve.worker.geometry import KVGeometry

log = logging.getLogger("trioserve")


class EngineStartupError(RuntimeError):
    pass


def open_listener(host: str, port: int, backlog: int = 4096) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


def engine_command(config: ServeConfig, handshake: str) -> list[str]:
    """The engine process to spawn: the mock engine, or an engine core (with a worker running the
    model, or with the reference executor)."""
    common = [
        f"--handshake-address={handshake}",
        f"--vocab-size={config.vocab_size}",
        f"--max-num-seqs={config.max_num_seqs}",
        f"--max-model-len={config.max_model_len}",
        f"--output-hwm={config.engine_output_hwm}",
        f"--output-policy={config.engine_output_policy}",
        f"--log-level={config.log_level}",
    ]
    if config.engine == "mock":
        specific = [f"--step-interval-us={config.step_interval_us}", f"--seed={config.mock_seed}"]
        return [sys.executable, "-m", "trioserve", "mock-engine", *common, *specific]
    if config.engine == "model":
        assert config.model is not None, "resolve_model() first"
        common += [
            f"--model={config.model}",
            f"--device={config.device}",
            f"--dtype={config.dtype}",
            f"--kv-cache-gib={config.kv_cache_gib}",
            f"--worker-threads={config.worker_threads}",
            f"--worker-step-timeout={config.worker_step_timeout}",
        ]
    specific = [
        f"--block-size={config.block_size}",
        f"--num-gpu-blocks-override={config.num_gpu_blocks_override}",
        f"--max-num-batched-tokens={config.max_num_batched_tokens}",
        f"--scheduling-policy={config.scheduling_policy}",
        f"--step-time-us={config.step_time_us}",
    ]
    return [sys.executable, "-m", "trioserve", "engine-core", *common, *specific]


async def run_engine_process(
    command: list[str],
    on_exit: Callable[[int], None],
    *,
    task_status: trio.TaskStatus[trio.Process] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Own one engine process: report its exit, and terminate it when cancelled."""
    proc = await trio.lowlevel.open_process(command, stdin=subprocess.DEVNULL)
    task_status.started(proc)
    try:
        code = await proc.wait()
        on_exit(code)
    finally:
        if proc.returncode is None:
            with trio.CancelScope(shield=True):
                with trio.move_on_after(3):
                    await proc.wait()
                if proc.returncode is None:
                    proc.terminate()
                    with trio.move_on_after(3):
                        await proc.wait()
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()


async def serve(config: ServeConfig, listener: socket.socket, ipc_dir: str) -> None:
    tokenizer = await trio.to_thread.run_sync(load_tokenizer, config.tokenizer or config.model)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    addresses = EngineAddresses(
        handshake=config.handshake_address or f"ipc://{ipc_dir}/handshake",
        input=f"ipc://{ipc_dir}/input",
        output=f"ipc://{ipc_dir}/output",
    )
    api = ApiServer(config, tokenizer, ctx, addresses)
    # Everything built so far (tokenizer tables, modules) lives for the whole process: move it out of
    # the collector's generations so full collections stop re-walking it (vLLM does the same).
    gc.collect()
    gc.freeze()
    ready = False
    stopping = False

    def engine_exited(code: int) -> None:
        if stopping:
            return
        if not ready:
            raise EngineStartupError(f"the engine process exited with code {code} during start-up")
        api.serving.on_engine_dead(f"the engine process exited with code {code}")

    try:
        async with trio.open_nursery() as nursery:
            if config.engine != "external":
                command = engine_command(config, addresses.handshake)
                await nursery.start(run_engine_process, command, engine_exited)
            await nursery.start(api.run, listener)
            ready = True
            host, port = listener.getsockname()[:2]
            log.info(
                "trioserve ready on http://%s:%d (model names: %s)", host, port, ", ".join(config.model_names)
            )
            await exit_on_signals()
            log.info("shutting down: draining %d requests", len(api.serving.active))
            stopping = True
            api.http.stop_accepting()
            with trio.move_on_after(config.shutdown_timeout):
                await api.serving.drained()
            nursery.cancel_scope.cancel()
    finally:
        ctx.destroy(linger=0)


def resolve_model(config: ServeConfig) -> ServeConfig:
    """For ``--engine model``: the model folder (converting the embedded default on first use), the
    model's vocabulary, and ``max_model_len`` capped at what the model's positions allow."""
    model = config.model
    names = config.served_model_name
    if model is None:
        from trioserve.worker.embedded_model import MODEL_NAME, ensure_default_model

        model = str(ensure_default_model(progress=log.info))
        names = names or (MODEL_NAME,)
    geometry = KVGeometry.from_model_dir(model)
    max_len = config.max_model_len
    if geometry.max_position_embeddings:
        max_len = min(max_len, geometry.max_position_embeddings)
    return dataclasses.replace(
        config, model=model, served_model_name=names, max_model_len=max_len, vocab_size=geometry.vocab_size
    )


def run_serve(config: ServeConfig) -> int:
    set_title("APIServer")
    setup_logging(config.log_level)
    if config.engine == "model":
        try:
            config = resolve_model(config)
        except (ValueError, RuntimeError) as exc:
            print(f"trioserve serve: error: {exc}", file=sys.stderr)
            return 1
    try:
        listener = open_listener(config.host, config.port)
    except OSError as exc:
        print(f"trioserve serve: error: cannot listen on {config.host}:{config.port}: {exc}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix=f"trioserve-{os.getpid()}-") as ipc_dir:
        failed = False
        try:
            trio.run(serve, config, listener, ipc_dir)
        except* EngineStartupError as group:
            failed = True
            for error in group.exceptions:
                log.error("%s", error)  # noqa: TRY400  (the message says it all; no traceback)
        finally:
            listener.close()
    return 1 if failed else 0
