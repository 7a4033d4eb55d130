"""What a response does when its client cannot take bytes as fast as the engine makes them.

- ``merge`` (default, vLLM's one-slot collector): deltas wait, merged into one chunk per choice, and
  go out as soon as the socket drains. Memory per slow client: one merged delta. Tokens per event rise.
- ``queue:N``: up to N chunks queue behind the socket as they are, then deltas merge.
- ``stall``: the output handler waits for the slow client before it processes the next engine step:
  every stream on this API server waits with it, and the wait reaches the engine through the step
  queue's policy. Strict pacing at the price of head-of-line blocking; for experiments.
- ``abort-slow-client``: a client more than ``--slow-client-max-tokens`` tokens behind is cut off: its
  engine requests are aborted at once and its stream ends with an error event (after what it has not
  read yet). Everyone else is untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PolicyKind = Literal["merge", "queue", "stall", "abort-slow-client"]


@dataclass(frozen=True, slots=True)
class StreamPolicy:
    kind: PolicyKind = "merge"
    queue_events: int = 0  # queue:N
    slow_client_max_tokens: int = 256  # abort-slow-client

    @classmethod
    def parse(cls, text: str) -> StreamPolicy:
        """``merge`` | ``queue:N`` | ``stall`` | ``abort-slow-client``; ValueError otherwise."""
        if text.startswith("queue:"):
            count = int(text.removeprefix("queue:"))
            if count < 1:
                raise ValueError("queue:N needs N >= 1")
            return cls("queue", queue_events=count)
        if text in ("merge", "stall", "abort-slow-client"):
            return cls(text)  # type: ignore[arg-type]
        raise ValueError(f"unknown stream policy {text!r}: use merge, queue:N, stall or abort-slow-client")
