"""Engine core ↔ worker messages (design §8): how a worker is started (``WorkerLaunch``), then steps
going out on the shared-memory ring to every worker and results coming back from the output rank
only, on a second ring. The ring messages follow ``messages.py``'s rules: tagged msgpack arrays,
append-only fields with defaults, no pickle."""

from __future__ import annotations

import msgspec

from trioserve.config import WorkerConfig
from trioserve.protocol.codec import Codec
from trioserve.protocol.messages import TokenLogprobs
from trioserve.protocol.ring_layout import RingHandle
from trioserve.protocol.step import SchedulerOutput
from trioserve.protocol.thread_report import THREAD_REPORT_BYTES, WorkerThreads


class WorkerLaunch(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything a worker process is started with, as one value: ``python -m trioserve worker
    --launch JSON`` (``to_json``/``from_json``), built by the engine core that starts it
    (``engine/worker_executor.py``). Parent and child are the same installation, so JSON with unknown
    fields refused is enough: nothing here is re-spelled as a flag. The ring handles' fds travel in
    ``pass_fds`` (``RingHandle``'s rule)."""

    model: str  # the Hugging Face folder to load
    tokenizer: str | None = None  # the tokenizer folder structured output reads; None: ``model``'s
    worker: WorkerConfig  # device, dtype, KV-cache memory, threads (the config tree's section)
    block_size: int
    num_blocks: int  # 0: as many as ``kv_cache_bytes`` holds
    steps_ring: RingHandle  # this worker's reader end of the step ring
    results_ring: RingHandle | None = None  # the writer end of the result ring (output rank only)
    rank: int = 0
    log_level: str = "info"
    title: str = "Worker"  # the process title's role and ranks (``runtime.process.rank_title``)
    # Tensor parallelism: ``rank`` is this worker's rank among ``tensor_parallel_size`` workers, which
    # meet through ``dist_init_method`` (a torch.distributed init URL the engine core owns; None with
    # one worker). Every rank reads the same step ring; only rank 0 has the result ring.
    tensor_parallel_size: int = 1
    dist_init_method: str | None = None

    @property
    def kv_cache_bytes(self) -> int:
        return int(self.worker.kv_cache_gib * (1 << 30))

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerLaunch:
        return msgspec.json.decode(text, type=cls)


class _Wire(msgspec.Struct, array_like=True, gc=False):
    pass


class WorkerStep(_Wire, tag="step"):
    step: SchedulerOutput


class WorkerShutdown(_Wire, tag="shutdown"):
    pass


class WorkerReady(_Wire, tag="ready"):
    rank: int
    pid: int
    load_seconds: float
    device: str
    num_blocks: int  # KV blocks the worker allocated: the engine core's ledger gets exactly these
    threads: WorkerThreads | None = None  # its CPU threads, after the golden check (thread_report.py)


class StepResult(_Wire, tag="result"):
    """One step's answer: the sampled token ids of the requests whose chunk samples, and, for requests
    that ask, their logprobs (``SamplingParams.logprobs``: one entry per sampled token) and this
    step's prompt logprobs (``prompt_logprobs``: the prompt tokens this step's chunk made known, in
    prompt order from the second token; the engine core gathers a request's chunks for its first
    output). A step where no request asks sends None for both."""

    step: int  # the SchedulerOutput.step it answers
    sampled: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]] | None = None
    prompt_logprobs: dict[str, list[TokenLogprobs]] | None = None
    threads: WorkerThreads | None = None  # only when the worker's thread report changed (thread_report.py)


# The most alternatives per token (SamplingParams.logprobs / prompt_logprobs) the engine computes: the
# result ring's slots are sized for it (``step_result_bytes``); the engine refuses a request asking
# for more (the API server's --max-logprobs, 20 by default, is normally far below).
MAX_ENGINE_LOGPROBS = 64


def step_result_bytes(max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """An upper bound on one encoded ``StepResult``, rounded up to a MiB, at least 1 MiB: a step sends
    at most one prompt logprobs entry per computed token and one sampled entry per request, each at
    most ``MAX_ENGINE_LOGPROBS`` alternatives (a 5-byte id and a 9-byte float64 each) plus its own
    fields and headers (26 bytes); per request its id (1 KiB) in each of the three maps and a token;
    and a thread report."""
    per_entry = 26 + 14 * MAX_ENGINE_LOGPROBS
    per_request = 3 * 1024 + 16
    bound = (max_num_batched_tokens + max_num_seqs) * per_entry + max_num_seqs * per_request
    bound += THREAD_REPORT_BYTES + 4096
    return max(1, -(-bound // (1 << 20))) * (1 << 20)


class WorkerFailed(_Wire, tag="failed"):
    """A worker that cannot go on says why before it exits (the engine turns this into request errors)."""

    rank: int
    error: str


WorkerInput = WorkerStep | WorkerShutdown
WorkerOutput = WorkerReady | StepResult | WorkerFailed


def worker_input_codec() -> Codec[WorkerInput]:
    return Codec(WorkerInput, "worker input")


def worker_output_codec() -> Codec[WorkerOutput]:
    return Codec(WorkerOutput, "worker output")
