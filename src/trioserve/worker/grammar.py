"""Structured output in the worker: each constrained request's grammar matcher, its next-token
bitmask, and the bitmask applied to logits (docs/structured_output.md).

Where the work happens, and why here: the API server builds and checks the grammar
(``frontend/request/structured.py``) and it reaches the worker in the request's sampling parameters.
The worker (the output rank: where sampling happens) keeps one llguidance matcher per constrained
request, and per step:

1. before the forward, every matcher takes in the request's output tokens that became inputs this
   step (the rule the penalties' token history follows: an output becomes an input the step after it
   is sampled; a request resumed after a preemption, or whose outputs hit the prefix cache, takes in
   the earlier ones too, read back from the KV slots' token ids) — ``GrammarState.accepted`` counts
   them, so each output is taken in exactly once;
2. the sampling rows' bitmasks are then filled on a thread of their own (``GrammarBook.start``),
   while the forward runs: llguidance computes masks in Rust without the GIL, so the forward waits on
   the masks only when they take longer than the forward itself. The same thread turns them into the
   additive bias below;
3. after the forward the bias is added to those rows' logits (0 where allowed, -inf elsewhere),
   before the sampler's own processors, so greedy, sampling, penalties and logprobs all see only
   allowed tokens.

A matcher whose grammar is complete allows only the end-of-sequence token (llguidance's rule with the
request's EOS as the tokenizer's): the request ends with ``finish_reason: "stop"`` there. A matcher
that fails (a token it refuses: never expected, since every output was drawn under its mask) is
logged and from then on allows only the EOS token, so the request ends rather than leave the grammar.

Costs: the llguidance view of the vocabulary is built once per worker and EOS id, on the first
constrained request (0.34 s for the embedded model's 49,152 tokens here); a grammar's matcher is
built once and kept by its text (``MATCHER_CACHE_SIZE``), each request starting from a copy. Both are
built on the mask thread too, beside the forward of the request's first sampling step
(``GrammarBook.ready`` there), unless the request has outputs to take in before that forward (a
resumed one), which builds them on the step's own thread first.

A bitmask row holds one bit per vocabulary entry, little-endian within 32-bit words (bit ``t % 32`` of
word ``t // 32`` is token ``t``), 1 where the grammar allows the token: the layout xgrammar and
llguidance both fill. Tokens past the bitmask's width (a model vocabulary padded past the tokenizer's)
are never allowed.

The mask is applied by adding, not by ``masked_fill``: torch's CPU ``masked_fill_`` branches per
element and took 6 ms for 32 rows of 49,152 with a mixed mask here, where adding a float32 tensor
whose bits are 0 (+0.0) or 0xFF800000 (-inf), built from the unpacked bits with integer operations
only, took 0.6 ms (building it and adding it, for 32 rows). The result is exact: ``x + 0.0 == x``
and ``x + -inf == -inf`` for every finite ``x`` (logits are never +inf or NaN where the model is
sound).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

log = logging.getLogger("trioserve.worker")

MATCHER_CACHE_SIZE = 64

_NEG_INF_BITS = int(np.array([0xFF800000], dtype=np.uint32).view(np.int32)[0])


def bitmask_words(vocab_size: int) -> int:
    """32-bit words in one bitmask row of ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def bitmask_bias(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[rows, vocab_size]`` float32: 0.0 where ``bitmask`` (int32 ``[rows, words]``, on the CPU)
    allows the token, -inf elsewhere (and past the bitmask's width)."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    width = min(vocab_size, bits.shape[1])
    bias = bits[:, :width].astype(np.int32)
    bias -= 1  # 0 where allowed, -1 (all bits) where not
    bias &= _NEG_INF_BITS
    if width < vocab_size:  # past the bitmask: never allowed
        bias = np.concatenate(
            [bias, np.full((bias.shape[0], vocab_size - width), _NEG_INF_BITS, np.int32)], 1
        )
    return torch.from_numpy(bias.view(np.float32))


def add_bias(logits: torch.Tensor, bias: torch.Tensor, rows: Sequence[int]) -> None:
    """Add ``bias[i]`` (``bitmask_bias``'s) to ``logits[rows[i]]``, in place; ``logits`` is
    ``[batch, vocab]`` on any device, any float dtype."""
    if not rows:
        return
    bias = bias[: len(rows)].to(logits.device, logits.dtype)
    if len(rows) == logits.shape[0] and list(rows) == list(range(len(rows))):
        logits.add_(bias)
    else:
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        logits.index_add_(0, index, bias)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set ``logits[rows[i], t]`` to -inf wherever row ``i`` of ``bitmask`` does not allow token ``t``,
    in place."""
    if rows:
        add_bias(logits, bitmask_bias(bitmask[: len(rows)], logits.shape[1]), rows)


class GrammarState:
    """One constrained request's matcher (None until ``GrammarBook.ready`` builds it from
    ``grammar``), and how many of its output tokens it has taken in."""

    __slots__ = ("accepted", "eos", "failed", "grammar", "matcher")

    def __init__(self, matcher: Any, eos: int | None, grammar: str | None = None) -> None:
        self.matcher = matcher
        self.eos = eos
        self.grammar = grammar  # to build, while matcher is None
        self.accepted = 0
        self.failed = False

    def take(self, tokens: Sequence[int]) -> None:
        """Take in the next output tokens (in order); a refused one fails the state (logged)."""
        if self.failed or not tokens:
            return
        if not self.matcher.consume_tokens(list(tokens)):
            self.failed = True
            log.error(
                "a grammar refused an output token (%s); the request is ended at EOS",
                self.matcher.get_error() or "no reason given",
            )
        self.accepted += len(tokens)


class GrammarBook:
    """The worker's grammar machinery: the tokenizer's llguidance view (per EOS id), pristine matchers
    by grammar text, the mask thread and its bitmask buffer."""

    def __init__(self, tokenizer_path: str | None, vocab_size: int) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        self._hf: Any = None
        self._tokenizers: dict[int | None, Any] = {}
        self._pristine: OrderedDict[tuple[str, int | None], Any] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._executor: Any = None
        self._bitmask = torch.zeros((0, self.words), dtype=torch.int32)
        self._lock = threading.Lock()

    def _tokenizer(self, eos: int | None) -> Any:
        lltok = self._tokenizers.get(eos)
        if lltok is None:
            import llguidance.hf
            from transformers import AutoTokenizer

            if self.tokenizer_path is None:
                raise RuntimeError("structured output needs the model's tokenizer; the worker has none")
            if self._hf is None:
                self._hf = AutoTokenizer.from_pretrained(self.tokenizer_path)
            lltok = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size, eos_token=eos)
            self._tokenizers[eos] = lltok
        return lltok

    def state(self, grammar: str, eos: int | None) -> GrammarState:
        """A new request's state, its matcher not built yet (``ready`` builds it)."""
        return GrammarState(None, eos, grammar)

    def ready(self, state: GrammarState) -> None:
        """Give ``state`` its matcher: a copy of the grammar's pristine one (built on first use). A
        request is never the worker's failure: if the tokenizer view cannot be built, the state is
        failed (logged) and the request ends at EOS. Called on the step's thread or the mask thread,
        never both at once (a step joins its masks before the next step starts); the lock says so."""
        if state.grammar is None:
            return
        import llguidance

        with self._lock:
            grammar, state.grammar = state.grammar, None
            key = (grammar, state.eos)
            pristine = self._pristine.get(key)
            if pristine is None:
                try:
                    lltok = self._tokenizer(state.eos)
                except Exception:
                    log.exception("structured output: no tokenizer view for the grammar; the request ends")
                    state.failed = True
                    return
                pristine = llguidance.LLMatcher(lltok, grammar, log_level=0)
                if pristine.is_error():  # the API server checked it; a tokenizer-specific failure is left
                    log.error("a grammar failed to build in the worker: %s", pristine.get_error())
                self._pristine[key] = pristine
                while len(self._pristine) > MATCHER_CACHE_SIZE:
                    self._pristine.popitem(last=False)
            else:
                self._pristine.move_to_end(key)
            state.matcher = pristine.deep_copy()
            state.failed = pristine.is_error()

    def take(self, state: GrammarState, tokens: Sequence[int]) -> None:
        """``state`` takes in its next output tokens (its matcher built first, here, if need be)."""
        if tokens:
            self.ready(state)
            state.take(tokens)

    def start(self, states: Sequence[GrammarState]) -> Future[torch.Tensor]:
        """Fill row ``i`` of a bitmask with ``states[i]``'s allowed next tokens and turn it into the
        additive bias (``bitmask_bias``), on the mask thread; the future's result is the
        ``[len(states), vocab]`` bias, for ``add_bias``."""
        import llguidance

        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
            self._executor = llguidance.LLExecutor(num_threads=1)
        n = len(states)
        if self._bitmask.shape[0] < n:
            self._bitmask = torch.zeros((max(n, 2 * self._bitmask.shape[0]), self.words), dtype=torch.int32)
        bitmask = self._bitmask[:n]
        return self._pool.submit(self._fill, list(states), bitmask)

    def _fill(self, states: list[GrammarState], bitmask: torch.Tensor) -> torch.Tensor:
        for s in states:
            self.ready(s)  # a new request's matcher, built beside the forward
        live = [(s.matcher, i) for i, s in enumerate(states) if not s.failed]
        if live:
            self._executor.unsafe_compute_mask_ptr(live, bitmask.data_ptr(), self.words * 4, bitmask.shape[0])
        for i, s in enumerate(states):
            if s.failed:  # only the request's EOS (none known: every token): it ends here
                only_eos(bitmask[i], s.eos)
        return bitmask_bias(bitmask, self.vocab_size)


def only_eos(row: torch.Tensor, eos: int | None) -> None:
    """Make bitmask ``row`` allow only ``eos`` (every token where there is no EOS to end on)."""
    if eos is None:
        row.fill_(-1)
        return
    row.zero_()
    bit = 1 << (eos % 32)
    row[eos // 32] = bit - (1 << 32) if bit >= 1 << 31 else bit
