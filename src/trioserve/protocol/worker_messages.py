"""Engine core ↔ worker messages (design §8): how a worker is started (``WorkerLaunch``), then steps
going out on the shared-memory ring to every worker and results coming back from the output rank
only, on a second ring. The ring messages follow ``messages.py``'s rules: tagged msgpack arrays,
append-only fields with defaults, no pickle."""

from __future__ import annotations

import msgspec

from trioserve.config import WorkerConfig
from trioserve.protocol.codec import Codec
from trioserve.protocol.ring_layout import RingHandle
from trioserve.protocol.step import SchedulerOutput


class WorkerLaunch(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything a worker process is started with, as one value: ``python -m trioserve worker
    --launch JSON`` (``to_json``/``from_json``), built by the engine core that starts it
    (``engine/worker_executor.py``). Parent and child are the same installation, so JSON with unknown
    fields refused is enough: nothing here is re-spelled as a flag. The ring handles' fds travel in
    ``pass_fds`` (``RingHandle``'s rule)."""

    model: str  # the Hugging Face folder to load
    worker: WorkerConfig  # device, dtype, KV-cache memory, threads (the config tree's section)
    block_size: int
    num_blocks: int  # 0: as many as ``kv_cache_bytes`` holds
    steps_ring: RingHandle  # this worker's reader end of the step ring
    results_ring: RingHandle | None = None  # the writer end of the result ring (output rank only)
    rank: int = 0
    log_level: str = "info"

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


class StepResult(_Wire, tag="result"):
    step: int  # the SchedulerOutput.step it answers
    sampled: dict[str, list[int]]


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
