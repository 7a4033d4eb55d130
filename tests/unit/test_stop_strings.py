from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trioserve.frontend.stop_strings import StopResult, StopStringMatcher


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
