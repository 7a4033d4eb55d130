"""Stop strings over streamed text (sans-I/O, pure).

Semantics: generation stops at the first point in the stream where the text contains any stop
string. The text is cut just before that occurrence (or just after it with
``include_stop_str_in_output``). When several occurrences complete at once, the one that ends
first wins, and among those ending at the same character the longest (earliest-starting) one.
This is the only rule that gives the same answer however the text is chunked: a longer stop
string that started earlier but has not completed yet never delays a completed one, just as
the engine would not keep generating to find out.

Rule: the client never sees any part of a stop string. The matcher holds back exactly the
longest suffix of the unemitted text that is a proper prefix of some stop string; that suffix
is released by a later ``feed`` once it can no longer become a stop string, or by ``flush``.

Callers should not build a matcher when a request has no stop strings (the hot path then skips
it entirely); one built with no stop strings passes text through unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["StopResult", "StopStringMatcher"]


class StopResult(NamedTuple):
    text: str
    """Text that may be sent to the client now."""
    matched: str | None
    """The stop string that ended generation in this feed, else None."""


class StopStringMatcher:
    __slots__ = ("_first_chars", "_held", "_include", "_matched", "_max_hold", "_prefixes", "_stops")

    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if isinstance(stops, str):
            raise TypeError("stops must be a sequence of strings, not a single string")
        for stop in stops:
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
        # Longest first: when two occurrences end at the same character, the longer one started
        # earlier, and the scan below keeps the first candidate it sees on a tie.
        self._stops: tuple[str, ...] = tuple(sorted(set(stops), key=len, reverse=True))
        self._include = include_stop_str_in_output
        # Every proper prefix of every stop string: what may be held back.
        self._prefixes = frozenset(stop[:n] for stop in self._stops for n in range(1, len(stop)))
        self._first_chars = frozenset(prefix[0] for prefix in self._prefixes)
        self._max_hold = max((len(stop) - 1 for stop in self._stops), default=0)
        # Invariant: _held is a proper prefix of some stop string and contains no stop string.
        self._held = ""
        self._matched: str | None = None

    @property
    def matched(self) -> str | None:
        """The stop string that ended the stream, once one has."""
        return self._matched

    def feed(self, text: str) -> StopResult:
        """Add newly generated text; return what may be emitted now and any stop string hit.

        After a match the matcher is spent: later feeds (tokens the engine produced before it
        heard about the stop) return empty text and ``matched=None``.
        """
        if self._matched is not None:
            return StopResult("", None)
        if not self._stops:
            return StopResult(text, None)
        buffer = self._held + text
        # Every occurrence found is new: _held holds none, so each one ends inside `text`.
        best_start = -1
        best_end = len(buffer) + 1
        best_stop = ""
        for stop in self._stops:
            start = buffer.find(stop)
            if start >= 0 and start + len(stop) < best_end:
                best_start, best_end, best_stop = start, start + len(stop), stop
        if best_start >= 0:
            self._matched = best_stop
            self._held = ""
            return StopResult(buffer[: best_end if self._include else best_start], best_stop)
        hold = self._hold_length(buffer)
        self._held = buffer[len(buffer) - hold :]
        return StopResult(buffer[: len(buffer) - hold], None)

    def flush(self) -> str:
        """At the natural end of generation: release the held-back text ("" after a match)."""
        held, self._held = self._held, ""
        return held

    def _hold_length(self, buffer: str) -> int:
        # Longest suffix first, so the first hit is the answer; the first-character test skips
        # most candidates without slicing.
        first_chars = self._first_chars
        prefixes = self._prefixes
        for length in range(min(len(buffer), self._max_hold), 0, -1):
            if buffer[-length] in first_chars and buffer[-length:] in prefixes:
                return length
        return 0
