"""Typed configuration, built once at the edge (``cli.py``) and passed down as plain values.

Each dataclass is frozen: nothing changes a setting after start-up, so every component can read the
value it was given without re-validating it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from trioserve.frontend.stream_policy import StreamPolicy

EngineKind = Literal["model", "mock", "reference", "external"]


@dataclass(frozen=True, slots=True)
class MockEngineConfig:
    """The mock engine core: instant prefill, random tokens, a fixed step clock (seed 000's tool)."""

    handshake_address: str
    engine_index: int = 0
    vocab_size: int = 32000
    step_interval_us: int = 0  # 0: step as fast as possible
    max_num_seqs: int = 1024
    max_model_len: int = 8192
    seed: int = 0
    log_level: str = "info"
    output_hwm: int = 64  # ZMQ high-water mark of the output socket, in steps; 0 = unbounded (vLLM)
    output_policy: Literal["fold", "block"] = "fold"  # when the HWM is reached: fold steps, or stall


@dataclass(frozen=True, slots=True)
class ServeConfig:
    model: str | None = None  # a Hugging Face folder; None: the embedded default
    host: str = "127.0.0.1"
    port: int = 8000
    engine: EngineKind = "model"
    handshake_address: str | None = None  # for --engine external: where engine cores join
    tokenizer: str | None = None  # a Hugging Face tokenizer folder; None: the model's, or Qwen3's
    served_model_name: tuple[str, ...] = ()
    max_model_len: int = 8192
    max_num_seqs: int = 1024
    renderer_num_workers: int = 1
    max_request_body_bytes: int = 4 * 1024 * 1024
    max_connections: int = 0  # connections an API server holds open; more are closed at once; 0: no limit
    max_n: int = 16
    output_queue_size: int = 2  # engine steps queued between the output pump and output handler
    output_queue_policy: Literal["coalesce", "block", "unbounded"] = "coalesce"
    stream_policy: StreamPolicy = field(default_factory=StreamPolicy)  # output handler -> each request
    slow_client_max_tokens: int = 256  # abort-slow-client: how far behind a client may fall
    engine_output_hwm: int = 64  # ZMQ high-water mark, engine -> API server, in steps; 0 = unbounded
    engine_output_policy: Literal["fold", "block"] = "fold"  # what the engine does when it is reached
    # Admission control (frontend/admission.py says which status each refusal gets and why).
    max_concurrent_requests: int = 2048
    max_pending_renders: int = 256
    max_num_seqs_waiting: int = 1024
    max_loop_lag_ms: float = 500.0
    max_output_delay_ms: float = 200.0  # shed (503) while engine output waits longer here; 0 = off
    shutdown_timeout: float = 5.0
    engine_ready_timeout: float = 120.0
    # When the engine core dies: restart it with backoff ("always"), or drain and exit 1 ("never").
    engine_restart: Literal["always", "never"] = "always"
    log_level: str = "info"
    # Engine core settings, passed to the engine-core process when engine is "model" or "reference".
    block_size: int = 16
    num_gpu_blocks_override: int = 0  # 0: model: what --kv-cache-gib holds; reference: 4096
    max_num_batched_tokens: int = 2048  # per step: bounds how long a prefill chunk stalls decodes
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    step_time_us: int = 0
    # Worker settings, used when engine == "model".
    device: str = "auto"
    dtype: str = "auto"
    kv_cache_gib: float = 2.0
    worker_threads: int = 0
    worker_step_timeout: float = 300.0
    # Mock engine settings, used when engine == "mock".
    vocab_size: int = 32000
    step_interval_us: int = 0
    mock_seed: int = 0

    @property
    def model_names(self) -> tuple[str, ...]:
        """Names clients may put in ``model``; the first is the one responses report."""
        if self.served_model_name:
            return self.served_model_name
        if self.model:
            return (self.model,)
        return ("trioserve-reference",) if self.engine == "reference" else ("trioserve-mock",)
