"""The model runner against transformers' own ``generate()``: greedy output must match token for token,
alone and batched, with chunked prefill, prefix-cache hits and preemption, on tiny random Llama and
Qwen3 models (hidden 64, 2 layers: milliseconds per step), each served by the own decoder
(``worker/decoder_model.py``, with the reference's weights) and by the transformers model itself."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from trioserve.engine.scheduler import Scheduler, SchedulerConfig
from trioserve.protocol.messages import AddRequest, RequestOutput, SamplingParams
from trioserve.worker import packed_linear
from trioserve.worker.decoder_model import CausalLM, assign, build
from trioserve.worker.decoder_spec import DecoderSpec
from trioserve.worker.model_runner import ModelRunner
from trioserve.worker.sampler import Sampler, SamplingRow

VOCAB = 512


def tiny_model(family: str) -> Any:
    torch.manual_seed(0)
    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention, as in SmolLM2 and Qwen3
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = (
        LlamaForCausalLM(LlamaConfig(**common))
        if family == "llama"
        else Qwen3ForCausalLM(Qwen3Config(**common))
    )
    # Random weights have no EOS; the config's default one (id 2) would stop or bias generate().
    model.generation_config.eos_token_id = None
    return model.eval()


@pytest.fixture(params=["llama", "qwen3"], scope="module")
def model(request: pytest.FixtureRequest) -> Any:
    return tiny_model(request.param)


@pytest.fixture(params=["auto", "all-blocked", "torch"], autouse=True)
def cpu_kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here three times: with the CPU fast paths (``auto``: decode attention read in place
    and the draw by the native kernels, the MLPs' SiLU fused; these models' linears mostly too narrow
    for the native blocks, so packed for oneDNN), with every linear in the native blocks, and with
    torch's own."""
    mode = str(request.param)
    if mode == "all-blocked":
        monkeypatch.setattr(packed_linear, "MIN_BLOCKED_IN", 0)
        mode = "auto"
    monkeypatch.setattr(Engine, "cpu_kernels", mode)
    return mode


@pytest.fixture(params=["trioserve", "transformers"], autouse=True)
def implementation(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """And each with both implementations of the model (``Engine.implementation``)."""
    monkeypatch.setattr(Engine, "implementation", request.param)
    return str(request.param)


def own_copy(model: Any) -> CausalLM:
    """The own decoder with a copy of transformers model ``model``'s weights, on its device."""
    tensors = {name: t.detach().clone() for name, t in model.state_dict().items()}
    spec = DecoderSpec.from_mapping(model.config.to_dict())
    return assign(build(spec), tensors, model.dtype).to(model.device).eval()


def reference_greedy(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt], device=model.device),  # (tests/gpu runs these tests on CUDA)
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return list(out[0, len(prompt) :].tolist())


class Engine:
    """The pure scheduler and the runner in a loop: what the engine core does, minus processes.
    ``cpu_kernels``: the runner's CPU fast paths (this module runs every test with and without them);
    ``implementation``: ``trioserve`` serves the own decoder with the weights of the transformers model
    given, ``transformers`` that model itself (this module runs every test with both)."""

    cpu_kernels = "auto"
    implementation = "trioserve"

    def __init__(self, model: Any, tokenizer: str | None = None, **limits: Any) -> None:
        config = dict(
            max_num_seqs=16, max_num_batched_tokens=256, max_model_len=256, num_blocks=64, block_size=4
        )
        config.update(limits)
        self.scheduler = Scheduler(SchedulerConfig(**config))
        fast = self.cpu_kernels == "auto" and model.device.type == "cpu"
        linears = sum(type(m) is torch.nn.Linear for m in model.modules())
        if self.implementation == "trioserve":
            model = own_copy(model)
        elif fast:  # packing replaces the linears in place: the caller's model stays generate()'s reference
            model = copy.deepcopy(model)
        self.runner = ModelRunner(
            model,
            config["num_blocks"],
            config["block_size"],
            tokenizer=tokenizer,
            cpu_kernels=self.cpu_kernels,
        )
        if fast:  # the kernels and the packed linears, not a silent fallback
            assert self.runner.cache.native is not None and self.runner.sampler.native is not None
            assert self.runner.packed_linears == linears
            assert self.runner.fused_mlps == model.config.num_hidden_layers
            # per layer its attention and two norms (Qwen3: and the attention's two per-head norms),
            # then the final norm
            per_layer = 5 if model.config.model_type == "qwen3" else 3
            assert self.runner.native_layers == per_layer * model.config.num_hidden_layers + 1
            if packed_linear.MIN_BLOCKED_IN == 0:  # the all-blocked case: every one in the native blocks
                modules = self.runner.model.modules()
                assert sum(isinstance(m, packed_linear.BlockedLinear) for m in modules) == linears
        assert self.runner.implementation == self.implementation
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.cached: dict[str, int] = {}
        self.preemptions = 0
        self.now = 0.0

    def add(
        self, rid: str, prompt: list[int], max_tokens: int, eos: int | None = None, **sampling: Any
    ) -> None:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=sampling.pop("temperature", 0.0), **sampling
        )
        add = AddRequest(rid, prompt, params, self.now, eos_token_id=eos)
        assert self.scheduler.add_request(add, self.now) is None
        self.tokens[rid] = []

    def step(self) -> list[RequestOutput]:
        self.now += 1.0
        out = self.scheduler.schedule(self.now)
        self.preemptions += len(out.preempted_request_ids)
        sampled = self.runner.execute(out)
        outputs = [o for outs in self.scheduler.update_from_output(out, sampled).values() for o in outs]
        for o in outputs:
            self.tokens[o.request_id] += o.new_token_ids
            if o.finish_reason is not None:
                self.cached[o.request_id] = o.num_cached_tokens
                self.finish[o.request_id] = o.finish_reason
        return outputs

    def run(self) -> dict[str, list[int]]:
        for _ in range(1000):
            if not self.scheduler.has_work:
                return self.tokens
            self.step()
        raise AssertionError("did not finish")


def prompt(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (length,), generator=g).tolist()  # type: ignore[no-any-return]


def test_alone_matches_generate(model: Any) -> None:
    p = prompt(1, 13)
    expected = reference_greedy(model, p, 12)
    engine = Engine(model)
    engine.add("a", p, 12)
    assert engine.run()["a"] == expected


def test_batched_with_other_requests_and_chunked_prefill(model: Any) -> None:
    prompts = {f"r{i}": prompt(10 + i, 5 + 7 * i) for i in range(5)}
    expected = {rid: reference_greedy(model, p, 9) for rid, p in prompts.items()}
    # 16 tokens a step: the longer prompts are split over several steps, mixed with others' decodes.
    engine = Engine(model, max_num_batched_tokens=16)
    for rid, p in prompts.items():
        engine.add(rid, p, 9)
    assert engine.run() == expected


def test_requests_arriving_mid_decode(model: Any) -> None:
    prompts = {"early": prompt(20, 9), "late": prompt(21, 17)}
    expected = {rid: reference_greedy(model, p, 10) for rid, p in prompts.items()}
    engine = Engine(model)
    engine.add("early", prompts["early"], 10)
    engine.step()
    engine.step()
    engine.add("late", prompts["late"], 10)
    assert engine.run() == expected


def test_prefix_cache_hit_matches_generate(model: Any) -> None:
    shared = prompt(30, 16)
    first, second = [*shared, 7, 8, 9], [*shared, 100, 101]
    expected = reference_greedy(model, second, 8)
    engine = Engine(model)
    engine.add("first", first, 4)
    engine.run()
    engine.add("second", second, 8)
    assert engine.run()["second"] == expected
    assert engine.cached["second"] == 16  # four full blocks of 4 came from the cache


def test_preemption_by_recompute_matches_generate(model: Any) -> None:
    prompts = {f"p{i}": prompt(40 + i, 10) for i in range(3)}
    expected = {rid: reference_greedy(model, p, 14) for rid, p in prompts.items()}
    engine = Engine(model, num_blocks=14)  # 3 x 24 tokens = 18 blocks needed: someone is preempted
    for rid, p in prompts.items():
        engine.add(rid, p, 14)
    assert engine.run() == expected
    assert engine.preemptions > 0


def test_same_seed_same_tokens_whatever_the_batch(model: Any) -> None:
    p = prompt(50, 8)
    alone = Engine(model)
    alone.add("s", p, 10, temperature=1.0, seed=1234)
    solo = alone.run()["s"]

    crowded = Engine(model, max_num_batched_tokens=8)
    for i in range(4):
        crowded.add(f"other{i}", prompt(60 + i, 11), 10, temperature=1.0)
    crowded.add("s", p, 10, temperature=1.0, seed=1234)
    assert crowded.run()["s"] == solo

    other_seed = Engine(model)
    other_seed.add("s", p, 10, temperature=1.0, seed=4321)
    assert other_seed.run()["s"] != solo


def test_min_tokens_bans_eos_then_eos_stops(model: Any) -> None:
    p = prompt(70, 6)
    greedy = reference_greedy(model, p, 6)
    eos = greedy[1]  # the model's second greedy token plays EOS
    engine = Engine(model)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    engine.scheduler.add_request(AddRequest("stop", p, params, 0.0, eos_token_id=eos), 0.0)
    params_min = SamplingParams(max_tokens=6, temperature=0.0, min_tokens=3)
    engine.scheduler.add_request(AddRequest("min", p, params_min, 0.0, eos_token_id=eos), 0.0)
    engine.tokens = {"stop": [], "min": []}
    tokens = engine.run()
    assert tokens["stop"] == greedy[:2]  # stops at EOS, which is returned as the last token
    assert eos not in tokens["min"][:3]  # banned while fewer than min_tokens outputs exist


# --------------------------------------------------------------------------------------------------
# The sampler on its own.
# --------------------------------------------------------------------------------------------------


def test_sampler_top_k_one_and_tiny_top_p_are_greedy() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 50)
    best = logits.argmax(-1).tolist()
    rows = [SamplingRow(1.0, top_k=1), SamplingRow(0.7, top_p=1e-6), SamplingRow(0.0)]
    for _ in range(20):
        assert Sampler(torch.device("cpu")).sample(logits.clone(), rows) == best


def test_sampler_top_k_never_leaves_the_top_k() -> None:
    torch.manual_seed(2)
    logits = torch.randn(1, 100)
    allowed = set(logits[0].topk(5).indices.tolist())
    sampler = Sampler(torch.device("cpu"))
    seen = {sampler.sample(logits.clone(), [SamplingRow(2.0, top_k=5)])[0] for _ in range(300)}
    assert seen <= allowed
    assert len(seen) > 1


def test_sampler_frequencies_follow_the_distribution() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.2]])
    sampler = Sampler(torch.device("cpu"))
    counts = [0, 0, 0]
    for i in range(3000):
        counts[sampler.sample(probs.log(), [SamplingRow(1.0, seed=7, output_index=i)])[0]] += 1
    assert [round(c / 3000, 1) for c in counts] == [0.5, 0.3, 0.2]


def test_sampler_banned_tokens_are_never_chosen() -> None:
    logits = torch.tensor([[10.0, 0.0, 0.0]])
    assert Sampler(torch.device("cpu")).sample(logits, [SamplingRow(0.0, banned=(0,))])[0] != 0
