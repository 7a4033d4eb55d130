"""Tool calls in chat responses: the streamed chunks' ``delta.tool_calls`` and the full response's
``message.tool_calls``, from the choice's text through its parser (``tool_parsers.py``).

Only responses to requests with tools that produce calls (``tool_choice`` ``auto``, ``required`` or a
named function) use this: their encoder is a ``ToolChunkEncoder``, so the plain per-token path is the
one it always was. A call's first delta carries its ``id`` (``chatcmpl-tool-`` and 32 hex digits), type
and name; the rest carry argument pieces. ``finish_reason`` is ``"tool_calls"`` when the choice made a
call under ``auto`` or ``required`` (a named function finishes with ``"stop"``, as at OpenAI); a finish
by length stays ``"length"``. With ``single`` (``parallel_tool_calls: false``) calls after the first are
dropped.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from trioserve.frontend.output.chunks import ChunkEncoder, Kind, Usage
from trioserve.frontend.output.tool_parsers import ToolCallDelta, ToolOutput, ToolParser

_encode = msgspec.json.Encoder().encode


def new_call_id() -> str:
    return f"chatcmpl-tool-{secrets.token_hex(16)}"


@dataclass(frozen=True, slots=True)
class ToolFormat:
    mode: Literal["auto", "required", "named"]
    new_parser: Callable[[], ToolParser]
    single: bool = False

    def finish_reason(self, finish: str | None, made_call: bool) -> str | None:
        if finish == "stop" and made_call and self.mode != "named":
            return "tool_calls"
        return finish


class _ChoiceCalls:
    """One choice's parser and the ids of the calls it has started."""

    __slots__ = ("ids", "parser")

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.ids: list[str] = []

    def entries(self, deltas: list[ToolCallDelta], single: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for d in deltas:
            if single and d.index > 0:
                continue
            if d.name is not None:
                self.ids.append(new_call_id())
                entry: dict[str, Any] = {
                    "index": d.index,
                    "id": self.ids[d.index],
                    "type": "function",
                    "function": {"name": d.name, "arguments": d.arguments},
                }
            else:
                entry = {"index": d.index, "function": {"arguments": d.arguments}}
            if out and out[-1]["index"] == d.index and "id" not in entry:  # one entry per call per chunk
                out[-1]["function"]["arguments"] += d.arguments
            else:
                out.append(entry)
        return out


class ToolChunkEncoder(ChunkEncoder):
    """A chat stream's chunks with ``delta.tool_calls``: each choice's text goes through its parser."""

    __slots__ = ("_choices", "_format", "_model_name")

    def __init__(
        self,
        kind: Kind,
        response_id: str,
        created: int,
        model: str,
        return_token_ids: bool,
        continuous_usage_prompt_tokens: int | None,
        tool_format: ToolFormat,
        n: int,
    ) -> None:
        super().__init__(kind, response_id, created, model, return_token_ids, continuous_usage_prompt_tokens)
        self._format = tool_format
        self._model_name = model
        self._choices = [_ChoiceCalls(tool_format.new_parser()) for _ in range(n)]

    def delta(
        self,
        index: int,
        text: str,
        token_ids: list[int],
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,
        completion_tokens: int = 0,
        logprobs: bytes | None = None,
    ) -> bytes:
        choice = self._choices[index]
        out = choice.parser.feed(text)
        if finish_reason is not None:
            out.extend(choice.parser.finish())
        calls = choice.entries(out.calls, self._format.single)
        delta: dict[str, Any] = {}
        if out.content or not calls:
            delta["content"] = out.content
        if calls:
            delta["tool_calls"] = calls
        finish = self._format.finish_reason(finish_reason, bool(choice.ids))
        entry: dict[str, Any] = {
            "index": index,
            "delta": delta,
            "logprobs": None if logprobs is None else msgspec.Raw(logprobs),
            "finish_reason": finish,
        }
        if finish is not None:
            entry["stop_reason"] = stop_reason
        if self._return_ids:
            entry["token_ids"] = token_ids
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self._model_name,
            "choices": [entry],
        }
        if self._prompt_tokens is not None:
            p = self._prompt_tokens
            body["usage"] = Usage(p, completion_tokens, p + completion_tokens)
        return _encode(body)


def tool_message(text: str, tool_format: ToolFormat) -> tuple[dict[str, Any], bool]:
    """A full response's assistant message for ``text``, and whether it made a call."""
    parser = tool_format.new_parser()
    out = ToolOutput()
    out.extend(parser.feed(text))
    out.extend(parser.finish())
    calls = _ChoiceCalls(parser).entries(out.calls, tool_format.single)
    message: dict[str, Any] = {"role": "assistant", "content": out.content or None}
    if calls:
        message["tool_calls"] = [
            {"id": c["id"], "type": "function", "function": c["function"]} for c in calls
        ]
    return message, bool(calls)
