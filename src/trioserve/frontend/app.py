"""The quart-trio app: every route that is not on the per-token hot path.

Admin and metadata routes live here, and so do the generation routes for connections that hypercorn
already owns (a keep-alive connection whose first request was, say, ``GET /v1/models``). Those stream
through ASGI, slower per event than the fast path but with identical bytes and semantics, because they
share ``Serving`` and the response objects. The WebSocket route multiplexes requests over one socket.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

import msgspec
import trio
from quart import Response as QuartResponse
from quart import request, websocket
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from trioserve.frontend.chunks import Kind
from trioserve.frontend.errors import ApiError, error_body
from trioserve.frontend.openai_schema import DetokenizeRequest, TokenizeRequest
from trioserve.frontend.queue_sinks import OutboxWriter, SseQueueSink
from trioserve.frontend.responses import Response
from trioserve.frontend.serving import Serving, message_dicts
from trioserve.frontend.validate import decode_body, resolve_model
from trioserve.frontend.ws_server import WsSession


def _json(body: bytes, status: int = 200) -> QuartResponse:
    return QuartResponse(body, status=status, content_type="application/json")


async def _body() -> bytes:
    data = await request.get_data()
    return data if isinstance(data, bytes) else data.encode()


def _error(exc: ApiError) -> QuartResponse:
    response = _json(exc.body(), exc.status)
    if exc.retry_after is not None:
        response.headers["retry-after"] = str(exc.retry_after)
    return response


def create_app(serving: Serving, metrics_text: Callable[[], str]) -> QuartTrio:
    config = serving.config
    app = QuartTrio("trioserve")
    app.config["MAX_CONTENT_LENGTH"] = config.max_request_body_bytes
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = False
    created = int(time.time())

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> QuartResponse:
        status = exc.code or 500
        return _json(error_body(status, exc.description or exc.name), status)

    @app.errorhandler(ApiError)
    async def api_error(exc: ApiError) -> QuartResponse:
        return _error(exc)

    @app.get("/health")
    async def health() -> QuartResponse:
        if serving.dead_reason is not None:
            return _json(error_body(503, f"the engine is unavailable: {serving.dead_reason}"), 503)
        return QuartResponse(b"", status=200)

    @app.get("/metrics")
    async def metrics() -> QuartResponse:
        return QuartResponse(metrics_text(), status=200, content_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> QuartResponse:
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "trioserve",
                "root": config.model or name,
                "max_model_len": config.max_model_len,
            }
            for name in config.model_names
        ]
        return _json(msgspec.json.encode({"object": "list", "data": data}))

    @app.post("/tokenize")
    async def tokenize() -> QuartResponse:
        req = decode_body(await _body(), TokenizeRequest)
        resolve_model(req.model, config.model_names)
        tok = serving.tokenizer
        if req.messages is not None:
            messages = message_dicts(req.messages)
            ids = await serving.render(tok.apply_chat_template, messages, req.add_generation_prompt, None)
        elif req.prompt is not None:
            ids = await serving.render(tok.encode, req.prompt, req.add_special_tokens)
        else:
            raise ApiError(400, "send either `prompt` or `messages`")
        body = {"count": len(ids), "max_model_len": config.max_model_len, "tokens": ids}
        return _json(msgspec.json.encode(body))

    @app.post("/detokenize")
    async def detokenize() -> QuartResponse:
        req = decode_body(await _body(), DetokenizeRequest)
        resolve_model(req.model, config.model_names)
        vocab = serving.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise ApiError(400, f"token ids must be in [0, {vocab})", param="tokens")
        text = await serving.render(serving.tokenizer.decode, req.tokens, False)
        return _json(msgspec.json.encode({"prompt": text}))

    async def generate(kind: Kind) -> QuartResponse:
        sink = SseQueueSink()
        response = await serving.start(kind, await _body(), sink)
        if not response.options.stream:
            try:
                while not sink.ended:
                    await sink.waker.wait()
            finally:
                if not response.done:
                    serving.cancel(response)
            return _json(sink.body, sink.status)
        return QuartResponse(
            _stream(serving, response, sink),
            status=200,
            content_type="text/event-stream; charset=utf-8",
            headers={"cache-control": "no-cache"},
        )

    @app.post("/v1/chat/completions")
    async def chat_completions() -> QuartResponse:
        return await generate("chat")

    @app.post("/v1/completions")
    async def completions() -> QuartResponse:
        return await generate("completion")

    @app.websocket("/v1/ws")
    async def ws() -> None:
        await _serve_websocket(serving)

    return app


async def _stream(serving: Serving, response: Response, sink: SseQueueSink) -> AsyncIterator[bytes]:
    try:
        while True:
            if sink.chunks:
                data = sink.take()
                response.on_drained()  # deltas merged while we were away become chunks now
                yield data
            elif sink.ended:
                return
            else:
                await sink.waker.wait()
    finally:
        if not response.done:
            serving.cancel(response)


async def _serve_websocket(serving: Serving) -> None:
    """Several requests over one socket (``WsSession``); one writer task sends the outbox in order.
    Only for a connection hypercorn already owns: a fresh ``/v1/ws`` upgrade takes the fast path
    (``ws_server.py``)."""
    out = OutboxWriter()
    session: WsSession | None = None

    async def write_loop() -> None:
        while True:
            if not out.outbox:
                await out.waker.wait()
                continue
            batch = out.take()
            assert session is not None
            session.drained()  # deltas merged while we were away queue behind this batch
            for message in batch:
                await websocket.send(message.decode())

    try:
        async with trio.open_nursery() as nursery:
            session = WsSession(serving, out, nursery)
            nursery.start_soon(write_loop)
            while True:
                session.receive(await websocket.receive())
    finally:
        if session is not None:
            session.close()
