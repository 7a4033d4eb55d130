"""Thread learning on this machine (issue 15, item 7): the learned table and mode 2 against fixed counts.

The embedded model (SmolLM2-135M-Instruct, ``trioserve.models.embedded_model``) in this process, on the
worker's own runner and thread tuner (``worker/model_runner.py``, ``worker/shadow.py``), driven by the
engine's scheduler (no API server, no rings: only the model's forwards are measured). The configured
count is ``TRIOSERVE_CPU_THREADS`` (default 2 here, to give the learner a choice on a 2-core machine).

1. **Learning** (mode 2, one shadow pass per ``--shadow-every`` served steps: default 1 so it finishes
   in a bench run; the worker's default is 10): a *short* workload (``--short-streams`` requests of
   ``--short-prompt`` tokens decoding ``--short-output`` tokens together: decode steps of that many
   tokens) and a *long* one (``--long-prompts`` prompts of ``--long-prompt`` tokens, one after the other,
   each a one-step prefill). Prints the learned table (range -> fastest count, medians, verified
   passes), the learning state (retired: why), and whether the host kept bit-identity.
2. **Direct check**: one step of each shape kept and re-run ``--reruns`` times at each count: the median
   time per count, and whether every re-run's logits equal the served ones byte for byte.
3. **Tokens/s, side by side**: the same two workloads served at fixed 1 thread, fixed configured count,
   and mode 2's learned counts (the tuner from step 1: its ranges are done, so it runs no shadows),
   interleaved ``--rounds`` times; greedy outputs of all three compared.

``uptime`` is printed before and after (a load above 1 on two cores: something else was running).

    .venv/bin/python bench/thread_learning.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trioserve.engine.scheduler import Scheduler, SchedulerConfig
from trioserve.models.embedded_model import ensure_default_model
from trioserve.protocol.messages import AddRequest, SamplingParams
from trioserve.protocol.step import SchedulerOutput
from trioserve.protocol.worker_messages import StepResult
from trioserve.worker.model_runner import ModelRunner, RunnerConfig
from trioserve.worker.shadow import ThreadTuner
from trioserve.worker.thread_learner import LearnerRules, ThreadLearner, range_tokens

BLOCK = 16
Serve = Callable[[SchedulerOutput], StepResult]


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output: int
    together: bool  # all at once (decodes batched), else one after another


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def run_workload(
    runner: ModelRunner, serve: Serve, work: Workload
) -> tuple[dict[str, list[int]], float, int]:
    """Serve ``work`` through a fresh scheduler: (outputs, seconds, tokens computed)."""
    config = SchedulerConfig(
        max_num_seqs=64,
        max_num_batched_tokens=max(512, *(len(p) for p in work.prompts)),
        max_model_len=2048,
        num_blocks=runner.num_blocks,
        block_size=BLOCK,
    )
    scheduler = Scheduler(config)
    params = SamplingParams(max_tokens=work.output, temperature=0.0, ignore_eos=True)
    outputs: dict[str, list[int]] = {}
    queue = [(f"{work.name}{i}", p) for i, p in enumerate(work.prompts)]
    now, computed = 0.0, 0
    started = time.perf_counter()
    while queue or scheduler.has_work:
        if queue and (work.together or not scheduler.has_work):
            for rid, prompt in queue if work.together else queue[:1]:
                assert scheduler.add_request(AddRequest(rid, prompt, params, now), now) is None
                outputs[rid] = []
            queue = [] if work.together else queue[1:]
        now += 1.0
        step = scheduler.schedule(now)
        computed += runner.step_tokens(step)
        result = serve(step)
        for outs in scheduler.update_from_output(step, result.sampled).values():
            for o in outs:
                outputs[o.request_id] += o.new_token_ids
    return outputs, time.perf_counter() - started, computed


def prompts(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab, (length,), generator=g).tolist() for _ in range(n)]


def served_by(tuner: ThreadTuner) -> Serve:
    return lambda step: tuner.serve(step, lambda _: None)


def report_learning(work: Workload, tuner: ThreadTuner, seconds: float, every: int) -> None:
    learner = tuner.learner
    view = learner.view()
    print(
        f"\n1. learning on the {work.name!r} workload (mode 2, a shadow per {every} steps): {seconds:.1f} s"
    )
    print(f"   state: {learner.state}" + (f" ({learner.reason})" if learner.reason else ""))
    wall, cpu = view["shadow_seconds"], view["shadow_thread_seconds"]
    print(f"   shadow passes {view['shadow_passes']}: {wall:.2f} s wall, {cpu:.2f} s x threads")
    ranges = view["ranges"]
    assert isinstance(ranges, dict)
    for rng, rec in ranges.items():
        lo, hi = range_tokens(int(rng))
        medians = ", ".join(f"{c}: {m * 1e3:.2f} ms" for c, m in rec["medians"].items()) or "-"
        print(
            f"   range {rng:>4} ({lo}..{hi} tokens): {rec['status']}, fastest {rec['fastest']}, "
            f"serving {rec['serving']}; medians {medians}; verified {rec['verified']}; steps {rec['steps']}"
        )


def direct_check(
    runner: ModelRunner, step_of: Callable[[], SchedulerOutput], counts: list[int], reruns: int
) -> str:
    """One step kept and re-run at each count: median ms per count and whether all bytes matched."""
    step = step_of()
    runner.run(step, keep_logits=True)
    kept = runner.last
    assert kept is not None
    parts, same = [], True
    for count in counts:
        times = []
        for _ in range(reruns):
            seconds, logits = runner.reforward(count)
            times.append(seconds)
            same = same and logits == kept.logits
        parts.append(f"{count}: {statistics.median(times) * 1e3:.2f} ms")
    return f"{kept.tokens} tokens: " + ", ".join(parts) + f"; bytes equal at every count: {same}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shadow-every", type=int, default=1)
    parser.add_argument("--short-streams", type=int, default=4)
    parser.add_argument("--short-prompt", type=int, default=16)
    parser.add_argument("--short-output", type=int, default=48)
    parser.add_argument("--long-prompts", type=int, default=20)
    parser.add_argument("--long-prompt", type=int, default=384)
    parser.add_argument("--reruns", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    configured = int(os.environ.get("TRIOSERVE_CPU_THREADS", "2"))
    print(f"uptime (start): {uptime()}")
    cpus = sorted(os.sched_getaffinity(0))
    print(f"os.cpu_count() {os.cpu_count()}, affinity {cpus}, torch {torch.__version__}")
    model_dir = ensure_default_model()
    runner = ModelRunner.load(RunnerConfig(str(model_dir), 1024, BLOCK, "cpu", "float32", configured))
    print(f"model {model_dir.name}; configured {configured} threads; backend {runner.threads.backend}")
    vocab = runner.vocab_size
    short = Workload(
        "short", prompts(args.short_streams, args.short_prompt, 1, vocab), args.short_output, True
    )
    long = Workload("long", prompts(args.long_prompts, args.long_prompt, 2, vocab), 1, False)

    # 1. Learning, mode 2: one learner per workload (a worker has one: its first drift, in any
    # range, retires it for every range).
    tuners: dict[str, ThreadTuner] = {}
    learn_outputs: dict[str, list[int]] = {}
    kept_identity = True
    for work in (short, long):
        learner = ThreadLearner(LearnerRules(2, configured, shadow_every=args.shadow_every))
        tuner = tuners[work.name] = ThreadTuner(runner, learner)
        tuner.golden()
        started = time.perf_counter()
        for _ in range(2):  # the second pass: the transition window, where the first did not finish it
            out, _, _ = run_workload(runner, served_by(tuner), work)
            learn_outputs.update(out)
            if learner.state == "retired":
                break
        report_learning(work, tuner, time.perf_counter() - started, args.shadow_every)
        kept_identity = kept_identity and not str(learner.reason).startswith("drift")
    print(f"   bit-identity across counts (every shadow pass): {'held' if kept_identity else 'DRIFTED'}")

    # 2. Direct check, one step of each shape.
    counts = list(range(1, configured + 1))

    def first_step(work: Workload, decode: bool) -> SchedulerOutput:
        scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=64,
                max_num_batched_tokens=max(512, args.long_prompt),
                max_model_len=2048,
                num_blocks=runner.num_blocks,
                block_size=BLOCK,
            )
        )
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(work.prompts if work.together else work.prompts[:1]):
            scheduler.add_request(AddRequest(f"d{i}", p, params, 0.0), 0.0)
        step = scheduler.schedule(1.0)
        if decode:
            result = runner.run(step)
            scheduler.update_from_output(step, result.sampled)
            step = scheduler.schedule(2.0)
        return step

    print("\n2. direct check (one step kept, re-run at each count):")
    print(
        f"   short decode step, {direct_check(runner, lambda: first_step(short, True), counts, args.reruns)}"
    )
    print(
        f"   long prefill step, {direct_check(runner, lambda: first_step(long, False), counts, args.reruns)}"
    )

    # 3. Tokens/s side by side.
    modes: dict[str, Serve] = {
        "fixed 1": lambda step: runner.run(step, threads=1),
        f"fixed {configured} (configured)": lambda step: runner.run(step, threads=configured),
    }
    learned_mode = "mode 2 (learned)"
    passes_before = sum(t.learner.shadow_passes for t in tuners.values())
    names = [*modes, learned_mode]
    rates: dict[str, dict[str, list[float]]] = {m: {"short": [], "long": []} for m in names}
    outputs: dict[str, dict[str, list[int]]] = {m: {} for m in names}
    for _ in range(args.rounds):
        for name in names:
            for work, key in ((short, "short"), (long, "long")):
                serve = modes[name] if name in modes else served_by(tuners[work.name])
                out, seconds, computed = run_workload(runner, serve, work)
                outputs[name].update(out)
                generated = sum(len(t) for t in out.values())
                rates[name][key].append((generated if key == "short" else computed) / seconds)
    print(
        f"\n3. tokens/s, median of {args.rounds} interleaved rounds "
        "(short: generated tokens/s; long: prefill tokens/s):"
    )
    for name in names:
        s, lg = statistics.median(rates[name]["short"]), statistics.median(rates[name]["long"])
        print(f"   {name:<22} short {s:8.1f}   long {lg:8.1f}")
    base = outputs[f"fixed {configured} (configured)"]
    passes = sum(t.learner.shadow_passes for t in tuners.values()) - passes_before
    print(f"   shadow passes during the timed runs: {passes}")
    for name in names:
        print(f"   greedy outputs of {name!r} equal the configured count's: {outputs[name] == base}")
    same = all(learn_outputs[k] == base[k] for k in learn_outputs)
    print(f"   learning-phase outputs equal the configured count's: {same}")
    print(f"\nuptime (end): {uptime()}")


if __name__ == "__main__":
    main()
