"""xgrammar and llguidance side by side, on the embedded model's tokenizer (issue 17, item 1).

For each engine, in this process, one CPU thread each (``--threads``, both engines' own pools):

- ``tokenizer``: building the engine's view of the vocabulary from the Hugging Face tokenizer (once
  per process);
- ``compile``: a typical JSON schema (an order with a nested object, an array of objects, an enum,
  a nullable field: what a pydantic model gives) compiled from nothing, no cache, until the first
  mask is ready (llguidance builds lazily, so its first mask is part of it);
- ``mask per step``: ``--batch`` requests, each following its own valid instance of the schema token
  by token (different names and numbers, so the requests are in different states), timed per step
  for the whole batch: every request's next-token bitmask filled (the batch entry point of each
  engine), then each request's token accepted;
- ``apply``: turning the batch's bitmask into ``-inf`` on ``[batch, vocab]`` float32 logits here
  (``worker/grammar.py``'s way, the same for both engines).

    .venv/bin/python bench/grammar_engines.py [--batch 32] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

SCHEMA: dict[str, Any] = {
    "title": "Order",
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "email": {"type": "string"}},
            "required": ["name", "email"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1},
                    "price": {"type": "number"},
                },
                "required": ["sku", "quantity", "price"],
                "additionalProperties": False,
            },
        },
        "status": {"enum": ["pending", "shipped", "delivered"]},
        "notes": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["id", "customer", "items", "status", "notes"],
    "additionalProperties": False,
}

NAMES = ["Ada", "Grace", "Linus", "Barbara", "Ken", "Margaret", "Dennis", "Frances"]


def instance(i: int) -> str:
    """The ``i``-th valid instance, compact (accepted whether an engine's whitespace is strict or not)."""
    name = NAMES[i % len(NAMES)] + " " + ["Lovelace", "Hopper", "Torvalds", "Liskov"][i % 4]
    doc = {
        "id": 1000 + 37 * i,
        "customer": {"name": name, "email": f"{name.split()[0].lower()}{i}@example.com"},
        "items": [
            {"sku": f"SKU-{i * 7 + k:04d}", "quantity": 1 + (i + k) % 5, "price": 9.5 + i + k}
            for k in range(1 + i % 3)
        ],
        "status": ["pending", "shipped", "delivered"][i % 3],
        "notes": None if i % 2 else f"leave at door {i}",
    }
    return json.dumps(doc, separators=(",", ":"))


def apply_cost(bitmask: torch.Tensor, vocab: int, repeats: int) -> float:
    from trioserve.worker.grammar import apply_bitmask

    logits = torch.randn(bitmask.shape[0], vocab)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        apply_bitmask(logits, bitmask, list(range(bitmask.shape[0])))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def run_xgrammar(tok: Any, vocab: int, docs: list[list[int]], threads: int) -> dict[str, Any]:
    import xgrammar as xgr

    t_tok, info = timed(lambda: xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab))
    schema = json.dumps(SCHEMA)
    batch = len(docs)
    bitmask = xgr.allocate_token_bitmask(batch, vocab)

    def compile_once() -> Any:
        compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        compiled = compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))
        m = xgr.GrammarMatcher(compiled)
        m.fill_next_token_bitmask(bitmask, 0)
        return compiled

    compiles = [timed(compile_once) for _ in range(3)]
    compiled = compiles[-1][1]
    matchers = [xgr.GrammarMatcher(compiled) for _ in docs]
    batcher = xgr.BatchGrammarMatcher(max_threads=threads)
    steps: list[float] = []
    for pos in range(max(len(d) for d in docs)):
        live = [i for i, d in enumerate(docs) if pos < len(d)]
        t = time.perf_counter()
        batcher.batch_fill_next_token_bitmask([matchers[i] for i in live], bitmask, indices=live)
        for i in live:
            if not matchers[i].accept_token(docs[i][pos]):
                raise RuntimeError(f"xgrammar refused token {pos} of instance {i}")
        steps.append((time.perf_counter() - t, len(live)))  # type: ignore[arg-type]
    return {"tokenizer": t_tok, "compile": [c[0] for c in compiles], "steps": steps, "bitmask": bitmask}


def run_llguidance(tok: Any, vocab: int, docs: list[list[int]], threads: int) -> dict[str, Any]:
    import llguidance
    import llguidance.hf

    t_tok, lltok = timed(lambda: llguidance.hf.from_tokenizer(tok, n_vocab=vocab))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False}
    )
    batch = len(docs)
    words = (vocab + 31) // 32
    bitmask = torch.full((batch, words), -1, dtype=torch.int32)

    def compile_once() -> Any:
        m = llguidance.LLMatcher(lltok, grammar)
        m.unsafe_compute_mask_ptr(bitmask[0].data_ptr(), words * 4)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m

    compiles = [timed(compile_once) for _ in range(3)]
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in docs]
    executor = llguidance.LLExecutor(num_threads=threads)
    steps: list[tuple[float, int]] = []
    for pos in range(max(len(d) for d in docs)):
        live = [i for i, d in enumerate(docs) if pos < len(d)]
        t = time.perf_counter()
        executor.unsafe_compute_mask_ptr(
            [(matchers[i], i) for i in live], bitmask.data_ptr(), words * 4, batch
        )
        for i in live:
            if not matchers[i].consume_token(docs[i][pos]):
                raise RuntimeError(
                    f"llguidance refused token {pos} of instance {i}: {matchers[i].get_error()}"
                )
        steps.append((time.perf_counter() - t, len(live)))
    return {"tokenizer": t_tok, "compile": [c[0] for c in compiles], "steps": steps, "bitmask": bitmask}


def installed_mib(*packages: str) -> float:
    import importlib.util

    total = 0
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.submodule_search_locations is None:
            continue
        for root, _, files in os.walk(next(iter(spec.submodule_search_locations))):
            total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total / (1 << 20)


def import_seconds(module: str) -> float:
    """A fresh interpreter's import of ``module`` after torch and transformers (already paid by the
    worker), minus theirs."""
    code = "import time,torch,transformers;t=time.perf_counter();import {m};print(time.perf_counter()-t)"
    out = subprocess.run(
        [sys.executable, "-c", code.format(m=module)], capture_output=True, text=True, check=True
    )
    return float(out.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    model = args.model
    if not model:
        from trioserve.models.embedded_model import default_model_dir

        model = str(default_model_dir())
    tok = AutoTokenizer.from_pretrained(model)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    docs = [tok.encode(instance(i), add_special_tokens=False) for i in range(args.batch)]
    print(
        f"load: {os.getloadavg()[0]:.2f} (1-min average); vocab {vocab}; batch {args.batch}; "
        f"{statistics.mean(map(len, docs)):.0f} tokens per instance; {args.threads} engine thread(s)"
    )
    rows = []
    for name, fn, pkgs in (
        ("xgrammar", run_xgrammar, ("xgrammar", "triton", "tvm_ffi")),
        ("llguidance", run_llguidance, ("llguidance",)),
    ):
        r = fn(tok, vocab, docs, args.threads)
        full = [t for t, n in r["steps"] if n == args.batch]
        per_token = [t / n for t, n in r["steps"]]
        rows.append(
            (
                name,
                r["tokenizer"] * 1e3,
                statistics.median(r["compile"]) * 1e3,
                statistics.median(full) * 1e3,
                sorted(full)[int(0.99 * (len(full) - 1))] * 1e3,
                statistics.median(per_token) * 1e6,
                apply_cost(r["bitmask"], vocab, 50) * 1e3,
                import_seconds(name),
                installed_mib(*pkgs),
            )
        )
    print(
        f"\n| engine | tokenizer ms | compile ms | {args.batch} masks + accepts per step ms (median) "
        "| p99 ms "
        "| per request per token µs | apply ms | import s | installed MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r[0]} | {r[1]:.0f} | {r[2]:.1f} | {r[3]:.2f} | {r[4]:.2f} | {r[5]:.0f} | {r[6]:.2f} | "
            f"{r[7]:.2f} | {r[8]:.0f} |"
        )


if __name__ == "__main__":
    main()
