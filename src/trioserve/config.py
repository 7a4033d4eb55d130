"""One typed configuration tree, built once at the edge (``cli.py``), validated there, handed down in
sections.

Rules:

- Every setting lives in exactly one section, under one name, and that name is its flag's
  (``--max-num-seqs`` is ``EngineConfig.max_num_seqs``; the one exception, ``--engine``, is
  ``EngineConfig.kind``). Its default is written here once; the command line only overrides.
  ``override`` routes a flat ``name=value`` to the section that holds ``name``, which is how the command
  line and tests build a tree (``test_config.py`` checks that no name is held twice).
- Each component receives its own section (or the few it reads), never the whole tree.
- A child process receives its part as one serialized value (``encode``/``decode_engine_process``):
  no setting is re-spelled as a flag on the way down.
- Sections are frozen msgspec Structs: nothing changes a setting after start-up, and the tree
  serializes as it is. This module imports no trio, zmq or torch (the layering test checks it).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import msgspec

EngineKind = Literal["model", "mock", "reference", "external"]
EngineOutputPolicy = Literal["fold", "block"]  # when the engine's output HWM is reached: fold, or stall
OutputQueuePolicy = Literal["coalesce", "block", "unbounded"]
PolicyKind = Literal["merge", "queue", "stall", "abort-slow-client"]
DispatchPolicyName = Literal["dplb", "round-robin", "prefix", "least-outstanding-bytes"]
LogLevel = Literal["debug", "info", "warning", "error"]
ToolCallParserName = Literal["hermes", "llama3_json"]  # frontend/output/tool_parsers.py: auto_parser

S = TypeVar("S", bound=msgspec.Struct)

# Bounds checked wherever a tree is built (``override``, a child's ``decode_engine_process``).
Positive = Annotated[int, msgspec.Meta(ge=1)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Percent = Annotated[int, msgspec.Meta(ge=0, le=100)]


class _Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


# --------------------------------------------------------------------------------------------------
# Shared by the API server and the engine core.
# --------------------------------------------------------------------------------------------------


class ModelConfig(_Section, frozen=True):
    """What is served. The API server reads the names, the length limit and the tokenizer; the engine
    core reads the model folder, the length limit and the vocabulary."""

    model: str | None = None  # a Hugging Face folder; None: the embedded default
    tokenizer: str | None = None  # a Hugging Face tokenizer folder; None: the model's, or Qwen3's
    served_model_name: tuple[str, ...] = ()  # empty: the model folder, or the engine's own name
    max_model_len: Positive = 8192
    vocab_size: Positive = 32000  # the mock and reference engines'; a model's own replaces it at start-up

    @property
    def model_names(self) -> tuple[str, ...]:
        """Names clients may put in ``model``; the first is the one responses report."""
        if self.served_model_name:
            return self.served_model_name
        return (self.model,) if self.model else ("trioserve-mock",)


# --------------------------------------------------------------------------------------------------
# The API server.
# --------------------------------------------------------------------------------------------------


class HttpConfig(_Section, frozen=True):
    """The edge: the listening socket, connections and request bodies."""

    host: str = "127.0.0.1"
    port: Port = 8000
    max_request_body_bytes: Positive = 4 * 1024 * 1024
    # Connections an API server holds open; one more is closed at once. 0: no limit.
    max_connections: NonNegative = 0


class AdmissionConfig(_Section, frozen=True):
    """Which requests an API server takes (``frontend/request/admission.py`` says which status each
    refusal gets and why)."""

    max_concurrent_requests: NonNegative = 2048
    max_pending_renders: NonNegative = 256
    max_num_seqs_waiting: NonNegative = 1024
    max_loop_lag_ms: NonNegativeFloat = 500.0
    max_output_delay_ms: NonNegativeFloat = 200.0  # shed (503) while engine output waits longer here; 0 = off


class RequestConfig(_Section, frozen=True):
    """The request path: validation limits and the renderer pool."""

    max_n: Positive = 16
    # The most logprobs alternatives a request may ask for (chat top_logprobs, completions logprobs,
    # prompt_logprobs): vLLM's flag and default.
    max_logprobs: NonNegative = 20
    renderer_num_workers: NonNegative = 1  # threads; 0: render on the event loop
    # The chat template in place of the model's (the text: cli.py reads a file the flag names).
    chat_template: str | None = None
    trust_request_chat_template: bool = False  # a request's own `chat_template` is refused unless set
    # Tool calling (docs/tool_calling.md): tool_choice "auto" needs both, as in vLLM.
    enable_auto_tool_choice: bool = False
    tool_call_parser: ToolCallParserName | None = None


class StreamPolicy(msgspec.Struct, frozen=True):
    """What a response does when its client cannot take bytes as fast as the engine makes them.

    - ``merge`` (default, vLLM's one-slot collector): deltas wait, merged into one chunk per choice, and
      go out as soon as the socket drains. Memory per slow client: one merged delta. Tokens per event
      rise.
    - ``queue:N``: up to N chunks queue behind the socket as they are, then deltas merge.
    - ``stall``: the output handler waits for the slow client before it processes the next engine step:
      every stream on this API server waits with it, and the wait reaches the engine through the step
      queue's policy. Strict pacing at the price of head-of-line blocking; for experiments.
    - ``abort-slow-client``: a client more than ``--slow-client-max-tokens`` tokens behind is cut off:
      its engine requests are aborted at once and its stream ends with an error event (after what it
      has not read yet). Everyone else is untouched.
    """

    kind: PolicyKind = "merge"
    queue_events: int = 0  # queue:N
    slow_client_max_tokens: int = 256  # abort-slow-client

    @classmethod
    def parse(cls, text: str, slow_client_max_tokens: int = 256) -> StreamPolicy:
        """``merge`` | ``queue:N`` | ``stall`` | ``abort-slow-client``; ValueError otherwise."""
        if text.startswith("queue:"):
            count = int(text.removeprefix("queue:"))
            if count < 1:
                raise ValueError("queue:N needs N >= 1")
            return cls("queue", queue_events=count, slow_client_max_tokens=slow_client_max_tokens)
        if text in ("merge", "stall", "abort-slow-client"):
            return cls(text, slow_client_max_tokens=slow_client_max_tokens)  # type: ignore[arg-type]
        raise ValueError(f"unknown stream policy {text!r}: use merge, queue:N, stall or abort-slow-client")


class StreamsConfig(_Section, frozen=True):
    """Engine output to each client: the step queue between the output pump and the output handler,
    and each response's policy towards a slow client."""

    output_queue_size: Positive = 2  # engine steps queued between the output pump and output handler
    output_queue_policy: OutputQueuePolicy = "coalesce"
    stream_policy: str = "merge"  # merge | queue:N | stall | abort-slow-client (``policy`` parses it)
    slow_client_max_tokens: Positive = 256  # abort-slow-client: how far behind a client may fall

    def __post_init__(self) -> None:
        try:  # a bad value is refused where the tree is built
            StreamPolicy.parse(self.stream_policy)
        except ValueError as exc:
            raise ValueError(f"stream_policy: {exc}") from None

    @property
    def policy(self) -> StreamPolicy:
        return StreamPolicy.parse(self.stream_policy, self.slow_client_max_tokens)


class AccessConfig(_Section, frozen=True):
    """Who may call an API server, what its responses tell browsers, and what it logs per request
    (the rules: ``frontend/edge/auth.py``, ``frontend/edge/cors.py``, ``frontend/edge/access.py``,
    ``frontend/access_log.py``). CORS names and defaults are vLLM's."""

    api_key: tuple[str, ...] = ()  # empty: no key needed; else ``Bearer`` one of these
    api_key_all_routes: bool = False  # the key on /health, /ping, /load, /version, /metrics too
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    enable_request_id_headers: bool = False  # echo X-Request-Id on every response
    disable_access_log: bool = False
    disable_access_log_for_endpoints: str = ""  # comma-separated paths left out of the access log

    def __post_init__(self) -> None:
        if any(not key for key in self.api_key):  # "" would make a missing key the right one
            raise ValueError("api_key: an API key must not be empty")


class DispatchConfig(_Section, frozen=True):
    """Which engine an API server sends each request to, with several (``frontend/dispatch.py``)."""

    dispatch: DispatchPolicyName = "dplb"
    # least-outstanding-bytes: in-flight HTTP requests per replica, across every API server; no queue
    max_inflight_per_replica: Positive = 32
    # Deadlines and replica health (frontend/replica_pool.py, replica_health.py; docs/replicas.md).
    request_timeout_ms: NonNegative = 0  # an engine request's limit without output; 0: none
    consecutive_timeouts: NonNegative = 3  # timeouts in a row that eject a replica; 0: never eject
    base_ejection_ms: Positive = 30000  # the first ejection's length; each next one doubles
    max_ejection_ms: NonNegative = 0  # the longest ejection; 0: ten times the base, at most an hour
    max_ejection_percent: Percent = 50  # of the replicas out at once; one may always be

    def __post_init__(self) -> None:
        if self.max_ejection_ms and self.max_ejection_ms < self.base_ejection_ms:
            raise ValueError("max_ejection_ms: shorter than base_ejection_ms")


class SupervisorConfig(_Section, frozen=True):
    """``serve``'s process tree: how many API servers, shutdown, and the engine cores it starts and
    restarts."""

    # API server processes sharing the listening socket; 0: the data-parallel size (vLLM's default).
    # More than one starts a supervisor process that serves no HTTP itself (docs/processes.md).
    api_server_count: NonNegative = 0
    shutdown_timeout: NonNegativeFloat = 5.0
    engine_ready_timeout: PositiveFloat = 120.0
    # When the engine core dies: restart it with backoff ("always"), or drain and exit 1 ("never").
    engine_restart: Literal["always", "never"] = "always"
    config_file: str | None = None  # serve --config: the file a SIGHUP reads again (a resize)
    drain_timeout: PositiveFloat = 300.0  # seconds a replica a resize retires may take to drain


# --------------------------------------------------------------------------------------------------
# The engine core and what runs its steps.
# --------------------------------------------------------------------------------------------------


class EngineConfig(_Section, frozen=True):
    """One engine core: what executes its steps, how it joins the API servers, its scheduler and its
    KV ledger."""

    kind: EngineKind = "model"  # --engine
    handshake_address: str | None = None  # where engine cores join; None: the API server's own
    engine_index: NonNegative = 0
    data_parallel_size: Positive = 1  # engine cores, each with its own workers and KV ledger
    # The most engine cores a resize may reach (a --config reload on SIGHUP, docs/replicas.md); the
    # tree's sockets, tables and placement are sized for it at start. None: data_parallel_size (no
    # resizing).
    max_data_parallel_size: Positive | None = None
    # Of those, how many this host starts (serve: ranks 0..K-1; engine-core --headless: from
    # data_parallel_start_rank); None: all of them. The others join over TCP from other hosts.
    data_parallel_size_local: NonNegative | None = None
    data_parallel_start_rank: NonNegative = 0
    # serve: one device per local rank, canonical (runtime/placement.py); empty: not placed. Built at
    # the edge from --device-ids, or the default placement for a model with several local ranks.
    device_ids: tuple[str, ...] = ()
    headless: bool = False  # engine-core: start this host's ranks as child processes, and restart them
    # Authenticates and encrypts every tcp:// socket between API servers and engines (CURVE); never
    # serialized into a child's command line (``without_secrets``).
    engine_secret: str | None = None
    max_num_seqs: Positive = 1024
    max_num_batched_tokens: Positive = 2048  # per step: bounds how long a prefill chunk stalls decodes
    block_size: Positive = 16
    num_gpu_blocks_override: NonNegative = 0  # 0: model: what --kv-cache-gib holds; reference: 4096
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    engine_output_hwm: NonNegative = 64  # ZMQ high-water mark, engine -> API server, in steps; 0 = unbounded
    engine_output_policy: EngineOutputPolicy = "fold"
    step_time_us: NonNegative = 0  # reference executor: time per forward

    @property
    def capacity(self) -> int:
        """The engine ranks the tree is sized for: ``max_data_parallel_size``, else the DP size."""
        return max(self.data_parallel_size, self.max_data_parallel_size or 0)


class WorkerConfig(_Section, frozen=True):
    """The worker processes that run the model (``--engine model``)."""

    device: str = "auto"  # auto: cuda when present, else cpu
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16 on cuda, fp32 on cpu
    kv_cache_gib: PositiveFloat = 2.0
    # The CPU worker's float32 fast paths: "native" reads the paged KV cache in place for decode
    # attention, draws tokens, multiplies by the linears' weights (repacked at load in column blocks,
    # worker/packed_linear.py) and runs the MLPs' SiLU(gate) * up (worker/native_mlp.py) with C kernels
    # compiled here (worker/native_kernels.py), refused where they cannot run; "torch": torch's own
    # ops; "auto": each fast path where it builds. Other devices and dtypes: torch always.
    cpu_kernels: Literal["auto", "native", "torch"] = "auto"
    # Which implementation runs the model (worker/model_loader.py): "trioserve", the own Llama/Qwen3
    # decoder (refused for other models); "transformers", AutoModelForCausalLM; "auto": the own one
    # where it can, else transformers.
    model_impl: Literal["auto", "trioserve", "transformers"] = "auto"
    worker_threads: NonNegative = 0  # torch CPU threads per worker, capped by its budget; 0: half of it
    tensor_parallel_size: Positive = 1  # workers per engine core, each holding a shard of the weights
    worker_step_timeout: PositiveFloat = 300.0  # a step's hard limit; also how long an engine may be silent
    # CPU workers: 0 off; 1 learn the thread count from shadow passes and log it; 2 also serve it
    # (worker/thread_learner.py, docs/threads.md).
    cpu_adaptive_threads: Literal[0, 1, 2] = 0


class MockConfig(_Section, frozen=True):
    """The mock engine core (``--engine mock``): instant prefill, random tokens, a fixed step clock."""

    step_interval_us: NonNegative = 0  # 0: step as fast as possible
    mock_seed: int = 0


class EngineProcessConfig(_Section, frozen=True):
    """What an engine-core process is started with, as one value."""

    model: ModelConfig = ModelConfig()
    engine: EngineConfig = EngineConfig()
    worker: WorkerConfig = WorkerConfig()
    mock: MockConfig = MockConfig()
    log_level: LogLevel = "info"


# --------------------------------------------------------------------------------------------------
# The whole tree.
# --------------------------------------------------------------------------------------------------


class FrontendConfig(_Section, frozen=True):
    """An API server's own sections."""

    http: HttpConfig = HttpConfig()
    admission: AdmissionConfig = AdmissionConfig()
    request: RequestConfig = RequestConfig()
    streams: StreamsConfig = StreamsConfig()
    access: AccessConfig = AccessConfig()
    dispatch: DispatchConfig = DispatchConfig()


class ServeConfig(_Section, frozen=True):
    model: ModelConfig = ModelConfig()
    frontend: FrontendConfig = FrontendConfig()
    supervisor: SupervisorConfig = SupervisorConfig()
    engine: EngineConfig = EngineConfig()
    worker: WorkerConfig = WorkerConfig()
    mock: MockConfig = MockConfig()
    log_level: LogLevel = "info"

    @property
    def api_server_count(self) -> int:
        """API server processes: ``--api-server-count``, or the data-parallel size when that is 0."""
        return self.supervisor.api_server_count or self.engine.data_parallel_size

    @property
    def supervised(self) -> bool:
        """Whether ``serve`` starts a supervisor process (several API servers or engine cores)."""
        return self.api_server_count > 1 or self.engine.capacity > 1

    def engine_process(self, handshake_address: str, engine_index: int = 0) -> EngineProcessConfig:
        """The engine-core process's part: engine ``engine_index``, joining at ``handshake_address``."""
        engine = msgspec.structs.replace(
            self.engine, handshake_address=handshake_address, engine_index=engine_index
        )
        return EngineProcessConfig(
            model=self.model, engine=engine, worker=self.worker, mock=self.mock, log_level=self.log_level
        )


def setting_names(root: type[msgspec.Struct]) -> dict[str, tuple[str, ...]]:
    """Every setting under ``root``: name -> the path of sections that holds it (``()`` for the
    root's own). Raises ``TypeError`` if a name is held twice (the tree's first rule)."""
    out: dict[str, tuple[str, ...]] = {}

    def walk(section: type[msgspec.Struct], path: tuple[str, ...]) -> None:
        for field in msgspec.structs.fields(section):
            if isinstance(field.type, type) and issubclass(field.type, _Section):
                walk(field.type, (*path, field.name))
                continue
            if field.name in out:
                held = ".".join(out[field.name]) or "the root"
                raise TypeError(f"setting {field.name!r} is held by both {held} and {'.'.join(path)}")
            out[field.name] = path

    walk(root, ())
    return out


def override(config: S, **values: Any) -> S:
    """``config`` with each ``name=value`` set in the section that holds ``name`` (flat names, as on
    the command line). Unknown names raise ``TypeError``; values are checked against the field types."""
    names = setting_names(type(config))
    tree: dict[str, Any] = {}
    for name, value in values.items():
        if name not in names:
            raise TypeError(f"no setting named {name!r}")
        node = tree
        for part in names[name]:
            node = node.setdefault(part, {})
        node[name] = value

    def apply(section: msgspec.Struct, changes: dict[str, Any]) -> msgspec.Struct:
        for key, value in changes.items():
            if isinstance(value, dict):
                changes[key] = apply(getattr(section, key), value)
        return msgspec.structs.replace(section, **changes)

    new = apply(config, tree)
    # Round-trip through the validating decoder: a wrong type is an error here, not in a component.
    return msgspec.json.decode(msgspec.json.encode(new), type=type(config))


def encode(config: msgspec.Struct) -> str:
    """One value for a child process's command line (JSON)."""
    return msgspec.json.encode(config).decode()


def decode_engine_process(text: str) -> EngineProcessConfig:
    return msgspec.json.decode(text, type=EngineProcessConfig)


# Settings a child process must not get on its command line (``/proc/PID/cmdline`` is readable by
# every user of the host); they travel in its environment instead (``SECRETS_ENV``, readable by its
# user only).
SECRET_SETTINGS = ("api_key", "engine_secret")
SECRETS_ENV = "TRIOSERVE_CHILD_SECRETS"


def without_secrets(config: S) -> tuple[S, str]:
    """``config`` with every secret setting at its default, and the secrets as one JSON value."""
    names = setting_names(type(config))
    held: dict[str, Any] = {}
    defaults: dict[str, Any] = {}
    for name in SECRET_SETTINGS:
        if name in names:
            section: Any = config
            for part in names[name]:
                section = getattr(section, part)
            held[name] = getattr(section, name)
            defaults[name] = getattr(type(section)(), name)
    return override(config, **defaults), msgspec.json.encode(held).decode()


def with_secrets(config: S, secrets: str | None) -> S:
    """``config`` with the secrets ``without_secrets`` took out (``secrets``: its JSON; None: none)."""
    if not secrets:
        return config
    names = setting_names(type(config))
    values = {k: v for k, v in msgspec.json.decode(secrets).items() if k in names}
    if "api_key" in values:
        values["api_key"] = tuple(values["api_key"])
    return override(config, **values)
