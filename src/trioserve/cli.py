"""Command line: ``trioserve serve`` and the processes it starts (``engine-core``, its ``mock-engine``
alias, ``worker``); builds the one configuration tree (``config.py``).

Rules: every flag is defined once, in the group of the config section that holds it, and its ``dest``
is the setting's name; no flag has a default of its own (``argparse.SUPPRESS``): what is not given
keeps the section's default, which ``--help`` shows. ``serve`` takes every group; ``engine-core`` (an
engine core joining an API server started with ``--engine external``) takes the groups an engine core
reads. Processes that ``serve`` starts get their part of the tree as one JSON value (``--config-json``,
``--launch``), never as flags.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, get_args

import msgspec

from trioserve.config import (
    SECRETS_ENV,
    AccessConfig,
    AdmissionConfig,
    DispatchConfig,
    EngineConfig,
    EngineProcessConfig,
    HttpConfig,
    MockConfig,
    ModelConfig,
    RequestConfig,
    ServeConfig,
    StreamsConfig,
    SupervisorConfig,
    ToolCallParserName,
    WorkerConfig,
    decode_engine_process,
    override,
    with_secrets,
)
from trioserve.runtime.placement import (
    DEVICE_IDS_HELP,
    PlacementError,
    available_cpus,
    check_placement,
    cuda_device_count,
    default_placement,
    parse_device_ids,
)
from trioserve.transport.security import SECRET_ENV


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr and exit code 2 (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _choices(section: type[msgspec.Struct], name: str) -> list[str]:
    """The values of a ``Literal`` setting, in the order its section writes them."""
    values = typing.get_args(typing.get_type_hints(section)[name])
    assert values, f"{section.__name__}.{name} is not a Literal"
    return [str(v) for v in values]


class _Group:
    """Adds one section's flags to a parser; each flag's help ends with the section's default."""

    def __init__(self, section: type[msgspec.Struct], parser: argparse.ArgumentParser) -> None:
        self._defaults = section()
        self._section = section
        self._group = parser.add_argument_group(section.__name__.removesuffix("Config").lower())

    def add(
        self,
        flag: str,
        name: str,
        help: str = "",
        choices: bool | list[str] = False,
        shown: str | None = None,
        aliases: tuple[str, ...] = (),
        **kw: Any,
    ) -> None:
        """``choices``: True takes them from the setting's ``Literal`` type; ``shown``: the default as
        ``--help`` words it, when the value itself says nothing (None, empty); ``aliases``: other
        spellings of the same flag (another server's name for it)."""
        if shown is None:
            default = getattr(self._defaults, name)
            shown = " ".join(default) if isinstance(default, tuple) else str(default)
        text = f"{help} (default: {shown})" if help else f"default: {shown}"
        if choices:
            kw["choices"] = _choices(self._section, name) if choices is True else choices
        self._group.add_argument(flag, *aliases, dest=name, default=argparse.SUPPRESS, help=text, **kw)


API_KEY_ENV = "TRIOSERVE_API_KEY"  # the API key when --api-key is absent (read once, in ``main``)
THREADS_ENV = "TRIOSERVE_CPU_THREADS"  # --worker-threads when that flag is absent
ADAPTIVE_THREADS_ENV = "TRIOSERVE_CPU_ADAPTIVE_THREADS"  # --cpu-adaptive-threads when absent
# Outlier ejection's settings (seed 002): with one replica none has an effect.
_EJECTION_SETTINGS = ("consecutive_timeouts", "base_ejection_ms", "max_ejection_ms", "max_ejection_percent")


def _json_list(text: str) -> tuple[str, ...]:
    """A JSON list of strings, as vLLM's CORS flags take them (``'["https://a.example"]'``)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings such as '[\"*\"]', got {text!r}")
    return tuple(value)


def _device_ids(text: str) -> tuple[str, ...]:
    """``--device-ids``: each id checked and written canonically (``cpu:0-3``, ``cuda:1``)."""
    try:
        return tuple(str(device) for device in parse_device_ids(text))
    except PlacementError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _model_flags(p: argparse.ArgumentParser, *, serve: bool) -> None:
    """``serve`` names the model as a positional, and takes the names and tokenizer only the API
    server reads."""
    g = _Group(ModelConfig, p)
    if serve:
        p.add_argument(
            "model", nargs="?", default=argparse.SUPPRESS, help="Hugging Face folder (default: embedded)"
        )
        g.add("--tokenizer", "tokenizer", "Hugging Face tokenizer folder", shown="the model's, or Qwen3's")
        g.add(
            "--served-model-name",
            "served_model_name",
            nargs="+",
            type=str,
            shown="the model folder, or the engine's name",
        )
    else:
        g.add("--model", "model", "Hugging Face folder to run (--engine model)", shown="the embedded model")
    g.add("--max-model-len", "max_model_len", type=int)
    g.add("--vocab-size", "vocab_size", "mock and reference engines' vocabulary", type=int)


def _frontend_flags(p: argparse.ArgumentParser) -> None:
    g = _Group(HttpConfig, p)
    g.add("--host", "host")
    g.add("--port", "port", type=int)
    g.add("--max-request-body-bytes", "max_request_body_bytes", type=int)
    g.add(
        "--max-connections",
        "max_connections",
        "client connections an API server holds open; one more is closed at once "
        "(counted in /metrics as trioserve:connections_refused_total). 0: no limit",
        type=int,
    )
    g = _Group(AdmissionConfig, p)
    g.add(
        "--max-concurrent-requests",
        "max_concurrent_requests",
        "per API server; 0 = no limit (429)",
        type=int,
    )
    g.add("--max-pending-renders", "max_pending_renders", "requests queued to render (503)", type=int)
    g.add("--max-num-seqs-waiting", "max_num_seqs_waiting", "engine waiting-queue cap (503)", type=int)
    g.add(
        "--max-loop-lag-ms", "max_loop_lag_ms", "shed new requests above this loop lag; 0 = off", type=float
    )
    g.add(
        "--max-output-delay-ms",
        "max_output_delay_ms",
        "shed new requests (503) while engine output waits longer than this before the output "
        "handler takes it, until it is back under half; 0 = off",
        type=float,
    )
    g = _Group(RequestConfig, p)
    g.add("--max-n", "max_n", "largest accepted `n`", type=int)
    g.add(
        "--max-logprobs",
        "max_logprobs",
        "most alternatives per token a request may ask for (top_logprobs, logprobs, prompt_logprobs)",
        type=int,
    )
    g.add("--renderer-num-workers", "renderer_num_workers", "threads; 0 = on the event loop", type=int)
    g.add(
        "--chat-template",
        "chat_template",
        "a jinja chat template in place of the model's: a file, or the template itself",
        shown="the tokenizer's",
        metavar="FILE_OR_STRING",
    )
    g.add(
        "--trust-request-chat-template",
        "trust_request_chat_template",
        "accept a request's own `chat_template` (vLLM's flag; off: such a request is a 400). A "
        "template runs sandboxed, but it may loop for as long as it likes on a renderer thread",
        action="store_true",
    )
    g.add(
        "--enable-auto-tool-choice",
        "enable_auto_tool_choice",
        'accept tool_choice "auto" (the default with tools): the model decides, and --tool-call-parser '
        "reads its calls (vLLM's flag)",
        action="store_true",
    )
    g.add(
        "--tool-call-parser",
        "tool_call_parser",
        "the model's tool-call format: hermes (Qwen, Hermes) or llama3_json",
        choices=list(get_args(ToolCallParserName)),
    )
    g = _Group(StreamsConfig, p)
    g.add("--output-queue-size", "output_queue_size", "engine steps", type=int)
    g.add("--output-queue-policy", "output_queue_policy", choices=True)
    g.add(
        "--stream-policy",
        "stream_policy",
        "what a response does when its client is slower than the engine",
        metavar="{merge,queue:N,stall,abort-slow-client}",
    )
    g.add("--slow-client-max-tokens", "slow_client_max_tokens", type=int)
    _access_flags(p)
    g = _Group(DispatchConfig, p)
    g.add(
        "--dispatch",
        "dispatch",
        "with several engine cores (-dp), which one each request goes to: dplb: vLLM's score "
        "(the coordinator's waiting + running, this API server's own in-flight requests, a KV-usage "
        "penalty); round-robin: each in turn; prefix: the engine already caching the longest prefix of "
        "the prompt (its KV events, through the coordinator), unless much more loaded than dplb's pick; "
        "least-outstanding-bytes: the ready replica with the fewest request bytes in flight (seed 002), "
        "at most --max-inflight-per-replica on each, 503 when every one is full",
        choices=True,
    )
    g.add(
        "--max-inflight-per-replica",
        "max_inflight_per_replica",
        "least-outstanding-bytes: HTTP requests in flight per replica across every API server",
        type=int,
    )
    g.add(
        "--request-timeout-ms",
        "request_timeout_ms",
        "an engine request's deadline: no output for this long (queueing included) ends it with 504 "
        "and counts a timeout against its replica (a request's own timeout_ms may be shorter); 0: none",
        type=int,
    )
    g.add(
        "--consecutive-timeouts",
        "consecutive_timeouts",
        "-dp: timeouts in a row that eject a replica from dispatch (docs/replicas.md); 0: never",
        type=int,
    )
    g.add("--base-ejection-ms", "base_ejection_ms", "a first ejection's length; each next doubles", type=int)
    g.add(
        "--max-ejection-ms",
        "max_ejection_ms",
        "the longest ejection",
        shown="0: ten times the base, at most an hour",
        type=int,
    )
    g.add(
        "--max-ejection-percent",
        "max_ejection_percent",
        "replicas ejected at once (one may always be)",
        type=int,
    )
    g = _Group(SupervisorConfig, p)
    g.add(
        "--api-server-count",
        "api_server_count",
        "API server processes sharing the listening socket (SO_REUSEPORT, least-loaded accept); more "
        "than one, or -dp above 1, starts a supervisor process",
        shown="the data-parallel size",
        type=int,
    )
    g.add("--shutdown-timeout", "shutdown_timeout", type=float)
    g.add(
        "--drain-timeout",
        "drain_timeout",
        "seconds a replica that a resize retires may take to finish its requests before it is shut down",
        type=float,
    )
    g.add("--engine-ready-timeout", "engine_ready_timeout", type=float)
    g.add(
        "--engine-restart",
        "engine_restart",
        "when the engine core dies (exits, or reports a fatal error such as a dead worker): "
        "always: fail the requests in flight, answer 503 with Retry-After, and start a new "
        "engine core and workers after a backoff (0.5 s doubling to 30 s; back to 0.5 s once an engine "
        "has run for 60 s); never: fail the requests in flight, drain and exit with code 1, for a "
        "supervisor that restarts processes. Not for --engine external",
        choices=True,
    )


def _access_flags(p: argparse.ArgumentParser) -> None:
    g = _Group(AccessConfig, p)
    g.add(
        "--api-key",
        "api_key",
        "require `Authorization: Bearer KEY`, KEY one of these, on every route but /health, /ping, "
        f"/load, /version and /metrics (401 otherwise); {API_KEY_ENV} gives one when the flag is absent",
        nargs="+",
        type=str,
        metavar="KEY",
        shown="none: no key needed",
    )
    g.add(
        "--api-key-all-routes",
        "api_key_all_routes",
        "with --api-key: require the key on /health, /ping, /load, /version and /metrics too",
        action="store_true",
    )
    for flag, name, what in (
        ("--allowed-origins", "allowed_origins", "origins"),
        ("--allowed-methods", "allowed_methods", "methods"),
        ("--allowed-headers", "allowed_headers", "request headers"),
    ):
        g.add(flag, name, f"CORS: the {what} allowed, a JSON list", type=_json_list, shown='["*"]')
    g.add("--allow-credentials", "allow_credentials", "CORS: allow credentials", action="store_true")
    g.add(
        "--enable-request-id-headers",
        "enable_request_id_headers",
        "add X-Request-Id to every response: the client's, or the id the server made",
        action="store_true",
    )
    g.add(
        "--disable-access-log",
        "disable_access_log",
        "no access-log line per request (logger trioserve.access)",
        action="store_true",
        aliases=("--disable-uvicorn-access-log",),
    )
    g.add(
        "--disable-access-log-for-endpoints",
        "disable_access_log_for_endpoints",
        "comma-separated paths left out of the access log, e.g. /health,/metrics,/ping",
        shown="none",
    )


def _engine_flags(p: argparse.ArgumentParser, *, serve: bool) -> None:
    g = _Group(EngineConfig, p)
    kinds = _choices(EngineConfig, "kind")
    g.add(
        "--engine",
        "kind",
        "model: an engine core running the model on a worker process; mock: the mock engine core "
        "(random tokens on a step clock); reference: an engine core with the deterministic "
        "reference executor" + ("; external: wait for engine cores at --handshake-address" if serve else ""),
        choices=kinds if serve else [k for k in kinds if k != "external"],
    )
    g.add(
        "--handshake-address",
        "handshake_address",
        "ZMQ address engine cores join; tcp://IP:PORT for engines on other hosts (docs/remote_engines.md: "
        "the API side then also listens on PORT+1 upwards, and needs --engine-secret)",
        shown="the API server's own",
    )
    g.add(
        "--engine-secret",
        "engine_secret",
        f"shared secret that authenticates and encrypts (ZMQ CURVE) every TCP socket between API "
        f"servers and engines; {SECRET_ENV} gives it when the flag is absent (keeps it out of ps)",
        shown="none",
    )
    if not serve:
        g.add("--engine-index", "engine_index", type=int)
        g.add(
            "--headless",
            "headless",
            "start this host's engine ranks (--data-parallel-size-local from --data-parallel-start-rank) "
            "as child processes, restarting any that dies, for API servers on another host",
            action="store_true",
        )
        g.add(
            "--data-parallel-start-rank", "data_parallel_start_rank", "--headless: its first rank", type=int
        )
    g.add(
        "--data-parallel-size-local",
        "data_parallel_size_local",
        "engine ranks this host starts (serve: ranks 0..K-1, the rest join over TCP from other hosts)",
        shown="all of them",
        type=int,
    )
    g.add(
        "--data-parallel-size",
        "data_parallel_size",
        "engine cores, each with its own workers and KV cache; a DP coordinator publishes their loads",
        aliases=("-dp",),
        type=int,
    )
    if serve:
        g.add(
            "--max-data-parallel-size",
            "max_data_parallel_size",
            "the most engine cores a resize may reach: with --config FILE, a SIGHUP to serve reads the "
            "file again and starts or retires replicas to match its replica count (docs/replicas.md)",
            shown="-dp: no resizing",
            type=int,
        )
        g.add("--device-ids", "device_ids", DEVICE_IDS_HELP, shown="see above", type=_device_ids)
    g.add("--max-num-seqs", "max_num_seqs", type=int)
    g.add(
        "--max-num-batched-tokens",
        "max_num_batched_tokens",
        "tokens per engine step; longer prompts are prefilled in chunks between decodes",
        type=int,
    )
    g.add("--block-size", "block_size", type=int)
    g.add(
        "--num-gpu-blocks-override",
        "num_gpu_blocks_override",
        "KV blocks in the pool (0: model: what --kv-cache-gib holds; reference: 4096)",
        type=int,
    )
    g.add("--scheduling-policy", "scheduling_policy", choices=True)
    g.add("--engine-output-hwm", "engine_output_hwm", "steps; 0 = unbounded", type=int)
    g.add("--engine-output-policy", "engine_output_policy", choices=True)
    g.add("--step-time-us", "step_time_us", "reference executor: time per forward", type=int)
    g = _Group(WorkerConfig, p)
    g.add("--device", "device", "model: cpu, cuda, cuda:N (auto: cuda when present)")
    g.add("--dtype", "dtype", "model weights and KV cache", choices=True)
    g.add("--kv-cache-gib", "kv_cache_gib", "model: KV-cache memory", type=float)
    g.add(
        "--cpu-kernels",
        "cpu_kernels",
        "model, CPU float32: decode attention read in place, the draw, the linears (weights repacked at "
        "load) and the MLPs' SiLU by C kernels compiled here (native; refused where they cannot run), "
        "or torch's own ops (torch); auto: each fast path where it builds",
        choices=True,
    )
    g.add(
        "--model-impl",
        "model_impl",
        "model: trioserve's own Llama/Qwen3 decoder (trioserve; refused for other models), transformers' "
        "AutoModelForCausalLM (transformers), or auto: the own one where it can, else transformers",
        choices=True,
    )
    g.add(
        "--worker-threads",
        "worker_threads",
        f"model: torch CPU threads per worker, capped by its cores and cgroup quota (0: half of them, "
        f"1 to 16); {THREADS_ENV} gives it when the flag is absent",
        type=int,
    )
    g.add(
        "--cpu-adaptive-threads",
        "cpu_adaptive_threads",
        "model, CPU: 0 off; 1 learn each input size's fastest thread count from bit-exact shadow "
        "passes and log it; 2 also serve it once verified (docs/threads.md); "
        f"{ADAPTIVE_THREADS_ENV} gives it when the flag is absent",
        type=int,
        metavar="{0,1,2}",
    )
    g.add(
        "--tensor-parallel-size",
        "tensor_parallel_size",
        "model: workers per engine core, the weights sharded across them (torch.distributed: gloo on "
        "the CPU, NCCL on CUDA)",
        aliases=("-tp",),
        type=int,
    )
    g.add(
        "--worker-step-timeout",
        "worker_step_timeout",
        "seconds before a hung step fails its engine (model), and before an engine core that "
        "sends nothing (stopped or hung) is killed and restarted (any engine)",
        type=float,
    )
    g = _Group(MockConfig, p)
    g.add("--step-interval-us", "step_interval_us", "mock engine step clock", type=int)
    g.add("--mock-seed", "mock_seed", "mock engine random seed", type=int)


def _log_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--log-level",
        dest="log_level",
        default=argparse.SUPPRESS,
        choices=["debug", "info", "warning", "error"],
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="trioserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible API server and its engine")
    serve.add_argument(
        "--config",
        dest="config_file",
        default=None,
        metavar="FILE",
        help="YAML settings (docs/replicas.md): setting names as keys, or the seed's replicas: and "
        "outlier_detection: fields; flags given as well win",
    )
    _model_flags(serve, serve=True)
    _frontend_flags(serve)
    _engine_flags(serve, serve=True)
    _log_flag(serve)

    for name, help_text in (
        ("engine-core", "run an engine core that joins an API server (serve --engine external)"),
        ("mock-engine", "engine-core --engine mock"),
    ):
        core = sub.add_parser(name, help=help_text)
        _model_flags(core, serve=False)
        _engine_flags(core, serve=False)
        _log_flag(core)
        core.add_argument("--config-json", default=None, help=argparse.SUPPRESS)  # from serve

    for name, help_text in (
        ("worker", "a worker process (started by an engine core)"),
        ("api-server", "an API server under the supervisor (started by serve)"),
        ("dp-coordinator", "the data-parallel coordinator (started by serve -dp N)"),
    ):
        child = sub.add_parser(name, help=help_text)
        child.add_argument("--launch", required=True, help="the process's launch value (JSON)")
    return parser


def _settings(ns: argparse.Namespace) -> dict[str, Any]:
    skip = ("command", "config_json", "launch", "config_file")
    values = {k: v for k, v in vars(ns).items() if k not in skip}
    if "served_model_name" in values:
        values["served_model_name"] = tuple(values["served_model_name"])
    return values


def _from_env(values: dict[str, Any], environ: Mapping[str, str] | None) -> None:
    """The settings the environment gives when their flags are absent: the engine secret (kept out of
    ``ps``), the CPU threads per worker and whether they learn their count."""
    environ = environ or {}
    secret = environ.get(SECRET_ENV)
    if secret and "engine_secret" not in values:
        values["engine_secret"] = secret
    threads = environ.get(THREADS_ENV, "").strip()
    if threads and "worker_threads" not in values:
        if not threads.isdigit() or int(threads) < 1:
            raise ValueError(f"{THREADS_ENV}={threads!r}: expected a positive number of threads")
        values["worker_threads"] = int(threads)
    adaptive = environ.get(ADAPTIVE_THREADS_ENV, "").strip()
    if adaptive and "cpu_adaptive_threads" not in values:
        if adaptive not in ("0", "1", "2"):
            raise ValueError(f"{ADAPTIVE_THREADS_ENV}={adaptive!r}: expected 0, 1 or 2")
        values["cpu_adaptive_threads"] = int(adaptive)


def serve_config(ns: argparse.Namespace, environ: Mapping[str, str] | None = None) -> ServeConfig:
    """``environ``: the process environment (``main`` passes it), for the API key and the engine
    secret when their flags are absent; components never read the environment themselves."""
    values = _settings(ns)
    if getattr(ns, "config_file", None):
        from trioserve.config_file import load_config_file

        # One configuration: the file's settings, then the flags over them (the same names).
        values = {**load_config_file(ns.config_file), **values}
        values["config_file"] = os.path.abspath(ns.config_file)  # a SIGHUP reads it again
    env_key = (environ or {}).get(API_KEY_ENV)
    if env_key and "api_key" not in values:
        values["api_key"] = (env_key,)
    _from_env(values, environ)
    if "chat_template" in values:
        # The tree holds the template's text, checked here: one that does not compile is a bad flag.
        from trioserve.frontend.text.chat_template import compile_chat_template, read_chat_template

        try:
            values["chat_template"] = read_chat_template(values["chat_template"])
            compile_chat_template(values["chat_template"])
        except ValueError as exc:
            raise ValueError(f"argument --chat-template: {exc}") from None
    config = override(ServeConfig(), **values)
    if config.engine.handshake_address:
        from trioserve.launch.addresses import AddressLayout
        from trioserve.transport.security import require_secret_for

        AddressLayout.of(config.engine.handshake_address, "")  # a TCP one needs a reachable IP:PORT
        require_secret_for(config.engine.handshake_address, config.engine.engine_secret)
    _check_resizing(config, values)
    check_adaptive_threads(config.engine.kind, config.worker)
    if config.engine.capacity == 1:
        for name in ("dispatch", *_EJECTION_SETTINGS):
            if name in values:  # a deployment of one replica never ejects it: they would do nothing
                raise ValueError(f"argument {_flag(name)}: it acts between replicas; it needs -dp above 1")
    if (
        "max_inflight_per_replica" in values
        and config.frontend.dispatch.dispatch != "least-outstanding-bytes"
    ):
        raise ValueError("argument --max-inflight-per-replica: only with --dispatch least-outstanding-bytes")
    model = config.model
    if config.engine.kind == "reference" and not model.served_model_name and model.model is None:
        config = override(config, served_model_name=("trioserve-reference",))
    return place_replicas(config, available_cpus(), cuda_device_count())


def _check_resizing(config: ServeConfig, values: dict[str, Any]) -> None:
    """``--max-data-parallel-size``: at least ``-dp``, and only where a resize can act: engines this
    tree starts, all of them on this host, and a config file to read again."""
    engine = config.engine
    if engine.max_data_parallel_size is None:
        if "drain_timeout" in values:  # only a resize retires replicas: it would do nothing
            raise ValueError("argument --drain-timeout: only with --max-data-parallel-size (a resize)")
        return
    flag = "argument --max-data-parallel-size"
    if engine.max_data_parallel_size < engine.data_parallel_size:
        raise ValueError(f"{flag}: {engine.max_data_parallel_size} is below -dp {engine.data_parallel_size}")
    if engine.kind == "external" or "data_parallel_size_local" in values:
        raise ValueError(f"{flag}: a resize starts and retires engines on this host; not with remote ones")
    if config.supervisor.config_file is None:
        raise ValueError(f"{flag}: a resize is a reload of --config FILE (SIGHUP); give --config")


def place_replicas(config: ServeConfig, cpus: frozenset[int], cuda_count: int) -> ServeConfig:
    """``config`` with its local ranks placed (``engine.device_ids``; runtime/placement.py has the
    rules). Given ids are checked against this host; without them a model with several local ranks
    takes the first devices, and the other engines (mock, reference: no model) stay unplaced."""
    engine, worker = config.engine, config.worker
    # Every rank a resize may start is placed now (they are local: ``_check_resizing``).
    local = engine.capacity if engine.data_parallel_size_local is None else engine.data_parallel_size_local
    cuda = worker.device.startswith("cuda") or (worker.device == "auto" and cuda_count > 0)
    if engine.device_ids:
        if engine.kind == "external":
            raise ValueError("argument --device-ids: --engine external places its own engines")
        if worker.device.startswith("cuda:"):
            raise ValueError("argument --device-ids: give the GPUs there, not also --device cuda:N")
        try:
            devices = parse_device_ids(",".join(engine.device_ids))  # a config file's, unchecked yet
            check_placement(devices, local, cpus, cuda_count)
        except PlacementError as exc:
            raise ValueError(f"argument --device-ids: {exc}") from None
        if any(d.kind == "cuda" for d in devices) and worker.tensor_parallel_size > 1:
            raise ValueError("argument --device-ids: with -tp on CUDA each rank takes its own GPU")
        return override(config, device_ids=tuple(str(d) for d in devices))
    if engine.kind != "model" or local < 2 or (cuda and worker.tensor_parallel_size > 1):
        return config
    devices = default_placement(local, "cuda" if cuda else "cpu", cpus, cuda_count)
    return override(config, device_ids=tuple(str(d) for d in devices))


def engine_process_config(
    ns: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> EngineProcessConfig:
    """``environ``: for the engine secret (``SECRET_ENV``, or the secrets a parent passed down)."""
    values = _settings(ns)
    if ns.config_json is not None:
        if values:
            raise ValueError(
                f"--config-json is the whole configuration; not also {_flag(next(iter(values)))}"
            )
        return with_secrets(decode_engine_process(ns.config_json), (environ or {}).get(SECRETS_ENV))
    _from_env(values, environ)
    if ns.command == "mock-engine":
        values.setdefault("kind", "mock")
    # Started by hand, an engine core without --model runs the reference executor (as it always has).
    values.setdefault("kind", "model" if "model" in values else "reference")
    config = override(EngineProcessConfig(), **values)
    if not config.engine.handshake_address:
        raise ValueError("the following arguments are required: --handshake-address")
    from trioserve.transport.security import require_secret_for

    require_secret_for(config.engine.handshake_address, config.engine.engine_secret)
    if not config.engine.headless:
        for name in ("data_parallel_size_local", "data_parallel_start_rank"):
            if name in values:
                raise ValueError(f"argument {_flag(name)}: only with --headless (else --engine-index)")
    if config.engine.kind == "model" and config.model.model is None:
        raise ValueError("--engine model needs --model (a Hugging Face folder)")
    check_tensor_parallel(config.engine.kind, config.model, config.worker)
    check_adaptive_threads(config.engine.kind, config.worker)
    return config


def check_tensor_parallel(kind: str, model: ModelConfig, worker: WorkerConfig) -> None:
    """Refuses (``ValueError``) a ``-tp`` the model's heads cannot be split into (``models/shard_plan``),
    before anything starts. The embedded default, converted later, is checked by its workers."""
    from trioserve.models.shard_plan import ShardPlan

    folder = model.model
    if worker.tensor_parallel_size > 1 and kind != "model":
        raise ValueError(
            f"argument --tensor-parallel-size: it shards a model's weights; not for --engine {kind}"
        )
    if kind != "model" or worker.tensor_parallel_size == 1 or folder is None:
        return
    if (Path(folder) / "config.json").is_file():  # a folder that is not a model fails where it always has
        ShardPlan.from_model_dir(folder, worker.tensor_parallel_size)


def check_adaptive_threads(kind: str, worker: WorkerConfig) -> None:
    """Refuses (``ValueError``) thread learning where it could not run: it tunes a CPU model worker's
    intra-op count, so not for an engine without one, not on CUDA, and not with ``-tp`` (every rank
    must run each step at the same count; no rank holds a whole answer to verify a count against).
    ``--device auto`` is decided by the worker, which reports learning off on a GPU."""
    if worker.cpu_adaptive_threads == 0:
        return
    where = f"{_flag('cpu_adaptive_threads')} ({ADAPTIVE_THREADS_ENV})"
    if kind != "model":
        raise ValueError(f"{where}: it tunes a model worker's CPU threads; not for --engine {kind}")
    if worker.device.startswith("cuda"):
        raise ValueError(
            f"{where}: only CPU workers learn their thread count; not with --device {worker.device}"
        )
    if worker.tensor_parallel_size > 1:
        raise ValueError(f"{where}: not with --tensor-parallel-size above 1 (every rank runs one count)")


def _flag(setting: str) -> str:
    return "--engine" if setting == "kind" else "--" + setting.replace("_", "-")


def _fail(parser: argparse.ArgumentParser, build: Callable[[], object]) -> Any:
    """``build()``, or the one-line error that names the flag whose value the tree refused."""
    try:
        return build()
    except msgspec.ValidationError as exc:
        # msgspec says where: "Expected `int` >= 1 - at `$.engine.max_num_seqs`".
        message, _, where = str(exc).partition(" - at `$.")
        parser.error(f"argument {_flag(where.rstrip('`').split('.')[-1])}: {message}" if where else message)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command == "serve":
        config: ServeConfig = _fail(parser, lambda: serve_config(ns, os.environ))
        if config.engine.kind == "external" and not config.engine.handshake_address:
            parser.error("--engine external needs --handshake-address")
        if (
            config.frontend.request.enable_auto_tool_choice
            and config.frontend.request.tool_call_parser is None
        ):
            parser.error("--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json)")
        _fail(parser, lambda: check_tensor_parallel(config.engine.kind, config.model, config.worker))
        from trioserve.launch.serve import run_serve

        return run_serve(config)
    if ns.command in ("engine-core", "mock-engine"):
        process: EngineProcessConfig = _fail(parser, lambda: engine_process_config(ns, os.environ))
        if process.engine.headless:
            from trioserve.launch.headless import headless_ranks, run_headless

            _fail(parser, lambda: headless_ranks(process))
            return run_headless(process)
        from trioserve.engine.main import run_engine_core

        return run_engine_core(process)
    if ns.command == "api-server":
        from trioserve.launch.api_server_main import run_api_server

        return run_api_server(ns.launch)
    if ns.command == "dp-coordinator":
        from trioserve.coordinator.main import CoordinatorLaunch, run_coordinator

        return run_coordinator(msgspec.json.decode(ns.launch, type=CoordinatorLaunch))
    from trioserve.protocol.worker_messages import WorkerLaunch
    from trioserve.worker import kv_prefault

    launch = WorkerLaunch.from_json(ns.launch)
    prefault = kv_prefault.start(launch)  # before torch's imports, which it runs beside
    from trioserve.worker.main import run_worker

    return run_worker(launch, prefault)


if __name__ == "__main__":
    sys.exit(main())
