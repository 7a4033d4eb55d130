"""Which engine (data-parallel rank) gets a request: the dispatch policies (design §10), pure objects.

Every API server can send to every engine; each has one policy object, fed by three hands:

- the engine client asks ``pick(ready)`` for each new request, with the engines that may take one
  now (joined, not dead, not ejected: health is the caller's business, the policy never picks an
  engine outside ``ready``), and gets an engine index, or None when ``ready`` holds none;
- it calls ``sent(engine)`` once for each request it sends (the pick it took, or an engine a request
  named itself) and ``done(engine)`` once when that request ends there (finished, aborted, or failed
  because the engine died), so the policy knows this client's own in-flight requests;
- the coordinator link (``frontend/coordinator_link.py``) calls ``update(snapshot)`` with each
  ``LoadSnapshot`` the DP coordinator publishes (at most every ``COORDINATOR_PUBLISH_INTERVAL``, and
  once a second anyway).

``pick`` changes nothing: a request that is picked for but never sent (rejected before it left) leaves
no trace. Three policies, by name (``make_policy``):

``dplb`` (``DpScore``): vLLM's score. For engine *e*, with the coordinator's latest counts for it
(``waiting``, ``running``, ``kv`` usage 0..1), ``bumps`` the requests this client sent to *e* since
that snapshot, ``own`` this client's requests in flight on *e* and ``N`` API servers::

    waiting' = waiting + N * bumps
    score(e) = max(waiting' + running, N * own) + waiting' * 6 * max(0, kv - 0.5)

- The first term is the engine's load as best known: the coordinator's count, or this client's own
  in-flight count scaled to all N clients (each API server is assumed to carry its share), whichever
  is larger. The floor is exact and local, so a burst this client sends between two snapshots spreads
  over the engines even if the snapshot lags; the coordinator's count raises it when other API servers
  (or requests this client has forgotten) load the engine.
- The second is the waiting penalty: 0 up to 50 % KV usage, then linear to 3 x waiting at 100 % (a
  queue on an engine whose KV cache is nearly full drains slowly; at low usage a queue is transient,
  mid-burst, and costs nothing extra).
- Bumps: each ``sent`` adds N to the engine's waiting count, as if every API server had sent one
  (the same extrapolation as the floor), until the next snapshot *replaces* the counts and clears the
  bumps. That is approximate: the new snapshot counts the requests the engine had received and
  reported before the coordinator published it, not the ones still on their way (sent in the last
  few milliseconds); the floor covers those of this client.
- Before the first snapshot (the coordinator not heard from yet) the score is the floor alone: own
  in-flight counts, no bumps (there is no snapshot for them to correct).
- Lowest score wins. **Ties** go to the first tied engine in scan order, which starts at
  ``num_engines * client_index // api_server_count`` (so N API servers without load information
  start on different engines instead of all on engine 0) and moves to the engine after the one each
  ``sent`` went to, so ties rotate over the tied engines.

``round-robin`` (``RoundRobin``): the ready engine after the one the last request went to (the same
spread start as above for the first); ignores load. A baseline for benchmarks.

``prefix`` (``PrefixAware``): the engine that already caches the longest prefix of the prompt, unless
it is too much more loaded than the least loaded; otherwise the ``dplb`` score (design §10). Nothing
in vLLM's score knows where a prefix lives.

- **The key.** When the engine client queues an add it asks ``request_key(add, engines)`` once: the
  keys (``protocol.block_hash.prefix_block_keys``) of the prompt's first ``min((tokens - 1) // B,
  MAX_DISPATCH_BLOCKS)`` full blocks, hashed exactly as the engines hash them (the block size ``B``
  from the engines' ``EngineReady.block_size``, the request's ``cache_salt``), so a key the engine
  reports is one the request can hit. None (plain ``dplb``) when the engines keep no prefix cache
  (``B`` = 0: the mock, or prefix caching off), the request wants prompt logprobs (the engine skips
  the cache for those), or the prompt has no full block before its last token.
- **The rule.** For a key, with ``m(e)`` the leading keys engine *e* holds (the index, below),
  ``s(e)`` the ``dplb`` score, ``e*`` the ``dplb`` pick and ``s* = s(e*)``::

      allowed(e) = s(e) - s* <= f(e) * (PREFIX_LOAD_SLACK + PREFIX_LOAD_RATIO * s*)
      f(e)       = m(e) * B / prompt tokens                      (the cached share, 0..1)
      pick       = the allowed engine with the largest m(e); ties to the lower s(e), then dplb's order

  with ``PREFIX_LOAD_SLACK`` = 4 requests and ``PREFIX_LOAD_RATIO`` = 0.5: a prompt wholly cached on
  an engine goes there while that engine's score is at most 4 + 50 % above the least loaded's; half
  cached, half that margin; ``e*`` is always allowed. So when no ready engine holds the first block the
  pick is exactly ``dplb``'s, and the pick's score never exceeds ``s* + 4 + 0.5 * s*`` (the bound: a
  popular prefix cannot pile every request onto one engine).
- **The index** (``PrefixIndex``), per engine: the keys the coordinator's ``KvEvents`` say it caches
  (``apply_kv``), plus the keys of the requests this client sent it (``sent(engine, key)``: it will
  cache them when it prefills). Without those *expected* keys a burst sharing a new prompt would
  spread over every engine before the first KV event came back (one publish interval at least).
  Expected keys are at most ``MAX_EXPECTED_KEYS`` per engine (least recently sent dropped first); a
  removal drops a key from both sets; a ``cleared`` message (a re-sync, every 5 s at the latest)
  replaces the confirmed keys with the engine's truth and drops the expected keys sent before the
  re-sync before it. Those sent since survive it: the mirror a re-sync carries can predate a request
  this client sent (the request done, its blocks stored, their events still on their way), and
  dropping its keys would send the next request with the same prefix elsewhere (the likely cause of
  one failure of ``tests/multiproc/test_prefix_dispatch.py`` in CI). So an expectation that never
  came true (the request was aborted before its prefill, or evicted at once) misleads for at most
  two re-syncs. Confirmed keys are at most ``MAX_INDEX_KEYS`` per engine (the coordinator's mirror
  bound). The index only steers: a wrong entry costs a cache miss, never a wrong answer.
- **Cost** per request: hashing at most 256 blocks once, when the add is queued (about 1.2 µs a
  block), and at pick at most 256 set lookups per ready engine.

Invariants (all policies): ``pick`` returns a member of ``ready`` that is a valid engine index
(0..num_engines-1; others in ``ready`` are ignored) or None when there is none; own in-flight counts
never go below 0 (a ``done`` without a ``sent`` is ignored); ``DpScore.pick`` returns an engine of
minimal ``score`` among those.

vLLM (``DPLBAsyncMPClient.get_core_engine_for_request`` in ``vllm/v1/engine/core_client.py``, the
score as of vllm-project/vllm#49204; checked against the source, not copied):

- Same: the max of the coordinator's waiting + running and ``client_count`` x the client's in-flight
  count to the engine; the waiting penalty ``waiting * 6 * max(0, kv - 0.5)`` (0 at 50 %, 3 x waiting
  at 100 %); after each pick the chosen engine's local waiting count grows by ``client_count`` until
  the next coordinator update replaces the counts; the scan starts at
  ``num_engines * client_index // client_count``; strict less-than, so the first minimum in scan
  order wins. Its coordinator publishes at most every 100 ms when counts changed.
- Differs: vLLM bumps and counts at pick time (picking is sending there); ours at ``sent``. vLLM
  moves the scan start one engine on after every pick; ours to the engine after the one sent to, so
  ties cycle through exactly the tied engines. vLLM scans every engine (health is handled elsewhere);
  ours only ``ready``. vLLM applies bumps even before its first update (to zeroed counts); ours uses
  the floor alone until the first snapshot. vLLM's coordinator re-publishes unchanged counts every
  5 s; ours once a second (``coordinator/core.py``). Older vLLM releases scored ``4 * waiting +
  running`` with neither the floor nor the KV term.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol, get_args

from trioserve.protocol.block_hash import prefix_block_keys
from trioserve.protocol.messages import AddRequest, EngineReady, KvEvents, LoadSnapshot

PolicyName = Literal["dplb", "round-robin", "prefix", "least-outstanding-bytes"]
POLICY_NAMES: tuple[str, ...] = get_args(PolicyName)

KV_PENALTY_FROM = 0.5  # KV usage below which waiting requests cost nothing extra
KV_PENALTY_AT_FULL = 3.0  # x waiting, at 100 % KV usage
_KV_SLOPE = KV_PENALTY_AT_FULL / (1.0 - KV_PENALTY_FROM)  # 6: linear from 0.5 to 1.0

PREFIX_LOAD_SLACK = 4.0  # score a wholly cached prefix may cost over the least loaded engine ...
PREFIX_LOAD_RATIO = 0.5  # ... plus this share of the least loaded engine's score
MAX_DISPATCH_BLOCKS = 256  # leading blocks of a prompt hashed for dispatch (4096 tokens at 16)
MAX_EXPECTED_KEYS = 65536  # per engine: keys of requests sent there, not confirmed by KV events yet
MAX_INDEX_KEYS = 1 << 18  # per engine: keys confirmed by KV events (the coordinator's bound too)


@dataclass(frozen=True, slots=True)
class RequestKey:
    """What the ``prefix`` policy needs of one request at pick time (``request_key``)."""

    blocks: tuple[int, ...]  # block keys of the prompt's leading full blocks
    num_tokens: int  # prompt tokens
    block_size: int


class DispatchPolicy(Protocol):
    name: str

    def request_key(self, request: AddRequest, engines: Mapping[int, EngineReady]) -> RequestKey | None:
        """What ``pick`` needs to know of ``request`` (None: nothing), asked once when it is queued;
        ``engines`` are the latest Readys of the engines that joined."""
        ...

    def pick(self, ready: Collection[int], key: RequestKey | None = None) -> int | None:
        """The engine for the next request (its ``request_key``), among ``ready``; None when none is
        ready. No side effects."""
        ...

    def sent(self, engine: int, key: RequestKey | None = None) -> None:
        """One of this client's requests (with its ``request_key``) went to ``engine``."""
        ...

    def done(self, engine: int) -> None:
        """One of this client's requests on ``engine`` ended (finished, aborted or failed)."""
        ...

    def update(self, snapshot: LoadSnapshot) -> None:
        """The DP coordinator's latest loads."""
        ...

    def apply_kv(self, events: KvEvents) -> None:
        """Block keys an engine cached or evicted, as the DP coordinator forwards them."""
        ...


def spread_start(num_engines: int, api_server_count: int, client_index: int) -> int:
    """Where this client's scan starts: API servers spread evenly over the engines (vLLM's rule)."""
    return (num_engines * client_index // max(api_server_count, 1)) % num_engines


def _check(num_engines: int, api_server_count: int, client_index: int) -> None:
    if num_engines < 1 or api_server_count < 1 or not 0 <= client_index < api_server_count:
        raise ValueError(
            f"need num_engines >= 1, api_server_count >= 1 and 0 <= client_index < api_server_count, "
            f"got {num_engines}, {api_server_count}, {client_index}"
        )


class DpScore:
    """``dplb``: vLLM's load score (the module docstring states the rule)."""

    name = "dplb"

    __slots__ = (
        "_bumps",
        "_kv",
        "_own",
        "_running",
        "_start",
        "_waiting",
        "api_server_count",
        "num_engines",
        "snapshot_seq",
    )

    def __init__(self, num_engines: int, api_server_count: int = 1, client_index: int = 0) -> None:
        _check(num_engines, api_server_count, client_index)
        self.num_engines = num_engines
        self.api_server_count = api_server_count
        self._start = spread_start(num_engines, api_server_count, client_index)
        self._own = [0] * num_engines  # this client's requests in flight, per engine (exact)
        self._bumps = [0] * num_engines  # this client's sends since the snapshot, per engine
        self._waiting = [0] * num_engines  # the snapshot's counts
        self._running = [0] * num_engines
        self._kv = [0.0] * num_engines
        self.snapshot_seq: int | None = None  # the snapshot in use (None: none yet, own counts only)

    # ---------------------------------------------------------------------------------------- inputs

    def request_key(self, request: AddRequest, engines: Mapping[int, EngineReady]) -> RequestKey | None:
        return None

    def apply_kv(self, events: KvEvents) -> None:
        pass

    def sent(self, engine: int, key: RequestKey | None = None) -> None:
        if not 0 <= engine < self.num_engines:
            return
        self._own[engine] += 1
        if self.snapshot_seq is not None:
            self._bumps[engine] += 1
        self._start = (engine + 1) % self.num_engines

    def done(self, engine: int) -> None:
        if 0 <= engine < self.num_engines and self._own[engine] > 0:
            self._own[engine] -= 1

    def update(self, snapshot: LoadSnapshot) -> None:
        """Replaces every engine's counts (an engine the snapshot omits has reported nothing yet: 0)
        and clears the bumps: the snapshot counts what the engines had received."""
        n = self.num_engines
        self._waiting = [0] * n
        self._running = [0] * n
        self._kv = [0.0] * n
        self._bumps = [0] * n
        for load in snapshot.engines:
            i = load.engine_index
            if 0 <= i < n:
                self._waiting[i] = max(load.num_waiting, 0)
                self._running[i] = max(load.num_running, 0)
                self._kv[i] = load.kv_usage
        self.snapshot_seq = snapshot.seq

    # --------------------------------------------------------------------------------------- outputs

    def score(self, engine: int) -> float:
        n = self.api_server_count
        floor = float(n * self._own[engine])
        if self.snapshot_seq is None:
            return floor
        waiting = self._waiting[engine] + n * self._bumps[engine]
        load = max(float(waiting + self._running[engine]), floor)
        kv = min(self._kv[engine], 1.0)  # a NaN usage fails both comparisons: no penalty
        if waiting and kv > KV_PENALTY_FROM:
            load += waiting * _KV_SLOPE * (kv - KV_PENALTY_FROM)
        return load

    def scan_order(self, ready: Collection[int]) -> list[int]:
        """The engines of ``ready`` in the order ``pick`` scans them (ties go to the first)."""
        n = self.num_engines
        return [e for e in ((self._start + offset) % n for offset in range(n)) if e in ready]

    def pick(self, ready: Collection[int], key: RequestKey | None = None) -> int | None:
        best: int | None = None
        best_score = 0.0
        n = self.num_engines
        for offset in range(n):
            engine = (self._start + offset) % n
            if engine not in ready:
                continue
            score = self.score(engine)
            if best is None or score < best_score:  # strict: the first minimum in scan order wins
                best, best_score = engine, score
        return best

    def in_flight(self, engine: int) -> int:
        """This client's requests in flight on ``engine``."""
        return self._own[engine]

    def coordinator_load(self, engine: int) -> tuple[int, int, float]:
        """The snapshot's (waiting, running, kv usage) for ``engine``, without this client's bumps."""
        return self._waiting[engine], self._running[engine], self._kv[engine]


class RoundRobin:
    """``round-robin``: the next ready engine after the one the last request went to."""

    name = "round-robin"

    __slots__ = ("_next", "num_engines")

    def __init__(self, num_engines: int, api_server_count: int = 1, client_index: int = 0) -> None:
        _check(num_engines, api_server_count, client_index)
        self.num_engines = num_engines
        self._next = spread_start(num_engines, api_server_count, client_index)

    def request_key(self, request: AddRequest, engines: Mapping[int, EngineReady]) -> RequestKey | None:
        return None

    def pick(self, ready: Collection[int], key: RequestKey | None = None) -> int | None:
        n = self.num_engines
        for offset in range(n):
            engine = (self._next + offset) % n
            if engine in ready:
                return engine
        return None

    def sent(self, engine: int, key: RequestKey | None = None) -> None:
        if 0 <= engine < self.num_engines:
            self._next = (engine + 1) % self.num_engines

    def done(self, engine: int) -> None:
        pass

    def update(self, snapshot: LoadSnapshot) -> None:
        pass

    def apply_kv(self, events: KvEvents) -> None:
        pass


class PlacedAtAdmission(RoundRobin):
    """``least-outstanding-bytes`` (seed 002): the replica is chosen when the request is admitted,
    not here: ``frontend/replica_slots.py`` reserves the ready replica with the fewest outstanding
    request bytes across every API server (ties to the least recently assigned), at most
    ``--max-inflight-per-replica`` in flight on each, and serving answers 503 when all are full.
    Every add then arrives with its replica (``EngineClient.add``'s ``replica``); ``pick`` serves
    only an add without one, in turn."""

    name = "least-outstanding-bytes"

    __slots__ = ()


class PrefixIndex:
    """Which block keys each engine holds, as far as this API server knows (the ``prefix`` policy's
    index; the module docstring states the rules). Pure."""

    __slots__ = ("_confirmed", "_expected", "_resyncs", "max_expected", "max_keys", "num_engines")

    def __init__(
        self, num_engines: int, max_keys: int = MAX_INDEX_KEYS, max_expected: int = MAX_EXPECTED_KEYS
    ) -> None:
        self.num_engines = num_engines
        self.max_keys = max_keys
        self.max_expected = max_expected
        self._confirmed: list[set[int]] = [set() for _ in range(num_engines)]
        # key -> the engine's re-sync count when it was sent; in send order, so counts never decrease
        self._expected: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(num_engines)]
        self._resyncs = [0] * num_engines

    def apply(self, events: KvEvents) -> None:
        """One engine's KV events (an engine index out of range is ignored)."""
        i = events.engine_index
        if not 0 <= i < self.num_engines:
            return
        confirmed, expected = self._confirmed[i], self._expected[i]
        if events.cleared:
            confirmed.clear()
            self._resyncs[i] += 1
            while expected and next(iter(expected.values())) < self._resyncs[i] - 1:
                expected.popitem(last=False)  # sent before the re-sync before this one
        for key in events.removed:
            confirmed.discard(key)
            expected.pop(key, None)
        room = self.max_keys - len(confirmed)
        if len(events.stored) <= room:
            confirmed.update(events.stored)
        else:
            for key in events.stored:
                if len(confirmed) >= self.max_keys:
                    break
                confirmed.add(key)
        for key in events.stored:
            expected.pop(key, None)  # confirmed now

    def expect(self, engine: int, blocks: tuple[int, ...]) -> None:
        """A request with these block keys went to ``engine``: it will cache them."""
        if not 0 <= engine < self.num_engines:
            return
        confirmed, expected = self._confirmed[engine], self._expected[engine]
        for key in blocks:
            if key in confirmed:
                continue
            expected[key] = self._resyncs[engine]
            expected.move_to_end(key)
        while len(expected) > self.max_expected:
            expected.popitem(last=False)

    def match(self, engine: int, blocks: tuple[int, ...]) -> int:
        """How many leading keys of ``blocks`` ``engine`` holds (confirmed or expected)."""
        confirmed, expected = self._confirmed[engine], self._expected[engine]
        count = 0
        for key in blocks:
            if key not in confirmed and key not in expected:
                break
            count += 1
        return count

    def num_keys(self, engine: int) -> tuple[int, int]:
        """(confirmed, expected) keys held for ``engine``."""
        return len(self._confirmed[engine]), len(self._expected[engine])


class PrefixAware:
    """``prefix``: the longest cached prefix within a load bound, else ``dplb`` (the module docstring
    states the rule)."""

    name = "prefix"

    __slots__ = ("index", "load", "max_blocks", "num_engines", "ratio", "slack")

    def __init__(
        self,
        num_engines: int,
        api_server_count: int = 1,
        client_index: int = 0,
        *,
        slack: float = PREFIX_LOAD_SLACK,
        ratio: float = PREFIX_LOAD_RATIO,
        max_blocks: int = MAX_DISPATCH_BLOCKS,
    ) -> None:
        if slack < 0 or ratio < 0 or max_blocks < 1:
            raise ValueError(
                f"need slack >= 0, ratio >= 0 and max_blocks >= 1, got {slack}, {ratio}, {max_blocks}"
            )
        self.num_engines = num_engines
        self.load = DpScore(num_engines, api_server_count, client_index)
        self.index = PrefixIndex(num_engines)
        self.slack = slack
        self.ratio = ratio
        self.max_blocks = max_blocks

    def request_key(self, request: AddRequest, engines: Mapping[int, EngineReady]) -> RequestKey | None:
        if request.sampling.prompt_logprobs is not None:
            return None
        block_size = next((r.block_size for r in engines.values() if r.block_size > 0), 0)
        if not block_size:
            return None
        tokens = request.prompt_token_ids
        blocks = prefix_block_keys(tokens, block_size, request.cache_salt, self.max_blocks)
        return RequestKey(tuple(blocks), len(tokens), block_size) if blocks else None

    def pick(self, ready: Collection[int], key: RequestKey | None = None) -> int | None:
        load = self.load
        base = load.pick(ready)
        if key is None or base is None or not key.blocks:
            return base
        least = load.score(base)
        margin = self.slack + self.ratio * least
        best, best_match, best_score = base, self.index.match(base, key.blocks), least
        for engine in load.scan_order(ready):
            match = self.index.match(engine, key.blocks)
            if match == 0 or match < best_match:
                continue
            score = load.score(engine)
            share = min(match * key.block_size / key.num_tokens, 1.0)
            if score - least > share * margin:
                continue
            if match > best_match or score < best_score:
                best, best_match, best_score = engine, match, score
        return best

    def score(self, engine: int) -> float:
        return self.load.score(engine)

    def sent(self, engine: int, key: RequestKey | None = None) -> None:
        if key is not None:
            self.index.expect(engine, key.blocks)
        self.load.sent(engine)

    def done(self, engine: int) -> None:
        self.load.done(engine)

    def update(self, snapshot: LoadSnapshot) -> None:
        self.load.update(snapshot)

    def apply_kv(self, events: KvEvents) -> None:
        self.index.apply(events)


def make_policy(name: str, num_engines: int, api_server_count: int, client_index: int) -> DispatchPolicy:
    """The policy called ``name`` (one of ``POLICY_NAMES``) for one API server's engine client."""
    if name == "dplb":
        return DpScore(num_engines, api_server_count, client_index)
    if name == "round-robin":
        return RoundRobin(num_engines, api_server_count, client_index)
    if name == "prefix":
        return PrefixAware(num_engines, api_server_count, client_index)
    if name == "least-outstanding-bytes":
        return PlacedAtAdmission(num_engines, api_server_count, client_index)
    raise ValueError(f"unknown dispatch policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
