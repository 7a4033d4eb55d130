"""What the edge decides about a request before it routes it: CORS preflight, API key, request id.

The accept loop (``http_server.py``) calls ``Gate.check`` once per request, on its head, and applies
the ``Verdict`` the same way whichever path serves the request (the generation fast path, the
WebSocket upgrade, the quart app). Rules, in order:

1. A CORS preflight is answered at once (``cors.py``): no API key is asked of it.
2. A route the API key protects (``auth.py``), without the key, is answered 401, with the CORS
   headers so a page can read why.
3. Otherwise the request is routed, and every response to it carries ``Verdict.headers`` (CORS).

``X-Request-Id`` (``client_request_id``): accepted when it is 1 to ``MAX_REQUEST_ID`` bytes of
letters, digits and ``-._~:/+=`` (safe in a JSON string, a log line and a header without escaping);
any other value is ignored, as if absent, and the server makes the id itself. A tracing header is
no reason to refuse a request, and the echo (``--enable-request-id-headers``) shows the client which
id was used. It is read whether or not the echo is on (as vLLM does).

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from trioserve.config import AccessConfig
from trioserve.frontend.edge.auth import ApiKeys, unauthorized_body
from trioserve.frontend.edge.cors import CorsPolicy, Header
from trioserve.frontend.request.errors import error_body

MAX_REQUEST_ID = 128  # bytes
_ID_CHARS = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~:/+="
REQUEST_ID_HEADER = b"x-request-id"


def client_request_id(value: bytes | None) -> str | None:
    """The client's ``X-Request-Id`` when acceptable (see the module's rules), else None."""
    if value is None or not 0 < len(value) <= MAX_REQUEST_ID or value.translate(None, _ID_CHARS):
        return None
    return value.decode("ascii")


@dataclass(frozen=True, slots=True)
class Reply:
    """A response the edge gives instead of routing the request."""

    status: int
    body: bytes
    headers: list[Header]


@dataclass(frozen=True, slots=True)
class Verdict:
    reply: Reply | None  # answer this instead of routing (a preflight, a 401)
    headers: list[Header] = field(default_factory=list)  # every response carries these (shared: copy)
    request_id: str | None = None  # the client's X-Request-Id, when acceptable


class Gate:
    def __init__(self, access: AccessConfig) -> None:
        self.keys = ApiKeys(access.api_key, all_routes=access.api_key_all_routes)
        self.echo_request_id = access.enable_request_id_headers
        self.cors = CorsPolicy(
            access.allowed_origins,
            access.allowed_methods,
            access.allowed_headers,
            credentials=access.allow_credentials,
            expose=("X-Request-Id",) if self.echo_request_id else (),
        )

    def check(self, method: bytes, path: bytes, headers: Sequence[Header]) -> Verdict:
        """``path``: the target without its query; ``headers``: h11's (names in lower case)."""
        origin = authorization = request_id = wanted_method = wanted_headers = None
        for name, value in headers:
            if name == b"origin":
                origin = value
            elif name == b"authorization":
                if authorization is None:
                    authorization = value
            elif name == REQUEST_ID_HEADER:
                request_id = value
            elif name == b"access-control-request-method":
                wanted_method = value
            elif name == b"access-control-request-headers":
                wanted_headers = value
        rid = client_request_id(request_id)
        if method == b"OPTIONS" and origin is not None and wanted_method is not None:
            status, cors, refused = self.cors.preflight(origin, wanted_method, wanted_headers)
            return Verdict(Reply(status, b"" if refused is None else error_body(400, refused), cors), [], rid)
        cors = self.cors.response_headers(origin)
        if self.keys.protects(path):
            why = self.keys.refusal(authorization)
            if why is not None:
                challenge = [*cors, (b"www-authenticate", b"Bearer")]
                return Verdict(Reply(401, unauthorized_body(why), challenge), cors, rid)
        return Verdict(None, cors, rid)
