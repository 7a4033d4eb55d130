"""Turning one step's logits into tokens: the logits processors, greedy, temperature, min-p, top-k,
top-p, per-request seeds.

Order of application (vLLM's), each stage over all the rows that use it at once, and skipped entirely
when no row of the batch does:

1. masks: ``allowed_token_ids`` (every other token to -inf), then ``bad_words`` (a word's last token
   to -inf when the output so far ends with the rest of the word; a one-token word always), and the
   banned ids (stop ids while fewer than ``min_tokens`` outputs exist);
2. ``logit_bias``, added to the logits;
3. penalties, from the request's token history: ``repetition_penalty`` over the prompt and output
   tokens (a positive logit divided by it, a negative one multiplied, as vLLM and transformers do),
   then ``frequency_penalty`` times each token's count in the output and ``presence_penalty`` times
   whether it is there (OpenAI's formula). Greedy rows take the argmax of these logits;
4. temperature;
5. ``min_p``: tokens less likely than ``min_p`` times the most likely one are dropped;
6. top-k, then top-p;
7. the draw.

Logprobs (rows whose request asks, ``SamplingRow.logprobs`` not None) are read after stage 4: the
``log_softmax`` of the processed logits divided by the temperature (greedy rows: not divided), before
min_p, top-k and top-p cut the distribution (``protocol/messages.py:TokenLogprobs``'s contract; vLLM
reads its default ``raw_logprobs`` before stage 1 and its ``processed_logprobs`` after the cuts, so
this point is neither). A row's sampled token gets its logprob, its
rank (1 + how many tokens are strictly more likely) and the ``logprobs`` most likely tokens
(``torch.topk``), computed for all the asking rows at once; a step where no row asks does none of it.

Every row is drawn by inverting its distribution's cumulative sum: with ``u`` uniform in
``[0, total)``, the first token whose cumulative probability exceeds ``u`` is token ``i`` with
probability ``p_i``, and never a token of probability 0 (the sum does not rise there). A row needs one
uniform draw, where the exponential race vLLM runs on GPUs (``argmax(p / q)``, ``q ~ Exp(1)``) needs one
per vocabulary entry: torch's CPU ``exponential_`` took 45 ms for 32 rows of 49,152 here, the cumulative
sum 2 ms. On the CPU in float32 with the native kernels (``worker/native_kernels.py``), the same rule
runs without the row-sized softmax and cumulative sum: ``native/inverse_cdf.c`` reads each row twice
(its maximum, then sums of chunks of weights) and scans one chunk, 0.6 against 2.4 ms for those 32
rows (softmax, cumulative sum and search; docs/benchmarks.md). A seeded row draws its uniform from
its own generator, re-seeded from ``(seed, output index)`` for every token, so a seeded request gives
the same tokens whatever else is in the batch and even after a preemption recomputes it (the output
index is a position, not a count of calls). Stages 1-6 are functions of the row's own logits and
history only, so the seed stays reproducible with them on.

State: the penalties read per-request token histories kept in one pool on the device
(``TokenCounts``: row ``slot`` of a request holds the distinct tokens it has seen and its output
tokens' counts), filled by ``record`` as the runner computes tokens; ``RequestProcessors`` holds the
rest of a request's processors, built once when the request arrives. Requests without processors have
neither.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trioserve.protocol.messages import SamplingParams, TokenLogprobs
from trioserve.worker.native_kernels import NativeKernels

GREEDY_BELOW = 1e-5  # temperatures under this are greedy (vLLM's epsilon)
ARGMAX_CHUNK = 1024  # row_argmax's block: its maxima are a vectorised reduction, the rest is small


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a 2-D tensor, exactly (the first maximal index of each row; NaN ranks
    highest, as there), faster on the CPU: torch's CPU argmax is a scalar loop (4.1 ms for 32 rows of
    49,152 here) while ``amax`` is vectorised. So: the maximum of each block of ``ARGMAX_CHUNK`` (a
    view, no copy), the first block holding the row's maximum (an argmax over 48 values), and the
    first maximal index inside that block (an argmax over 1,024): 0.48 ms. The first block with the
    maximum holds its first occurrence, so ties break as ``argmax``'s do. Elsewhere (CUDA, narrow
    rows) it is ``argmax`` itself."""
    n = x.shape[-1]
    if x.device.type != "cpu" or n < 4 * ARGMAX_CHUNK:
        return x.argmax(dim=-1)
    chunk = ARGMAX_CHUNK
    maxima = torch.amax(x.unfold(1, chunk, chunk), dim=-1)  # [rows, n // chunk]
    whole = maxima.shape[1] * chunk
    if whole < n:  # the tail, shorter than a block
        maxima = torch.cat([maxima, torch.amax(x[:, whole:], dim=-1, keepdim=True)], dim=1)
    start = maxima.argmax(dim=-1) * chunk
    # The block's indices; the tail's are clamped to the last column (a repeat, later than the
    # original: never the first occurrence).
    index = (start[:, None] + torch.arange(chunk, device=x.device)).clamp_(max=n - 1)
    return start + x.gather(1, index).argmax(dim=-1)


_MASK64 = (1 << 63) - 1
_NEG_INF = float("-inf")


class RequestProcessors:
    """One request's logits processors, built once (``Sampler.processors``), and the part of its token
    history the bad words read. ``num_seen``: how many of its tokens (positions 0, 1, ...) ``record``
    has taken in."""

    __slots__ = (
        "allowed",
        "bad_multi",
        "bad_single",
        "bias_ids",
        "bias_values",
        "frequency",
        "num_prompt_tokens",
        "num_seen",
        "out_cols",
        "outputs",
        "presence",
        "repetition",
        "seen",
        "slot",
    )

    def __init__(self, num_prompt_tokens: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.num_seen = 0
        self.allowed: torch.Tensor | None = None  # token ids (long, on the device)
        self.bias_ids: torch.Tensor | None = None
        self.bias_values: torch.Tensor | None = None
        self.bad_single: tuple[int, ...] = ()  # one-token bad words: always banned
        # Longer bad words by the last token of their prefix: (prefix, the token it bans).
        self.bad_multi: dict[int, list[tuple[tuple[int, ...], int]]] = {}
        self.outputs: list[int] | None = None  # output tokens so far, kept only for bad_multi
        self.presence = 0.0
        self.frequency = 0.0
        self.repetition = 1.0
        self.slot: int | None = None  # row in the sampler's TokenCounts (any penalty on)
        # Where TokenCounts keeps this request's tokens: the distinct tokens seen, prompt and output, in
        # the order their columns were given (repetition_penalty only); each distinct output token's
        # column (frequency or presence penalty only).
        self.seen: dict[int, None] | None = None
        self.out_cols: dict[int, int] | None = None

    @property
    def keeps_history(self) -> bool:
        return self.slot is not None or self.outputs is not None


@dataclass(frozen=True, slots=True)
class SamplingRow:
    temperature: float
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    output_index: int = 0  # which output token this sample becomes (0 = the first)
    banned: tuple[int, ...] = ()  # token ids that may not be sampled (stop ids before min_tokens)
    min_p: float = 0.0  # 0: off
    processors: RequestProcessors | None = None  # the request's own; None: it uses none
    logprobs: int | None = None  # the request's SamplingParams.logprobs: None, none are computed

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def seed_for(seed: int, output_index: int) -> int:
    """A 63-bit generator seed per (request seed, output position), well mixed (splitmix64's finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + output_index + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _MASK64


class TokenCounts:
    """The penalties' per-request state, pooled on the device, one row (``slot``) per request that
    uses a penalty, and sparse: ``seen[slot, :n]`` the distinct tokens it has seen, prompt and output
    (for repetition_penalty), ``out_ids[slot, :m]`` the distinct tokens of its output and
    ``out_counts[slot, :m]`` their counts (for the frequency and presence penalties). Which column
    holds which token is kept on the request (``RequestProcessors.seen`` and ``out_cols``), so taking
    in a step's tokens is one scatter per tensor for all requests, and a step's penalties touch only
    the tokens each row has seen, never the whole vocabulary (a dense ``[rows, vocab]`` pool of counts
    costs several times more per step on the CPU, and rebuilding counts from token lists every step
    more still: ``bench/sampler_cost.py``). Rows and columns grow by doubling; a released row is
    reused."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seen = torch.zeros(0, 0, dtype=torch.long, device=device)
        self.out_ids = torch.zeros(0, 0, dtype=torch.long, device=device)
        self.out_counts = torch.zeros(0, 0, device=device)
        self._free: list[int] = []

    @property
    def capacity(self) -> int:
        return self.seen.shape[0]

    def acquire(self) -> int:
        if not self._free:
            old = self.capacity
            self._grow(max(8, 2 * old), self.seen.shape[1], self.out_ids.shape[1])
            self._free = list(range(self.capacity - 1, old - 1, -1))
        slot = self._free.pop()
        self.out_counts[slot].zero_()  # counts accumulate; ids are only read up to each row's length
        return slot

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def fit(self, seen_width: int, out_width: int) -> None:
        """Room for ``seen_width`` seen tokens and ``out_width`` distinct output tokens in every row."""
        seen, out = self.seen.shape[1], self.out_ids.shape[1]
        if seen_width > seen or out_width > out:
            self._grow(self.capacity, _wider(seen, seen_width), _wider(out, out_width))

    def _grow(self, rows: int, seen_width: int, out_width: int) -> None:
        def bigger(old: torch.Tensor, width: int) -> torch.Tensor:
            new = torch.zeros(rows, width, dtype=old.dtype, device=self.device)
            new[: old.shape[0], : old.shape[1]] = old
            return new

        # Normal tensors even when grown under the runner's inference mode: they are updated in place
        # outside it too (a new request's row is cleared when it arrives).
        with torch.inference_mode(False):
            self.seen = bigger(self.seen, seen_width)
            self.out_ids = bigger(self.out_ids, out_width)
            self.out_counts = bigger(self.out_counts, out_width)

    def counts_of(self, p: RequestProcessors) -> dict[int, float]:
        """A request's output-token counts (for tests and debugging)."""
        assert p.slot is not None and p.out_cols is not None
        return {t: float(self.out_counts[p.slot, j]) for t, j in p.out_cols.items()}

    def seen_of(self, p: RequestProcessors) -> list[int]:
        """The distinct tokens a request has seen, as its row holds them (for tests and debugging)."""
        assert p.slot is not None and p.seen is not None
        ids: list[int] = self.seen[p.slot, : len(p.seen)].tolist()
        return ids


def _wider(have: int, need: int) -> int:
    return have if need <= have else max(need, 2 * have, 64)


class Sampler:
    def __init__(
        self, device: torch.device, vocab_size: int = 0, native: NativeKernels | None = None
    ) -> None:
        """``vocab_size``: the logits' width, which the processors' token ids are checked against (0:
        unknown, nothing is checked; the runner always gives it). ``native``: the CPU kernels, whose
        ``draw`` then inverts float32 rows (None: torch's softmax, cumulative sum and search)."""
        self.device = device
        self.vocab_size = vocab_size
        self.native = native
        self._generator = torch.Generator(device=device)  # re-seeded per seeded row
        self.token_counts = TokenCounts(device)

    # ---- per-request state ---------------------------------------------------------------------------

    def processors(self, params: SamplingParams, num_prompt_tokens: int) -> RequestProcessors | None:
        """The request's processors, or None when it uses none (its rows then cost nothing extra).
        Token ids outside the vocabulary (the API server refuses them; this is the worker's own guard)
        are dropped."""
        vocab = self.vocab_size or 2**31
        penalized = (
            params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
            or params.repetition_penalty != 1.0
        )
        if not (penalized or params.logit_bias or params.allowed_token_ids or params.bad_words_token_ids):
            return None
        p = RequestProcessors(num_prompt_tokens)
        dev = self.device
        if params.allowed_token_ids:
            allowed = sorted({t for t in params.allowed_token_ids if 0 <= t < vocab})
            if allowed:  # none left would leave nothing to sample: then no restriction
                p.allowed = torch.tensor(allowed, dtype=torch.long, device=dev)
        if params.logit_bias:
            bias = {t: b for t, b in params.logit_bias.items() if 0 <= t < vocab and b != 0}
            if bias:
                p.bias_ids = torch.tensor(list(bias), dtype=torch.long, device=dev)
                p.bias_values = torch.tensor(list(bias.values()), dtype=torch.float32, device=dev)
        if params.bad_words_token_ids:
            single: set[int] = set()
            for word in params.bad_words_token_ids:
                if not word or not all(0 <= t < vocab for t in word):
                    continue
                if len(word) == 1:
                    single.add(word[0])
                else:
                    prefix = tuple(word[:-1])
                    p.bad_multi.setdefault(prefix[-1], []).append((prefix, word[-1]))
            p.bad_single = tuple(sorted(single))
            if p.bad_multi:
                p.outputs = []
        if penalized:
            p.presence = params.presence_penalty
            p.frequency = params.frequency_penalty
            p.repetition = params.repetition_penalty
            p.slot = self.token_counts.acquire()
            if p.repetition != 1.0:
                p.seen = {}
            if p.presence != 0.0 or p.frequency != 0.0:
                p.out_cols = {}
        return p

    def release(self, processors: RequestProcessors) -> None:
        if processors.slot is not None:
            self.token_counts.release(processors.slot)
            processors.slot = None

    def record(self, entries: Iterable[tuple[RequestProcessors, Sequence[int]]]) -> None:
        """Take in tokens just computed: each entry's tokens are its request's next positions
        (``num_seen`` on), prompt tokens up to ``num_prompt_tokens``, outputs after. One scatter per
        pooled tensor for all the entries."""
        seen_at: tuple[list[int], list[int]] = ([], [])
        seen_ids: list[int] = []
        new_at: tuple[list[int], list[int]] = ([], [])
        new_ids: list[int] = []
        counted_at: tuple[list[int], list[int]] = ([], [])
        seen_width = out_width = 0
        for p, tokens in entries:
            split = min(max(p.num_prompt_tokens - p.num_seen, 0), len(tokens))
            p.num_seen += len(tokens)
            outputs = tokens[split:]
            if p.outputs is not None:
                p.outputs.extend(outputs)
            slot = p.slot
            if slot is None:
                continue
            seen = p.seen
            if seen is not None:  # prompt and output tokens alike
                for t in tokens:
                    if t not in seen:
                        seen_at[0].append(slot)
                        seen_at[1].append(len(seen))
                        seen_ids.append(t)
                        seen[t] = None
                seen_width = max(seen_width, len(seen))
            cols = p.out_cols
            if cols is not None:
                for t in outputs:
                    j = cols.get(t)
                    if j is None:
                        j = cols[t] = len(cols)
                        new_at[0].append(slot)
                        new_at[1].append(j)
                        new_ids.append(t)
                    counted_at[0].append(slot)
                    counted_at[1].append(j)
                out_width = max(out_width, len(cols))
        if not (seen_ids or counted_at[0]):
            return
        tc = self.token_counts
        tc.fit(seen_width, out_width)
        dev = self.device

        def at(index: tuple[list[int], list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.tensor(index[0], device=dev), torch.tensor(index[1], device=dev)

        if seen_ids:
            tc.seen[at(seen_at)] = torch.tensor(seen_ids, device=dev)
        if new_ids:
            tc.out_ids[at(new_at)] = torch.tensor(new_ids, device=dev)
        if counted_at[0]:
            ones = torch.ones(len(counted_at[0]), device=dev)
            tc.out_counts.index_put_(at(counted_at), ones, accumulate=True)

    # ---- one step ------------------------------------------------------------------------------------

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
        """``logits``: ``[len(rows), vocab]``. Returns one token id per row."""
        return self.sample_with_logprobs(logits, rows)[0]

    def sample_with_logprobs(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow]
    ) -> tuple[list[int], dict[int, TokenLogprobs]]:
        """``sample``, and the logprobs of each row that asks for them, by row index."""
        logits = self.process(logits, rows)
        tokens = self._draw(logits, rows)
        asking = [i for i, row in enumerate(rows) if row.logprobs is not None]
        if not asking:
            return tokens, {}
        return tokens, self._logprobs(logits, rows, asking, tokens)

    def _logprobs(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], asking: list[int], tokens: list[int]
    ) -> dict[int, TokenLogprobs]:
        """Stage 4 (temperature) on the asking rows' processed logits, then their logprobs."""
        dev = logits.device
        whole = len(asking) == logits.shape[0]
        sub = logits if whole else logits[torch.tensor(asking, device=dev)]
        temps = [1.0 if rows[i].greedy else rows[i].temperature for i in asking]
        if any(t != 1.0 for t in temps):
            sub = sub / torch.tensor(temps, device=dev).unsqueeze(1)
        ks = [rows[i].logprobs or 0 for i in asking]
        found = token_logprobs(sub, [tokens[i] for i in asking], ks)
        return dict(zip(asking, found, strict=True))

    def _draw(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
        """Stages 4-7 on processed logits: one token id per row."""
        if all(row.greedy for row in rows):
            return row_argmax(logits).tolist()
        scaled = self.warp(logits, rows)
        greedy = [i for i, row in enumerate(rows) if row.greedy]
        # One uniform draw per row: seeded rows' from their own generator, the others' from the
        # global one (greedy rows draw too, and take the argmax below).
        u = torch.rand(len(rows), device=scaled.device)
        for i, r in enumerate(rows):
            if r.seed is not None and not r.greedy:
                self._generator.manual_seed(seed_for(r.seed, r.output_index))
                u[i] = torch.rand(1, generator=self._generator, device=scaled.device)
        if self.native is not None and scaled.dtype == torch.float32 and scaled.device.type == "cpu":
            tokens = self.native.draw(scaled, u)  # the same rule, in two reads of each row
        else:
            cdf = torch.softmax(scaled, dim=-1).cumsum_(dim=-1)
            total = cdf[:, -1:]
            # u * total < total (a rounding up to it would pick past the last token of mass): the
            # first index whose sum exceeds it has p > 0.
            target = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
            tokens = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=cdf.shape[-1] - 1)
        if greedy:
            tokens[greedy] = row_argmax(logits[greedy])
        return tokens.tolist()

    def process(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Stages 1-3 (masks, logit_bias, penalties): the logits greedy rows take the argmax of.
        Float32; in place when they already are."""
        logits = logits.float()
        dev = logits.device
        width = logits.shape[-1]
        with_processors = [(i, r.processors) for i, r in enumerate(rows) if r.processors is not None]
        allowed = [(i, p.allowed) for i, p in with_processors if p.allowed is not None]
        if allowed:
            _keep_only(logits, allowed)
        ban_rows: list[int] = []
        ban_ids: list[int] = []
        for i, row in enumerate(rows):
            if row.banned:
                ban_rows += [i] * len(row.banned)
                ban_ids += row.banned
        for i, p in with_processors:
            if p.bad_single:
                ban_rows += [i] * len(p.bad_single)
                ban_ids += p.bad_single
            if p.outputs:
                for prefix, token in p.bad_multi.get(p.outputs[-1], ()):
                    n = len(prefix)
                    if len(p.outputs) >= n and tuple(p.outputs[-n:]) == prefix:
                        ban_rows.append(i)
                        ban_ids.append(token)
        if ban_ids and max(ban_ids) >= width:  # a stop id past the vocabulary can never be drawn anyway
            keep = [k for k, t in enumerate(ban_ids) if t < width]
            ban_rows = [ban_rows[k] for k in keep]
            ban_ids = [ban_ids[k] for k in keep]
        if ban_ids:
            logits[torch.tensor(ban_rows, device=dev), torch.tensor(ban_ids, device=dev)] = _NEG_INF
        biased = [(i, p) for i, p in with_processors if p.bias_ids is not None]
        if biased:
            ids = [p.bias_ids for _, p in biased]
            values = [p.bias_values for _, p in biased]
            index = (_row_index([i for i, _ in biased], ids, dev), torch.cat(ids))  # type: ignore[arg-type]
            logits.index_put_(index, torch.cat(values), accumulate=True)  # type: ignore[arg-type]
        penalized = [(i, p) for i, p in with_processors if p.slot is not None]
        if penalized:
            self._penalize(logits, penalized)
        return logits

    def _penalize(self, logits: torch.Tensor, penalized: list[tuple[int, RequestProcessors]]) -> None:
        """Only the tokens a row has seen are touched: its columns of the pooled tensors, up to its
        length, are gathered for all the rows at once, and just those logits change."""
        dev = logits.device
        tc = self.token_counts
        repeating = [(i, p) for i, p in penalized if p.seen is not None]
        if repeating:
            r, c, row = _columns(repeating, [len(p.seen or ()) for _, p in repeating], dev)
            token = tc.seen[torch.tensor([p.slot for _, p in repeating], device=dev)[r], c]
            factor = torch.tensor([p.repetition for _, p in repeating], device=dev)[r]
            x = logits[row, token]
            logits[row, token] = torch.where(x > 0, x / factor, x * factor)
        counted = [(i, p) for i, p in penalized if p.out_cols]
        if counted:
            r, c, row = _columns(counted, [len(p.out_cols or ()) for _, p in counted], dev)
            slot = torch.tensor([p.slot for _, p in counted], device=dev)[r]
            token = tc.out_ids[slot, c]
            frequency = torch.tensor([p.frequency for _, p in counted], device=dev)[r]
            presence = torch.tensor([p.presence for _, p in counted], device=dev)[r]
            logits[row, token] -= frequency * tc.out_counts[slot, c] + presence

    def warp(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Stages 4-6 (temperature, min-p, top-k and top-p) on processed logits: the logits of the
        distribution sampled from (greedy rows keep temperature 1 and are not cut)."""
        vocab = logits.shape[-1]
        min_p = [(i, r.min_p) for i, r in enumerate(rows) if r.min_p > 0.0 and not r.greedy]
        temps = [1.0 if r.greedy else r.temperature for r in rows]
        if any(t != 1.0 for t in temps):
            scaled = logits / torch.tensor(temps, device=logits.device).unsqueeze(1)
        else:  # x / 1 is x: no row-sized division; a copy only where min_p cuts in place
            scaled = logits.clone() if min_p else logits
        if min_p:
            _min_p(scaled, min_p)
        if any(0 < r.top_k < vocab or r.top_p < 1.0 for r in rows):
            scaled = _top_k_top_p(scaled, rows, vocab)
        return scaled


# Rows of logits ``token_logprobs`` takes at once: on the CPU a few, so that its temporaries (a
# ``[rows, vocab]`` float tensor, and a bool one) are reused from the allocator, not faulted in fresh
# for every prompt chunk (a 256-row chunk at vocabulary 49,152 takes about half as long in blocks of
# 32 as in one piece); on an accelerator more, to launch fewer kernels.
_ROWS_AT_ONCE = {"cpu": 32}
_ROWS_AT_ONCE_ELSE = 256


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], ks: Sequence[int]) -> list[TokenLogprobs]:
    """Row ``i`` of ``logits`` (the distribution's logits, any scale) gives ``token_ids[i]``'s logprob
    and rank (1 + the tokens strictly more likely: ties share the best rank) and the ``ks[i]`` most
    likely tokens, most likely first (at most the vocabulary). One ``log_softmax`` and one ``topk`` per
    block of rows (``_ROWS_AT_ONCE``). A token at least as likely as its row's k-th (or, with k = 0, its
    row's best) has every more likely token among those: its rank is counted there, and only the other
    rows compare the whole vocabulary (a greedy token never does)."""
    block = _ROWS_AT_ONCE.get(logits.device.type, _ROWS_AT_ONCE_ELSE)
    n = logits.shape[0]
    if n <= block:
        return _token_logprobs(logits, token_ids, ks)
    found: list[TokenLogprobs] = []
    for a in range(0, n, block):
        found += _token_logprobs(logits[a : a + block], token_ids[a : a + block], ks[a : a + block])
    return found


def _token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], ks: Sequence[int]) -> list[TokenLogprobs]:
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.long, device=lp.device).unsqueeze(1)
    own = lp.gather(1, ids)
    k_max = min(max(ks, default=0), lp.shape[-1])
    top_ids: list[list[int]] = [[] for _ in ks]
    top_lps: list[list[float]] = [[] for _ in ks]
    if k_max > 0:
        values, indices = torch.topk(lp, k_max, dim=-1)
        floor = values[:, -1:]
        ahead = (values > own).sum(dim=-1, dtype=torch.int32)
        all_values: list[list[float]] = values.tolist()
        all_indices: list[list[int]] = indices.tolist()
        for i, k in enumerate(ks):
            top_ids[i] = all_indices[i][:k]
            top_lps[i] = all_values[i][:k]
    else:
        floor = lp.amax(dim=-1, keepdim=True)
        ahead = torch.zeros(lp.shape[0], dtype=torch.int32, device=lp.device)
    outside = (own < floor).squeeze(1).nonzero().squeeze(1)
    # (Counted in int32: summing the comparison in int64 costs twice as much on the CPU.)
    if outside.numel() == lp.shape[0]:
        ahead = (lp > own).sum(dim=-1, dtype=torch.int32)
    elif outside.numel():
        ahead[outside] = (lp[outside] > own[outside]).sum(dim=-1, dtype=torch.int32)
    own_list: list[float] = own.squeeze(1).tolist()
    rank_list: list[int] = (ahead + 1).tolist()
    return [
        TokenLogprobs(t, v, r, a, b)
        for t, v, r, a, b in zip(token_ids, own_list, rank_list, top_ids, top_lps, strict=True)
    ]


def _columns(
    rows: list[tuple[int, RequestProcessors]], lengths: list[int], dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For rows holding ``lengths`` entries each: every entry's position in ``rows``, its column, and
    its row of the logits."""
    n = torch.tensor(lengths, device=dev)
    r = torch.repeat_interleave(torch.arange(len(rows), device=dev), n)
    starts = torch.cumsum(n, 0) - n
    c = torch.arange(int(n.sum()), device=dev) - starts[r]
    return r, c, torch.tensor([i for i, _ in rows], device=dev)[r]


def _row_index(rows: list[int], ids: list[torch.Tensor], dev: torch.device) -> torch.Tensor:
    """The row of every id in ``torch.cat(ids)``: each row index repeated for its tensor's length."""
    lengths = torch.tensor([len(t) for t in ids], device=dev)
    return torch.repeat_interleave(torch.tensor(rows, device=dev), lengths)


def _keep_only(logits: torch.Tensor, allowed: list[tuple[int, torch.Tensor]]) -> None:
    """``allowed_token_ids``: every other token of each such row to -inf."""
    dev = logits.device
    ids = [t for _, t in allowed]
    rows = [i for i, _ in allowed]
    index = (_row_index(rows, ids, dev), torch.cat(ids))
    kept = logits[index]
    logits[rows] = _NEG_INF
    logits[index] = kept


def _min_p(scaled: torch.Tensor, rows: list[tuple[int, float]]) -> None:
    """Drops (to -inf) the tokens whose probability is below ``min_p`` times the top one's: in logits,
    ``p_i < min_p * p_max`` is ``s_i - s_max < log(min_p)``, so no softmax is needed. The top token
    always stays.

    On the CPU in float32, row by row with ``threshold_`` (``x if x > t else -inf``) at ``t`` the float
    just below the row's threshold, which keeps exactly ``x >= threshold``: torch's CPU ``masked_fill``
    and ``where`` over a ``[32, 49152]`` batch took 2.5-2.9 ms here, ``threshold_`` 0.18 ms (vectorised);
    the whole cut went 3.8-4.2 -> 0.38 ms. Elsewhere one ``masked_fill`` (one kernel, no host sync)."""
    index = [i for i, _ in rows]
    floor = torch.tensor([math.log(m) for _, m in rows], device=scaled.device, dtype=scaled.dtype)
    if scaled.device.type == "cpu" and scaled.dtype == torch.float32:
        thresholds = scaled.amax(dim=-1)[index] + floor
        below = torch.nextafter(thresholds, torch.tensor(_NEG_INF)).tolist()
        for i, t in zip(index, below, strict=True):
            F.threshold(scaled[i], t, _NEG_INF, inplace=True)
        return
    whole = len(index) == scaled.shape[0]
    sub = scaled if whole else scaled[index]
    threshold = sub.amax(dim=-1, keepdim=True) + floor.unsqueeze(1)
    sub = sub.masked_fill(sub < threshold, _NEG_INF)
    if whole:
        scaled.copy_(sub)
    else:
        scaled[index] = sub


def _top_k_top_p(scaled: torch.Tensor, rows: Sequence[SamplingRow], vocab: int) -> torch.Tensor:
    """Masks (to -inf) everything outside each row's top-k, then outside its top-p nucleus. The most
    likely token always survives."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ks = torch.tensor([r.top_k if 0 < r.top_k < vocab else vocab for r in rows], device=scaled.device)
    kth = sorted_logits.gather(1, (ks - 1).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    top_p = torch.tensor([r.top_p for r in rows], device=scaled.device)
    if bool((top_p < 1.0).any()):
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability mass strictly ahead of each token
        sorted_logits = sorted_logits.masked_fill(before > top_p.unsqueeze(1), float("-inf"))
    return torch.empty_like(scaled).scatter_(1, order, sorted_logits)
