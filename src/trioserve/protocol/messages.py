"""Wire messages between API servers and engine cores (design §5).

Every message is a msgspec Struct encoded as a msgpack array (``array_like``) whose first element is
its tag. Rules that keep old and new processes able to talk:

- Fields are append-only and every appended field has a default. An older decoder skips trailing
  elements it does not know (msgspec ignores unknown trailing array items by default); a newer decoder
  fills missing trailing fields with their defaults.
- Requests carry token ids, never text: the API server owns tokenizing and detokenizing.
- No pickle anywhere: a frame is decoded against one of the unions below or rejected.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from trioserve.protocol.thread_report import NO_WORKER_THREADS

PROTOCOL_VERSION = 1

# An engine sends every API server a message at least this often (seconds), busy or idle: an idle
# engine's stats-only ``EngineOutputs`` is its heartbeat. API servers rely on it twice: engine stats
# older than a few intervals are stale (admission ignores them), and an engine silent for longer than
# its stall bound is reported stalled (``frontend/engine_health.py``).
HEARTBEAT_INTERVAL = 1.0

# The reasons a request can finish, as the engine reports them. "stop" covers EOS and stop token ids
# (the engine sees them as soon as it samples them); stop *strings* are matched in the API server,
# which then aborts the request on the engine.
FinishReason = Literal["stop", "length", "abort", "error"]


class _Wire(msgspec.Struct, array_like=True, gc=False):
    """Base for wire structs: positional encoding, no GC tracking (the structs are acyclic)."""


# --------------------------------------------------------------------------------------------------
# Handshake: an engine core joins an API server (or, later, the supervisor) at its handshake address.
#   engine --Hello-->   frontend
#   engine <--Welcome-- frontend     (where to connect its DEALER and PUSH sockets)
#   engine --Ready-->   frontend     (sent on the DEALER once connected; carries engine limits)
# --------------------------------------------------------------------------------------------------


def engine_identity(engine_index: int) -> bytes:
    """The ZMQ identity of an engine core's input DEALER: how an API server's ROUTER addresses it."""
    return engine_index.to_bytes(2, "little")


class ClientAddresses(_Wire):
    """One API server's sockets, as an engine must connect to them. Index in the list = client_index."""

    input_address: str  # API server's ROUTER; the engine connects a DEALER (requests in)
    output_address: str  # API server's PULL; the engine connects a PUSH (outputs out)


class EngineHello(_Wire, tag="hello"):
    engine_index: int
    pid: int
    protocol_version: int = PROTOCOL_VERSION


class Welcome(_Wire, tag="welcome"):
    clients: list[ClientAddresses]
    protocol_version: int = PROTOCOL_VERSION
    # With data parallelism: the DP coordinator's PULL, where the engine pushes its ``LoadReport``s
    # ("": no coordinator).
    coordinator_address: str = ""


class EngineReady(_Wire, tag="ready"):
    engine_index: int
    pid: int
    kind: str  # "mock" or "model": what executes steps behind this engine core
    max_model_len: int
    max_num_seqs: int
    vocab_size: int
    num_kv_blocks: int = 0  # 0: the engine keeps no KV ledger (the mock engine by default)
    block_size: int = 0
    protocol_version: int = PROTOCOL_VERSION
    max_num_batched_tokens: int = 0  # the per-step token budget; 0: none (the mock engine)


HandshakeMessage = EngineHello | Welcome | EngineReady


# --------------------------------------------------------------------------------------------------
# API server -> engine (ROUTER -> DEALER).
# --------------------------------------------------------------------------------------------------


# The most stop token ids a request may carry (the API server refuses more with a 400): every step
# carries each new request's sampling parameters, and the worker ring's slot is sized for this many
# (``protocol.step.step_slot_bytes``).
MAX_STOP_TOKEN_IDS = 128
# The same bound for the logits processors' lists (the API server refuses more with a 400 naming the
# parameter): logit_bias entries (OpenAI's 300), allowed_token_ids, and bad words after tokenizing
# (vLLM's 128 sequences of at most 1024 tokens in all).
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_ALLOWED_TOKEN_IDS = 2048
MAX_BAD_WORDS = 128
MAX_BAD_WORDS_TOKENS = 1024
# A request's output grammar (llguidance's form, built and checked by the API server) is at most this
# many bytes, and a step admits at most ``MAX_GRAMMARS_PER_STEP`` requests that carry one (the
# scheduler holds the rest for the next step): the ring slot is sized for that many.
MAX_GRAMMAR_BYTES = 64 * 1024
MAX_GRAMMARS_PER_STEP = 8


class SamplingParams(_Wire):
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: disabled
    seed: int | None = None
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False  # EOS does not stop the request; stop_token_ids still do (as in vLLM)
    min_tokens: int = 0
    # Logits processors, applied in the worker's sampler in the order its docstring states; each
    # default is the neutral value, and a request that leaves them all there costs the sampler nothing.
    presence_penalty: float = 0.0  # -2..2, times (count > 0) of each output token so far
    frequency_penalty: float = 0.0  # -2..2, times the count of each output token so far
    repetition_penalty: float = 1.0  # > 0; over prompt and output tokens (vLLM's and HF's rule)
    min_p: float = 0.0  # 0..1, of the top token's probability
    logit_bias: dict[int, float] | None = None  # token id -> -100..100, added to its logit
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words_token_ids: list[list[int]] | None = None  # the bad words, tokenized by the API server
    # Logprobs (``TokenLogprobs`` below): None asks for none; k >= 0 asks for the sampled token's own
    # logprob and rank plus the k most likely alternatives, for each output token (``logprobs``) and,
    # on the request's first output, for each prompt token (``prompt_logprobs``). The API server caps
    # k at --max-logprobs.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Structured output: the grammar every output token must keep the text inside (llguidance's JSON
    # form; ``frontend/request/structured.py`` builds it, ``worker/grammar.py`` runs it). None: free text.
    grammar: str | None = None


class AddRequest(_Wire, tag="add"):
    request_id: str  # unique across the deployment: "<http id>-<choice index>"
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float  # wall clock (time.time()) when the API server received the request
    client_index: int = 0  # which API server owns this request: outputs go to its PUSH socket
    priority: int = 0
    # Salts the prompt's block hashes (prefix caching per tenant). No API server sets it yet; it stays:
    # fields are positional (array_like) and append-only, so removing it would shift eos_token_id.
    cache_salt: str | None = None
    eos_token_id: int | None = None  # the tokenizer's EOS; stops the request unless ignore_eos


class AbortRequests(_Wire, tag="abort"):
    request_ids: list[str]


class ShutdownEngine(_Wire, tag="shutdown"):
    reason: str = ""


class ClientReset(_Wire, tag="reset"):
    """A new API server process now holds ``client_index`` (the supervisor restarted it): every request
    the engine holds for that index belonged to the one that died, and is dropped without output."""

    client_index: int


class ClientDone(_Wire, tag="done"):
    """Client ``client_index`` sends this engine no more requests: its replica is retiring (a resize,
    docs/replicas.md). Sent after the last add the client placed there; its aborts may still follow.
    An engine that has heard it from every client it joined, and holds no request, says
    ``EngineRetired`` to all of them and exits."""

    client_index: int


EngineInput = AddRequest | AbortRequests | ShutdownEngine | ClientReset | ClientDone


# --------------------------------------------------------------------------------------------------
# Engine -> API server (PUSH -> PULL): one EngineOutputs per engine step per client.
# --------------------------------------------------------------------------------------------------

RequestEventKind = Literal["queued", "scheduled", "preempted"]


class RequestEvent(_Wire):
    kind: RequestEventKind
    timestamp: float  # engine wall clock


class TokenLogprobs(_Wire):
    """One position's logprobs. Output tokens: of the distribution the token was sampled from (after
    logit_bias, allowed/bad words, penalties and temperature; before min_p, top-k and top-p; how that
    differs from vLLM's modes is in docs/openai_api.md). Prompt tokens: of the raw logits.
    ``top_ids``/``top_logprobs``: the k most likely tokens, most likely first (k = the request's
    ``logprobs``; may include the token itself)."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top_ids: list[int] = msgspec.field(default_factory=list)
    top_logprobs: list[float] = msgspec.field(default_factory=list)


class RequestOutput(_Wire):
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None  # the token that stopped it, when finish_reason == "stop"
    num_cached_tokens: int = 0
    error: str | None = None  # set with finish_reason == "error": why the engine refused or failed it
    events: list[RequestEvent] | None = None
    # With SamplingParams.logprobs: one entry per new_token_ids entry, in order.
    logprobs: list[TokenLogprobs] | None = None
    # With SamplingParams.prompt_logprobs, on the request's first output only: one entry per prompt
    # token; the first is None (nothing precedes it), as in vLLM.
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class EngineStats(_Wire):
    """Queue stats of one engine, sent with every step so API servers need no extra round trip, and
    in the stats-only messages of an idle engine (see ``EngineOutputs``)."""

    num_waiting: int
    num_running: int
    kv_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    num_preemptions: int = 0  # cumulative
    prefix_cache_queries: int = 0  # cumulative tokens looked up
    prefix_cache_hits: int = 0  # cumulative tokens found
    folded_steps: int = 0  # cumulative steps the engine's output pump folded (its socket was full)
    # The step running as this message left (all 0 between steps; see ``engine/step_watch.py``): its
    # scheduled tokens, how long it has run, how long it may run, and whether it is overdue (the
    # engine core's own judgement, which the API server reports as a stall).
    step_tokens: int = 0
    step_elapsed: float = 0.0  # seconds
    step_bound: float = 0.0  # seconds
    step_overdue: bool = False
    # Its workers' thread reports: a msgpack ``list[WorkerThreads]`` encoded once by the engine core
    # when a report changes, decoded by an API server only for /metrics and the inventory
    # (``protocol/thread_report.py``). An engine without workers sends an empty list.
    worker_threads: msgspec.Raw = NO_WORKER_THREADS


class EngineOutputs(_Wire, tag="out"):
    """One engine step's outputs for one API server; or, with no outputs, a stats-only message: the
    report an engine sends right after the step in which its last request finished or was aborted
    (so the queue stats read 0 at once), and its heartbeat, sent to an API server that got no message
    for ``HEARTBEAT_INTERVAL``. A stats-only message repeats the number of the last step."""

    engine_index: int
    step: int  # engine step counter: increasing per engine (repeated by stats-only messages)
    timestamp: float  # engine wall clock at the end of the step
    outputs: list[RequestOutput]
    stats: EngineStats


class EngineDead(_Wire, tag="dead"):
    """An engine core that hits an unrecoverable error says so before it exits; the supervisor says
    it for an engine process that exited without a word (``pid``: that process; 0: not known)."""

    engine_index: int
    reason: str
    pid: int = 0


class EngineRetired(_Wire, tag="retired"):
    """An engine's last message to each client after ``ClientDone`` from all of them: every request
    it held has finished (its outputs went first, on the same socket), and it exits now."""

    engine_index: int


class ReplicaRoster(_Wire, tag="roster"):
    """The supervisor to every API server (on the socket its ``EngineDead`` notices use): the
    replicas wanted now are ranks ``0 .. desired - 1``. A rank at or past it that is still up is
    draining: it gets no new request, and its client owes it ``ClientDone``. ``epoch``: 1 for the
    first resize, then one more each time; a client ignores a roster older than the one it holds."""

    desired: int
    epoch: int = 0


EngineOutputMessage = EngineOutputs | EngineDead | EngineRetired | ReplicaRoster


# --------------------------------------------------------------------------------------------------
# Data parallelism: engines -> DP coordinator (PUSH -> PULL), coordinator -> API servers (PUB -> SUB).
# --------------------------------------------------------------------------------------------------


class LoadReport(_Wire, tag="load"):
    """One engine's load as its scheduler sees it, sent to the coordinator when it changes."""

    engine_index: int
    num_waiting: int
    num_running: int
    kv_usage: float = 0.0  # fraction of KV blocks in use, 0..1


class LoadSnapshot(_Wire, tag="loads"):
    """The coordinator's latest report of every engine it heard from (index order), published to
    every API server at most every ``COORDINATOR_PUBLISH_INTERVAL``; ``seq`` counts publications."""

    seq: int
    engines: list[LoadReport]


COORDINATOR_PUBLISH_INTERVAL = 0.1  # seconds: vLLM's DP coordinator publishes at most this often


# The most block keys (stored + removed) one ``KvEvents`` message carries: a larger batch is split
# into several messages, ``cleared`` on the first only. 4096 keys are ~37 KB of msgpack.
MAX_KV_EVENT_KEYS = 4096


class KvEvents(_Wire, tag="kv"):
    """Block keys (``protocol.block_hash.block_key``) an engine's prefix cache stored and evicted:
    engine -> DP coordinator on the PUSH its ``LoadReport``s use, and coordinator -> every API server
    on its PUB (``coordinator/core.py`` states the rules). ``cleared``: forget every key held for this
    engine before applying ``stored`` (a full re-sync starts so; further messages of the same re-sync
    follow with ``cleared`` False). ``stored`` and ``removed`` are disjoint. ``seq`` counts the
    sender's ``KvEvents`` (per engine from an engine, overall from the coordinator), so a receiver
    can tell it missed some. A hint for dispatch only: losing one never affects correctness."""

    engine_index: int
    stored: list[int]
    removed: list[int]
    cleared: bool = False
    seq: int = 0


CoordinatorInput = LoadReport | KvEvents  # engine -> coordinator (PUSH -> PULL)
CoordinatorOutput = LoadSnapshot | KvEvents  # coordinator -> API servers (PUB -> SUB)
