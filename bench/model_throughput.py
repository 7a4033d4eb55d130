"""Decode throughput and TTFT of a real model, side by side with transformers and vLLM (issue 4, item 6).

One run, the same prompts (random token ids, ``--prompt-len`` each) and the same output length
(``--output-len``, EOS ignored, greedy) at each concurrency in ``--streams``, against:

- trioserve: ``python -m trioserve serve MODEL`` (API server → engine core → worker over shared memory);
- transformers' own continuous batching, ``model.generate_batch`` (transformers.generation.
  continuous_batching), in a child process;
- vLLM 0.32.0's CPU build, ``vllm serve MODEL`` from the venv ``bench/peers/install_vllm.sh`` makes
  (skipped, and said so, when that venv is missing).

The core budget is the same for all three: the model runs on one torch thread bound to ``--model-cpu``
(vLLM's default on this machine), and everything else (API server, engine core, the HTTP client) on
``--api-cpu``. For trioserve that means the serve process starts on ``--api-cpu`` and its worker and the
worker's threads are moved to ``--model-cpu`` once it is up.

Per point: tokens/s = all generated tokens / (last stream's end - first stream's start), with every
stream started at once; TTFT p50 over the streams (it includes waiting for the other prompts' prefill,
as it would for real clients arriving together).

    .venv/bin/python bench/model_throughput.py                   # SmolLM2-135M-Instruct, 1/8/32 streams
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from frontend_cost import cmdline, descendants, free_port, managed, spawn, wait_healthy

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_VLLM_VENV = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / (
    "trioserve/peers/vllm-0.32.0-cpu"
)


@dataclass
class Point:
    system: str
    streams: int
    tokens: int
    seconds: float
    ttft_p50: float
    ttft_max: float
    model_busy: float = float("nan")  # trioserve: the worker's CPU time / wall time over the point

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def make_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(count)]


# --------------------------------------------------------------------------------------------------
# HTTP servers (trioserve and vLLM speak the same API)
# --------------------------------------------------------------------------------------------------


def one_stream(port: int, model: str, prompt: list[int], output_len: int) -> tuple[float, float, float, int]:
    """(start, first token, end, completion tokens) of one streamed completion."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    start = time.perf_counter()
    first = 0.0
    tokens = 0
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
        for raw in response:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif not first and any(c.get("text") for c in chunk.get("choices", ())):
                first = time.perf_counter()
    finally:
        conn.close()
    return start, first, time.perf_counter(), tokens


def run_http_point(system: str, port: int, model: str, prompts: list[list[int]], output_len: int) -> Point:
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: one_stream(port, model, p, output_len), prompts))
    start = min(r[0] for r in results)
    ttfts = [r[1] - r[0] for r in results]
    return Point(
        system,
        len(prompts),
        sum(r[3] for r in results),
        max(r[2] for r in results) - start,
        statistics.median(ttfts),
        max(ttfts),
    )


def pin_tree(pid: int, cpu: int) -> None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), {cpu})


def find_titled(root: int, title: str, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in descendants(root):
            if cmdline(pid).startswith(title):
                return pid
        time.sleep(0.2)
    raise RuntimeError(f"no {title} under pid {root}")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all threads (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def served_name(port: int) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/v1/models")
    name: str = json.loads(conn.getresponse().read())["data"][0]["id"]
    conn.close()
    return name


def bench_server(
    system: str, argv: list[str], args: argparse.Namespace, prompts: dict[int, list[list[int]]], log_dir: Path
) -> list[Point]:
    points: list[Point] = []
    with managed([]) as procs:
        port = int(argv[argv.index("--port") + 1])
        server = spawn(system.lower(), argv, args.api_cpu, log_dir)
        procs.append(server)
        print(f"[{system}] starting (pid {server.pid}, port {port})", file=sys.stderr)
        wait_healthy(server, port, args.startup_timeout)
        worker = 0
        if system.startswith("trioserve"):
            worker = find_titled(server.pid, "trioserve::Worker")
            pin_tree(worker, args.model_cpu)
            print(f"[{system}] worker {worker} moved to cpu {args.model_cpu}", file=sys.stderr)
        model = served_name(port)
        run_http_point(system, port, model, prompts[1][:1], 4)  # warm-up
        for n in args.streams:
            busy_before = cpu_seconds(worker) if worker else 0.0
            point = run_http_point(system, port, model, prompts[n], args.output_len)
            if worker:
                point.model_busy = (cpu_seconds(worker) - busy_before) / point.seconds
            print(
                f"[{system}] {n} streams: {point.tokens_per_s:.1f} tok/s, TTFT p50 {point.ttft_p50:.2f} s",
                file=sys.stderr,
            )
            points.append(point)
    return points


# --------------------------------------------------------------------------------------------------
# transformers' continuous batching, in a child pinned to the model core
# --------------------------------------------------------------------------------------------------


def transformers_child(model_dir: str, prompts_path: str, output_len: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=None)
    prompts: dict[str, list[list[int]]] = json.loads(Path(prompts_path).read_text())
    first = next(iter(prompts.values()))
    model.generate_batch(first[:1], generation_config=config, progress_bar=False)  # warm-up
    for n, batch in prompts.items():
        started = time.perf_counter()
        out = model.generate_batch(
            batch, generation_config=config, record_timestamps=True, progress_bar=False
        )
        seconds = time.perf_counter() - started
        ttfts = [o.timestamps[0] - o.created_time for o in out.values() if o.timestamps]
        tokens = sum(len(o.generated_tokens) for o in out.values())
        point = Point("transformers", int(n), tokens, seconds, statistics.median(ttfts), max(ttfts))
        print(json.dumps(asdict(point)), flush=True)


def bench_transformers(
    args: argparse.Namespace, prompts: dict[int, list[list[int]]], log_dir: Path
) -> list[Point]:
    prompts_path = log_dir / "prompts.json"
    prompts_path.write_text(json.dumps({str(n): prompts[n] for n in args.streams}))
    argv = [
        "taskset",
        "-c",
        str(args.model_cpu),
        sys.executable,
        __file__,
        "--transformers-child",
        args.model,
    ]
    argv += ["--prompts-file", str(prompts_path), "--output-len", str(args.output_len)]
    print("[transformers] generate_batch in a child on cpu", args.model_cpu, file=sys.stderr)
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=3600)
    points = [Point(**json.loads(line)) for line in out.stdout.splitlines() if line.startswith("{")]
    for p in points:
        print(
            f"[transformers] {p.streams} streams: {p.tokens_per_s:.1f} tok/s, TTFT p50 {p.ttft_p50:.2f} s",
            file=sys.stderr,
        )
    return points


# --------------------------------------------------------------------------------------------------


def table(points: list[Point], streams: list[int]) -> str:
    by = {(p.system, p.streams): p for p in points}
    systems = [s for s in ("trioserve", "transformers", "vLLM") if any(p.system == s for p in points)]
    head = ["streams"]
    for s in systems:
        head += [f"{s} tok/s", f"{s} TTFT p50 s"]
    head += [f"trioserve / {s}" for s in systems[1:]]
    head.append("trioserve model core busy")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in streams:
        row = [str(n)]
        for s in systems:
            p = by.get((s, n))
            row += [f"{p.tokens_per_s:.1f}", f"{p.ttft_p50:.2f}"] if p else ["-", "-"]
        ours = by.get(("trioserve", n))
        for s in systems[1:]:
            peer = by.get((s, n))
            ok = ours and peer and peer.tokens_per_s
            row.append(f"{ours.tokens_per_s / peer.tokens_per_s:.2f}x" if ok else "-")  # type: ignore[union-attr]
        row.append(f"{ours.model_busy:.0%}" if ours else "-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="HF folder (default: the embedded SmolLM2)")
    ap.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--model-cpu", type=int, default=0)
    ap.add_argument("--api-cpu", type=int, default=1)
    ap.add_argument("--vllm-venv", default=str(DEFAULT_VLLM_VENV))
    ap.add_argument("--skip", action="append", default=[], choices=["trioserve", "transformers", "vllm"])
    ap.add_argument(
        "--serve-arg", action="append", default=[], help="one more argument for trioserve serve (repeatable)"
    )
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--out", default=str(BENCH_DIR / "results" / "model_throughput"))
    ap.add_argument("--transformers-child", metavar="MODEL", help=argparse.SUPPRESS)
    ap.add_argument("--prompts-file", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.transformers_child:
        transformers_child(args.transformers_child, args.prompts_file, args.output_len)
        return 0
    if args.model is None:
        sys.path.insert(0, str(BENCH_DIR.parent / "src"))
        from trioserve.models.embedded_model import ensure_default_model

        args.model = str(ensure_default_model())
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    prompts = {n: make_prompts(n, args.prompt_len, vocab, seed=n) for n in sorted({1, *args.streams})}
    out = Path(args.out)
    log_dir = out.with_name(out.name + "-logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    points: list[Point] = []
    py = sys.executable
    max_len = str(args.prompt_len + args.output_len + 64)
    if "trioserve" not in args.skip:
        port = free_port()
        argv = [py, "-m", "trioserve", "serve", args.model, "--port", str(port), "--worker-threads", "1"]
        argv += ["--max-model-len", max_len, "--kv-cache-gib", "2", *args.serve_arg]
        points += bench_server("trioserve", argv, args, prompts, log_dir)
    if "transformers" not in args.skip:
        points += bench_transformers(args, prompts, log_dir)
    vllm = Path(args.vllm_venv) / "bin" / "vllm"
    if "vllm" not in args.skip and vllm.exists():
        port = free_port()
        env = [
            "env",
            "HF_HUB_OFFLINE=1",
            "VLLM_CPU_KVCACHE_SPACE=2",
            f"VLLM_CPU_OMP_THREADS_BIND={args.model_cpu}",
        ]
        env += ["VLLM_NO_USAGE_STATS=1"]
        argv = [*env, str(vllm), "serve", args.model, "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--max-model-len", max_len, "--enforce-eager", "--dtype", "float32"]
        points += bench_server("vLLM", argv, args, prompts, log_dir)
    elif "vllm" not in args.skip:
        print(f"[vLLM] skipped: {vllm} not found (bash bench/peers/install_vllm.sh)", file=sys.stderr)
    text = (
        f"model {args.model}; prompt {args.prompt_len} tokens, output {args.output_len} tokens (greedy, EOS "
        f"ignored); model on 1 thread on cpu {args.model_cpu}, the rest on cpu {args.api_cpu}\n\n"
        + table(points, args.streams)
    )
    print(text)
    out.with_suffix(".md").write_text(text + "\n")
    out.with_suffix(".json").write_text(json.dumps([asdict(p) for p in points], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
