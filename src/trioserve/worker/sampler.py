"""Turning one step's logits into tokens: greedy, temperature, top-k, top-p, per-request seeds.

Every row is sampled with the exponential race: ``argmax(p / q)`` with ``q ~ Exp(1)`` picks token ``i``
with probability ``p_i``, so a row needs exactly one draw of noise per vocabulary entry, and a seeded row
draws it from its own generator. That generator is re-seeded from ``(seed, output index)`` for every
token, so a seeded request gives the same tokens whatever else is in the batch and even after a
preemption recomputes it (the output index is a position, not a count of calls).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

GREEDY_BELOW = 1e-5  # temperatures under this are greedy (vLLM's epsilon)
_MASK64 = (1 << 63) - 1


@dataclass(frozen=True, slots=True)
class SamplingRow:
    temperature: float
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    output_index: int = 0  # which output token this sample becomes (0 = the first)
    banned: tuple[int, ...] = ()  # token ids that may not be sampled (stop ids before min_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def seed_for(seed: int, output_index: int) -> int:
    """A 63-bit generator seed per (request seed, output position), well mixed (splitmix64's finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + output_index + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _MASK64


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._generator = torch.Generator(device=device)  # re-seeded per seeded row

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
        """``logits``: ``[len(rows), vocab]``. Returns one token id per row."""
        logits = logits.float()
        for i, row in enumerate(rows):
            if row.banned:
                logits[i, list(row.banned)] = float("-inf")
        if all(row.greedy for row in rows):
            return logits.argmax(dim=-1).tolist()
        vocab = logits.shape[-1]
        temps = torch.tensor([1.0 if r.greedy else r.temperature for r in rows], device=logits.device)
        scaled = logits / temps.unsqueeze(1)
        if any(0 < r.top_k < vocab or r.top_p < 1.0 for r in rows):
            scaled = _top_k_top_p(scaled, rows, vocab)
        probs = torch.softmax(scaled, dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for i, row in enumerate(rows):
            if row.seed is not None and not row.greedy:
                self._generator.manual_seed(seed_for(row.seed, row.output_index))
                noise[i].exponential_(generator=self._generator)
        tokens = (probs / noise).argmax(dim=-1)
        greedy = [i for i, row in enumerate(rows) if row.greedy]
        if greedy:
            tokens[greedy] = logits[greedy].argmax(dim=-1)
        return tokens.tolist()


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
