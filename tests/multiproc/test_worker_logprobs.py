"""Logprobs from a real worker process: the engine core's scheduler drives ``open_worker_executor`` on
a tiny random Llama, and what comes back over the result ring (``StepResult``) becomes the outputs'
logprobs and prompt logprobs, equal to ``log_softmax`` of transformers' logits for the same sequence,
with chunked prefill and a request that asks for none beside them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from transformers import LlamaConfig, LlamaForCausalLM

from trioserve.config import WorkerConfig
from trioserve.engine.scheduler import SchedulerConfig
from trioserve.engine.scheduler_core import SchedulerCore
from trioserve.engine.worker_executor import WorkerExecutorConfig, open_worker_executor
from trioserve.protocol.messages import AddRequest, RequestOutput, SamplingParams

VOCAB = 256
TOL = 1e-4


def tiny_config() -> LlamaConfig:
    """A tiny random Llama over a 256-token vocabulary (test_thread_learning.py uses it too)."""
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
    )


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama-logprobs")
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_config()).save_pretrained(folder)
    return folder


def reference(model_dir: Path, ids: list[int]) -> torch.Tensor:
    model: Any = LlamaForCausalLM.from_pretrained(model_dir)
    model.eval()
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_logprobs_cross_the_result_ring(tiny_model: Path) -> None:
    prompts = {"both": list(range(3, 24)), "plain": list(range(40, 50))}
    worker = WorkerConfig(device="cpu", dtype="float32", kv_cache_gib=0.01, worker_threads=1)
    executor_config = WorkerExecutorConfig(str(tiny_model), worker, block_size=4, num_blocks=64)
    scheduler = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=8, max_model_len=128, num_blocks=64, block_size=4
    )
    outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in prompts}

    async def main() -> None:
        async with open_worker_executor(executor_config) as executor:
            core = SchedulerCore(scheduler, executor, vocab_size=VOCAB, kind="model")
            both = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, prompt_logprobs=2)
            core.add(AddRequest("both", prompts["both"], both, 0.0))
            core.add(
                AddRequest("plain", prompts["plain"], SamplingParams(max_tokens=4, temperature=0.0), 0.0)
            )
            with trio.fail_after(60):
                while core.has_work:
                    assert core.schedule() is not None
                    await core.execute()
                    for outs in core.update().values():
                        for o in outs:
                            outputs[o.request_id].append(o)

    trio.run(main)
    assert all(o.logprobs is None and o.prompt_logprobs is None for o in outputs["plain"])
    got = outputs["both"]
    tokens = [t for o in got for t in o.new_token_ids]
    sampled = [lp for o in got for lp in o.logprobs or ()]
    assert [lp.token_id for lp in sampled] == tokens and len(tokens) == 4
    p = prompts["both"]
    full = reference(tiny_model, p + tokens)
    for i, lp in enumerate(sampled):
        assert lp.logprob == pytest.approx(float(full[len(p) - 1 + i, tokens[i]]), abs=TOL)
        assert lp.rank == 1 and lp.top_ids[0] == tokens[i] and len(lp.top_ids) == 3
    entries = got[0].prompt_logprobs
    assert entries is not None and len(entries) == len(p) and entries[0] is None
    assert all(o.prompt_logprobs is None for o in got[1:])
    for j in range(1, len(p)):
        entry = entries[j]
        assert entry is not None and entry.token_id == p[j]
        assert entry.logprob == pytest.approx(float(full[j - 1, p[j]]), abs=TOL)
        row, own = full[j - 1], full[j - 1, p[j]]
        assert int((row > own + TOL).sum()) + 1 <= entry.rank <= int((row > own - TOL).sum()) + 1
        assert entry.top_logprobs == pytest.approx(torch.topk(full[j - 1], 2).values.tolist(), abs=TOL)
