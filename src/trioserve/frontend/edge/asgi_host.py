"""Calls the quart-trio app as ASGI, one request at a time, on connections the accept loop owns.

The accept loop (``http_server.py``) owns every connection from its first byte to its close: it reads
each request head and body with h11 under one set of limits (head, body and keep-alive timeouts, size
limits, ``Connection: close``), serves the generation routes itself, and calls the app here for every
other route. So a connection that listed the models first still streams its completions on the fast
path, and no route runs under a framework timeout the fast path does not have.

Rules:
- The app sees one complete request: ``receive`` returns the whole body once (already read and
  size-checked by the accept loop), then blocks until the app is done with it; quart's message
  watcher task is cancelled when its response is complete, so there is no ``http.disconnect`` to
  race the response.
- The response goes out through the connection's own ``h11.Connection``: h11 decides the framing
  (``Content-Length`` when the app gives one, else chunked, or close-delimited for HTTP/1.0) and
  whether the connection can be reused.
- A response to ``HEAD`` goes out without its body (the app may send one).
- The edge's headers for the request (CORS, X-Request-Id) are added to the app's response head.
- The app's lifespan (startup, shutdown) runs once, in ``run``, through hypercorn's lifespan driver.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any
from urllib.parse import unquote

import h11
import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config
from hypercorn.trio.lifespan import Lifespan

SendBytes = Callable[[bytes], Awaitable[None]]
Address = tuple[str, int] | None


class AsgiHost:
    def __init__(self, app: Any) -> None:
        self._app = app
        self._state: dict[str, Any] = {}  # the lifespan's state, copied into every request's scope

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the app's lifespan: startup before ``started``, shutdown when cancelled."""
        config = Config()
        config.accesslog = None
        lifespan = Lifespan(ASGIWrapper(self._app), config, self._state)
        async with trio.open_nursery() as nursery:
            await nursery.start(lifespan.handle_lifespan)
            await lifespan.wait_for_startup()
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(2):
                    await lifespan.wait_for_shutdown()
                nursery.cancel_scope.cancel()

    async def call(
        self,
        request: h11.Request,
        body: bytes,
        conn: h11.Connection,
        send_bytes: SendBytes,
        *,
        client: Address,
        server: Address,
        headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> int:
        """Serve ``request`` (whose whole ``body`` was read) with the app, writing the response
        through ``conn`` with ``headers`` added. Returns the response's status (0 if the app sent
        none) when the app returns; the caller checks ``conn``'s states to see whether the response
        is complete and the connection reusable."""
        raw_path, _, query = request.target.partition(b"?")
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": request.http_version.decode("ascii"),
            "method": request.method.decode("ascii"),
            "scheme": "http",
            "path": unquote(raw_path.decode("latin-1")),
            "raw_path": raw_path,
            "query_string": query,
            "root_path": "",
            "headers": list(request.headers),
            "client": client,
            "server": server,
            "state": self._state.copy(),
            "extensions": {},
        }
        body_given = False
        head_only = request.method == b"HEAD"
        status = 0

        async def receive() -> dict[str, Any]:
            nonlocal body_given
            if not body_given:
                body_given = True
                return {"type": "http.request", "body": body, "more_body": False}
            await trio.sleep_forever()  # cancelled once the app's response is complete
            raise AssertionError("unreachable")

        async def send(message: dict[str, Any]) -> None:
            nonlocal status
            kind = message["type"]
            if kind == "http.response.start":
                status = message["status"]
                head = h11.Response(status_code=status, headers=[*message.get("headers", ()), *headers])
                await send_bytes(conn.send(head) or b"")
            elif kind == "http.response.body":
                # A response to HEAD has no body, whatever the app sends (h11 refuses one).
                data: bytes = b"" if head_only else message.get("body", b"")
                out = (conn.send(h11.Data(data=data)) or b"") if data else b""
                if not message.get("more_body", False):
                    out += conn.send(h11.EndOfMessage()) or b""
                if out:
                    await send_bytes(out)

        await self._app(scope, receive, send)
        return status
