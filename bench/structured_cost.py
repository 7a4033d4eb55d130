"""What structured output costs a decode step (issue 17, item 4), on the worker's own runner with the
embedded model, in this process.

Three batches, decoded side by side (their steps interleaved round by round, so drift in the machine's
load lands on all three alike):

- ``32 plain``: 32 unconstrained requests;
- ``32 plain + 8 JSON``: the same 32 and 8 requests constrained by a JSON schema that keeps them
  writing (an array of at least 60 short strings);
- ``40 plain``: 40 unconstrained requests: the same batch size without any grammar.

For each: the median decode-step wall time (``ModelRunner.run``: forward, masks, sampling), and for
the constrained batch the mask thread's time per step (masks and their bias, beside the forward) and
the bias's addition to the logits after it. The grammar's
whole cost per step is ``32 + 8 JSON`` minus ``40 plain``; per constrained request per token, that
over 8. Greedy decoding; one torch thread by default (``--threads``), the mask thread beside it.
``--model tiny`` runs ``bench/peers/tiny_model.py``'s shape (random weights, the embedded model's
49,152-token vocabulary and tokenizer): a step of milliseconds, where the grammar's share shows.

    .venv/bin/python bench/structured_cost.py [--model smollm2|tiny] [--steps 30] [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from step_profile import tiny_model_dir
from trioserve.engine.scheduler import Scheduler, SchedulerConfig
from trioserve.frontend.request.structured import GrammarCache, GrammarSource, checked_grammar
from trioserve.models.embedded_model import ensure_default_model
from trioserve.protocol.messages import AddRequest, SamplingParams
from trioserve.worker import grammar as grammar_module
from trioserve.worker import model_runner as runner_module
from trioserve.worker.model_runner import ModelRunner, RunnerConfig

BLOCK = 16
PROMPT = 24
SCHEMA = {
    "type": "object",
    "properties": {"words": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 60}},
    "required": ["words"],
    "additionalProperties": False,
}


class Timers:
    """Wall time of the mask fills with their bias (on their thread) and of adding the bias, per step."""

    def __init__(self) -> None:
        self.fill = 0.0
        self.apply = 0.0
        fill = grammar_module.GrammarBook._fill
        apply = runner_module.add_bias

        def timed_fill(book: Any, *args: Any) -> Any:
            t = time.perf_counter()
            try:
                return fill(book, *args)
            finally:
                self.fill += time.perf_counter() - t

        def timed_apply(*args: Any) -> None:
            t = time.perf_counter()
            apply(*args)
            self.apply += time.perf_counter() - t

        grammar_module.GrammarBook._fill = timed_fill  # type: ignore[method-assign]
        runner_module.add_bias = timed_apply  # type: ignore[assignment]

    def take(self) -> tuple[float, float]:
        out = (self.fill, self.apply)
        self.fill = self.apply = 0.0
        return out


class Batch:
    def __init__(
        self, runner: ModelRunner, name: str, plain: int, constrained: int, grammar: str, eos: int
    ) -> None:
        self.name = name
        self.runner = runner
        n = plain + constrained
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=n,
                max_num_batched_tokens=n * PROMPT,
                max_model_len=1024,
                num_blocks=runner.num_blocks,
                block_size=BLOCK,
            )
        )
        vocab = runner.vocab_size
        for i in range(n):
            ids = [(17 + 31 * i + 7 * j) % vocab for j in range(PROMPT)]
            if i < plain:
                params = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
            else:
                params = SamplingParams(max_tokens=900, temperature=0.0, grammar=grammar)
            add = AddRequest(f"{name}-{i}", ids, params, 0.0, eos_token_id=eos)
            assert self.scheduler.add_request(add, 0.0) is None
        self.now = 0.0
        self.steps: list[float] = []
        self.fills: list[float] = []
        self.applies: list[float] = []
        self.forwards: list[float] = []

    def step(self, timers: Timers, measured: bool) -> None:
        self.now += 1.0
        out = self.scheduler.schedule(self.now)
        timers.take()
        started = time.perf_counter()
        result = self.runner.run(out)
        spent = time.perf_counter() - started
        fill, apply = timers.take()
        self.scheduler.update_from_output(out, result.sampled)
        if measured:
            self.steps.append(spent)
            self.fills.append(fill)
            self.applies.append(apply)
            self.forwards.append(self.runner.last_seconds or 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="measured decode steps per batch and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"load (1-min average) at start: {os.getloadavg()[0]:.2f}; {args.model}; torch threads {args.threads}"
    )
    folder = ensure_default_model()
    model = tiny_model_dir(Path(tempfile.mkdtemp())) if args.model == "tiny" else folder
    blocks = 40 * 64 * args.rounds
    config = RunnerConfig(str(model), blocks, BLOCK, "cpu", "float32", args.threads, tokenizer=str(folder))
    runner = ModelRunner.load(config)
    grammar = checked_grammar(GrammarCache(), GrammarSource("json_schema", json.dumps(SCHEMA), "bench"))
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(str(folder)).eos_token_id
    timers = Timers()
    specs = [("32 plain", 32, 0), ("32 plain + 8 JSON", 32, 8), ("40 plain", 40, 0)]
    results: dict[str, Batch] = {}
    for r in range(args.rounds):
        batches = [Batch(runner, f"{name}#{r}", p, c, grammar, eos) for name, p, c in specs]
        for b in batches:  # prefill and 3 warm decode steps each
            for _ in range(4):
                b.step(timers, measured=False)
        for _ in range(args.steps):
            for b in batches:
                b.step(timers, measured=True)
        for (name, _, _), b in zip(specs, batches, strict=True):
            if name in results:
                for field in ("steps", "fills", "applies", "forwards"):
                    getattr(results[name], field).extend(getattr(b, field))
            else:
                results[name] = b
    print(f"load (1-min average) at end: {os.getloadavg()[0]:.2f}")
    print(f"\n{args.rounds} rounds x {args.steps} decode steps per batch, medians in ms\n")
    print("| batch | step | forward | masks + bias (thread) | bias added |")
    print("|---|---|---|---|---|")
    for name, b in results.items():
        med = statistics.median
        print(
            f"| {name} | {med(b.steps) * 1e3:.2f} | {med(b.forwards) * 1e3:.2f} | "
            f"{med(b.fills) * 1e3:.2f} | {med(b.applies) * 1e3:.2f} |"
        )
    plain32 = statistics.median(results["32 plain"].steps)
    mixed = statistics.median(results["32 plain + 8 JSON"].steps)
    plain40 = statistics.median(results["40 plain"].steps)
    print(
        f"\ngrammar's cost per step (32 + 8 JSON minus 40 plain): {(mixed - plain40) * 1e3:.2f} ms "
        f"({(mixed / plain40 - 1) * 100:+.1f} %); per constrained request per token: "
        f"{(mixed - plain40) / 8 * 1e6:.0f} µs; 8 more rows of any kind (40 plain minus 32 plain): "
        f"{(plain40 - plain32) * 1e3:.2f} ms"
    )


if __name__ == "__main__":
    main()
