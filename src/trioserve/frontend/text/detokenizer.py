"""Incremental detokenization on the per-token hot path.

A thin shell over ``tokenizers.decoders.DecodeStream``: the Rust side keeps a short window of ids,
decodes it, and hands back only the text that is new and complete. Python adds two guards and
nothing else, because this runs once per generated token per request.

Invariant (tested): for any ids whose full decode does not end in an incomplete character,
``"".join(d.step(i) for i in ids) == backend.decode(ids, skip_special_tokens=...)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.decoders import DecodeStream

__all__ = ["PROMPT_CONTEXT_TOKENS", "Detokenizer", "IncrementalDetokenizer"]


class Detokenizer(Protocol):
    """What the output handler needs: new text per token id ("" while a character is split)."""

    def step(self, token_id: int) -> str: ...

    def step_many(self, ids: Sequence[int]) -> str: ...


# How many trailing prompt ids seed the stream. A few are enough for decoders whose output for a
# token depends on what precedes it (SentencePiece's leading "▁" is dropped at the start of a
# text but is a real space mid-text); more would only make the first step decode more ids.
PROMPT_CONTEXT_TOKENS = 4

# DecodeStream raises a plain Exception with this text when the decode of its window stops
# starting with the text it already emitted (non-monotonic decodes of invalid UTF-8 do this).
_INVALID_PREFIX = "Invalid prefix"


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into a stream of text deltas.

    ``step`` returns "" while a multi-byte UTF-8 character is split across tokens and returns the
    whole character once its last byte arrives, so U+FFFD never appears mid-stream for text that
    decodes cleanly. Ids outside the vocabulary (negative, past the added tokens, or beyond the
    32-bit range) produce "" and leave the stream unchanged; models whose embedding table is
    padded past the tokenizer (Qwen3: 151936 rows, 151669 tokens) can sample such ids.
    Bytes still held when generation ends are dropped, as a full decode would render them U+FFFD.
    """

    __slots__ = ("_backend", "_skip_special_tokens", "_stream")

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] = (),
    ) -> None:
        self._backend = backend
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(
            ids=_prompt_context(backend, prompt_ids, skip_special_tokens),
            skip_special_tokens=skip_special_tokens,
        )

    def step(self, token_id: int) -> str:
        """Feed one generated id; return the text it completes ("" if none yet)."""
        try:
            text = self._stream.step(self._backend, token_id)
        except (TypeError, OverflowError):
            # The binding converts ids to u32; anything outside that range is out of vocabulary.
            return ""
        except Exception as exc:
            if _INVALID_PREFIX not in str(exc):
                raise
            text = self._restart(token_id)
        return text or ""

    def step_many(self, ids: Sequence[int]) -> str:
        """Feed several ids; return the concatenation of what ``step`` would return for each.

        Deliberately a loop over ``step`` rather than one ``DecodeStream.step(list)`` call: the list
        form returns nothing for the whole batch when its last id ends mid-character, so text
        completed earlier in the batch would be lost if generation ended there.
        """
        step = self.step
        return "".join([step(token_id) for token_id in ids])

    def _restart(self, token_id: int) -> str | None:
        # Rare recovery path: the window's decode is no longer an extension of the emitted text.
        # Start a fresh stream at this id; at worst a character straddling the restart is lost
        # (it would have decoded to U+FFFD anyway, which is what breaks monotonicity).
        self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
        try:
            return self._stream.step(self._backend, token_id)
        except (TypeError, OverflowError):
            return None


def _prompt_context(backend: BackendTokenizer, prompt_ids: Sequence[int], skip: bool) -> list[int]:
    # Seed with the prompt's last ids only if they decode to complete text: DecodeStream treats an
    # incomplete seed as "nothing emitted yet" and would then re-emit the prompt's own text.
    if not prompt_ids:
        return []
    context = [i for i in prompt_ids[-PROMPT_CONTEXT_TOKENS:] if 0 <= i < 2**32]
    if not context:
        return []
    text = backend.decode(context, skip_special_tokens=skip)
    if not text or text.endswith("\ufffd"):
        return []
    return context
