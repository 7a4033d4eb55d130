"""CORS: what a browser is told about cross-origin use (vLLM's flags and defaults: ``--allowed-origins``,
``--allowed-methods``, ``--allowed-headers`` as JSON lists, each ``["*"]``, and ``--allow-credentials``
off).

Rules:

- A request without ``Origin`` is not a CORS request; it gets no ``Access-Control-*`` header.
- A preflight is ``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``. The edge answers it
  before the API key check and before routing, for every path (``access.py``): 204 when the origin,
  the method and every requested header are allowed, with ``Access-Control-Allow-Origin``,
  ``-Allow-Methods``, ``-Allow-Headers``, ``-Max-Age`` (600 s) and, with credentials,
  ``-Allow-Credentials: true``; else 400 naming what was refused, without
  ``Access-Control-Allow-Origin`` (so the browser stops there).
- Any other request from an allowed origin gets ``Access-Control-Allow-Origin`` (and
  ``-Allow-Credentials``, ``-Expose-Headers``). A request from another origin is still served
  without them: CORS decides what a page may read, not who may call (that is the API key), and the
  browser keeps the response from the page.
- ``Access-Control-Allow-Origin`` is ``*`` when every origin is allowed and credentials are not;
  otherwise it is the request's own origin, since a browser refuses ``*`` with credentials.
- ``*`` in the methods or headers allows any. On a preflight the answer names them (the method
  list, or the headers the browser asked for) rather than sending ``*``, which a browser reads
  literally on a request with credentials.
- ``Vary: Origin`` on every response whenever the answer depends on the origin (an explicit origin
  list, or credentials), so a cache never hands one origin's answer to another; a preflight that
  echoes the requested headers also varies on ``Access-Control-Request-Headers``.
- The CORS-safelisted request headers (``Accept``, ``Accept-Language``, ``Content-Language``,
  ``Content-Type``) are always allowed.

Pure: no I/O. Origins, methods and headers are compared as bytes: origins exactly, methods in upper
case, header names in lower case.
"""

from __future__ import annotations

from collections.abc import Sequence

Header = tuple[bytes, bytes]

MAX_AGE = b"600"
ALL_METHODS = (b"DELETE", b"GET", b"HEAD", b"OPTIONS", b"PATCH", b"POST", b"PUT")
SAFELISTED = frozenset({b"accept", b"accept-language", b"content-language", b"content-type"})


class CorsPolicy:
    def __init__(
        self,
        origins: Sequence[str],
        methods: Sequence[str],
        headers: Sequence[str],
        *,
        credentials: bool = False,
        expose: Sequence[str] = (),
    ) -> None:
        """``expose``: response headers page scripts may read (``Access-Control-Expose-Headers``)."""
        self._any_origin = "*" in origins
        self._origins = frozenset(o.encode() for o in origins)
        self._any_method = "*" in methods
        self._methods = (
            ALL_METHODS if self._any_method else tuple(dict.fromkeys(m.upper().encode() for m in methods))
        )
        self._any_header = "*" in headers
        self._headers = SAFELISTED | {h.strip().lower().encode() for h in headers}
        self.credentials = credentials
        # The answer depends on the origin: Vary on every response, and the origin echoed.
        self.by_origin = not self._any_origin or credentials
        self.vary: list[Header] = [(b"vary", b"origin")] if self.by_origin else []
        simple = [(b"access-control-allow-origin", b"*")] if not self.by_origin else []
        if credentials:
            simple.append((b"access-control-allow-credentials", b"true"))
        if expose:
            simple.append((b"access-control-expose-headers", ", ".join(expose).encode()))
        self._simple = simple

    def origin_allowed(self, origin: bytes) -> bool:
        return self._any_origin or origin in self._origins

    def response_headers(self, origin: bytes | None) -> list[Header]:
        """The CORS headers of a response (not a preflight) to a request with this ``Origin``."""
        if origin is None or not self.origin_allowed(origin):
            return self.vary
        if self.by_origin:
            return [(b"access-control-allow-origin", origin), *self.vary, *self._simple]
        return self._simple

    def preflight(
        self, origin: bytes, method: bytes, requested_headers: bytes | None
    ) -> tuple[int, list[Header], str | None]:
        """The answer to a preflight: status, headers and, for a refusal, what was refused."""
        vary = [b"origin"] if self.by_origin else []
        asked = [h.strip().lower() for h in requested_headers.split(b",")] if requested_headers else []
        asked = [h for h in asked if h]
        refused = []
        if not self.origin_allowed(origin):
            refused.append("origin")
        if method.upper() not in self._methods:
            refused.append("method")
        if not self._any_header and any(h not in self._headers for h in asked):
            refused.append("headers")
        if refused:
            headers = [(b"vary", b", ".join(vary))] if vary else []
            return 400, headers, "CORS preflight refused: " + ", ".join(refused) + " not allowed"
        headers = [
            (b"access-control-allow-origin", origin if self.by_origin else b"*"),
            (b"access-control-allow-methods", b", ".join(self._methods)),
        ]
        if not self._any_header:
            headers.append((b"access-control-allow-headers", b", ".join(sorted(self._headers))))
        elif asked:
            headers.append((b"access-control-allow-headers", b", ".join(asked)))
            vary.append(b"access-control-request-headers")
        headers.append((b"access-control-max-age", MAX_AGE))
        if self.credentials:
            headers.append((b"access-control-allow-credentials", b"true"))
        if vary:
            headers.append((b"vary", b", ".join(vary)))
        return 204, headers, None
