"""The quart-trio app: every route that is not on the per-token hot path.

Admin and metadata routes live here. The generation routes and the WebSocket are never served by
this app: the accept loop owns every connection and serves those itself, calling this app per
request for everything else (``asgi_host.py``), so no response here streams. The API key, CORS and
the X-Request-Id echo are the accept loop's too (``access.py``): they apply before a request gets here.

Routes: ``GET /health`` and ``GET|POST /ping`` (200, or 503 while draining or without an engine;
``/ping`` is SageMaker's name for it, as in vLLM), ``GET /load`` (vLLM's ``{"server_load": N}``: the
requests this API server holds, rendering ones included), ``GET /version``, ``GET /metrics``,
``GET /v1/models`` and ``GET /v1/models/{id}`` (404 with an OpenAI body for a name not served),
``POST /tokenize`` and ``POST /detokenize``.
"""

from __future__ import annotations

import importlib.metadata
import time
from collections.abc import Awaitable, Callable
from functools import partial

import msgspec
import trio
from quart import Response as QuartResponse
from quart import request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from trioserve.frontend.request.errors import ApiError, error_body
from trioserve.frontend.request.openai_schema import DetokenizeRequest, TokenizeRequest
from trioserve.frontend.request.tools import checked_functions
from trioserve.frontend.request.validate import decode_body, resolve_model
from trioserve.frontend.serving import Serving, message_dicts


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


def _version() -> str:
    try:
        return importlib.metadata.version("trioserve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def create_app(
    serving: Serving, metrics_text: Callable[[], Awaitable[str]], max_request_body_bytes: int
) -> QuartTrio:
    served = serving.model
    app = QuartTrio("trioserve")
    app.config["MAX_CONTENT_LENGTH"] = max_request_body_bytes
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = False
    # The accept loop enforces the connection's limits (head, body and idle timeouts) for every route;
    # quart's own 60 s response timeout would only ever cut a response short without telling.
    app.config["RESPONSE_TIMEOUT"] = None
    created = int(time.time())

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> QuartResponse:
        status = exc.code or 500
        return _json(error_body(status, exc.description or exc.name), status)

    @app.errorhandler(ApiError)
    async def api_error(exc: ApiError) -> QuartResponse:
        return _error(exc)

    version = msgspec.json.encode({"version": _version()})

    @app.get("/health")
    async def health() -> QuartResponse:
        if serving.draining:  # a balancer should move away before the listener is gone
            return _json(error_body(503, "the server is shutting down"), 503)
        if serving.dead_reason is not None:
            return _json(error_body(503, f"the engine is unavailable: {serving.dead_reason}"), 503)
        stall = serving.engine.stall()  # nothing from an engine for longer than its stall bound
        if stall is not None:
            return _json(error_body(503, stall.message), 503)
        return QuartResponse(b"", status=200)

    @app.route("/ping", methods=["GET", "POST"])
    async def ping() -> QuartResponse:
        return await health()

    @app.get("/load")
    async def load() -> QuartResponse:
        return _json(msgspec.json.encode({"server_load": serving.admission.in_flight}))

    @app.get("/version")
    async def show_version() -> QuartResponse:
        return _json(version)

    @app.get("/metrics")
    async def metrics() -> QuartResponse:
        return QuartResponse(await metrics_text(), status=200, content_type="text/plain; version=0.0.4")

    def model_card(name: str) -> dict[str, object]:
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "trioserve",
            "root": served.model or name,
            "max_model_len": served.max_model_len,
        }

    @app.get("/v1/models")
    async def models() -> QuartResponse:
        data = [model_card(name) for name in served.model_names]
        return _json(msgspec.json.encode({"object": "list", "data": data}))

    @app.get("/v1/models/<path:model_id>")  # names may hold slashes (org/model)
    async def model(model_id: str) -> QuartResponse:
        if model_id not in served.model_names:
            raise ApiError(404, f"The model `{model_id}` does not exist.", param="model")
        return _json(msgspec.json.encode(model_card(model_id)))

    @app.get("/v1/replicas")
    async def replicas() -> QuartResponse:
        return _json(msgspec.json.encode(serving.inventory(trio.current_time())))

    @app.post("/tokenize")
    async def tokenize() -> QuartResponse:
        req = decode_body(await _body(), TokenizeRequest)
        resolve_model(req.model, served.model_names)
        tok = serving.tokenizer
        if req.messages is not None:
            messages = message_dicts(req.messages)
            tools = list(req.tools) if req.tools else None
            if tools is not None:
                checked_functions(tools)
            render = partial(serving.apply_chat_template, tools=tools)
            ids = await serving.render(render, messages, req.add_generation_prompt)
        elif req.prompt is not None:
            ids = await serving.render(tok.encode, req.prompt, req.add_special_tokens)
        else:
            raise ApiError(400, "send either `prompt` or `messages`")
        body = {"count": len(ids), "max_model_len": served.max_model_len, "tokens": ids}
        return _json(msgspec.json.encode(body))

    @app.post("/detokenize")
    async def detokenize() -> QuartResponse:
        req = decode_body(await _body(), DetokenizeRequest)
        resolve_model(req.model, served.model_names)
        vocab = serving.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise ApiError(400, f"token ids must be in [0, {vocab})", param="tokens")
        text = await serving.render(serving.tokenizer.decode, req.tokens, False)
        return _json(msgspec.json.encode({"prompt": text}))

    return app
