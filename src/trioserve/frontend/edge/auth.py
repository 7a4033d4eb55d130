"""API keys (``--api-key``): which routes need one, and whether a request carries one.

Rules:

- With no key configured nothing is checked and nothing is added.
- Open routes: ``/health``, ``/ping``, ``/load``, ``/version`` and ``/metrics`` (probes, balancers and
  scrapers carry no key; vLLM leaves the same ones open), unless ``--api-key-all-routes``. Every other
  path needs the key, paths that match no route too: the check fails closed, so a route added later
  is protected without a change here, and a 401 for a path that does not exist gives nothing away.
  Paths are compared as sent (before percent-decoding): ``/%68ealth`` is not ``/health``, so it needs
  the key, and no spelling of a protected route can pass as an open one.
- A request carries a key when its first ``Authorization`` header is ``Bearer <token>`` (the scheme in
  any case, RFC 7235) and the token equals one of the keys. The comparison takes the same time
  whatever the token: SHA-256 of the token against SHA-256 of every key with
  ``hmac.compare_digest``, all keys compared, so neither a key's length nor which key matched (nor how
  many bytes of one did) shows in the timing.
- A refusal is 401 with OpenAI's error for a bad key (``invalid_request_error``, code
  ``invalid_api_key``; the ``openai`` SDK raises ``AuthenticationError``) and
  ``WWW-Authenticate: Bearer`` (RFC 6750). The message never repeats the token.
- A CORS preflight is answered before this check (browsers never send credentials on one): see
  ``access.py``.

Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

import msgspec

OPEN_PATHS = frozenset({b"/health", b"/ping", b"/load", b"/version", b"/metrics"})
MISSING = "no API key: send it in the Authorization header, as `Authorization: Bearer <key>`"
WRONG = "invalid API key"


class _AuthError(msgspec.Struct):
    message: str
    type: str
    param: None
    code: str


class _AuthBody(msgspec.Struct):
    error: _AuthError


def unauthorized_body(message: str) -> bytes:
    """OpenAI's body for a missing or wrong key (``code`` is its string, not the status)."""
    return msgspec.json.encode(
        _AuthBody(_AuthError(message, "invalid_request_error", None, "invalid_api_key"))
    )


class ApiKeys:
    def __init__(self, keys: Sequence[str], *, all_routes: bool = False) -> None:
        self._digests = [hashlib.sha256(key.encode()).digest() for key in keys]
        self.enabled = bool(self._digests)
        self._open = frozenset() if all_routes else OPEN_PATHS

    def protects(self, path: bytes) -> bool:
        """Whether a request for ``path`` (the target without its query) needs a key."""
        return self.enabled and path not in self._open

    def refusal(self, authorization: bytes | None) -> str | None:
        """None when ``authorization`` (the header's value) carries a key; else why not, the message
        of the 401."""
        if authorization is None:
            return MISSING
        scheme, _, token = authorization.partition(b" ")
        token = token.strip(b" \t")
        if scheme.lower() != b"bearer" or not token:
            return MISSING
        digest = hashlib.sha256(token).digest()
        matched = False
        for key in self._digests:  # every key, no early exit
            matched |= hmac.compare_digest(digest, key)
        return None if matched else WRONG
