"""Closed-loop load generator for streamed OpenAI chat and text completions (SSE or WebSocket).

Each of N clients (``--max-concurrency``) keeps one keep-alive connection, sends a streaming request,
reads the stream to its end (``data: [DONE]`` and the end of the chunked body over SSE, the ``done``
message over ``/v1/ws``), and sends the next request at once. The I/O side is deliberately minimal so that
the client is never the bottleneck: non-blocking stdlib sockets driven by ``trio.lowlevel.wait_readable``
(by default one ``epoll`` set for all of them), a hand-written status-line / header / chunked / SSE /
WebSocket-frame reader, and one ``msgspec`` decode per event into a struct that only keeps
``choices[].token_ids`` and the text.

Requests ask for ``return_token_ids``, so every event's token count is exact (tokens per event). Per
request it records TTFT, every inter-token gap (ITL) and its event count; failures are refused
connections (``connect``), HTTP errors (``http NNN``), truncated streams and stream error events. A request
refused with 429 or 503 (admission control) is counted as *rejected*, not as a failure, and that client
waits the response's ``Retry-After`` seconds (1 s if absent, at most ``--max-backoff``) before its next
request, as a real client backs off.

Two ways to run:

- ``--num-prompts N`` (vllm-bench's shape): send exactly N requests, then stop. Throughput is counted over
  the steady-state window: from the first to the last 0.1 s sample at which at least 95% of the target
  concurrency was in flight. TTFT, TPOT and ITL are over the requests sent inside that window.
- otherwise (``--duration``): after ``--warmup`` and once 95% of the clients are in flight, measure a
  window of ``--duration`` seconds.

Prompts are either exact token counts made with the configured tokenizer (``--random-input-len``,
``--random-output-len``, ``--random-range-ratio``, ``--tokenizer``; default the built-in Qwen3 tokenizer
that ``trioserve`` caches) or ``--input-words`` random words. ``--request-rate R`` spreads the first
connections at R per second; the concurrency cap does the rest.

CPU time (``utime + stime`` from ``/proc/PID/stat``) of processes named with ``--watch NAME=PID`` and of
the load generator itself is measured over the same window. The result is written as JSON
(``LoadResult``); ``--save-detailed PATH`` also writes every request (TTFT, ITL gaps, tokens, events).

    python bench/sse_loadgen.py --port 8000 --max-concurrency 256 --num-prompts 1536 \
        --random-input-len 256 --random-output-len 256 --request-rate 400 --watch server=1234
    python bench/sse_loadgen.py --port 8000 --clients 256 --duration 10 --transport ws --endpoint completions

The code lives in three modules beside this one, layered without cycles: ``loadgen_wire.py`` (the
HTTP/chunked/SSE and WebSocket readers, bytes only), ``loadgen_report.py`` (``LoadResult``, the
statistics, ``--save-detailed``, the /proc CPU readers) and ``loadgen_loop.py`` (the prompts, ``LoadGen``
and the two run modes, above both). This file is the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import urllib.request

import msgspec
import trio

from loadgen_loop import LoadGen, run_load, run_prompts, token_prompts, word_prompts
from loadgen_report import LoadResult, proc_stat_fields, save_detailed
from loadgen_wire import HIST_MAX, MAX_BACKOFF_S

# Names other bench scripts imported from here before the split; they now import from the modules
# above, and these stay importable for anything that still uses the old place.
__all__ = ["HIST_MAX", "LoadResult", "main", "proc_stat_fields", "served_model"]


def raise_nofile_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _parse_watch(items: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        name, _, pid = item.partition("=")
        out[name] = int(pid)
    return out


def served_model(host: str, port: int) -> str | None:
    """The first model id of ``GET /v1/models``; None if the server does not say."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/v1/models", timeout=5.0) as resp:
            data = json.loads(resp.read())
        return str(data["data"][0]["id"])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    ap.add_argument(
        "--clients",
        "--max-concurrency",
        dest="clients",
        type=int,
        default=256,
        help="closed-loop clients: requests in flight at most, one connection each",
    )
    ap.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="send this many requests, then stop; steady-state window (default: --duration mode)",
    )
    ap.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="first connections per second (spreads the start; overrides --ramp)",
    )
    ap.add_argument(
        "--endpoint",
        choices=("chat", "completions"),
        default="chat",
        help="/v1/chat/completions or /v1/completions",
    )
    ap.add_argument(
        "--transport",
        choices=("sse", "ws"),
        default="sse",
        help="HTTP + SSE, or one WebSocket per client on --ws-path (docs/websocket.md)",
    )
    ap.add_argument("--ws-path", default="/v1/ws")
    ap.add_argument(
        "--list-models-first",
        action="store_true",
        help="each connection sends GET /v1/models before its first completion (an SDK-style pooled client)",
    )
    ap.add_argument(
        "--output-len",
        "--random-output-len",
        dest="output_len",
        type=int,
        default=256,
        help="max_tokens per request (mean, with --random-range-ratio)",
    )
    ap.add_argument(
        "--random-input-len",
        type=int,
        default=None,
        help="prompt tokens per request (mean), made with --tokenizer; default: --input-words words",
    )
    ap.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="input/output lengths uniform in [len*(1-r), len*(1+r)]",
    )
    ap.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer.json or a folder with one (default: trioserve's built-in Qwen3)",
    )
    ap.add_argument(
        "--input-words", type=int, default=200, help="words per prompt without --random-input-len"
    )
    ap.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask for exactly max_tokens tokens",
    )
    ap.add_argument("--seed", type=int, default=0, help="prompt and length seed")
    ap.add_argument(
        "--logprobs", type=int, default=None, metavar="K", help="ask for logprobs, K alternatives per token"
    )
    ap.add_argument("--ramp", type=float, default=1.0, help="stagger connection starts over this many s")
    ap.add_argument("--warmup", type=float, default=3.0, help="duration mode: seconds before the window")
    ap.add_argument("--duration", type=float, default=10.0, help="duration mode: measurement window, s")
    ap.add_argument("--grace", type=float, default=10.0, help="duration mode: max wait for in-window TTFTs")
    ap.add_argument("--max-duration", type=float, default=600.0, help="--num-prompts mode: stop after this")
    ap.add_argument("--watch", action="append", default=[], metavar="NAME=PID", help="measure CPU of PID")
    ap.add_argument("--io", choices=("epoll", "tasks"), default="epoll", help="client I/O strategy")
    ap.add_argument(
        "--max-backoff", type=float, default=MAX_BACKOFF_S, help="cap on the Retry-After wait after 429/503"
    )
    ap.add_argument("--cpu", type=int, default=None, help="pin this process to one CPU core")
    ap.add_argument("--result-file", default=None, help="write the JSON result here (default: stdout)")
    ap.add_argument(
        "--save-detailed",
        default=None,
        metavar="PATH",
        help="write every request (TTFT, ITL gaps, tokens, events, error) as JSON here",
    )
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = ap.parse_args(argv)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    if args.num_prompts is not None and args.num_prompts < 1:
        ap.error("--num-prompts must be at least 1")
    raise_nofile_limit()
    ramp = args.ramp if args.request_rate is None else args.clients / args.request_rate
    model = args.model or served_model(args.host, args.port) or "mock"
    n_prompts = args.num_prompts or args.clients
    if args.random_input_len is not None:
        prompts = token_prompts(
            n_prompts,
            args.random_input_len,
            args.output_len,
            args.random_range_ratio,
            args.tokenizer,
            args.seed,
        )
    else:
        prompts = word_prompts(
            n_prompts, args.input_words, args.output_len, args.random_range_ratio, args.seed
        )
    gen = LoadGen(
        host=args.host,
        port=args.port,
        clients=args.clients,
        model=model,
        output_len=args.output_len,
        io=args.io,
        max_backoff_s=args.max_backoff,
        prompts=prompts,
        num_prompts=args.num_prompts,
        endpoint=args.endpoint,
        transport=args.transport,
        ignore_eos=args.ignore_eos,
        ws_path=args.ws_path,
        list_models_first=args.list_models_first,
        logprobs=args.logprobs,
    )
    watch = _parse_watch(args.watch)
    if args.num_prompts is not None:
        result = trio.run(
            lambda: run_prompts(
                gen, ramp_s=ramp, watch=watch, max_duration_s=args.max_duration, log=not args.quiet
            )
        )
    else:
        result = trio.run(
            lambda: run_load(
                gen,
                ramp_s=ramp,
                warmup_s=args.warmup,
                duration_s=args.duration,
                watch=watch,
                grace_s=args.grace,
                log=not args.quiet,
            )
        )
    data = msgspec.json.encode(result)
    if args.result_file:
        with open(args.result_file, "wb") as f:
            f.write(data)
    else:
        sys.stdout.buffer.write(msgspec.json.format(data) + b"\n")
    if args.save_detailed:
        save_detailed(args.save_detailed, gen, result, gen.t_start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
