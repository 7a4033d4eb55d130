"""Logprobs in the worker and on their way to the API server (issue 16, item 2).

The sampler's logprobs equal ``log_softmax`` of the processed logits divided by the temperature
(greedy rows: not divided), with ranks (ties share the best) and the top-k; rows that ask sit beside
rows that do not, which get none and cost nothing. Through the scheduler and the runner on a tiny random
Llama: each sampled token's logprob equals ``log_softmax`` of transformers' own logits for the same
sequence, and the prompt logprobs across chunked prefill equal one full forward's, come once with the
first output, skip the prefix cache and are not sent again after a preemption. Then the wire: the
worker's ``StepResult`` and the ``RequestOutput`` round trip, the worst case fits the result slot, the
scheduler core takes a ``StepResult`` from its executor, and folded outputs keep the logprobs beside
their tokens.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import torch
import trio

from tests.unit.test_model_runner import VOCAB, Engine, prompt, tiny_model
from trioserve.config import EngineProcessConfig, override
from trioserve.engine.executor import ReferenceExecutor
from trioserve.engine.scheduler import SchedulerConfig
from trioserve.engine.scheduler_core import SchedulerCore
from trioserve.engine.worker_executor import WorkerExecutorConfig
from trioserve.protocol.codec import engine_output_codec
from trioserve.protocol.fold import fold_outputs
from trioserve.protocol.messages import (
    AddRequest,
    EngineOutputs,
    EngineStats,
    RequestOutput,
    SamplingParams,
    TokenLogprobs,
)
from trioserve.protocol.step import SchedulerOutput
from trioserve.protocol.worker_messages import (
    MAX_ENGINE_LOGPROBS,
    StepResult,
    step_result_bytes,
    worker_output_codec,
)
from trioserve.worker import sampler as sampler_module
from trioserve.worker.paged_attention import attach_to_transformers
from trioserve.worker.sampler import Sampler, SamplingRow, token_logprobs

V = 300
STATS = EngineStats(num_waiting=0, num_running=0)
TOL = 1e-4


def check(lp: TokenLogprobs, row: torch.Tensor, token: int, k: int) -> None:
    """``lp`` is ``token``'s entry of the distribution whose logprobs are ``row``."""
    assert lp.token_id == token
    assert lp.logprob == pytest.approx(float(row[token]), abs=TOL)
    # Ties count strictly greater; near-ties within the tolerance may go either way.
    assert int((row > row[token] + TOL).sum()) + 1 <= lp.rank <= int((row > row[token] - TOL).sum()) + 1
    assert len(lp.top_ids) == len(lp.top_logprobs) == k
    values, _ = torch.topk(row, k)
    assert lp.top_logprobs == pytest.approx(values.tolist(), abs=TOL)
    # Ids compared by their values: near-ties may come in either order.
    assert [float(row[t]) for t in lp.top_ids] == pytest.approx(values.tolist(), abs=TOL)
    assert set(lp.top_ids) <= set(range(row.shape[-1]))


# --------------------------------------------------------------------------------------------------
# The sampler.
# --------------------------------------------------------------------------------------------------


def test_token_logprobs_ranks_ties_and_top_k() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5, 2.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    first, second = token_logprobs(logits, [4, 3], [3, 0])
    lp = torch.log_softmax(logits, dim=-1)
    assert first.logprob == pytest.approx(float(lp[0, 4]))
    assert first.rank == 3  # two tokens strictly more likely
    assert first.top_ids[2] == 4 and set(first.top_ids[:2]) == {1, 2}
    assert first.top_logprobs == pytest.approx([float(lp[0, 1]), float(lp[0, 2]), float(lp[0, 4])])
    assert second.rank == 1  # all tied: none strictly more likely
    assert second.top_ids == [] and second.top_logprobs == []
    assert second.logprob == pytest.approx(-torch.log(torch.tensor(5.0)).item())
    # More alternatives than the vocabulary: the whole vocabulary.
    (whole,) = token_logprobs(logits[:1], [0], [50])
    assert len(whole.top_ids) == 5


@pytest.mark.parametrize("k", [0, 1, 3, 7])
def test_ranks_inside_and_outside_the_top_k_match_counting(k: int) -> None:
    # Small integer logits: many ties, at the k-th value too; tokens inside and outside the top k.
    g = torch.Generator().manual_seed(k)
    logits = torch.randint(0, 6, (40, 30), generator=g).float()
    tokens = torch.randint(0, 30, (40,), generator=g).tolist()
    tokens[0] = int(logits[0].argmax())
    found = token_logprobs(logits, tokens, [k] * 40)
    for row, token, lp in zip(logits, tokens, found, strict=True):
        assert lp.rank == int((row > row[token]).sum()) + 1
        assert lp.logprob == pytest.approx(float(torch.log_softmax(row, -1)[token]))
        assert sorted((float(row[t]) for t in lp.top_ids), reverse=True) == torch.topk(row, k).values.tolist()


def test_rows_side_by_side_greedy_and_temperature() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, V, generator=g) * 3
    sampler = Sampler(torch.device("cpu"), V)
    params = SamplingParams(max_tokens=1, logit_bias={5: 40.0, 6: -100.0})
    bias = sampler.processors(params, 0)
    rows = [
        SamplingRow(0.0, logprobs=5),  # greedy: no temperature
        SamplingRow(1.0, seed=1),  # does not ask
        SamplingRow(0.7, seed=2, top_k=20, min_p=0.1, logprobs=3),  # cut after the logprobs are read
        SamplingRow(1.3, seed=3, processors=bias, logprobs=0),  # processed, then scaled
    ]
    tokens, found = sampler.sample_with_logprobs(logits.clone(), rows)
    assert tokens == sampler.sample(logits.clone(), rows)  # asking draws no extra noise
    assert sorted(found) == [0, 2, 3]
    assert tokens[0] == int(logits[0].argmax()) and found[0].rank == 1
    check(found[0], torch.log_softmax(logits[0], -1), tokens[0], 5)
    check(found[2], torch.log_softmax(logits[2] / 0.7, -1), tokens[2], 3)
    biased = logits[3].clone()
    biased[5] += 40.0
    biased[6] -= 100.0
    check(found[3], torch.log_softmax(biased / 1.3, -1), tokens[3], 0)
    assert tokens[3] == 5  # the bias makes it all but certain


def test_no_row_asking_computes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: Any) -> Any:
        raise AssertionError("computed logprobs nobody asked for")

    monkeypatch.setattr(sampler_module, "token_logprobs", fail)
    sampler = Sampler(torch.device("cpu"), V)
    logits = torch.randn(3, V)
    tokens, found = sampler.sample_with_logprobs(
        logits, [SamplingRow(0.0), SamplingRow(1.0), SamplingRow(0.5)]
    )
    assert found == {} and len(tokens) == 3


# --------------------------------------------------------------------------------------------------
# The runner and the scheduler on a tiny random Llama, against transformers.
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_model("llama")


def reference_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    """``log_softmax`` of transformers' logits at every position of one full forward."""
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0].float()
    finally:
        attach_to_transformers(model)  # as a runner serving it left it
    return torch.log_softmax(logits, dim=-1)


class LogprobEngine(Engine):
    """``Engine`` with the runner's whole answer passed on, every output kept."""

    def __init__(self, model: Any, **limits: Any) -> None:
        super().__init__(model, **limits)
        self.outputs: dict[str, list[RequestOutput]] = {}
        # Each time a request reaches the worker as new: (request id, its prompt_logprobs, had outputs).
        self.arrivals: list[tuple[str, int | None, bool]] = []

    def step(self) -> list[RequestOutput]:
        self.now += 1.0
        out = self.scheduler.schedule(self.now)
        self.arrivals += [
            (n.request_id, n.sampling.prompt_logprobs, bool(self.tokens[n.request_id]))
            for n in out.new_requests
        ]
        self.preemptions += len(out.preempted_request_ids)
        result = self.runner.run(out)
        per_client = self.scheduler.update_from_output(
            out, result.sampled, result.logprobs, result.prompt_logprobs
        )
        outputs = [o for outs in per_client.values() for o in outs]
        for o in outputs:
            self.tokens[o.request_id] += o.new_token_ids
            self.outputs.setdefault(o.request_id, []).append(o)
            if o.finish_reason is not None:
                self.cached[o.request_id] = o.num_cached_tokens
        return outputs


def sampled_logprobs(engine: LogprobEngine, rid: str) -> list[TokenLogprobs]:
    found: list[TokenLogprobs] = []
    for o in engine.outputs[rid]:
        assert o.logprobs is not None and len(o.logprobs) == len(o.new_token_ids)
        found += o.logprobs
    return found


def prompt_logprobs_sent(engine: LogprobEngine, rid: str) -> list[list[TokenLogprobs | None]]:
    return [o.prompt_logprobs for o in engine.outputs[rid] if o.prompt_logprobs is not None]


def test_sampled_logprobs_equal_transformers_batched(model: Any) -> None:
    prompts = {"greedy": prompt(1, 11), "warm": prompt(2, 19), "plain": prompt(3, 7)}
    engine = LogprobEngine(model, max_num_batched_tokens=16)  # chunked prefill, mixed with decodes
    engine.add("greedy", prompts["greedy"], 8, logprobs=4)
    engine.add("warm", prompts["warm"], 8, temperature=0.6, seed=7, logprobs=2)
    engine.add("plain", prompts["plain"], 8, temperature=1.0, seed=8)
    tokens = engine.run()
    assert all(o.logprobs is None for o in engine.outputs["plain"])
    for rid, temperature, k in (("greedy", 1.0, 4), ("warm", 0.6, 2)):
        found = sampled_logprobs(engine, rid)
        assert [lp.token_id for lp in found] == tokens[rid]
        full = prompts[rid] + tokens[rid]
        raw = reference_logprobs(model, full)  # the logits up to a constant per row
        n = len(prompts[rid])
        for i, lp in enumerate(found):
            check(lp, torch.log_softmax(raw[n - 1 + i] / temperature, -1), tokens[rid][i], k)
        if rid == "greedy":
            assert all(lp.rank == 1 for lp in found)


def test_prompt_logprobs_across_chunked_prefill_equal_one_forward(model: Any) -> None:
    prompts = {"a": prompt(10, 29), "b": prompt(11, 6), "c": prompt(12, 13)}
    engine = LogprobEngine(model, max_num_batched_tokens=8)  # a's prompt takes several steps
    engine.add("a", prompts["a"], 3, prompt_logprobs=3)
    engine.add("b", prompts["b"], 3, prompt_logprobs=0, logprobs=1)
    engine.add("c", prompts["c"], 3)  # asks for none, beside them
    engine.run()
    assert prompt_logprobs_sent(engine, "c") == []
    for rid, k in (("a", 3), ("b", 0)):
        sent = prompt_logprobs_sent(engine, rid)
        assert len(sent) == 1 and engine.outputs[rid][0].prompt_logprobs is sent[0]  # the first output
        (entries,) = sent
        p = prompts[rid]
        assert len(entries) == len(p) and entries[0] is None
        full = reference_logprobs(model, p)
        for j in range(1, len(p)):
            lp = entries[j]
            assert lp is not None
            check(lp, full[j - 1], p[j], k)


def test_prompt_logprobs_skip_the_prefix_cache(model: Any) -> None:
    p = prompt(20, 18)
    engine = LogprobEngine(model)
    engine.add("warm", p, 2)
    engine.run()
    engine.add("again", p, 2)
    engine.add("asks", p, 2, prompt_logprobs=1)
    engine.run()
    assert engine.cached["again"] == 16
    assert engine.cached["asks"] == 0  # computed from position 0: every prompt row has logits
    (entries,) = prompt_logprobs_sent(engine, "asks")
    full = reference_logprobs(model, p)
    assert len(entries) == len(p)
    for j in range(1, len(p)):
        lp = entries[j]
        assert lp is not None
        check(lp, full[j - 1], p[j], 1)


def test_prompt_logprobs_sent_once_across_preemptions(model: Any) -> None:
    prompts = {f"p{i}": prompt(30 + i, 10) for i in range(3)}
    engine = LogprobEngine(model, num_blocks=14, max_num_batched_tokens=6)  # someone is preempted
    for rid, p in prompts.items():
        engine.add(rid, p, 14, prompt_logprobs=2, logprobs=0)
    tokens = engine.run()
    assert engine.preemptions > 0
    for rid, p in prompts.items():
        (entries,) = prompt_logprobs_sent(engine, rid)
        full = reference_logprobs(model, p)
        assert len(entries) == len(p)
        for j in range(1, len(p)):
            lp = entries[j]
            assert lp is not None
            check(lp, full[j - 1], p[j], 2)
        assert len(sampled_logprobs(engine, rid)) == len(tokens[rid]) == 14
    # A request resumed after its first output (it has sent them) comes back not asking again; one
    # preempted before it asks again, and the recompute gathers them from the start.
    assert any(had for _, _, had in engine.arrivals)
    for _, k, had in engine.arrivals:
        assert k == (None if had else 2)


def reference_core(executor: ReferenceExecutor | None = None) -> SchedulerCore:
    config = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, num_blocks=32, block_size=4
    )
    return SchedulerCore(config, executor or ReferenceExecutor(32, 4, VOCAB), vocab_size=VOCAB)


def test_logprobs_past_the_engine_cap_are_refused() -> None:
    core = reference_core()
    for field in ("logprobs", "prompt_logprobs"):
        asked: dict[str, Any] = {field: MAX_ENGINE_LOGPROBS + 1}
        params = SamplingParams(max_tokens=2, **asked)
        refused = core.add(AddRequest(f"r-{field}", [1, 2, 3], params, 0.0))
        assert refused is not None and refused.finish_reason == "error"
        assert refused.error is not None and field in refused.error


# --------------------------------------------------------------------------------------------------
# The wire and the engine core.
# --------------------------------------------------------------------------------------------------


def test_step_result_and_request_output_round_trip() -> None:
    lp = TokenLogprobs(7, -0.25, 2, [3, 7], [-0.1, -0.25])
    result = StepResult(4, {"a": [7]}, {"a": [lp]}, {"b": [lp, lp]})
    codec = worker_output_codec()
    assert codec.decode(codec.encode(result)) == result
    assert codec.decode(codec.encode(StepResult(5, {"a": [1]}))) == StepResult(5, {"a": [1]})
    output = RequestOutput("a", [7], logprobs=[lp], prompt_logprobs=[None, lp])
    outputs = EngineOutputs(engine_index=0, outputs=[output], step=1, timestamp=0.0, stats=STATS)
    out_codec = engine_output_codec()
    back = out_codec.decode(out_codec.encode(outputs))
    assert isinstance(back, EngineOutputs) and back.outputs == [output]


def test_worst_case_step_result_fits_the_slot() -> None:
    batched, seqs = 2048, 1024
    k = MAX_ENGINE_LOGPROBS
    worst = TokenLogprobs(2**31 - 1, -1e-300, 2**31 - 1, [2**31 - 1] * k, [-1e-300] * k)
    rid = "r" * 1000
    ids = [f"{rid}{i:05d}" for i in range(seqs)]
    result = StepResult(
        2**31 - 1,
        {i: [2**31 - 1] for i in ids},
        {i: [worst] for i in ids},
        {ids[0]: [worst] * batched},
    )
    assert len(msgspec.msgpack.encode(result)) <= step_result_bytes(batched, seqs)


def test_the_result_slot_is_sized_from_the_engine_section() -> None:
    config = override(
        EngineProcessConfig(), model="/models/tiny", max_num_batched_tokens=8192, max_num_seqs=64
    )
    assert WorkerExecutorConfig.from_config(config).result_slot_bytes == step_result_bytes(8192, 64) > 1 << 20


def test_the_engine_core_takes_a_step_result() -> None:
    lp = TokenLogprobs(0, -0.5, 1)

    class WithLogprobs(ReferenceExecutor):
        async def execute(self, step: SchedulerOutput) -> StepResult:  # type: ignore[override]
            sampled = self.execute_now(step)
            prompt_lps = {n.request_id: [lp] * (len(n.token_ids) - 1) for n in step.new_requests}
            return StepResult(step.step, sampled, {rid: [lp] for rid in sampled}, prompt_lps)

    core = reference_core(WithLogprobs(32, 4, VOCAB))
    core.add(
        AddRequest("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3, logprobs=0, prompt_logprobs=0), 0.0)
    )
    outputs: list[RequestOutput] = []

    async def main() -> None:
        while core.has_work:
            assert core.schedule() is not None
            await core.execute()
            outputs.extend(o for outs in core.update().values() for o in outs)

    trio.run(main)
    assert [len(o.logprobs or ()) for o in outputs] == [1, 1, 1]
    assert outputs[0].prompt_logprobs == [None, lp, lp, lp, lp]
    assert all(o.prompt_logprobs is None for o in outputs[1:])


def test_the_reference_executor_still_sends_none() -> None:
    core = reference_core()
    core.add(AddRequest("a", [1, 2, 3], SamplingParams(max_tokens=2, logprobs=2), 0.0))

    async def main() -> list[RequestOutput]:
        found: list[RequestOutput] = []
        while core.has_work:
            core.schedule()
            await core.execute()
            found.extend(o for outs in core.update().values() for o in outs)
        return found

    outputs = trio.run(main)
    assert len(outputs) == 2 and all(o.logprobs is None for o in outputs)


def test_a_stop_cuts_the_logprobs_with_the_tokens() -> None:
    core = reference_core()
    scheduler = core.scheduler
    scheduler.add_request(AddRequest("a", [1, 2, 3], SamplingParams(max_tokens=1, logprobs=0), 0.0), 0.0)
    out = scheduler.schedule(1.0)
    lps = [TokenLogprobs(9, -1.0, 1), TokenLogprobs(8, -2.0, 1)]
    (output,) = [
        o for outs in scheduler.update_from_output(out, {"a": [9, 8]}, {"a": lps}).values() for o in outs
    ]
    assert output.new_token_ids == [9] and output.logprobs == lps[:1]


def test_folded_outputs_keep_logprobs_beside_their_tokens() -> None:
    a, b, c = (TokenLogprobs(t, -float(t), 1) for t in (1, 2, 3))
    first = EngineOutputs(
        engine_index=0,
        outputs=[RequestOutput("x", [1], logprobs=[a], prompt_logprobs=[None, c]), RequestOutput("y", [5])],
        step=1,
        timestamp=0.0,
        stats=STATS,
    )
    second = EngineOutputs(
        engine_index=0,
        outputs=[RequestOutput("x", [2, 3], logprobs=[b, c]), RequestOutput("y", [6])],
        step=2,
        timestamp=1.0,
        stats=STATS,
    )
    fold_outputs(first, second)
    x, y = first.outputs
    assert x.new_token_ids == [1, 2, 3] and x.logprobs == [a, b, c] and x.prompt_logprobs == [None, c]
    assert y.new_token_ids == [5, 6] and y.logprobs is None and y.prompt_logprobs is None
