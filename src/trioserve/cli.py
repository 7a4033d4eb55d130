"""Command line: ``trioserve serve`` and the processes it starts (``engine-core``, ``worker``,
``mock-engine``); builds the one typed config of each."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import fields
from typing import Any, NoReturn, TypeVar

from trioserve.config import MockEngineConfig, ServeConfig
from trioserve.engine.core import EngineCoreConfig
from trioserve.engine.scheduler import SchedulerConfig
from trioserve.engine.worker_executor import WorkerExecutorConfig, step_slot_bytes
from trioserve.frontend.stream_policy import StreamPolicy

T = TypeVar("T")


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr and exit code 2 (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _stream_policy(text: str) -> StreamPolicy:
    try:
        return StreamPolicy.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


_DTYPES = ["auto", "float32", "bfloat16", "float16"]


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port (0-65535), got {text}")
    return value


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="trioserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible API server and its engine")
    serve.add_argument("model", nargs="?", default=None, help="Hugging Face folder (default: embedded)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=_port, default=8000)
    serve.add_argument(
        "--engine",
        choices=["model", "mock", "reference", "external"],
        default="model",
        help="model (default): an engine core running the model on a worker process; mock: the mock "
        "engine core (random tokens on a step clock); reference: an engine core with the "
        "deterministic reference executor; external: wait for engine cores at --handshake-address",
    )
    serve.add_argument("--handshake-address", default=None, help="ZMQ address engine cores join")
    serve.add_argument("--tokenizer", default=None, help="Hugging Face tokenizer folder")
    serve.add_argument("--served-model-name", nargs="+", default=None)
    serve.add_argument("--max-model-len", type=_positive, default=8192)
    serve.add_argument("--max-num-seqs", type=_positive, default=1024)
    serve.add_argument(
        "--renderer-num-workers", type=_non_negative, default=1, help="threads; 0 = on the event loop"
    )
    serve.add_argument("--max-request-body-bytes", type=_positive, default=4 * 1024 * 1024)
    serve.add_argument(
        "--max-connections",
        type=_non_negative,
        default=0,
        help="client connections an API server holds open; one more is closed at once "
        "(counted in /metrics as trioserve:connections_refused_total). 0: no limit (default)",
    )
    serve.add_argument("--max-n", type=_positive, default=16, help="largest accepted `n`")
    serve.add_argument("--output-queue-size", type=_positive, default=2, help="engine steps")
    serve.add_argument(
        "--output-queue-policy", choices=["coalesce", "block", "unbounded"], default="coalesce"
    )
    serve.add_argument(
        "--stream-policy",
        type=_stream_policy,
        default=StreamPolicy(),
        metavar="{merge,queue:N,stall,abort-slow-client}",
        help="what a response does when its client is slower than the engine (default merge)",
    )
    serve.add_argument("--slow-client-max-tokens", type=_positive, default=256)
    serve.add_argument("--engine-output-hwm", type=_non_negative, default=64, help="steps; 0 = unbounded")
    serve.add_argument("--engine-output-policy", choices=["fold", "block"], default="fold")
    serve.add_argument(
        "--max-concurrent-requests",
        type=_non_negative,
        default=2048,
        help="per API server; 0 = no limit (429)",
    )
    serve.add_argument(
        "--max-pending-renders", type=_non_negative, default=256, help="requests queued to render (503)"
    )
    serve.add_argument(
        "--max-num-seqs-waiting", type=_non_negative, default=1024, help="engine waiting-queue cap (503)"
    )
    serve.add_argument(
        "--max-loop-lag-ms", type=float, default=500.0, help="shed new requests above this loop lag; 0 = off"
    )
    serve.add_argument(
        "--max-output-delay-ms",
        type=float,
        default=200.0,
        help="shed new requests (503) while engine output waits longer than this before the output "
        "handler takes it, until it is back under half; 0 = off",
    )
    serve.add_argument("--shutdown-timeout", type=float, default=5.0)
    serve.add_argument("--engine-ready-timeout", type=float, default=120.0)
    serve.add_argument(
        "--engine-restart",
        choices=["always", "never"],
        default="always",
        help="when the engine core dies (exits, or reports a fatal error such as a dead worker): "
        "always (default): fail the requests in flight, answer 503 with Retry-After, and start a new "
        "engine core and workers after a backoff (0.5 s doubling to 30 s; back to 0.5 s once an engine "
        "has run for 60 s); never: fail the requests in flight, drain and exit with code 1, for a "
        "supervisor that restarts processes. Not for --engine external",
    )
    serve.add_argument("--vocab-size", type=_positive, default=32000, help="mock engine vocabulary")
    serve.add_argument("--step-interval-us", type=_non_negative, default=0, help="mock engine step clock")
    serve.add_argument("--mock-seed", type=int, default=0)
    _add_engine_core_flags(serve)
    _add_common(serve)

    mock = sub.add_parser("mock-engine", help="run a mock engine core that joins an API server")
    mock.add_argument("--handshake-address", required=True)
    mock.add_argument("--engine-index", type=_non_negative, default=0)
    mock.add_argument("--vocab-size", type=_positive, default=32000)
    mock.add_argument("--step-interval-us", type=_non_negative, default=0)
    mock.add_argument("--max-num-seqs", type=_positive, default=1024)
    mock.add_argument("--max-model-len", type=_positive, default=8192)
    mock.add_argument("--seed", type=int, default=0)
    mock.add_argument("--output-hwm", type=_non_negative, default=64, help="steps; 0 = unbounded")
    mock.add_argument("--output-policy", choices=["fold", "block"], default="fold")
    _add_common(mock)

    core = sub.add_parser("engine-core", help="run an engine core that joins an API server")
    core.add_argument("--handshake-address", required=True)
    core.add_argument(
        "--model", default=None, help="run this model on a worker (default: reference executor)"
    )
    core.add_argument("--engine-index", type=_non_negative, default=0)
    core.add_argument("--max-num-seqs", type=_positive, default=256)
    core.add_argument("--max-model-len", type=_positive, default=8192)
    core.add_argument("--vocab-size", type=_positive, default=32000)
    _add_engine_core_flags(core)
    core.add_argument("--output-hwm", type=_non_negative, default=64, help="steps; 0 = unbounded")
    core.add_argument("--output-policy", choices=["fold", "block"], default="fold")
    _add_common(core)

    worker = sub.add_parser("worker", help="a worker process (started by an engine core)")
    worker.add_argument("--model", required=True)
    worker.add_argument("--steps-ring", required=True, help="ring handle (JSON) of the step ring")
    worker.add_argument("--results-ring", default=None, help="ring handle (JSON); output rank only")
    worker.add_argument("--rank", type=_non_negative, default=0)
    worker.add_argument("--block-size", type=_positive, default=16)
    worker.add_argument("--num-blocks", type=_non_negative, default=0)
    worker.add_argument("--kv-cache-bytes", type=_positive, default=2 << 30)
    worker.add_argument("--device", default="auto")
    worker.add_argument("--dtype", default="auto", choices=_DTYPES)
    worker.add_argument("--num-threads", type=_non_negative, default=0)
    _add_common(worker)
    return parser


def _add_engine_core_flags(p: argparse.ArgumentParser) -> None:
    """Scheduler and KV-ledger flags, shared by ``serve`` (passed on) and ``engine-core``."""
    p.add_argument("--block-size", type=_positive, default=16)
    p.add_argument(
        "--num-gpu-blocks-override",
        type=_non_negative,
        default=0,
        help="KV blocks in the pool (0: model: what --kv-cache-gib holds; reference: 4096)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=_positive,
        default=2048,
        help="tokens per engine step; longer prompts are prefilled in chunks between decodes",
    )
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs")
    p.add_argument(
        "--step-time-us", type=_non_negative, default=0, help="reference executor: time per forward"
    )
    p.add_argument("--device", default="auto", help="model: cpu, cuda, cuda:N (auto: cuda when present)")
    p.add_argument("--dtype", default="auto", choices=_DTYPES, help="model weights and KV cache")
    p.add_argument("--kv-cache-gib", type=_positive_float, default=2.0, help="model: KV-cache memory")
    p.add_argument(
        "--worker-threads", type=_non_negative, default=0, help="model: torch CPU threads (0: cores - 1)"
    )
    p.add_argument(
        "--worker-step-timeout",
        type=_positive_float,
        default=300.0,
        help="seconds before a hung step fails its engine (model), and before an engine core that "
        "sends nothing (stopped or hung) is killed and restarted (any engine)",
    )


def _from_namespace(cls: type[T], ns: argparse.Namespace, **overrides: Any) -> T:
    """Each config field takes the flag of the same name (flags and fields are named alike)."""
    values = {f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)}  # type: ignore[arg-type]
    return cls(**{**values, **overrides})


def serve_config(ns: argparse.Namespace) -> ServeConfig:
    return _from_namespace(ServeConfig, ns, served_model_name=tuple(ns.served_model_name or ()))


def engine_core_config(ns: argparse.Namespace) -> EngineCoreConfig:
    scheduler = SchedulerConfig(
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        max_model_len=ns.max_model_len,
        num_blocks=ns.num_gpu_blocks_override or 4096,
        block_size=ns.block_size,
        policy=ns.scheduling_policy,
    )
    return EngineCoreConfig(
        handshake_address=ns.handshake_address,
        scheduler=scheduler,
        vocab_size=ns.vocab_size,
        engine_index=ns.engine_index,
        output_hwm=ns.output_hwm,
        output_policy=ns.output_policy,
    )


def worker_executor_config(ns: argparse.Namespace) -> WorkerExecutorConfig | None:
    if ns.model is None:
        return None
    return WorkerExecutorConfig(
        model=ns.model,
        block_size=ns.block_size,
        num_blocks=ns.num_gpu_blocks_override,
        kv_cache_bytes=int(ns.kv_cache_gib * (1 << 30)),
        device=ns.device,
        dtype=ns.dtype,
        num_threads=ns.worker_threads,
        step_timeout=ns.worker_step_timeout,
        step_slot_bytes=step_slot_bytes(
            ns.max_num_batched_tokens, ns.max_num_seqs, ns.max_model_len, ns.block_size
        ),
        log_level=ns.log_level,
    )


def mock_engine_config(ns: argparse.Namespace) -> MockEngineConfig:
    return _from_namespace(MockEngineConfig, ns)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command == "serve":
        if ns.engine == "external" and not ns.handshake_address:
            parser.error("--engine external needs --handshake-address")
        config = serve_config(ns)
        from trioserve.launch.serve import run_serve

        return run_serve(config)
    if ns.command == "engine-core":
        from trioserve.engine.main import run_engine_core

        return run_engine_core(
            engine_core_config(ns), worker_executor_config(ns), ns.step_time_us / 1e6, ns.log_level
        )
    if ns.command == "worker":
        from trioserve.worker.main import WorkerConfig, run_worker

        return run_worker(_from_namespace(WorkerConfig, ns))
    from trioserve.mock.main import run_mock_engine

    return run_mock_engine(mock_engine_config(ns))


if __name__ == "__main__":
    sys.exit(main())
