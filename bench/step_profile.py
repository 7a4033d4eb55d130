"""Where a decode step's time goes (issue 18, item 1), on the worker's own runner in this process.

For each point (model, sequences): ``--prompt`` -token prompts for that many requests are prefilled,
then ``--steps`` decode steps (one token per sequence) are timed twice, interleaved per step: plain
(the step's wall time, nothing installed) and instrumented, where forward hooks on the model's modules
and wrappers around the paged-attention helpers and the sampler add up time per part:

- ``embedding`` (``embed_tokens``), ``qkv/o projections`` (the attention's four linears),
  ``paged attention`` (``_decode_attention``: the decode rows' attention over the paged cache), of it
  ``KV gather`` (``gather``: reading the context's blocks back), ``attention other`` (the attention
  module minus those: rotary embedding, cache writes, reshapes), ``MLP``, ``norms`` (RMSNorm), ``LM
  head``, ``model glue`` (the model's forward minus its parts: residual adds, the decoder layers'
  Python), ``sampling`` (``Sampler.sample_with_logprobs``), ``runner outside the model`` (the step
  minus the forward and the sampler: batch and layout tensors, token history, the result);
- ``engine core``: the scheduler's ``schedule`` and ``update_from_output`` for the same steps (the
  engine core's own work per step, without its ZMQ and ring I/O).

Instrumented totals run above plain ones by the hooks' own cost (printed); the parts are exclusive
times on the instrumented steps. One torch thread (``torch.set_num_threads(1)``, as in
``bench/peer_compare.py``); greedy sampling. The tiny model is ``bench/peers/tiny_model.py``'s shape
with seeded random weights; SmolLM2 is the embedded model.

    .venv/bin/python bench/step_profile.py [--points tiny:32,tiny:128,smollm2:8,smollm2:32] [--prefill]

``--prefill``: the same parts for one step that prefills every point's prompts at once (the step
every stream of ``bench/model_throughput.py`` starts with), after one such step to warm up.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from peers.tiny_model import TINY_LLAMA
from trioserve.engine.scheduler import Scheduler, SchedulerConfig
from trioserve.models.embedded_model import ensure_default_model
from trioserve.protocol.messages import AddRequest, SamplingParams
from trioserve.worker import paged_attention
from trioserve.worker.model_loader import ModelImpl
from trioserve.worker.model_runner import ModelRunner, RunnerConfig

BLOCK = 16
PARTS = (
    "embedding",
    "qkv/o projections",
    "paged attention",
    "  of it: KV gather",
    "attention other",
    "MLP",
    "norms",
    "LM head",
    "model glue",
    "sampling",
    "runner outside the model",
)


class Clock:
    """Exclusive time per part: a stack of open spans; a child's time is taken out of its parent's."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[list[Any]] = []  # [part, started, children's time]
        self.on = False

    def enter(self, part: str) -> None:
        if self.on:
            self._stack.append([part, time.perf_counter(), 0.0])

    def leave(self) -> None:
        if not self.on:
            return
        part, started, children = self._stack.pop()
        spent = time.perf_counter() - started
        self.totals[part] += spent - children
        if self._stack:
            self._stack[-1][2] += spent

    @contextmanager
    def span(self, part: str) -> Iterator[None]:
        self.enter(part)
        try:
            yield
        finally:
            self.leave()


def part_of(name: str, module: torch.nn.Module) -> str | None:
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "embed_tokens":
        return "embedding"
    if leaf in ("q_proj", "k_proj", "v_proj", "o_proj"):
        return "qkv/o projections"
    if leaf == "self_attn":
        return "attention other"
    if leaf == "mlp":
        return "MLP"
    if "RMSNorm" in type(module).__name__:
        return "norms"
    if leaf == "lm_head":
        return "LM head"
    return None


def instrument(runner: ModelRunner, clock: Clock) -> None:
    model = runner.model
    model.register_forward_pre_hook(lambda *_: clock.enter("model glue"))
    model.register_forward_hook(lambda *_: clock.leave())
    for name, module in model.named_modules():
        part = part_of(name, module)
        if part is None:
            continue
        module.register_forward_pre_hook(lambda *_, p=part: clock.enter(p))
        module.register_forward_hook(lambda *_: clock.leave())

    def wrap(owner: Any, attr: str, part: str) -> None:
        inner: Callable[..., Any] = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            with clock.span(part):
                return inner(*args, **kwargs)

        setattr(owner, attr, timed)

    # Module globals, looked up at each call by paged_attention: patched here, seen there.
    wrap(paged_attention, "_decode_attention", "paged attention")
    wrap(paged_attention, "gather", "  of it: KV gather")
    wrap(runner.sampler, "sample_with_logprobs", "sampling")


def tiny_model_dir(folder: Path) -> Path:
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**cast(dict[str, Any], TINY_LLAMA))).save_pretrained(folder)
    return folder


def profile_point(
    model_dir: Path, seqs: int, prompt: int, steps: int, kernels: str, impl: ModelImpl
) -> dict[str, float]:
    config = RunnerConfig(
        str(model_dir), seqs * 16, BLOCK, "cpu", "float32", 1, cpu_kernels=kernels, model_impl=impl
    )
    runner = ModelRunner.load(config)
    clock = Clock()
    instrument(runner, clock)
    scheduling = SchedulerConfig(
        max_num_seqs=seqs,
        max_num_batched_tokens=seqs * prompt,
        max_model_len=prompt + 2 * steps + 16,
        num_blocks=runner.num_blocks,
        block_size=BLOCK,
    )
    scheduler = Scheduler(scheduling)
    params = SamplingParams(max_tokens=2 * steps + 8, temperature=0.0, ignore_eos=True)
    vocab = runner.vocab_size
    for i in range(seqs):
        ids = [(17 + 31 * i + 7 * j) % vocab for j in range(prompt)]
        assert scheduler.add_request(AddRequest(f"r{i}", ids, params, 0.0), 0.0) is None
    plain: list[float] = []
    timed: list[float] = []
    engine: list[float] = []
    now = 0.0
    for n in range(2 * steps + 4):  # the prefill, 3 warm decode steps, then plain and timed in turn
        now += 1.0
        started = time.perf_counter()
        step = scheduler.schedule(now)
        scheduled = time.perf_counter() - started
        measured = n >= 4
        instrumented = measured and n % 2 == 1
        if measured and not instrumented:
            assert step.total_num_scheduled_tokens == seqs, "every sequence decodes in one step"
        clock.on = instrumented
        started = time.perf_counter()
        if instrumented:
            with clock.span("runner outside the model"):
                result = runner.run(step)
        else:
            result = runner.run(step)
        spent = time.perf_counter() - started
        clock.on = False
        started = time.perf_counter()
        scheduler.update_from_output(step, result.sampled)
        updated = time.perf_counter() - started
        if measured:
            (timed if instrumented else plain).append(spent)
            engine.append(scheduled + updated)
    out = {part: clock.totals[part] / len(timed) for part in PARTS}
    out["paged attention"] += out["  of it: KV gather"]  # shown inclusive, the gather as its share
    out["step (plain)"] = statistics.median(plain)
    out["step (instrumented)"] = statistics.mean(timed)
    out["engine core"] = statistics.median(engine)
    return out


def profile_prefill(
    model_dir: Path, seqs: int, prompt: int, kernels: str, impl: ModelImpl
) -> dict[str, float]:
    """One step prefilling ``seqs`` prompts of ``prompt`` tokens, instrumented, after one such step
    that warms the runner up (each on a fresh scheduler, so both get the same blocks)."""
    config = RunnerConfig(
        str(model_dir), seqs * 16, BLOCK, "cpu", "float32", 1, cpu_kernels=kernels, model_impl=impl
    )
    runner = ModelRunner.load(config)
    clock = Clock()
    instrument(runner, clock)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    spent = 0.0
    for rep in range(2):
        scheduling = SchedulerConfig(
            max_num_seqs=seqs,
            max_num_batched_tokens=seqs * prompt,
            max_model_len=prompt + 16,
            num_blocks=runner.num_blocks,
            block_size=BLOCK,
        )
        scheduler = Scheduler(scheduling)
        for i in range(seqs):
            ids = [(17 + 31 * i + 7 * j + rep) % runner.vocab_size for j in range(prompt)]
            assert scheduler.add_request(AddRequest(f"w{rep}-{i}", ids, params, 0.0), 0.0) is None
        step = scheduler.schedule(1.0)
        assert step.total_num_scheduled_tokens == seqs * prompt, "every prompt in one step"
        clock.on = rep == 1
        started = time.perf_counter()
        with clock.span("runner outside the model"):
            runner.run(step)
        spent = time.perf_counter() - started
        clock.on = False
    out = {part: clock.totals[part] for part in PARTS}
    out["paged attention"] += out["  of it: KV gather"]
    out["step (instrumented)"] = spent
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", default="tiny:32,tiny:128,smollm2:8,smollm2:32")
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--prefill", action="store_true", help="profile one step prefilling every prompt instead of decode"
    )
    parser.add_argument(
        "--cpu-kernels",
        default="auto",
        choices=("auto", "native", "torch"),
        help="the runner's CPU fast paths (native kernels, packed linears; auto: where they build), torch's",
    )
    parser.add_argument(
        "--model-impl",
        default="auto",
        choices=("auto", "trioserve", "transformers"),
        help="the model's implementation (worker/model_loader.py)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        "uptime (start):",
        subprocess.run(["uptime"], check=False, capture_output=True, text=True).stdout.strip(),
    )
    points = [(p.split(":")[0], int(p.split(":")[1])) for p in args.points.split(",")]
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {"tiny": tiny_model_dir(Path(tmp)), "smollm2": ensure_default_model()}
        for name, seqs in points:
            if args.prefill:
                results[f"{name} @ {seqs}"] = profile_prefill(
                    dirs[name], seqs, args.prompt, args.cpu_kernels, args.model_impl
                )
            else:
                results[f"{name} @ {seqs}"] = profile_point(
                    dirs[name], seqs, args.prompt, args.steps, args.cpu_kernels, args.model_impl
                )
    print(
        "uptime (end):",
        subprocess.run(["uptime"], check=False, capture_output=True, text=True).stdout.strip(),
    )
    heads = list(results)
    if args.prefill:
        print(f"\nms in one step prefilling every prompt ({args.prompt} tokens each, instrumented, after "
              f"one warm-up step; --cpu-kernels {args.cpu_kernels}; --model-impl {args.model_impl}; "
              "% of the step)\n")  # fmt: skip
        print("| part | " + " | ".join(heads) + " |")
        print("|---|" + "---|" * len(heads))
        for part in [*PARTS, "step (instrumented)"]:
            cells = [
                f"{r[part] * 1e3:.1f} ({100 * r[part] / r['step (instrumented)']:.0f} %)"
                for r in results.values()
            ]
            print(f"| {part.strip()} | " + " | ".join(cells) + " |")
        return
    print(f"\nms per decode step ({args.steps} plain and {args.steps} instrumented steps, "
          f"{args.prompt}-token prompts, --cpu-kernels {args.cpu_kernels}, --model-impl {args.model_impl}; "
          "% of the instrumented step)\n")  # fmt: skip
    print("| part | " + " | ".join(heads) + " |")
    print("|---|" + "---|" * len(heads))
    for part in PARTS:
        cells = [
            f"{r[part] * 1e3:.2f} ({100 * r[part] / r['step (instrumented)']:.0f} %)"
            for r in results.values()
        ]
        print(f"| {part.strip()} | " + " | ".join(cells) + " |")
    for row in ("step (instrumented)", "step (plain)", "engine core"):
        print(f"| {row} | " + " | ".join(f"{r[row] * 1e3:.2f}" for r in results.values()) + " |")
    overhead = [r["step (instrumented)"] / r["step (plain)"] for r in results.values()]
    print(
        "\ninstrumented / plain: " + ", ".join(f"{h}: {o:.2f}x" for h, o in zip(heads, overhead, strict=True))
    )


if __name__ == "__main__":
    main()
