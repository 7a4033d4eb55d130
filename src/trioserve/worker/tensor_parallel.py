"""Tensor parallelism inside a worker: the process group, and a loaded transformers model cut down to
this rank's shard (``models/shard_plan.py`` says which slice of which weight; read it first).

The model's own modules run unchanged. Column-parallel layers (``q_proj``, ``k_proj``, ``v_proj``,
``gate_proj``, ``up_proj``) are ``nn.Linear`` with fewer output rows: the attention code reshapes
with ``view(..., -1, head_dim)``, so it simply sees fewer heads, and the paged attention function
reads the head counts from the tensors it is given. Row-parallel layers (``o_proj``, ``down_proj``)
become ``RowParallelLinear``: this rank's input columns, a sum across ranks (``all_reduce``), then
the bias once. Everything else stays replicated, so after each all-reduce every rank holds the same
hidden states the unsharded model would (up to the order of the floating-point sum: a row-parallel
matmul adds two half-length dot products where one process adds one long one).

The process group: ``torch.distributed`` with gloo on the CPU and NCCL on CUDA, rank = the tensor-
parallel rank, world = the tensor-parallel size, rendezvous through the store the engine core names in
the launch (``WorkerLaunch.dist_init_method``). Gloo talks over loopback (all ranks are on one host).
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trioserve.models.shard_plan import RankShard, ShardPlan


def init_group(init_method: str, rank: int, world: int, device: torch.device, timeout: float) -> None:
    """Join the tensor-parallel process group (gloo on the CPU, NCCL on CUDA), then wait for every
    rank (a barrier), so that a rank that never comes fails start-up here, within ``timeout``."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "gloo":
        # Every rank is on this host: loopback, whatever the host name resolves to.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout),
        device_id=device if backend == "nccl" else None,
    )
    probe = torch.ones(1, device=device)
    dist.all_reduce(probe)  # the barrier (gloo's and NCCL's own barrier differ; this works on both)
    if int(probe.item()) != world:
        raise RuntimeError(f"tensor-parallel group of {world} answered {probe.item()}")


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_min(value: int, device: torch.device) -> int:
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


class RowParallelLinear(nn.Module):
    """``y = sum over ranks (x_t @ W_t^T) + b``: this rank's input columns of a linear layer, the
    partial outputs summed by an all-reduce, the bias added once after it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        dist.all_reduce(out)
        return out if self.bias is None else out + self.bias


def _rows(linear: nn.Linear, rows: range) -> None:
    """Keep only output rows ``rows`` of ``linear`` (column parallel)."""
    weight = linear.weight.detach()[rows.start : rows.stop].clone()
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach()[rows.start : rows.stop].clone(), requires_grad=False)
    linear.out_features = len(rows)


def _columns(linear: nn.Linear, columns: range) -> RowParallelLinear:
    """``linear`` keeping only input columns ``columns``, summed across ranks (row parallel)."""
    weight = linear.weight.detach()[:, columns.start : columns.stop].clone()
    bias = linear.bias.detach().clone() if linear.bias is not None else None
    return RowParallelLinear(weight, bias)


def _linear(module: Any, name: str, where: str) -> nn.Linear:
    layer = getattr(module, name, None)
    if not isinstance(layer, nn.Linear):
        raise ValueError(f"tensor parallelism needs {where}.{name} to be a Linear layer; found {layer!r}")
    return layer


def decoder_layers(model: Any) -> list[Any]:
    """The decoder layers of a transformers causal LM (``model.model.layers``: Llama, Qwen, Mistral)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"tensor parallelism does not know where {type(model).__name__} keeps its layers")
    return list(layers)


def shard_model(model: Any, plan: ShardPlan, rank: int) -> RankShard:
    """Cut ``model`` down to rank ``rank``'s shard, in place (the module docstring says how); returns
    the shard. Refuses (``ValueError``) a model whose layers are not the Llama/Qwen shape."""
    shard = plan.shard(rank)
    for i, layer in enumerate(decoder_layers(model)):
        attn, mlp = layer.self_attn, layer.mlp
        where = f"layer {i}"
        for name, rows in (("q_proj", shard.q_rows), ("k_proj", shard.kv_rows), ("v_proj", shard.kv_rows)):
            _rows(_linear(attn, name, f"{where}.self_attn"), rows)
        attn.o_proj = _columns(_linear(attn, "o_proj", f"{where}.self_attn"), shard.q_rows)
        # What the stock attention functions would read; the paged one reads the tensors' shapes.
        attn.num_key_value_groups = len(shard.q_heads) // len(shard.kv_heads)
        for name in ("gate_proj", "up_proj"):
            _rows(_linear(mlp, name, f"{where}.mlp"), shard.mlp_columns)
        mlp.down_proj = _columns(_linear(mlp, "down_proj", f"{where}.mlp"), shard.mlp_columns)
    return shard
