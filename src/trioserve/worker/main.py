"""``trioserve worker``: a worker process, started by its engine core (design §2, §8).

A plain synchronous loop, no event loop: block on the step ring, run the step, and (output rank only)
put the sampled tokens (and any logprobs) on the result ring. The engine core owns this process's lifetime:

- it ends on ``WorkerShutdown``, or when the step ring's writer closes or dies (pipe EOF), or when the
  result ring's reader is found dead while answering, so a worker never outlives its engine core (one
  busy in a step notices when the step ends);
- SIGINT is ignored (a Ctrl-C in the terminal reaches the whole process group; the engine core decides
  when its workers stop), SIGTERM ends it;
- a step that raises is reported as ``WorkerFailed`` with the error before the process exits, so the
  engine core can fail the requests with a reason instead of only seeing an exit code.

Tensor parallelism (``tensor_parallel_size`` > 1): this worker is one rank of the engine's group, a
reader of the one step ring every rank reads (``ring_layout``'s many readers), holding a shard of
the weights (``worker/tensor_parallel.py``). Each rank runs every step; the layers' all-reduces keep
them in lockstep. Only rank 0 has the result ring: it says ready once every rank has loaded (the
group's barrier) with the KV blocks all ranks agreed on, and answers each step. A rank > 0 that fails
has no one to tell but its log: it exits 1, the engine core sees the exit, and its peers see their
next all-reduce fail (gloo: the connection closes), so one rank's death ends the engine's step.

Thread learning (``WorkerConfig.cpu_adaptive_threads`` 1 or 2, docs/threads.md): a CPU worker without
tensor parallelism runs the golden check after loading and before ``WorkerReady``, then serves each
step through ``worker/shadow.py`` (answer first, then at most one shadow pass per K steps; K is
``TRIOSERVE_CPU_SHADOW_EVERY``, default 10). A CUDA worker does not learn (its count is not an
intra-op CPU thread count), nor does a tensor-parallel rank (every rank must run every step at the same
count: a rank has no served answer of its own to compare, only its shard's part); each says so in the
log.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
from collections.abc import Callable

import msgspec
import torch

from trioserve.models.geometry import KVGeometry
from trioserve.models.shard_plan import ShardPlan
from trioserve.protocol.thread_report import WorkerThreads
from trioserve.protocol.worker_messages import (
    WorkerFailed,
    WorkerLaunch,
    WorkerReady,
    WorkerShutdown,
    WorkerStep,
    worker_input_codec,
)
from trioserve.runtime.placement import (
    Device,
    available_cpus,
    cgroup_cpu_quota,
    cpu_budget,
    worker_threads,
)
from trioserve.runtime.process import set_title, setup_logging
from trioserve.transport.shm_ring import ReaderDied, RingReader, RingWriter, WriterClosed, WriterDied
from trioserve.worker.kv_prefault import Prefault
from trioserve.worker.model_runner import ModelRunner, RunnerConfig, TensorParallel
from trioserve.worker.shadow import ThreadTuner
from trioserve.worker.tensor_parallel import leave_group
from trioserve.worker.thread_learner import SHADOW_EVERY, LearnerRules, ThreadLearner

log = logging.getLogger("trioserve.worker")

SHADOW_EVERY_ENV = "TRIOSERVE_CPU_SHADOW_EVERY"  # K: served steps per shadow pass (thread learning)


def run_worker(launch: WorkerLaunch | str, prefault: Prefault | None = None) -> int:
    """The worker process's main: ``launch`` is its ``WorkerLaunch`` (or that value's JSON, as
    ``--launch`` carries it), ``prefault`` its KV pool's pages if ``worker/kv_prefault.py`` started
    faulting them in before this module's imports; returns the exit code."""
    if isinstance(launch, str):
        launch = WorkerLaunch.from_json(launch)
    set_title(launch.title)
    setup_logging(launch.log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    steps = RingReader.attach(launch.steps_ring)
    results = RingWriter.attach(launch.results_ring) if launch.results_ring is not None else None
    encoder = msgspec.msgpack.Encoder()

    def answer(message: msgspec.Struct) -> None:
        if results is not None:
            results.write_blocking(encoder.encode(message))

    try:
        return _serve(launch, steps, answer, prefault)
    except ReaderDied:  # answering: the engine core, the result ring's one reader, is gone
        log.info("worker %d: the engine core is gone; exiting", launch.rank)
        return 0
    finally:
        leave_group()
        steps.close()
        if results is not None:
            results.close()


def _serve(
    launch: WorkerLaunch,
    steps: RingReader,
    answer: Callable[[msgspec.Struct], None],
    prefault: Prefault | None,
) -> int:
    """Load the model, say so, then run steps until told to stop (the return value: the exit code)."""
    try:
        runner = _load(launch, prefault)
        learning = thread_tuner(launch, runner)
    except Exception as exc:
        log.exception("worker %d could not load %s", launch.rank, launch.model)
        answer(WorkerFailed(launch.rank, f"loading {launch.model} failed: {exc!r}"))
        return 1
    tuner: ThreadTuner | None = None
    if isinstance(learning, ThreadTuner):
        tuner = learning
        tuner.golden()
        threads = tuner.take_report()  # WorkerReady carries it (the golden check changed it)
    else:
        threads = learning
    pid, device = os.getpid(), str(runner.device)
    answer(WorkerReady(launch.rank, pid, runner.load_seconds, device, runner.num_blocks, threads))
    codec = worker_input_codec()
    while True:
        try:
            frame = steps.read_blocking()
        except (WriterClosed, WriterDied):
            log.info("worker %d: the engine core is gone; exiting", launch.rank)
            return 0
        match codec.decode(frame):
            case WorkerShutdown():
                return 0
            case WorkerStep(step=step):
                try:
                    if tuner is None:
                        result = runner.run(step)
                    else:  # it answers before its shadow pass
                        tuner.serve(step, answer)
                        continue
                except ReaderDied:  # answering: not the step's failure (run_worker's exit)
                    raise
                except Exception as exc:
                    log.exception("worker %d failed in step %d", launch.rank, step.step)
                    answer(WorkerFailed(launch.rank, f"step {step.step} failed: {exc!r}"))
                    return 1
                answer(result)


def shadow_every(environ: dict[str, str] | None = None) -> int:
    """K, the served steps per shadow pass: ``TRIOSERVE_CPU_SHADOW_EVERY`` (a positive integer),
    else the learner's default."""
    raw = (os.environ if environ is None else environ).get(SHADOW_EVERY_ENV, "").strip()
    if not raw:
        return SHADOW_EVERY
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{SHADOW_EVERY_ENV}={raw!r}: expected a positive number of steps")
    return int(raw)


def thread_tuner(launch: WorkerLaunch, runner: ModelRunner) -> ThreadTuner | WorkerThreads:
    """This worker's thread learning; or, when it is off (mode 0) or cannot apply (logged), the
    report it gives instead: its configured count, state off, and why."""
    mode = launch.worker.cpu_adaptive_threads
    reason: str | None = None
    if mode != 0 and runner.device.type != "cpu":
        reason = f"only CPU workers learn (this one is on {runner.device})"
    elif mode != 0 and launch.tensor_parallel_size > 1:
        reason = (
            "tensor parallelism: every rank must run each step at the same count, and a rank holds no "
            "whole answer to verify a count against"
        )
    if mode == 0 or reason is not None:
        if reason is not None:
            log.info("worker %d: adaptive threads off: %s", launch.rank, reason)
        return WorkerThreads(
            rank=launch.rank,
            configured=runner.num_threads,
            mode=mode,
            reason=reason,
            set_num_threads_calls=runner.threads.sets,
            parallel_backend=runner.threads.backend,
        )
    rules = LearnerRules(mode, runner.num_threads, shadow_every=shadow_every())
    log.info(
        "worker %d: adaptive threads mode %d: counts %s, one shadow pass per %d served steps (%s backend)",
        launch.rank,
        mode,
        "/".join(map(str, rules.allowed)),
        rules.shadow_every,
        runner.threads.backend,
    )
    return ThreadTuner(runner, ThreadLearner(rules), launch.rank)


def cpu_threads(configured: int, rank: int) -> int:
    """This CPU worker's torch threads: ``configured`` (0: half the budget) capped by the budget its
    affinity and cgroup quota give (runtime/placement.py), said in the log. Each worker of a ``-tp``
    group gets its own count; busy workers on shared cores still contend (docs/replicas.md)."""
    cpus, quota = available_cpus(), cgroup_cpu_quota()
    budget = cpu_budget(cpus, quota)
    threads, capped = worker_threads(configured, budget)
    where = f"cores {Device('cpu', cores=cpus)}" + (f", cgroup quota {quota:g}" if quota else "")
    if capped:
        log.warning(
            "worker %d: %d threads asked, capped to its budget of %d (%s)", rank, configured, budget, where
        )
    else:
        log.info("worker %d: %d threads (budget %d: %s)", rank, threads, budget, where)
    return threads


def _load(launch: WorkerLaunch, prefault: Prefault | None = None) -> ModelRunner:
    worker = launch.worker
    tp_size = launch.tensor_parallel_size
    device = worker.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and tp_size > 1:  # one GPU per rank (NCCL refuses two ranks on one GPU)
        gpus = torch.cuda.device_count()
        if tp_size > gpus:
            raise ValueError(f"-tp {tp_size} on CUDA needs a GPU per rank; this host has {gpus}")
        device = f"cuda:{launch.rank}"
    dtype: str = worker.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    threads = 0
    if device == "cpu":
        threads = cpu_threads(worker.worker_threads, launch.rank)
    geometry = KVGeometry.from_model_dir(launch.model)
    tp: TensorParallel | None = None
    if tp_size > 1:
        if launch.dist_init_method is None:
            raise ValueError("tensor parallelism needs the engine core's dist_init_method")
        plan = ShardPlan.from_model_dir(launch.model, tp_size)
        # Every rank sizes its pool by the largest shard's heads: the same number of blocks on each.
        geometry = dataclasses.replace(geometry, num_kv_heads=plan.max_kv_heads)
        tp = TensorParallel(launch.rank, tp_size, launch.dist_init_method, worker.worker_step_timeout)
    num_blocks = launch.num_blocks or geometry.blocks_for(launch.kv_cache_bytes, launch.block_size, dtype)
    if num_blocks < 1:
        raise ValueError(f"{launch.kv_cache_bytes} bytes of KV cache hold no block of {launch.block_size}")
    config = RunnerConfig(
        launch.model,
        num_blocks,
        launch.block_size,
        device,
        dtype,
        threads,
        tp,
        tokenizer=launch.tokenizer,
        cpu_kernels=worker.cpu_kernels,
        model_impl=worker.model_impl,
    )
    pool = None
    if prefault is not None and device == "cpu":
        pool = prefault.take(num_blocks * geometry.bytes_per_block(launch.block_size, dtype))
    elif prefault is not None:
        prefault.release()
    return ModelRunner.load(config, pool=pool)
