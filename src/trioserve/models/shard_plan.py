"""Tensor parallelism's plan: which slice of which weight each rank holds (design §2, §8), read from a
model's ``config.json`` alone (no torch), so the command line can refuse a size it cannot run before
anything starts, and every worker derives the same plan on its own.

Megatron-style sharding of each decoder layer, ``N`` ranks (``tensor_parallel_size``):

- attention is split by heads. ``q_proj``, ``k_proj`` and ``v_proj`` are column-parallel: rank ``t``
  keeps the output rows of its query heads and of its key/value heads; ``o_proj`` is row-parallel: it
  keeps the input columns of the same query heads, and the partial outputs are summed across ranks
  (an all-reduce) before its bias is added once.
- the MLP is split by intermediate columns: ``gate_proj`` and ``up_proj`` column-parallel (output
  rows), ``down_proj`` row-parallel (input columns), then an all-reduce.
- everything else (embedding, norms, rotary tables, the LM head) is replicated: every rank computes the
  same hidden states, and only the output rank (0) runs the LM head and samples.

Rules for heads (``H`` query heads, ``K`` key/value heads, each group of ``H / K`` query heads reads one
key/value head, as transformers' ``repeat_kv`` orders them):

1. a rank holds whole groups: the query heads of its key/value heads, never a query head without the
   key/value head it reads;
2. ``N <= K``: the key/value heads are split into ``N`` contiguous ranges as evenly as possible (the
   first ``K % N`` ranks hold one more), so ``K`` need not divide by ``N`` (SmolLM2's 3 key/value heads
   on 2 ranks: 2 and 1, with 6 and 3 query heads). An uneven split costs balance, not correctness;
3. ``N > K``: each key/value head is replicated on ``N / K`` ranks (``N`` must divide by ``K``), which
   share out its group's query heads (the group size must divide by ``N / K``), as vLLM does;
4. anything else is refused with ``ShardPlanError`` (a ``ValueError``) saying why.

The MLP's intermediate columns are split into ``N`` contiguous ranges as evenly as possible, at
least one column each.

KV cache: each rank allocates blocks for its own key/value heads only. The engine's KV ledger counts
blocks, the same block ids on every rank, so all ranks must have the same number of blocks:
``max_kv_heads`` (the largest rank's share) is what each rank sizes its pool by.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ShardPlanError(ValueError):
    """A tensor-parallel size this model cannot be split into."""


def split_range(total: int, parts: int, index: int) -> range:
    """The ``index``-th of ``parts`` contiguous ranges covering ``range(total)``, as even as possible
    (the first ``total % parts`` ranges are one longer)."""
    if not 0 <= index < parts:
        raise IndexError(f"part {index} of {parts}")
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (1 if index < extra else 0))


@dataclass(frozen=True, slots=True)
class RankShard:
    """What rank ``rank`` holds: head ranges (indices into the model's heads) and MLP columns."""

    rank: int
    q_heads: range
    kv_heads: range
    mlp_columns: range
    head_dim: int

    @property
    def q_rows(self) -> range:
        """Rows of ``q_proj`` (and columns of ``o_proj``) this rank keeps."""
        return range(self.q_heads.start * self.head_dim, self.q_heads.stop * self.head_dim)

    @property
    def kv_rows(self) -> range:
        """Rows of ``k_proj`` and ``v_proj`` this rank keeps."""
        return range(self.kv_heads.start * self.head_dim, self.kv_heads.stop * self.head_dim)


@dataclass(frozen=True, slots=True)
class ShardPlan:
    tp_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int

    @classmethod
    def from_mapping(cls, cfg: dict[str, Any], tp_size: int) -> ShardPlan:
        """The plan for a ``config.json`` mapping, checked (``ShardPlanError`` when refused)."""
        cfg = cfg.get("text_config", cfg)  # multimodal configs nest the language model's
        try:
            heads = int(cfg["num_attention_heads"])
            kv = int(cfg.get("num_key_value_heads") or heads)
            head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
            intermediate = int(cfg["intermediate_size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ShardPlanError(f"the model's config has no usable attention/MLP sizes: {exc!r}") from None
        plan = cls(tp_size, heads, kv, head_dim, intermediate)
        plan.check()
        return plan

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, tp_size: int) -> ShardPlan:
        path = Path(model_dir) / "config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ShardPlanError(f"{model_dir} is not a Hugging Face model folder: {exc}") from None
        return cls.from_mapping(config, tp_size)

    def check(self) -> None:
        n, h, k = self.tp_size, self.num_heads, self.num_kv_heads
        what = (
            f"tensor-parallel size {n} does not fit the model's {h} attention heads and {k} key/value heads"
        )
        if n < 1:
            raise ShardPlanError(f"tensor-parallel size must be at least 1, got {n}")
        if k < 1 or h % k:
            raise ShardPlanError(f"{what}: the heads do not divide into key/value groups")
        if n > k:
            if n % k:
                raise ShardPlanError(
                    f"{what}: with more ranks than key/value heads, the ranks must divide by them"
                )
            if (h // k) % (n // k):
                raise ShardPlanError(
                    f"{what}: each key/value head would be shared by {n // k} ranks, "
                    f"which cannot split its {h // k} query heads evenly"
                )
        if self.intermediate_size < n:
            raise ShardPlanError(
                f"tensor-parallel size {n} exceeds the MLP's {self.intermediate_size} columns"
            )

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.num_heads // self.num_kv_heads

    def shard(self, rank: int) -> RankShard:
        n, k, group = self.tp_size, self.num_kv_heads, self.group
        if not 0 <= rank < n:
            raise IndexError(f"rank {rank} of {n}")
        if n <= k:  # rule 2: whole groups, contiguous, as even as possible
            kv = split_range(k, n, rank)
            q = range(kv.start * group, kv.stop * group)
        else:  # rule 3: kv head replicated on n // k ranks, which share its group's query heads
            share = n // k
            head = rank // share
            per = group // share
            kv = range(head, head + 1)
            first = head * group + (rank % share) * per
            q = range(first, first + per)
        return RankShard(rank, q, kv, split_range(self.intermediate_size, n, rank), self.head_dim)

    @property
    def max_kv_heads(self) -> int:
        """The most key/value heads any rank holds: every rank sizes its KV pool by this, so that all
        have the same number of blocks."""
        return max(len(self.shard(r).kv_heads) for r in range(self.tp_size))
