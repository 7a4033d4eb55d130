"""Tensor parallelism's plan (``models/shard_plan.py``): which heads, rows and columns each rank holds,
and which sizes are refused; and ``worker/tensor_parallel.shard_model`` cutting a real transformers
model to exactly those slices (the all-reduce itself runs in tests/multiproc/test_tensor_parallel.py)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from trioserve.cli import check_tensor_parallel
from trioserve.config import EngineProcessConfig, ModelConfig, WorkerConfig, override
from trioserve.engine.worker_executor import WorkerExecutorConfig
from trioserve.models.shard_plan import ShardPlan, ShardPlanError, split_range
from trioserve.protocol.ring_layout import RingHandle
from trioserve.protocol.worker_messages import WorkerLaunch
from trioserve.worker.tensor_parallel import RowParallelLinear, shard_model


def plan(heads: int, kv: int, tp: int, intermediate: int = 128, head_dim: int = 16) -> ShardPlan:
    cfg = {
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "hidden_size": 64,
        "intermediate_size": intermediate,
    }
    return ShardPlan.from_mapping(cfg, tp)


def test_split_range_is_contiguous_even_and_covers_everything() -> None:
    assert [split_range(10, 3, i) for i in range(3)] == [range(0, 4), range(4, 7), range(7, 10)]
    assert [split_range(4, 2, i) for i in range(2)] == [range(0, 2), range(2, 4)]
    for total, parts in [(1, 1), (7, 7), (128, 3), (1536, 2), (5, 4)]:
        ranges = [split_range(total, parts, i) for i in range(parts)]
        assert [x for r in ranges for x in r] == list(range(total))
        assert max(map(len, ranges)) - min(map(len, ranges)) <= 1
    with pytest.raises(IndexError):
        split_range(4, 2, 2)


def test_even_split_keeps_whole_groups() -> None:
    p = plan(4, 2, 2)  # the tiny test models: 2 query heads per key/value head
    s0, s1 = p.shard(0), p.shard(1)
    assert (s0.q_heads, s0.kv_heads, s0.mlp_columns) == (range(0, 2), range(0, 1), range(0, 64))
    assert (s1.q_heads, s1.kv_heads, s1.mlp_columns) == (range(2, 4), range(1, 2), range(64, 128))
    assert (s1.q_rows, s1.kv_rows) == (range(32, 64), range(16, 32))  # head_dim 16
    assert p.max_kv_heads == 1


def test_uneven_split_smollm2_on_two_ranks() -> None:
    # SmolLM2-135M: 9 query heads, 3 key/value heads (groups of 3), 1536 MLP columns.
    p = plan(9, 3, 2, intermediate=1536, head_dim=64)
    s0, s1 = p.shard(0), p.shard(1)
    assert (s0.kv_heads, s0.q_heads) == (range(0, 2), range(0, 6))
    assert (s1.kv_heads, s1.q_heads) == (range(2, 3), range(6, 9))
    assert (s0.mlp_columns, s1.mlp_columns) == (range(0, 768), range(768, 1536))
    assert p.max_kv_heads == 2  # both ranks size their pools by rank 0's two heads


def test_more_ranks_than_kv_heads_replicates_them() -> None:
    p = plan(8, 2, 4)  # each kv head on 2 ranks, its 4 query heads 2 and 2
    shards = [p.shard(r) for r in range(4)]
    assert [s.kv_heads for s in shards] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert [s.q_heads for s in shards] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    # Every query head is held exactly once, next to the kv head it reads (h // group).
    for s in shards:
        assert all(h // p.group in s.kv_heads for h in s.q_heads)
    assert sorted(h for s in shards for h in s.q_heads) == list(range(8))


def test_tp_one_is_the_whole_model() -> None:
    s = plan(4, 2, 1).shard(0)
    assert (s.q_heads, s.kv_heads, s.mlp_columns) == (range(4), range(2), range(128))


@pytest.mark.parametrize(
    ("heads", "kv", "tp", "why"),
    [
        (4, 2, 3, "ranks must divide by them"),
        (6, 2, 4, "cannot split its 3 query heads"),
        (6, 4, 2, "do not divide into key/value groups"),
        (4, 4, 0, "at least 1"),
    ],
)
def test_refused_sizes_say_why(heads: int, kv: int, tp: int, why: str) -> None:
    with pytest.raises(ShardPlanError, match=why):
        plan(heads, kv, tp)


def test_refused_when_the_mlp_is_narrower_than_the_ranks() -> None:
    with pytest.raises(ShardPlanError, match="MLP"):
        plan(4, 4, 4, intermediate=3)


def test_a_config_without_sizes_is_refused_not_guessed() -> None:
    with pytest.raises(ShardPlanError, match="no usable"):
        ShardPlan.from_mapping({"hidden_size": 64}, 2)


# ---- slicing a real model ---------------------------------------------------------------------------


def tiny(family: str) -> Any:
    torch.manual_seed(0)
    common: dict[str, Any] = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attention_bias=family == "qwen3",  # a bias on q/k/v/o too, to see it sliced (and o's kept)
    )
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**common)).eval()
    return Qwen3ForCausalLM(Qwen3Config(**common)).eval()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_shard_model_keeps_exactly_each_ranks_slices(family: str) -> None:
    full = tiny(family)
    p = ShardPlan.from_mapping(full.config.to_dict(), 2)
    shards = []
    for rank in range(2):
        model = copy.deepcopy(full)
        held = shard_model(model, p, rank)
        assert held == p.shard(rank)
        shards.append(model)
    for i, layer in enumerate(full.model.layers):
        parts = [m.model.layers[i] for m in shards]
        for name in ("q_proj", "k_proj", "v_proj"):
            whole = getattr(layer.self_attn, name)
            pieces = [getattr(part.self_attn, name) for part in parts]
            assert torch.equal(torch.cat([x.weight for x in pieces]), whole.weight)  # column parallel
            if whole.bias is not None:
                assert torch.equal(torch.cat([x.bias for x in pieces]), whole.bias)
        for name in ("gate_proj", "up_proj"):
            pieces = [getattr(part.mlp, name) for part in parts]
            assert torch.equal(torch.cat([x.weight for x in pieces]), getattr(layer.mlp, name).weight)
        for module, name in (("self_attn", "o_proj"), ("mlp", "down_proj")):
            whole = getattr(getattr(layer, module), name)
            pieces = [getattr(getattr(part, module), name) for part in parts]
            assert all(isinstance(x, RowParallelLinear) for x in pieces)  # row parallel
            assert torch.equal(torch.cat([x.weight for x in pieces], dim=1), whole.weight)
            for x in pieces:  # the bias is added once, after the sum: each rank keeps it whole
                assert (x.bias is None) == (whole.bias is None)
                assert x.bias is None or torch.equal(x.bias, whole.bias)
        assert [part.self_attn.num_key_value_groups for part in parts] == [2, 2]
    # Replicated: embedding, norms and the LM head are untouched.
    for model in shards:
        assert torch.equal(model.lm_head.weight, full.lm_head.weight)
        assert torch.equal(model.model.embed_tokens.weight, full.model.embed_tokens.weight)


def test_shard_model_refuses_a_model_it_does_not_know() -> None:
    with pytest.raises(ValueError, match="layers"):
        shard_model(torch.nn.Linear(2, 2), plan(4, 2, 2), 0)


# ---- what each rank is started with ---------------------------------------------------------------


def test_each_rank_gets_its_title_rank_and_the_groups_store() -> None:
    config = override(
        EngineProcessConfig(),
        model="/models/tiny",
        tensor_parallel_size=2,
        engine_index=1,
        data_parallel_size=2,
    )
    executor = WorkerExecutorConfig.from_config(config)
    steps = RingHandle("trioserve_s", 4, 1 << 20, 2, "reader", 1, (5,), (6,))
    launch = WorkerLaunch.from_json(executor.launch(steps, None, 1, "file:///tmp/x/store").to_json())
    assert (launch.title, launch.rank, launch.tensor_parallel_size) == ("Worker_DP1_TP1", 1, 2)
    assert (launch.results_ring, launch.dist_init_method) == (None, "file:///tmp/x/store")
    assert [executor.title(r) for r in range(2)] == ["Worker_DP1_TP0", "Worker_DP1_TP1"]
    one = WorkerExecutorConfig.from_config(override(EngineProcessConfig(), model="/models/tiny"))
    assert (one.tensor_parallel_size, one.title()) == (1, "Worker")


def test_the_command_line_refuses_a_size_before_anything_starts(tmp_path: Path) -> None:
    sizes = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64, "intermediate_size": 8}
    (tmp_path / "config.json").write_text(json.dumps(sizes))
    model = ModelConfig(model=str(tmp_path))
    check_tensor_parallel("model", model, WorkerConfig(tensor_parallel_size=2))  # fits
    with pytest.raises(ShardPlanError, match="tensor-parallel size 3"):
        check_tensor_parallel("model", model, WorkerConfig(tensor_parallel_size=3))
    with pytest.raises(ValueError, match="not for --engine mock"):  # no workers: -tp would do nothing
        check_tensor_parallel("mock", model, WorkerConfig(tensor_parallel_size=2))
