"""The model runner: one ``SchedulerOutput`` in, one forward pass, sampled token ids out.

It keeps, per request, the block table and sampling parameters the scheduler sent when the request
was first scheduled (``new_requests``), extends the table with each step's new blocks, and forgets
requests the scheduler reports finished or preempted. Everything else — which tokens, at which
positions — comes with each step.

Token history, for the logits processors that read it (penalties, bad words): a request that uses
one has its sampler state (``RequestProcessors``) take in every token the runner computes for it,
the prompt's and then the outputs' (an output becomes an input the step after it is sampled, so at
each sample the history holds exactly the outputs so far). The tokens before a new request's first
computed one (a prefix-cache hit, also on the return of a preempted request, which comes back with
prompt and outputs as its tokens and ``num_prompt_tokens`` saying where outputs start) are not sent
again: they are read from ``slot_tokens``, the token id of every KV slot, written with the KV itself
each step (one scatter of the step's tokens, for every request: a cache hit can be on blocks any
earlier request wrote). A request that uses no such processor keeps no history.

All scheduled tokens of a step run as one flat sequence (continuous batching: prefill chunks and
decodes in the same forward); ``paged_attention`` maps them onto the paged cache. Only the rows that
sample go through the LM head (``logits_to_keep`` with their indices), and the prompt rows of requests
that ask for prompt logprobs.

Logprobs: a sampling row whose request asks (``SamplingParams.logprobs``) gets its token's logprobs
from the sampler (its docstring says of which distribution). Prompt logprobs
(``SamplingParams.prompt_logprobs``) are of the model's own distribution (the raw logits: no
temperature or processors apply to tokens nobody sampled, as in vLLM): the logits at position ``p``
give prompt token ``p + 1``'s. A chunk's last prompt row predicts the first token of the next chunk,
which only comes with it: that row's logits wait on the request (``_Sequence.pending_prompt_row``)
until then. Each step's prompt logprobs are sent for the prompt tokens it made known, in order, and
the scheduler gathers them for the request's first output; it also sees that such a request's prompt
is computed from position 0 (no prefix-cache hit: a cached prefix has no logits) and that a request
that has sent them does not ask again after a preemption.

Tensor parallelism (``RunnerConfig.tensor_parallel``): every rank runs this same code on the same
steps with its shard of the weights (``worker/tensor_parallel.py``) and a KV cache for its own
key/value heads, so block tables and layouts are identical on every rank. Only the output rank
(rank 0) runs the LM head, keeps sampler state and samples, from logits that are complete there (the
hidden states are replicated after every all-reduce, the LM head is not sharded).

Thread counts (docs/threads.md): every forward states its intra-op thread count on ``self.threads``
(``worker/thread_context.py``) first: ``run(step, threads=n)`` serves at ``n`` (default: the
configured ``num_threads``). For the thread learner (``worker/shadow.py``), ``run(...,
keep_logits=True)`` keeps the step's forward inputs and its logits' bytes (copied before the sampler
touches them) in ``last``, and ``reforward(count)`` runs that forward again at ``count`` threads and
returns its time and logits' bytes. A re-run changes nothing a client gets: it samples nothing (no
RNG draws, no sampler state), records no history, and the KV slots it writes (the step's slot mapping)
are saved before and restored after, so the paged cache holds the served pass's keys and values
whatever the re-run computed. ``golden(count)`` is a fixed prompt's forward (a prefill, then a decode
reading it back) in the first blocks, with those slots restored the same way.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from trioserve.models.geometry import KVGeometry
from trioserve.models.shard_plan import ShardPlan
from trioserve.protocol.messages import SamplingParams, TokenLogprobs
from trioserve.protocol.step import SchedulerOutput
from trioserve.protocol.worker_messages import StepResult
from trioserve.worker import packed_linear
from trioserve.worker.decoder_model import CausalLM
from trioserve.worker.grammar import GrammarBook, GrammarState, add_bias
from trioserve.worker.model_loader import ModelImpl, load_model
from trioserve.worker.native_kernels import NativeKernels, native_kernels
from trioserve.worker.native_layers import native_layers
from trioserve.worker.native_mlp import fuse_silu_mlps
from trioserve.worker.packed_store import PackedStore
from trioserve.worker.paged_attention import BatchLayout, PagedKVCache, PrefillSpan, attach_to_transformers
from trioserve.worker.sampler import RequestProcessors, Sampler, SamplingRow, token_logprobs
from trioserve.worker.tensor_parallel import all_reduce_min, init_group, shard_model
from trioserve.worker.thread_context import ThreadContext

log = logging.getLogger("trioserve.worker")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    model: str  # a Hugging Face folder: config.json, safetensors, tokenizer files
    num_blocks: int
    block_size: int
    device: str = "cpu"
    dtype: str = "float32"
    num_threads: int = 0  # torch intra-op threads on the CPU; 0: torch's default
    tensor_parallel: TensorParallel | None = None  # None: the whole model in this process
    tokenizer: str | None = None  # the tokenizer folder structured output reads; None: ``model``'s
    cpu_kernels: str = "auto"  # WorkerConfig.cpu_kernels: auto, native or torch
    model_impl: ModelImpl = "auto"  # WorkerConfig.model_impl (worker/model_loader.py)


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This worker's place in its engine's tensor-parallel group (``worker/tensor_parallel.py``)."""

    rank: int
    size: int
    init_method: str  # the rendezvous store the engine core named
    timeout: float = 300.0  # joining, and any one collective


@dataclass(slots=True)
class _Sequence:
    block_ids: list[int]
    sampling: SamplingParams
    num_prompt_tokens: int
    stop_ids: tuple[int, ...]  # banned while fewer than min_tokens outputs exist
    processors: RequestProcessors | None  # the sampler's state for its logits processors, if any
    # With prompt logprobs: the last computed prompt row's logits, until the token it predicts comes.
    pending_prompt_row: torch.Tensor | None = None
    grammar: GrammarState | None = None  # structured output's matcher (output rank only)


@dataclass(frozen=True, slots=True)
class ForwardRecord:
    """A served step's forward, kept for a re-run (``ModelRunner.reforward``)."""

    tokens: int  # the step's tokens (the rows the forward computes)
    count: int  # the thread count it was served at
    seconds: float  # the served forward's wall time (the model call alone)
    logits: bytes  # the served logits' bytes (the LM-head rows), before sampling
    ids: torch.Tensor
    positions: torch.Tensor
    keep: torch.Tensor
    layout: BatchLayout


def logits_bytes(logits: torch.Tensor) -> bytes:
    """A logits tensor's bytes, whatever its dtype (bit-exact comparison: no NaN or -0.0 rules)."""
    return logits.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


@dataclass(slots=True)
class _Scheduled:
    request_id: str
    token_ids: list[int]
    start: int  # position of the first token
    samples: bool


class ModelRunner:
    """Runs ``model`` (whole, or this rank's shard of it: ``kv_heads`` then says how many key/value
    heads the shard holds). Only the output rank (``output_rank``, tensor-parallel rank 0) runs the LM
    head, samples and keeps sampler state; the other ranks run the same forward for its all-reduces
    and answer nothing (their ``StepResult`` is empty)."""

    def __init__(
        self,
        model: Any,
        num_blocks: int,
        block_size: int,
        *,
        kv_heads: int | None = None,
        output_rank: bool = True,
        num_threads: int = 0,
        tokenizer: str | None = None,
        pool: mmap.mmap | None = None,
        cpu_kernels: str = "auto",
        packed_store: PackedStore | None = None,
    ) -> None:
        if not isinstance(model, CausalLM):  # a transformers model: its attention becomes the paged one
            attach_to_transformers(model)
        self.model = model
        self.implementation = "trioserve" if isinstance(model, CausalLM) else "transformers"
        self.num_threads = num_threads  # the configured intra-op count; 0: torch's default, untouched
        self.threads = ThreadContext()
        self.last: ForwardRecord | None = None  # the latest step's forward, when asked to keep it
        self.last_seconds: float | None = None  # the latest forward's wall time (None: no forward)
        self.last_rows = 0  # the LM-head rows the latest forward kept (0: no logits on this rank)
        self.device: torch.device = model.device
        geometry = KVGeometry.from_mapping(model.config.to_dict())
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.output_rank = output_rank
        self.load_seconds = 0.0  # set by load()
        self.vocab_size = geometry.vocab_size
        kernels = native_kernels(cpu_kernels, self.device, model.dtype)
        # 0: F.linear on the weights as loaded
        self.packed_linears = _pack(model, cpu_kernels, kernels, packed_store)
        self.fused_mlps = 0 if kernels is None else fuse_silu_mlps(model, kernels)
        self.native_layers = 0 if kernels is None else native_layers(model, kernels)  # norms, attention
        self.cache = PagedKVCache(
            geometry.num_layers,
            num_blocks,
            block_size,
            kv_heads or geometry.num_kv_heads,
            geometry.head_dim,
            model.dtype,
            self.device,
            pool,
            kernels,
        )
        self.sampler = Sampler(self.device, self.vocab_size, kernels)
        self.grammars = GrammarBook(tokenizer, self.vocab_size)  # structured output (worker/grammar.py)
        self.sequences: dict[str, _Sequence] = {}
        # The token id in every KV slot (block * block_size + offset), for the histories above.
        self.slot_tokens = torch.zeros(num_blocks * block_size, dtype=torch.long, device=self.device)

    @classmethod
    def load(cls, config: RunnerConfig, pool: mmap.mmap | None = None) -> ModelRunner:
        """Load the model; with ``tensor_parallel``, join the group first, then keep this rank's shard
        and agree on the smallest KV pool any rank holds (the ledger's blocks are the same ids on
        every rank). ``pool``: the CPU pool's zeroed, resident pages (``worker/kv_prefault.py``)."""
        if config.num_threads > 0:  # loading runs parallel regions too; forwards state their own count
            ThreadContext().use(config.num_threads)
        started = time.perf_counter()
        tp = config.tensor_parallel
        device = torch.device(config.device)
        if tp is not None:
            init_group(tp.init_method, tp.rank, tp.size, device, tp.timeout)
        model, implementation = load_model(config.model, _DTYPES[config.dtype], config.model_impl)
        model = model.to(device)
        num_blocks, kv_heads, shard = config.num_blocks, None, ""
        if tp is not None:
            plan = ShardPlan.from_mapping(model.config.to_dict(), tp.size)
            held = shard_model(model, plan, tp.rank)
            kv_heads = len(held.kv_heads)
            num_blocks = all_reduce_min(num_blocks, device)
            shard = (
                f"; tensor-parallel rank {tp.rank} of {tp.size}: query heads {_span(held.q_heads)}, "
                f"key/value heads {_span(held.kv_heads)}, MLP columns {_span(held.mlp_columns)}"
            )
        runner = cls(
            model,
            num_blocks,
            config.block_size,
            kv_heads=kv_heads,
            output_rank=tp is None or tp.rank == 0,
            num_threads=config.num_threads,
            tokenizer=config.tokenizer or config.model,
            pool=pool,
            cpu_kernels=config.cpu_kernels,
            # one rank's whole model on the CPU: its packed weights are kept between starts
            packed_store=(
                PackedStore(config.model)
                if tp is None and device.type == "cpu" and os.path.isdir(config.model)
                else None
            ),
        )
        runner.load_seconds = time.perf_counter() - started
        log.info(
            "loaded %s on %s (%s) in %.1f s, model: %s; KV cache: %d blocks of %d tokens; CPU kernels: %s%s",
            config.model,
            device,
            config.dtype,
            runner.load_seconds,
            implementation,
            num_blocks,
            config.block_size,
            ("native (decode attention in place, the draw)" if runner.cache.native is not None else "torch's")
            + f"; {runner.packed_linears} linear layers packed"
            + (" in column blocks" if runner.cache.native is not None else " for oneDNN")
            + f"; {runner.fused_mlps} MLPs with a fused SiLU"
            + f"; {runner.native_layers} norms and attention modules native",
            shard,
        )
        return runner

    # ----------------------------------------------------------------------------------------------

    def execute(self, step: SchedulerOutput) -> dict[str, list[int]]:
        """The sampled token ids of the step (``run`` without the logprobs)."""
        return self.run(step).sampled

    def run(
        self, step: SchedulerOutput, *, threads: int | None = None, keep_logits: bool = False
    ) -> StepResult:
        """Serve ``step`` at ``threads`` intra-op threads (None: the configured count); with
        ``keep_logits``, keep its forward in ``last`` when it computed logits (else ``last`` is None)."""
        self.last, self.last_seconds, self.last_rows = None, None, 0
        for rid in (*step.finished_request_ids, *step.preempted_request_ids):
            gone = self.sequences.pop(rid, None)
            if gone is not None and gone.processors is not None:
                self.sampler.release(gone.processors)
        scheduled: list[_Scheduled] = []
        for new in step.new_requests:
            s = new.sampling
            stop_ids = list(s.stop_token_ids)
            if new.eos_token_id is not None and not s.ignore_eos:
                stop_ids.append(new.eos_token_id)
            old = self.sequences.get(new.request_id)
            if old is not None and old.processors is not None:  # never expected; never leak a slot
                self.sampler.release(old.processors)
            # Sampler and grammar state live where sampling happens: the output rank only.
            self.sequences[new.request_id] = _Sequence(
                list(new.block_ids),
                s,
                new.num_prompt_tokens,
                tuple(stop_ids),
                self.sampler.processors(s, new.num_prompt_tokens) if self.output_rank else None,
                grammar=(
                    self.grammars.state(s.grammar, new.eos_token_id)
                    if s.grammar is not None and self.output_rank
                    else None
                ),
            )
            scheduled.append(_Scheduled(new.request_id, new.token_ids, new.num_computed_tokens, new.samples))
        for running in step.running_requests:
            self.sequences[running.request_id].block_ids.extend(running.new_block_ids)
            scheduled.append(
                _Scheduled(
                    running.request_id, running.token_ids, running.num_computed_tokens, running.samples
                )
            )
        if not scheduled:
            return StepResult(step.step, {})
        count = self.num_threads if threads is None else threads
        with torch.inference_mode():
            self._record_history(scheduled)
            self._advance_grammars(scheduled)
            return self._forward(step.step, scheduled, count, keep_logits)

    @staticmethod
    def step_tokens(step: SchedulerOutput) -> int:
        """The tokens ``step``'s forward computes (prefill chunks and decodes together)."""
        return sum(len(r.token_ids) for r in step.new_requests) + sum(
            len(r.token_ids) for r in step.running_requests
        )

    def reforward(self, count: int) -> tuple[float, bytes]:
        """Run the kept forward (``last``) again at ``count`` threads: (its wall time, its logits'
        bytes). The paged cache's slots it writes are restored afterwards, even if it raises."""
        record = self.last
        if record is None:
            raise RuntimeError("no forward kept to run again")
        with torch.inference_mode(), self._slots_restored(record.layout):
            seconds, logits = self._timed_model(
                record.ids, record.positions, record.keep, record.layout, count
            )
            return seconds, logits_bytes(logits)

    def golden(self, count: int, length: int = 12) -> bytes:
        """A fixed prompt's logits at ``count`` threads: a ``length``-token prefill at position 0 in
        the first blocks, then a one-token decode that reads its keys and values back; every row's
        logits, as bytes. The slots it writes are restored afterwards (the pool is not touched)."""
        bs = self.block_size
        length = max(1, min(length, self.num_blocks * bs - 1))
        dev = self.device
        prompt = [(7 + 31 * i) % self.vocab_size for i in range(length + 1)]
        table = list(range(-(-(length + 1) // bs)))
        out: list[bytes] = []
        with torch.inference_mode():
            whole = self._layout([(table, 0, length + 1)], list(range(length + 1)))
            with self._slots_restored(whole):
                for ids, start in ((prompt[:length], 0), (prompt[length:], length)):
                    positions = list(range(start, start + len(ids)))
                    layout = self._layout([(table, start, len(ids))], positions)
                    keep = (
                        torch.arange(len(ids), device=dev)
                        if self.output_rank
                        else torch.zeros(0, dtype=torch.long)
                    )
                    _, logits = self._timed_model(
                        torch.tensor([ids], device=dev),
                        torch.tensor([positions], device=dev),
                        keep,
                        layout,
                        count,
                    )
                    out.append(logits_bytes(logits))
        return b"".join(out)

    @contextlib.contextmanager
    def _slots_restored(self, layout: BatchLayout) -> Iterator[None]:
        """Save the K/V slots ``layout`` writes, in every layer, and put them back on the way out."""
        blocks, offsets = layout.write_blocks, layout.write_offsets
        saved = [
            (k[blocks, offsets], v[blocks, offsets])
            for k, v in zip(self.cache.keys, self.cache.values, strict=True)
        ]
        try:
            yield
        finally:
            for (k, v), (sk, sv) in zip(
                zip(self.cache.keys, self.cache.values, strict=True), saved, strict=True
            ):
                k[blocks, offsets] = sk
                v[blocks, offsets] = sv

    def _timed_model(
        self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, layout: BatchLayout, count: int
    ) -> tuple[float, torch.Tensor]:
        """One model call at ``count`` threads: (its wall time, the kept rows' logits ``[rows, vocab]``)."""
        self.threads.use(count)
        started = time.perf_counter()
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            use_cache=False,
            logits_to_keep=keep,
            trioserve_layout=layout,
            trioserve_cache=self.cache,
        )
        return time.perf_counter() - started, out.logits[0]

    def _record_history(self, scheduled: list[_Scheduled]) -> None:
        """Hands each history-keeping request's tokens of this step to the sampler, preceded by any it
        has not seen (a new request's cached prefix), read back from ``slot_tokens``."""
        entries: list[tuple[RequestProcessors, list[int]]] = []
        bs = self.block_size
        for item in scheduled:
            seq = self.sequences[item.request_id]
            p = seq.processors
            if p is None or not p.keeps_history:
                continue
            tokens = item.token_ids
            if item.start > p.num_seen:
                table = seq.block_ids
                slots = [table[pos // bs] * bs + pos % bs for pos in range(p.num_seen, item.start)]
                tokens = self.slot_tokens[slots].tolist() + tokens
            elif item.start < p.num_seen:  # never expected: take only what is new
                tokens = tokens[p.num_seen - item.start :]
            entries.append((p, tokens))
        if entries:
            self.sampler.record(entries)

    def _advance_grammars(self, scheduled: list[_Scheduled]) -> None:
        """Each constrained request's matcher takes in its outputs that are inputs of this step and
        that it has not taken in yet (earlier ones of a resumed request from ``slot_tokens``)."""
        bs = self.block_size
        for item in scheduled:
            seq = self.sequences[item.request_id]
            g = seq.grammar
            if g is None:
                continue
            first = seq.num_prompt_tokens + g.accepted  # the first output position not taken in
            end = item.start + len(item.token_ids)
            if first >= end:
                continue
            tokens: list[int] = []
            if first < item.start:
                table = seq.block_ids
                slots = [table[pos // bs] * bs + pos % bs for pos in range(first, item.start)]
                tokens = self.slot_tokens[slots].tolist()
            tokens += item.token_ids[max(0, first - item.start) :]
            self.grammars.take(g, tokens)

    def _forward(self, step: int, scheduled: list[_Scheduled], count: int, keep_logits: bool) -> StepResult:
        dev = self.device
        input_ids: list[int] = []
        positions: list[int] = []
        keep: list[int] = []  # the rows through the LM head: prompt-logprobs rows, sampling rows
        sample_at: list[int] = []  # each sampling row's place in ``keep``
        sampling: list[SamplingRow] = []
        sample_ids: list[str] = []
        constrained: list[tuple[int, GrammarState]] = []  # (sampling row, its grammar)
        prompt_spans: list[tuple[_Scheduled, int, int]] = []  # (item, place in keep, rows)
        for item in scheduled:
            n = len(item.token_ids)
            row = len(input_ids)
            input_ids += item.token_ids
            positions += range(item.start, item.start + n)
            seq = self.sequences[item.request_id]
            if seq.sampling.prompt_logprobs is not None:
                # Rows at positions up to the prompt's second-to-last predict prompt tokens.
                rows = max(0, min(n, seq.num_prompt_tokens - 1 - item.start))
                if rows or seq.pending_prompt_row is not None:
                    prompt_spans.append((item, len(keep), rows))
                    keep += range(row, row + rows)
            if item.samples:
                if seq.grammar is not None:
                    constrained.append((len(sampling), seq.grammar))
                sample_at.append(len(keep))
                keep.append(row + n - 1)
                sample_ids.append(item.request_id)
                sampling.append(self._sampling_row(item))
        spans = [
            (self.sequences[item.request_id].block_ids, item.start, len(item.token_ids)) for item in scheduled
        ]
        layout = self._layout(spans, positions)
        ids = torch.tensor([input_ids], device=dev)
        self.slot_tokens[layout.write_blocks * self.block_size + layout.write_offsets] = ids[0]
        position_ids = torch.tensor([positions], device=dev)
        # The other tensor-parallel ranks run no LM head: only the output rank samples.
        keep_rows = torch.tensor(keep if self.output_rank else [], dtype=torch.long, device=dev)
        # The masks are filled on their own thread while the forward runs (worker/grammar.py).
        masks = self.grammars.start([g for _, g in constrained]) if constrained else None
        self.last_seconds, logits = self._timed_model(ids, position_ids, keep_rows, layout, count)
        if not keep or not self.output_rank:
            return StepResult(step, {})
        self.last_rows = len(keep)
        if keep_logits:  # the bytes before the sampler and the prompt logprobs touch the tensor
            self.last = ForwardRecord(
                len(input_ids),
                count,
                self.last_seconds,
                logits_bytes(logits),
                ids,
                position_ids,
                keep_rows,
                layout,
            )
        prompt_logprobs = self._prompt_logprobs(logits, prompt_spans) if prompt_spans else None
        if not sample_at:
            return StepResult(step, {}, None, prompt_logprobs)
        if len(sample_at) < len(keep):
            logits = logits[torch.tensor(sample_at, device=dev)]
        if masks is not None:
            add_bias(logits, masks.result(), [i for i, _ in constrained])
        tokens, found = self.sampler.sample_with_logprobs(logits, sampling)
        sampled = {rid: [token] for rid, token in zip(sample_ids, tokens, strict=True)}
        logprobs = {sample_ids[i]: [lp] for i, lp in found.items()} if found else None
        return StepResult(step, sampled, logprobs, prompt_logprobs)

    def _prompt_logprobs(
        self, logits: torch.Tensor, spans: list[tuple[_Scheduled, int, int]]
    ) -> dict[str, list[TokenLogprobs]] | None:
        """The prompt tokens' logprobs this step makes known, per request, in prompt order, for all the
        requests in one ``token_logprobs`` call; each request's newest prompt row is held back as its
        ``pending_prompt_row`` when the token it predicts is in the next chunk."""
        parts: list[torch.Tensor] = []
        targets: list[int] = []
        ks: list[int] = []
        owners: list[tuple[str, int]] = []  # (request id, entries)
        for item, at, rows in spans:
            seq = self.sequences[item.request_id]
            k = seq.sampling.prompt_logprobs or 0
            n = len(item.token_ids)
            block = logits[at : at + rows]
            # Rows before the chunk's last predict tokens of this chunk; the last may predict the next.
            known = rows if rows < n else rows - 1
            entries = known
            if seq.pending_prompt_row is not None:
                parts.append(seq.pending_prompt_row)
                targets.append(item.token_ids[0])
                entries += 1
            parts.append(block[:known])
            targets += item.token_ids[1 : known + 1]
            seq.pending_prompt_row = block[known:].clone() if known < rows else None
            ks += [k] * entries
            owners.append((item.request_id, entries))
        if not targets:
            return None
        found = token_logprobs(torch.cat(parts), targets, ks)
        result: dict[str, list[TokenLogprobs]] = {}
        start = 0
        for rid, entries in owners:
            if entries:
                result[rid] = found[start : start + entries]
                start += entries
        return result

    def _sampling_row(self, item: _Scheduled) -> SamplingRow:
        seq = self.sequences[item.request_id]
        s = seq.sampling
        output_index = item.start + len(item.token_ids) - seq.num_prompt_tokens
        banned = seq.stop_ids if output_index < s.min_tokens else ()
        return SamplingRow(
            s.temperature, s.top_p, s.top_k, s.seed, output_index, banned, s.min_p, seq.processors, s.logprobs
        )

    def _layout(self, spans: list[tuple[list[int], int, int]], positions: list[int]) -> BatchLayout:
        """The batch layout of ``spans`` (each: a block table, the first position, the tokens) laid
        out one after another in the flat batch, at ``positions``."""
        dev = self.device
        bs = self.block_size
        write_blocks: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSpan] = []
        row = 0
        for table, start, n in spans:
            write_blocks += [table[p // bs] for p in positions[row : row + n]]
            context = start + n
            used = table[: -(-context // bs)]
            if n == 1:
                decode_rows.append(row)
                decode_tables.append(used)
                decode_lens.append(context)
            elif start == 0:
                prefills.append(PrefillSpan(row, row + n, None, None))
            else:
                query_pos = torch.arange(start, context, device=dev).unsqueeze(1)
                mask = torch.arange(len(used) * bs, device=dev).unsqueeze(0) <= query_pos
                prefills.append(PrefillSpan(row, row + n, torch.tensor([used], device=dev), mask))
            row += n
        width = max((len(t) for t in decode_tables), default=0)
        decode_blocks = torch.tensor(
            [t + [0] * (width - len(t)) for t in decode_tables], dtype=torch.long, device=dev
        ).view(len(decode_tables), width)
        lens = torch.tensor(decode_lens, dtype=torch.long, device=dev)
        decode_mask = (torch.arange(width * bs, device=dev).unsqueeze(0) < lens.view(-1, 1)).view(
            len(decode_lens), 1, 1, width * bs
        )
        return BatchLayout(
            write_blocks=torch.tensor(write_blocks, dtype=torch.long, device=dev),
            write_offsets=torch.tensor(positions, dtype=torch.long, device=dev) % bs,
            decode_rows=torch.tensor(decode_rows, dtype=torch.long, device=dev),
            decode_blocks=decode_blocks,
            decode_mask=decode_mask,
            decode_lens=lens,
            prefills=tuple(prefills),
        )


def _pack(model: Any, cpu_kernels: str, kernels: NativeKernels | None, store: PackedStore | None) -> int:
    """``pack_linears`` on a CPU float32 model unless ``cpu_kernels`` is ``torch``: in the native
    kernels' blocks where they built, else (``auto`` only: ``native`` refused already) for oneDNN
    where torch has it; how many it packed."""
    if kernels is not None:
        return packed_linear.pack_linears(model, kernels, store)
    if cpu_kernels == "torch" or model.device.type != "cpu" or model.dtype != torch.float32:
        return 0
    return packed_linear.pack_linears(model) if packed_linear.available() else 0


def _span(r: range) -> str:
    return f"{r.start}..{r.stop - 1}" if len(r) > 1 else str(r.start)
