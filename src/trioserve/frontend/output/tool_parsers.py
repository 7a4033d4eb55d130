"""Tool calls out of generated text, incrementally: pure objects fed the text as it streams.

Every parser has ``feed(text) -> ToolOutput`` and ``finish() -> ToolOutput``: the content to show so
far and the tool-call deltas found in ``text``. The rule every parser keeps, tested with arbitrary
chunkings (``tests/unit/test_tool_parsers.py``): **the content and the calls are a function of the
whole text, not of how it was cut** — concatenating the outputs' contents, and merging their deltas
per call (name from the first, arguments concatenated), gives the same result for any chunking of the
same text.

A call's arguments stream as the raw text of its JSON value when the call's ``name`` comes before its
arguments (every format here writes them in that order; a call written the other way round is
emitted whole once its object is complete). Formats:

- ``forced``: what the grammar of ``tool_choice: "required"`` writes: a JSON array of
  ``{"name": ..., "parameters": {...}}`` objects (vLLM's shape for it);
- ``named``: ``tool_choice`` naming one function: the whole text is that call's arguments;
- ``hermes`` (Qwen, Hermes): content, with calls as ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>``; whitespace next to a tag is not content, nor is trailing whitespace once a call was
  made;
- ``llama3_json``: the whole text is calls when it starts (after whitespace, and an optional
  ``<|python_tag|>``) with ``{``: JSON objects with ``name`` and ``parameters`` (or ``arguments``),
  separated by ``;``; anything else is content.

A call whose object is not valid JSON when it ends is dropped with what it streamed left as it was
(clients see the deltas already sent; ``ToolOutput.errors`` counts them).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Literal, Protocol

from trioserve.config import ToolCallParserName


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    index: int  # the call's place in this choice: 0, 1, ...
    name: str | None  # on a call's first delta only
    arguments: str  # the next piece of the arguments' JSON text


@dataclass(slots=True)
class ToolOutput:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)
    errors: int = 0

    def extend(self, other: ToolOutput) -> None:
        self.content += other.content
        self.calls += other.calls
        self.errors += other.errors


class ToolParser(Protocol):
    def feed(self, text: str) -> ToolOutput: ...

    def finish(self) -> ToolOutput: ...


# The head of a call object up to its arguments' first character: name first, then the arguments key.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')
_HEAD_MAX = 1024  # a head longer than this is not one: the object is read whole instead


class _ObjectScanner:
    """One call object, fed text until it closes, one character at a time: the head (``_HEAD``: name,
    then the arguments key) is looked for after every non-space character, so the arguments stream
    from their first character whatever the chunking; an object that closes first, or whose head is
    another shape, is kept and parsed whole when it closes."""

    __slots__ = ("buffer", "depth", "escape", "in_string", "index", "state")

    def __init__(self, index: int) -> None:
        self.index = index
        self.buffer = ""
        # head -> value -> tail -> done; head -> whole -> done; tail -> skip -> done
        self.state = "head"
        self.depth = 0  # JSON nesting: the object's (head, whole, skip) or the arguments value's
        self.in_string = False
        self.escape = False

    def _scan(self, ch: str) -> bool:
        """Track JSON nesting; True when ``ch`` closes the outermost container."""
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
            return False
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            return self.depth == 0
        return False

    def feed(self, text: str, out: ToolOutput) -> str:
        """Take what of ``text`` belongs to this object; the rest (after it closed) is returned."""
        i, n = 0, len(text)
        while i < n and self.state != "done":
            if self.state == "value":  # the hot loop: a run of argument text, one delta
                start = i
                while i < n:
                    closed = self._scan(text[i])
                    i += 1
                    if closed:
                        self.state = "tail"
                        break
                out.calls.append(ToolCallDelta(self.index, None, text[start:i]))
                continue
            ch = text[i]
            i += 1
            if self.state == "head":
                self.buffer += ch
                if self._scan(ch):
                    self._emit_whole(out)
                elif not ch.isspace():
                    m = _HEAD.match(self.buffer)
                    if m is not None and ch in "{[":
                        out.calls.append(ToolCallDelta(self.index, json.loads(f'"{m.group(1)}"'), ch))
                        self.state, self.depth, self.buffer = "value", 1, ""
                    elif m is not None or len(self.buffer) > _HEAD_MAX:
                        self.state = "whole"  # a scalar value, or no head: read it whole
            elif self.state == "whole":
                self.buffer += ch
                if self._scan(ch):
                    self._emit_whole(out)
            elif self.state == "tail":  # whitespace, then the object's closing brace
                if ch == "}":
                    self.state = "done"
                elif not ch.isspace():  # more keys after the arguments: not a shape we stream
                    out.errors += 1
                    self.state, self.depth = "skip", 1
                    self._scan(ch)
            elif self._scan(ch):  # skip: the rest of an object given up on
                self.state = "done"
        return text[i:]

    def _emit_whole(self, out: ToolOutput) -> None:
        self.state = "done"
        try:
            obj = json.loads(self.buffer)
        except ValueError:
            obj = None
        args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
        name = obj.get("name") if isinstance(obj, dict) else None
        if not isinstance(name, str) or args is None:
            out.errors += 1
            return
        text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        out.calls.append(ToolCallDelta(self.index, name, text))

    @property
    def done(self) -> bool:
        return self.state == "done"


class NamedParser:
    """``tool_choice`` naming a function: the whole text is its arguments."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls_made = 0

    def feed(self, text: str) -> ToolOutput:
        out = ToolOutput()
        if self.calls_made == 0:
            self.calls_made = 1
            out.calls.append(ToolCallDelta(0, self.name, ""))
        if text:
            out.calls.append(ToolCallDelta(0, None, text))
        return out

    def finish(self) -> ToolOutput:
        return self.feed("")


class ForcedParser:
    """``tool_choice: "required"``: ``[{"name": ..., "parameters": ...}, ...]`` (the grammar's shape).
    Also the calls part of ``llama3_json``: whatever lies between objects (``[``, ``,``, ``;``, ``]``,
    whitespace) is skipped."""

    def __init__(self) -> None:
        self.calls_made = 0
        self._scanner: _ObjectScanner | None = None

    def feed(self, text: str) -> ToolOutput:
        out = ToolOutput()
        while text:
            if self._scanner is None:
                at = text.find("{")
                if at < 0:
                    return out
                self._scanner = _ObjectScanner(self.calls_made)
                self.calls_made += 1
                text = text[at:]
            text = self._scanner.feed(text, out)
            if self._scanner.done:
                self._scanner = None
        return out

    def finish(self) -> ToolOutput:
        out = ToolOutput()
        if self._scanner is not None:
            out.errors += 1  # the text ended inside a call
            self._scanner = None
        return out


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class HermesParser:
    """Content with ``<tool_call>...</tool_call>`` blocks (Qwen's and Hermes' format). Content is the
    text outside the blocks, less the whitespace next to a tag, and less trailing whitespace once a
    call was made."""

    def __init__(self) -> None:
        self.calls_made = 0
        self._pending = ""  # not shown yet: trailing whitespace and a possible start of a tag
        self._scanner: _ObjectScanner | None = None
        self._in_call = False  # after an open tag, until the call's object closed
        self._after_call = False  # after a call's object: skipping whitespace and the close tag

    def feed(self, text: str) -> ToolOutput:
        out = ToolOutput()
        text = self._pending + text
        self._pending = ""
        while text:
            if self._in_call:
                if self._scanner is None:
                    self._scanner = _ObjectScanner(self.calls_made)
                    self.calls_made += 1
                text = self._scanner.feed(text, out)
                if self._scanner.done:
                    self._scanner, self._in_call, self._after_call = None, False, True
                continue
            if self._after_call:
                stripped = text.lstrip()
                if stripped.startswith(_CLOSE):
                    text = stripped[len(_CLOSE) :]
                    continue
                if _CLOSE.startswith(stripped):  # nothing yet, or a close tag still arriving
                    self._pending = stripped
                    return out
                text, self._after_call = stripped, False
            at = text.find(_OPEN)
            if at >= 0:
                out.content += text[:at].rstrip()
                self._in_call = True
                text = text[at + len(_OPEN) :]
                continue
            keep = _partial_suffix(text, _OPEN)
            shown = text[: len(text) - keep]
            body = shown.rstrip()  # trailing whitespace waits: it is not content if a tag follows
            out.content += body
            self._pending = text[len(body) :]
            return out
        return out

    def finish(self) -> ToolOutput:
        out = ToolOutput()
        if self._in_call:
            out.errors += 1  # the text ended inside a call
        elif not self._after_call and (self._pending.strip() or self.calls_made == 0):
            out.content = self._pending
        self._pending, self._scanner, self._in_call = "", None, False
        return out


_PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser:
    """Llama 3's JSON tool calls: the whole text is calls when it starts with ``{`` (after whitespace
    and an optional ``<|python_tag|>``), separated by ``;``; otherwise it is content."""

    def __init__(self) -> None:
        self._mode: Literal["undecided", "content", "calls"] = "undecided"
        self._pending = ""
        self._calls = ForcedParser()

    def feed(self, text: str) -> ToolOutput:
        if self._mode == "undecided":
            text = self._pending + text
            head = text.lstrip()
            if head.startswith(_PYTHON_TAG):
                head = head[len(_PYTHON_TAG) :].lstrip()
            elif _PYTHON_TAG.startswith(head):  # whitespace, or a python tag still arriving
                self._pending = text
                return ToolOutput()
            if not head:
                self._pending = text
                return ToolOutput()
            self._pending = ""
            self._mode = "calls" if head[0] == "{" else "content"
            if self._mode == "calls":
                text = head
        if self._mode == "content":
            return ToolOutput(content=text)
        return self._calls.feed(text)

    def finish(self) -> ToolOutput:
        if self._mode == "undecided":
            content, self._pending = self._pending, ""
            return ToolOutput(content=content)
        return self._calls.finish()


def auto_parser(name: ToolCallParserName) -> ToolParser:
    return HermesParser() if name == "hermes" else Llama3JsonParser()
