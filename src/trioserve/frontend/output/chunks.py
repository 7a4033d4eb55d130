"""JSON bodies of streamed chunks and full responses.

Streamed chunks are on the per-token hot path, so each response precomputes the bytes that never change
(id, object, created, model) and a chunk is a ``bytes.join`` of those with the JSON-encoded delta:
about a microsecond, against several for building and dumping an object per chunk.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

Kind = Literal["chat", "completion"]

_json = msgspec.json.Encoder()
_encode = _json.encode
_FINISH = {None: b"null", "stop": b'"stop"', "length": b'"length"', "abort": b'"abort"', "error": b'"error"'}


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChunkEncoder:
    __slots__ = (
        "_after_text",
        "_head",
        "_logprobs_key",
        "_prompt_tokens",
        "_return_ids",
        "_text_key",
        "created",
        "id",
        "kind",
    )

    def __init__(
        self,
        kind: Kind,
        response_id: str,
        created: int,
        model: str,
        return_token_ids: bool,
        continuous_usage_prompt_tokens: int | None = None,
    ):
        """``continuous_usage_prompt_tokens``: the prompt's length, when every chunk carries usage
        (``stream_options.continuous_usage_stats``); None otherwise."""
        self.kind = kind
        self._prompt_tokens = continuous_usage_prompt_tokens
        self.id = response_id
        self.created = created
        self._return_ids = return_token_ids
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        self._head = b'{"id":%b,"object":"%b","created":%d,"model":%b,"choices":[' % (
            _encode(response_id),
            obj.encode(),
            created,
            _encode(model),
        )
        # chat:  {"index":i,"delta":{"content":"..."},"logprobs":null,"finish_reason":...}
        # text:  {"index":i,"text":"...","logprobs":null,"finish_reason":...}
        self._text_key = b',"delta":{"content":' if kind == "chat" else b',"text":'
        self._after_text = (
            b'},"logprobs":null,"finish_reason":' if kind == "chat" else b',"logprobs":null,"finish_reason":'
        )
        self._logprobs_key = b'},"logprobs":' if kind == "chat" else b',"logprobs":'

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
        """One chunk; ``completion_tokens`` (the response's so far) only matters with continuous usage;
        ``logprobs``: the JSON of this chunk's tokens' logprobs (``logprobs.py``), None for null."""
        parts = [
            self._head,
            b'{"index":%d' % index,
            self._text_key,
            _encode(text),
            self._after_text
            if logprobs is None
            else b'%b%b,"finish_reason":' % (self._logprobs_key, logprobs),
            _FINISH[finish_reason],
        ]
        if finish_reason is not None:
            parts += (b',"stop_reason":', _encode(stop_reason))
        if self._return_ids:
            parts += (b',"token_ids":', _encode(token_ids))
        parts.append(b"}]}" if self._prompt_tokens is None else b"}" + self._usage_tail(completion_tokens))
        return b"".join(parts)

    def role(self, index: int) -> bytes:
        """The first chunk of a chat choice: the assistant role and empty content (OpenAI's shape)."""
        return (
            self._head
            + b'{"index":%d,"delta":{"role":"assistant","content":""},"logprobs":null,' % (index)
            + (
                b'"finish_reason":null}]}'
                if self._prompt_tokens is None
                else b'"finish_reason":null}' + self._usage_tail(0)
            )
        )

    def _usage_tail(self, completion_tokens: int) -> bytes:
        assert self._prompt_tokens is not None
        usage = Usage(self._prompt_tokens, completion_tokens, self._prompt_tokens + completion_tokens)
        return b'],"usage":' + _encode(usage) + b"}"

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        usage = Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)
        return self._head + b'],"usage":' + _encode(usage) + b"}"


class Choice(msgspec.Struct, omit_defaults=True):
    """One choice of a non-streamed response; ``message`` for chat, ``text`` for completions."""

    index: int
    finish_reason: str | None
    stop_reason: int | str | None = None
    message: dict[str, Any] | None = None
    text: str | None = None
    logprobs: msgspec.Raw | None = None  # the JSON ``logprobs.py`` renders; omitted when not asked
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None  # completions (vLLM's place); chat: the response's
    prompt_logprobs: msgspec.Raw | None = None  # the same places as prompt_token_ids


class FullResponse(msgspec.Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: msgspec.Raw | None = None


def full_body(
    kind: Kind,
    response_id: str,
    created: int,
    model: str,
    choices: list[Choice],
    prompt_tokens: int,
    completion: int,
    prompt_token_ids: list[int] | None,
    prompt_logprobs: bytes | None = None,
) -> bytes:
    return _encode(
        FullResponse(
            id=response_id,
            object="chat.completion" if kind == "chat" else "text_completion",
            created=created,
            model=model,
            choices=choices,
            usage=Usage(prompt_tokens, completion, prompt_tokens + completion),
            prompt_token_ids=prompt_token_ids,
            prompt_logprobs=None if prompt_logprobs is None else msgspec.Raw(prompt_logprobs),
        )
    )
