"""Logprobs in OpenAI's shapes, from the engine's ``TokenLogprobs`` (``protocol/messages.py``).

- Chat (``choices[].logprobs``): ``{"content": [{"token", "logprob", "bytes", "top_logprobs":
  [{"token", "logprob", "bytes"}]}]}``, one content entry per output token, ``top_logprobs`` the k
  most likely tokens (k = the request's ``top_logprobs``; [] for 0).
- Completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``,
  parallel lists, one entry per token; ``text_offset`` is where each token's text starts in the
  choice's text, counted in characters of the token strings before it (vLLM's count).

Per-token text and bytes (the rule ``docs/openai_api.md`` states): ``bytes`` is the token's own bytes
(``Tokenizer.token_bytes``), byte-exact even for a byte-level BPE token that holds part of a UTF-8
character; ``token`` is those bytes decoded alone with U+FFFD for an incomplete or invalid sequence,
which is what vLLM returns (OpenAI's ``bytes`` are the way to rebuild such characters). Special tokens
show their literal text. A logprob of -inf is sent as -9999.0 (JSON has no infinity; vLLM's value).

A response renders the logprobs of each chunk's own tokens as the chunk is encoded (merged deltas
merge their logprobs: the entries simply accumulate until then), so nothing is built for a request
that does not ask for logprobs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import msgspec

from trioserve.protocol.messages import TokenLogprobs

_encode = msgspec.json.Encoder().encode
_FLOOR = -9999.0


class PromptLogprob(msgspec.Struct):
    """vLLM's shape of one prompt-logprobs entry (keyed by token id)."""

    logprob: float
    rank: int
    decoded_token: str


NO_LOGPROB = 0  # the rank of an entry that stands for a token without logprobs (echo's first token)


def echo_logprobs(
    prompt: Sequence[int], engine: Sequence[TokenLogprobs | None] | None, k: int
) -> list[TokenLogprobs]:
    """The prompt's entries for completions' ``echo``: the engine's prompt logprobs with at most
    ``k`` alternatives (the engine sends more when ``prompt_logprobs`` asks for more), the first token
    (nothing precedes it) as an entry of rank ``NO_LOGPROB``, which renders with null logprobs as in
    OpenAI's and vLLM's echo. An engine that sent none gives every prompt token null logprobs."""
    entries = list(engine) if engine is not None and len(engine) == len(prompt) else [None] * len(prompt)
    out = []
    for e, t in zip(entries, prompt, strict=True):
        if e is None:
            out.append(TokenLogprobs(t, 0.0, NO_LOGPROB))
        elif len(e.top_ids) > k:
            out.append(TokenLogprobs(e.token_id, e.logprob, e.rank, e.top_ids[:k], e.top_logprobs[:k]))
        else:
            out.append(e)
    return out


def _value(logprob: float) -> float:
    return logprob if logprob > _FLOOR else _FLOOR  # also catches -inf and NaN


def _number(logprob: float) -> bytes:
    """A logprob as JSON (Python's shortest round-trip repr, as msgspec writes floats)."""
    return b"%r" % logprob if logprob > _FLOOR else b"-9999.0"


class TokenStrings:
    """Each token's string and pre-encoded JSON pieces, shared by every response of an API server:
    the logprobs path is per token, and the same ids recur across requests (top alternatives most of
    all). At most ``MAX_ENTRIES`` are kept; past that the cache starts over (bounded memory)."""

    MAX_ENTRIES = 65536
    __slots__ = ("_bytes", "_cache")

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self._bytes = token_bytes
        # id -> (string, b'{"token":"..","logprob":', b',"bytes":[..]', the string as JSON)
        self._cache: dict[int, tuple[str, bytes, bytes, bytes]] = {}

    def get(self, token_id: int) -> tuple[str, bytes, bytes, bytes]:
        known = self._cache.get(token_id)
        if known is None:
            raw = self._bytes(token_id)
            text = raw.decode("utf-8", errors="replace")
            key = _encode(text)
            head = b'{"token":%b,"logprob":' % key
            known = (text, head, b',"bytes":' + _encode(list(raw)), key)
            if len(self._cache) >= self.MAX_ENTRIES:
                self._cache.clear()
            self._cache[token_id] = known
        return known


class LogprobsFormat:
    """Renders one response's logprobs; ``strings``: the API server's ``TokenStrings`` (or the
    tokenizer's ``token_bytes``, for a cache of this response's own)."""

    __slots__ = ("_get", "kind")

    def __init__(
        self, kind: Literal["chat", "completion"], strings: TokenStrings | Callable[[int], bytes]
    ) -> None:
        self.kind = kind
        self._get = (strings if isinstance(strings, TokenStrings) else TokenStrings(strings)).get

    def text(self, token_id: int) -> str:
        """A token's string, as the module docstring says."""
        return self._get(token_id)[0]

    def chat(self, entries: Sequence[TokenLogprobs]) -> bytes:
        """``{"content": [...]}`` for ``entries``, from the pre-encoded pieces (no objects built)."""
        get = self._get
        parts = [b'{"content":[']
        for i, e in enumerate(entries):
            _, head, tail, _ = get(e.token_id)
            parts += (b"," if i else b"", head, _number(e.logprob), tail, b',"top_logprobs":[')
            for j, (t, lp) in enumerate(zip(e.top_ids, e.top_logprobs, strict=False)):
                _, top_head, top_tail, _ = get(t)
                parts += (b"," if j else b"", top_head, _number(lp), top_tail, b"}")
            parts.append(b"]}")
        parts.append(b"]}")
        return b"".join(parts)

    def completion(self, entries: Sequence[TokenLogprobs], offset: int) -> tuple[bytes, int]:
        """The completions object for ``entries`` whose text starts at character ``offset``; returns
        it and the offset after them. An entry of rank 0 (``echo_logprobs``) has null logprobs."""
        get = self._get
        tokens, values, tops, offsets = [], [], [], []
        for e in entries:
            text, _, _, key = get(e.token_id)
            tokens.append(key)
            offsets.append(b"%d" % offset)
            offset += len(text)
            if e.rank == NO_LOGPROB:
                values.append(b"null")
                tops.append(b"null")
                continue
            values.append(_number(e.logprob))
            # A JSON object: alternatives whose strings are equal keep the last one's value.
            top = {get(t)[3]: lp for t, lp in zip(e.top_ids, e.top_logprobs, strict=False)}
            tops.append(b"{%b}" % b",".join([k + b":" + _number(v) for k, v in top.items()]))
        body = b'{"tokens":[%b],"token_logprobs":[%b],"top_logprobs":[%b],"text_offset":[%b]}' % (
            b",".join(tokens),
            b",".join(values),
            b",".join(tops),
            b",".join(offsets),
        )
        return body, offset

    def prompt(self, entries: Sequence[TokenLogprobs | None], k: int) -> bytes:
        """vLLM's ``prompt_logprobs``: per prompt token null (the first) or ``{token id: {logprob,
        rank, decoded_token}}`` for the token itself and its ``k`` most likely alternatives."""
        text = self.text
        out: list[dict[str, PromptLogprob] | None] = []
        for e in entries:
            if e is None:
                out.append(None)
                continue
            position = {str(e.token_id): PromptLogprob(_value(e.logprob), e.rank, text(e.token_id))}
            for rank, (t, lp) in enumerate(zip(e.top_ids[:k], e.top_logprobs[:k], strict=False), 1):
                position.setdefault(str(t), PromptLogprob(_value(lp), rank, text(t)))
            out.append(position)
        return _encode(out)
