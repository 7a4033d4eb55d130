"""The access log: one line per request, written once, when its response has gone out.

On by default (as uvicorn's is), off with ``--disable-access-log`` (vLLM's spelling,
``--disable-uvicorn-access-log``, works too); ``--disable-access-log-for-endpoints /health,/metrics``
leaves those paths out. Lines go to the ``logging`` logger ``trioserve.access`` at INFO, so the log
configuration decides where they end up (and ``--log-level warning`` drops them), and nothing is
formatted when that level is off.

A line::

    127.0.0.1:52344 "POST /v1/chat/completions HTTP/1.1" 200 prompt_tokens=12 output_tokens=40
    ttft_ms=31.2 duration_ms=402.7 request_id=8c1f...0000002a

(one line; wrapped here). ``-`` stands for what does not apply: a route that generates nothing has no
tokens and no TTFT; a request that ended before its first token has no TTFT; a request over a Unix
socket has no client address. TTFT and duration are measured from the moment the request head was
read, on the wall clock (the output handler stamps the first token with it), so they include the
body, rendering and queueing; the duration ends when the last byte was handed to the kernel (a
WebSocket's when its session ends). The request id is the one the response and the engine requests
carry (``--enable-request-id-headers`` echoes it).

Never on the per-token path: the fields are read off the response once, at its end.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("trioserve.access")


@dataclass(frozen=True, slots=True)
class AccessRecord:
    client: tuple[str, int] | None
    method: str
    target: str
    http_version: str
    status: int
    duration: float  # seconds
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    ttft: float | None = None  # seconds
    request_id: str | None = None


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _n(value: int | str | None) -> str:
    return "-" if value is None else str(value)


def format_line(r: AccessRecord) -> str:
    client = f"{r.client[0]}:{r.client[1]}" if r.client is not None else "-"
    return (
        f'{client} "{r.method} {r.target} HTTP/{r.http_version}" {r.status}'
        f" prompt_tokens={_n(r.prompt_tokens)} output_tokens={_n(r.output_tokens)}"
        f" ttft_ms={_ms(r.ttft)} duration_ms={_ms(r.duration)} request_id={_n(r.request_id)}"
    )


class AccessLog:
    def __init__(self, excluded_paths: str = "") -> None:
        """``excluded_paths``: comma-separated paths that get no line."""
        self._excluded = frozenset(p.strip().encode() for p in excluded_paths.split(",") if p.strip())

    def wanted(self, path: bytes) -> bool:
        """Whether a request for ``path`` gets a line (so the caller skips gathering its fields)."""
        return path not in self._excluded and log.isEnabledFor(logging.INFO)

    def write(self, record: AccessRecord) -> None:
        log.info("%s", format_line(record))
