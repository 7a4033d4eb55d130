"""OpenAI-shaped errors: every rejection a client sees is one of these, never a bare 500."""

from __future__ import annotations

import msgspec

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


class _ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: int


class _ErrorBody(msgspec.Struct):
    error: _ErrorInfo


class ApiError(Exception):
    """A request the server refuses; ``status`` is the HTTP status to answer with."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, retry_after: int | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after = retry_after  # seconds, sent as a Retry-After header with 429/503

    def body(self) -> bytes:
        info = _ErrorInfo(self.message, _TYPES.get(self.status, "Error"), self.param, self.status)
        return msgspec.json.encode(_ErrorBody(info))


def error_body(status: int, message: str) -> bytes:
    return ApiError(status, message).body()
