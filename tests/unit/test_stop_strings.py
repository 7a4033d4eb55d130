from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trioserve.frontend.text.stop_strings import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    StopResult,
    StopStringMatcher,
)


def run(matcher: StopStringMatcher, chunks: Sequence[str]) -> tuple[list[str], str | None]:
    """Feed chunks until a match; return every emitted piece (flush included) and the match."""
    pieces: list[str] = []
    for chunk in chunks:
        result = matcher.feed(chunk)
        pieces.append(result.text)
        if result.matched is not None:
            return pieces, result.matched
    pieces.append(matcher.flush())
    return pieces, None


def test_no_stops_passes_text_through() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("hello") == StopResult("hello", None)
    assert matcher.flush() == ""


def test_rejects_empty_stop_string() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(["ok", ""])


def test_rejects_bare_string() -> None:
    with pytest.raises(TypeError):
        StopStringMatcher("abc")


def test_match_inside_one_chunk() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("abc STOP def") == StopResult("abc ", "STOP")
    assert matcher.matched == "STOP"


def test_stop_spanning_tokens() -> None:
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.feed("42 </") == StopResult("42 ", None)
    assert matcher.feed("ans") == StopResult("", None)
    assert matcher.feed("wer>") == StopResult("", "</answer>")


def test_partial_prefix_held_back_then_released() -> None:
    matcher = StopStringMatcher(["\n\n"])
    assert matcher.feed("line\n") == StopResult("line", None)
    # The held "\n" is released once the next text shows it cannot start "\n\n".
    assert matcher.feed("more") == StopResult("\nmore", None)
    assert matcher.feed("\n") == StopResult("", None)
    assert matcher.flush() == "\n"


def test_holds_longest_suffix_only() -> None:
    matcher = StopStringMatcher(["abcd"])
    # "abcab": only "ab" can still become "abcd"; "abc" at the front cannot any more.
    assert matcher.feed("abcab") == StopResult("abc", None)
    assert matcher.feed("cd") == StopResult("", "abcd")


def test_overlapping_self_prefix() -> None:
    matcher = StopStringMatcher(["abc"])
    assert matcher.feed("ab") == StopResult("", None)
    assert matcher.feed("ab") == StopResult("ab", None)
    assert matcher.feed("c") == StopResult("", "abc")

    assert StopStringMatcher(["abc"]).feed("ababc") == StopResult("ab", "abc")


def test_several_stops_earliest_wins() -> None:
    matcher = StopStringMatcher(["world", "lo"])
    assert matcher.feed("hello world") == StopResult("hel", "lo")
    matcher = StopStringMatcher(["lo", "world"])
    assert matcher.feed("say world, hello") == StopResult("say ", "world")


def test_first_completed_occurrence_wins_over_longer_earlier_start() -> None:
    # "abcdef" starts first, but "bcd" is complete while "abcdef" is still only a prefix.
    assert StopStringMatcher(["abcdef", "bcd"]).feed("abcdef") == StopResult("a", "bcd")
    # Same end character: the longer (earlier-starting) one wins.
    assert StopStringMatcher(["cd", "abcd"]).feed("xabcd") == StopResult("x", "abcd")


def test_include_stop_str_in_output() -> None:
    matcher = StopStringMatcher(["END"], include_stop_str_in_output=True)
    assert matcher.feed("done E") == StopResult("done ", None)
    assert matcher.feed("ND trailing") == StopResult("END", "END")


def test_spent_after_match() -> None:
    matcher = StopStringMatcher(["x"])
    assert matcher.feed("ax") == StopResult("a", "x")
    assert matcher.feed("more x") == StopResult("", None)
    assert matcher.flush() == ""
    assert matcher.matched == "x"


def test_flush_releases_held_text_once() -> None:
    matcher = StopStringMatcher(["<|user|>"])
    assert matcher.feed("bye <|us") == StopResult("bye ", None)
    assert matcher.flush() == "<|us"
    assert matcher.flush() == ""


def test_duplicate_and_nested_stops() -> None:
    # A stop that is a prefix of another completes first and wins.
    assert StopStringMatcher(["abc", "ab", "ab"]).feed("xabc") == StopResult("x", "ab")
    # A stop reached only through a failure link ("b" inside "abX") still ends the text there.
    matcher = StopStringMatcher(["abc", "b"])
    assert matcher.feed("a") == StopResult("", None)
    assert matcher.feed("bX") == StopResult("a", "b")


def test_held_text_released_after_failed_long_prefix() -> None:
    matcher = StopStringMatcher(["aaab", "ac"])
    assert matcher.feed("aaa") == StopResult("", None)
    # "aaaa" cannot become "aaab" from the front; "aaa" still can.
    assert matcher.feed("a") == StopResult("a", None)
    assert matcher.feed("c") == StopResult("aa", "ac")


def test_feeding_after_flush_starts_afresh() -> None:
    matcher = StopStringMatcher(["abc"])
    assert matcher.feed("xab") == StopResult("x", None)
    assert matcher.flush() == "ab"
    # The flushed "ab" is gone: "c" alone cannot complete "abc".
    assert matcher.feed("c") == StopResult("c", None)


def test_unicode_stop() -> None:
    matcher = StopStringMatcher(["。\n"])
    assert matcher.feed("你好。") == StopResult("你好", None)
    assert matcher.feed("\n再见") == StopResult("", "。\n")


# --- property test -------------------------------------------------------------------------


def reference(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """Scan the text as it grows; stop at the first length at which it ends with a stop string."""
    for end in range(1, len(text) + 1):
        hits = [stop for stop in stops if text[:end].endswith(stop)]
        if hits:
            stop = max(hits, key=len)
            return text[: end - len(stop)], stop
    return text, None


def longest_held_suffix(text: str, stops: Sequence[str]) -> int:
    lengths = [n for n in range(1, len(text) + 1) for s in stops if n < len(s) and s.startswith(text[-n:])]
    return max(lengths, default=0)


alphabet = st.sampled_from("abc\n")
stop_lists = st.lists(st.text(alphabet, min_size=1, max_size=4), min_size=1, max_size=3)


@st.composite
def chunked_text(draw: st.DrawFn) -> list[str]:
    text = draw(st.text(alphabet, max_size=40))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@given(chunks=chunked_text(), stops=stop_lists, include=st.booleans())
def test_streaming_equals_truncation(chunks: list[str], stops: list[str], include: bool) -> None:
    text = "".join(chunks)
    expected_text, expected_stop = reference(text, stops)
    matcher = StopStringMatcher(stops, include_stop_str_in_output=include)

    fed = ""
    emitted = ""
    matched: str | None = None
    for chunk in chunks:
        fed += chunk
        result = matcher.feed(chunk)
        emitted += result.text
        if result.matched is not None:
            matched = result.matched
            break
        # Nothing emitted so far contains a stop string, and exactly the longest suffix that
        # could still grow into one is held back.
        assert not any(stop in emitted for stop in stops)
        assert fed.startswith(emitted)
        assert len(fed) - len(emitted) == longest_held_suffix(fed, stops)
    else:
        emitted += matcher.flush()

    assert matched == expected_stop
    if include and matched is not None:
        assert emitted == expected_text + matched
    else:
        assert emitted == expected_text


# --- against a naive reference matcher -------------------------------------------------------


class NaiveMatcher:
    """The documented rule, written as directly as possible: re-scan everything unemitted."""

    def __init__(self, stops: Sequence[str], include: bool) -> None:
        self.stops = list(stops)
        self.include = include
        self.unemitted = ""
        self.matched: str | None = None

    def feed(self, text: str) -> StopResult:
        if self.matched is not None:
            return StopResult("", None)
        old = len(self.unemitted)
        self.unemitted += text
        buffer = self.unemitted
        # The first end position at which a stop string completes; the longest one there.
        for end in range(old + 1, len(buffer) + 1):
            hits = [stop for stop in self.stops if buffer[:end].endswith(stop)]
            if hits:
                stop = max(hits, key=len)
                self.matched = stop
                self.unemitted = ""
                return StopResult(buffer[: end if self.include else end - len(stop)], stop)
        hold = max(
            (
                n
                for n in range(1, len(buffer) + 1)
                for s in self.stops
                if n < len(s) and s.startswith(buffer[-n:])
            ),
            default=0,
        )
        self.unemitted = buffer[len(buffer) - hold :]
        return StopResult(buffer[: len(buffer) - hold], None)

    def flush(self) -> str:
        held, self.unemitted = self.unemitted, ""
        return held


# Feeds (text) and flushes (None), in any order, with empty feeds allowed.
operations = st.lists(st.one_of(st.text(st.sampled_from("abc"), max_size=6), st.none()), max_size=25)
small_stop_lists = st.lists(st.text(st.sampled_from("abc"), min_size=1, max_size=6), max_size=5)


@settings(max_examples=500, deadline=None)
@given(stops=small_stop_lists, ops=operations, include=st.booleans())
def test_every_feed_equals_naive_reference(stops: list[str], ops: list[str | None], include: bool) -> None:
    matcher = StopStringMatcher(stops, include_stop_str_in_output=include)
    naive = NaiveMatcher(stops, include)
    assert matcher.state_count <= sum(map(len, set(stops))) + 1
    for op in ops:
        if op is None:
            assert matcher.flush() == naive.flush()
        else:
            assert matcher.feed(op) == naive.feed(op)
    assert matcher.flush() == naive.flush()
    assert matcher.matched == naive.matched


# --- long stop strings: linear size, no quadratic work ---------------------------------------


def test_caps_for_the_validator() -> None:
    assert (MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS) == (16, 1024)
    stops = [chr(ord("a") + i) * MAX_STOP_STRING_CHARS for i in range(MAX_STOP_STRINGS)]
    assert StopStringMatcher(stops).state_count == MAX_STOP_STRINGS * MAX_STOP_STRING_CHARS + 1


def test_100k_stop_string_is_linear() -> None:
    # The reported defect: one 100 kB stop string built every prefix (quadratic memory).
    stop = "ab" * 25_000 + "x" * 50_000
    matcher = StopStringMatcher([stop])
    assert matcher.state_count == len(stop) + 1
    # Every per-state table is linear in the stop string's length.
    assert all(len(table) <= len(stop) + 1 for table in (matcher._fail_j, matcher._fail_d, matcher._out))

    # Fed in 4-character chunks, all of it is held back, then it matches on the last character.
    head = stop[:-1]
    chunks = [head[i : i + 4] for i in range(0, len(head), 4)]
    pieces, matched = run(matcher, [*chunks, stop[-1]])
    assert matched == stop
    assert "".join(pieces) == ""

    # A near miss releases everything, once it can no longer become the stop string.
    matcher = StopStringMatcher([stop], include_stop_str_in_output=True)
    for chunk in chunks:
        assert matcher.feed(chunk) == StopResult("", None)
    assert matcher.feed("y") == StopResult(stop[:-1] + "y", None)


def test_long_self_overlapping_stop_slides() -> None:
    # "aaa...ab" against a long run of "a": the held text stays one short of the stop string
    # and each feed releases exactly what it adds.
    stop = "a" * 9_999 + "b"
    matcher = StopStringMatcher([stop])
    assert matcher.feed("a" * 20_000) == StopResult("a" * (20_000 - 9_999), None)
    for _ in range(5_000):
        assert matcher.feed("aaaa") == StopResult("aaaa", None)
    assert matcher.feed("ab") == StopResult("a", stop)


def test_a_fork_shares_the_automaton_and_starts_fresh() -> None:
    first = StopStringMatcher(["abc", "bd"])
    assert first.feed("xab") == StopResult("x", None)  # "ab" held
    twin = first.fork()
    assert twin.state_count == first.state_count
    assert twin.feed("bd") == StopResult("", "bd")  # its own state: nothing held from the first
    assert first.matched is None
    assert first.feed("c") == StopResult("", "abc")
    assert twin.feed("more") == StopResult("", None)  # spent after its own match
