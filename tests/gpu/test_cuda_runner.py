"""The model runner on CUDA against transformers' ``generate()`` on the same GPU: greedy output must
match token for token (float32; alone, batched with chunked prefill, prefix-cache hits, preemption),
as the CPU tests in ``tests/unit/test_model_runner.py`` require, on the same tiny random models and
on the embedded SmolLM2; seeded sampling must repeat. Plus a throughput smoke test that prints the
decode rate."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from tests.multiproc.test_embedded_model_convert import NEEDS_EMBEDDED_MODEL
from tests.unit.test_model_runner import Engine, prompt, tiny_model

CUDA = torch.device("cuda")


@pytest.fixture(params=["llama", "qwen3"], scope="module")
def model(request: pytest.FixtureRequest) -> Any:
    return tiny_model(request.param).to(CUDA)


def reference_greedy(model: Any, tokens: list[int], max_tokens: int) -> list[int]:
    model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([tokens], device=model.device),
            attention_mask=torch.ones(1, len(tokens), dtype=torch.long, device=model.device),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return list(out[0, len(tokens) :].tolist())


def test_the_runner_is_on_the_gpu(model: Any) -> None:
    engine = Engine(model)
    assert engine.runner.device.type == "cuda"
    assert engine.runner.cache.keys[0].device.type == "cuda"


def test_alone_and_batched_with_chunked_prefill_match_generate(model: Any) -> None:
    prompts = {f"r{i}": prompt(10 + i, 5 + 7 * i) for i in range(5)}
    expected = {rid: reference_greedy(model, p, 9) for rid, p in prompts.items()}
    alone = Engine(model)
    alone.add("r0", prompts["r0"], 9)
    assert alone.run()["r0"] == expected["r0"]
    engine = Engine(model, max_num_batched_tokens=16)  # longer prompts split, mixed with decodes
    for rid, p in prompts.items():
        engine.add(rid, p, 9)
    assert engine.run() == expected


def test_prefix_hit_and_preemption_match_generate(model: Any) -> None:
    shared = prompt(30, 16)
    second = [*shared, 100, 101]
    engine = Engine(model)
    engine.add("first", [*shared, 7, 8, 9], 4)
    engine.run()
    engine.add("second", second, 8)
    assert engine.run()["second"] == reference_greedy(model, second, 8)
    assert engine.cached["second"] == 16
    prompts = {f"p{i}": prompt(40 + i, 10) for i in range(3)}
    tight = Engine(model, num_blocks=14)
    for rid, p in prompts.items():
        tight.add(rid, p, 14)
    assert tight.run() == {rid: reference_greedy(model, p, 14) for rid, p in prompts.items()}
    assert tight.preemptions > 0


def test_seeded_sampling_repeats_whatever_the_batch(model: Any) -> None:
    p = prompt(50, 8)
    alone = Engine(model)
    alone.add("s", p, 10, temperature=1.0, seed=1234)
    solo = alone.run()["s"]
    crowded = Engine(model, max_num_batched_tokens=8)
    for i in range(4):
        crowded.add(f"other{i}", prompt(60 + i, 11), 10, temperature=1.0)
    crowded.add("s", p, 10, temperature=1.0, seed=1234)
    assert crowded.run()["s"] == solo


@pytest.fixture(scope="module")
def smollm2() -> Any:
    from transformers import AutoModelForCausalLM

    from trioserve.models.embedded_model import ensure_default_model

    folder = ensure_default_model()
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(CUDA).eval()


@NEEDS_EMBEDDED_MODEL
def test_smollm2_matches_generate(smollm2: Any) -> None:
    prompts = {f"q{i}": prompt(80 + i, 12 + 9 * i) for i in range(3)}
    expected = {rid: reference_greedy(smollm2, p, 16) for rid, p in prompts.items()}
    engine = Engine(smollm2, max_num_batched_tokens=32, num_blocks=128, max_model_len=512)
    for rid, p in prompts.items():
        engine.add(rid, p, 16)
    assert engine.run() == expected


@NEEDS_EMBEDDED_MODEL
def test_smollm2_decode_throughput_smoke(smollm2: Any) -> None:
    """32 sequences of 64 tokens: every sequence gets all its tokens, each a vocabulary id; the rate
    is printed (``-s``) for the report, not asserted (shared machines)."""
    engine = Engine(smollm2, max_num_seqs=32, max_num_batched_tokens=2048, num_blocks=1024, max_model_len=512)
    for i in range(32):
        engine.add(f"t{i}", prompt(200 + i, 32), 64)
    engine.step()  # the prefills
    torch.cuda.synchronize()
    started = time.perf_counter()
    tokens = engine.run()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    assert all(len(t) == 64 for t in tokens.values())
    vocab = engine.runner.vocab_size
    assert all(0 <= tok < vocab for t in tokens.values() for tok in t)
    print(f"\nCUDA SmolLM2 float32, 32 sequences: {32 * 63 / seconds:,.0f} decode tokens/s")
