"""``trioserve api-server --launch JSON``: one API server under the supervisor (``launch/supervisor.py``).

It serves HTTP on the listening socket it inherited, as API server ``client_index`` of the tree: its
own request ROUTER and output PULL in the supervisor's IPC folder (the supervisor greets the engines
and welcomes them here), the dispatch policy across the engines with the coordinator's snapshots
when there is one, and the accept balance with its peers. SIGTERM drains it (``ApiServer.drain``) and
it exits 0; it exits at once when the supervisor is gone.
"""

from __future__ import annotations

import gc
import logging
import os
import socket

import msgspec
import trio
import zmq

from trioserve.config import SECRETS_ENV, with_secrets
from trioserve.frontend.api_server import EngineAddresses
from trioserve.frontend.text.tokenizer import load_tokenizer
from trioserve.launch.serve import api_server
from trioserve.launch.supervisor import ApiServerLaunch
from trioserve.runtime.process import (
    exit_when_parent_dies,
    raise_open_file_limit,
    set_title,
    setup_logging,
    until_first,
    watch_signals,
)
from trioserve.transport.security import configure_security, serve_zap

log = logging.getLogger("trioserve")


async def _serve(launch: ApiServerLaunch, listener: socket.socket) -> None:
    config = launch.config
    tokenizer = await trio.to_thread.run_sync(load_tokenizer, config.model.tokenizer or config.model.model)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    own = launch.layout.client(launch.client_index)
    addresses = EngineAddresses(handshake=None, input=own.input_address, output=own.output_address)
    api = api_server(
        config,
        tokenizer,
        ctx,
        addresses,
        client_index=launch.client_index,
        ipc_dir=launch.ipc_dir,
        coordinator_address=launch.coordinator_address,
        connection_loads=launch.connection_loads,
        replica_slots=launch.replica_slots,
        incarnation=launch.incarnation,
        desired=launch.desired,
        roster_epoch=launch.roster_epoch,
    )
    gc.collect()
    gc.freeze()
    try:
        async with trio.open_nursery() as nursery:
            stop = trio.Event()
            await nursery.start(watch_signals, stop)
            if launch.layout.tcp_host is not None:
                await nursery.start(serve_zap, ctx)  # before the TCP sockets bind
            await nursery.start(api.run, listener)
            again = f" (started again: {launch.incarnation})" if launch.incarnation else ""
            log.info("API server %d ready%s", launch.client_index, again)
            orphaned = trio.Event()

            async def supervisor_gone() -> None:
                await exit_when_parent_dies()
                orphaned.set()

            await until_first(stop.wait, supervisor_gone)
            if not orphaned.is_set():
                log.info("shutting down: draining %d requests", len(api.serving.active))
                await api.drain(config.supervisor.shutdown_timeout)
            nursery.cancel_scope.cancel()
    finally:
        ctx.destroy(linger=0)


def run_api_server(text: str) -> int:
    launch = msgspec.json.decode(text, type=ApiServerLaunch)
    launch = with_secrets(launch, os.environ.get(SECRETS_ENV))
    config = launch.config
    count = config.api_server_count
    set_title("APIServer" if count == 1 else f"APIServer_{launch.client_index}")
    setup_logging(config.log_level)
    configure_security(config.engine.engine_secret)
    raise_open_file_limit(log)
    listener = socket.socket(fileno=launch.listen_fd)
    try:
        trio.run(_serve, launch, listener)
    finally:
        listener.detach()  # the supervisor's socket: it closes it
    return 0
