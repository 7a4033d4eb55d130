"""Metrics across API servers (design §11): gathered at scrape time, nothing on the token path.

Each API server of a deployment (client index ``i`` of ``count``) binds a ZMQ ROUTER at
``ipc://<ipc_dir>/metrics_<i>``, owned by one task (``serve``) that answers every request with this
server's ``MetricsState`` now. ``/metrics`` on any of them (``scrape``) sends one request to every peer
(one DEALER per peer: a request goes to the peer it is meant for, and a peer that is gone is known at
once), waits at most ``GATHER_TIMEOUT`` for the answers and renders the merge (``Metrics.render_states``).

Rules:

1. **Nothing on the token path.** Observations stay plain adds in ``Metrics``; the gather costs the
   scrape (one state per peer, a few KB of msgpack) and the peers' answers (one state each).
2. **Bounded.** A scrape waits at most ``GATHER_TIMEOUT`` in all, peers asked in parallel. Each DEALER
   queues at most ``PEER_HWM`` requests for its peer: a peer still connecting (just started, or
   restarted: ZMQ reconnects every 100 ms) gets its request when it connects, within the timeout
   (``ZMQ_IMMEDIATE`` would refuse the send, and a peer that had just started would count as gone);
   a peer that is gone or stuck costs the timeout for ``PEER_HWM`` scrapes, then none (the send is
   refused at once) until it takes its queue again. One gather at a time: a scrape that comes while
   one runs shares its answers (each socket has one owner at a time).
3. **Late answers are dropped.** Each request carries the gather's sequence number; an answer with an
   older one (a slow peer's, for an earlier scrape) is discarded.
4. **Counters never go back.** Every state this server shows or answers with is first written to
   ``<ipc_dir>/metrics_<i>.state`` (and every ``STATE_WRITE_INTERVAL``, and on a clean exit); a peer
   that does not answer counts with its file's state (its counters and histograms; its gauges are
   stale and left out), and a process started for index ``i`` after its predecessor died starts its
   cumulative counts from that file. What is lost is what the dead one counted after its last write:
   never shown, so no total ever drops. ``trioserve:metrics_peers_missing`` says how many did not
   answer, ``trioserve:metrics_peer_up`` which.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import trio
import zmq

from trioserve.metrics import (
    Labelled,
    Metrics,
    MetricsState,
    decode_state,
    encode_state,
    read_state,
    state_path,
    write_state,
)
from trioserve.transport.zmq_socket import TrioZmqSocket

log = logging.getLogger("trioserve.frontend.metrics")

GATHER_TIMEOUT = 0.5  # seconds a scrape waits for its peers' answers, in all
STATE_WRITE_INTERVAL = 2.0  # seconds between state-file writes (besides those at every answer)
PEER_HWM = 4  # requests queued per peer at most (a stuck peer's backlog)


@dataclass(frozen=True, slots=True)
class Families:
    """What an API server reads live for its metrics: name -> (help, value), and engine freshness."""

    gauges: Mapping[str, tuple[str, float]]
    counters: Mapping[str, tuple[str, float]]
    rejected: Mapping[str, int]
    engine_age: float  # seconds since the oldest engine stats behind the engine gauges arrived
    labelled: Labelled = field(default_factory=dict)  # per worker (``frontend/thread_metrics.py``)


def metrics_address(ipc_dir: str, index: int) -> str:
    return f"ipc://{os.path.join(ipc_dir, f'metrics_{index}')}"


class MetricsPeers:
    """One API server's end of the gather: its ROUTER (``serve``) and its scrapes (``scrape``)."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        metrics: Metrics,
        families: Callable[[], Families],
        *,
        ipc_dir: str,
        index: int,
        count: int,
        timeout: float = GATHER_TIMEOUT,
        write_interval: float = STATE_WRITE_INTERVAL,
    ) -> None:
        """Restores ``metrics`` from this index's state file (a predecessor's), if there is one, before
        anything is counted."""
        self.ctx = ctx
        self.metrics = metrics
        self.families = families
        self.ipc_dir = ipc_dir
        self.index = index
        self.count = count
        self.timeout = timeout
        self.write_interval = write_interval
        self.path = state_path(ipc_dir, index)
        self.peers: dict[int, TrioZmqSocket] = {}  # opened by ``serve``
        self._seq = 0
        self._gathering: trio.Event | None = None
        self._gathered: dict[int, MetricsState] = {}
        self._write_lock = trio.Lock()
        self.restored = read_state(self.path)
        if self.restored is not None:
            metrics.restore(self.restored)
            log.info("api server %d: metrics continue from %s", index, self.path)

    def state(self, f: Families | None = None) -> MetricsState:
        """This server's state now (from ``f``, else read now)."""
        if f is None:
            f = self.families()
        return self.metrics.state(
            f.gauges, f.counters, f.rejected, index=self.index, engine_age=f.engine_age, labelled=f.labelled
        )

    async def save(self, state: MetricsState) -> None:
        """Write ``state`` to this server's file (rule 4), on a worker thread: a write costs 20 µs on
        tmpfs but 0.2-1.5 ms on this machine's ext4, too long for the loop that streams tokens. One
        at a time (Trio's lock is FIFO, so a later state is never overwritten by an earlier one)."""
        async with self._write_lock:
            await trio.to_thread.run_sync(self._write, state)

    def _write(self, state: MetricsState) -> None:
        try:
            write_state(self.path, state)
        except OSError as exc:  # a full disk must not break /metrics; the next write tries again
            log.warning("cannot write %s: %s", self.path, exc)

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Bind this server's ROUTER, connect a DEALER to every peer, answer requests and write the
        state file every ``write_interval``; ``started`` once bound. Writes it a last time on exit."""
        router = TrioZmqSocket.create(
            self.ctx, zmq.ROUTER, bind=metrics_address(self.ipc_dir, self.index), rcvhwm=PEER_HWM
        )
        for peer in range(self.count):
            if peer != self.index:
                sock = self.ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, PEER_HWM)
                sock.setsockopt(zmq.RCVHWM, PEER_HWM)
                sock.connect(metrics_address(self.ipc_dir, peer))
                self.peers[peer] = TrioZmqSocket(sock)
        self._write(self.state())  # the file exists (the restored counts in it) from the start
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._write_periodically)
                task_status.started()
                await self._answer(router)
        finally:
            for owned in (router, *self.peers.values()):
                owned.close()
            self.peers = {}
            self._write(self.state())  # a clean stop loses nothing (no write is in flight here)

    async def _write_periodically(self) -> None:
        while True:
            await trio.sleep(self.write_interval)
            await self.save(self.state())

    async def _answer(self, router: TrioZmqSocket) -> None:
        while True:
            requests = [await router.recv_multipart()]
            while (more := router.try_recv_multipart()) is not None:
                requests.append(more)
            state = self.state()  # one state for every request queued now
            await self.save(state)  # before anyone sees it (rule 4)
            payload = encode_state(state)
            for frames in requests:
                if len(frames) == 2:  # [peer identity, sequence number]
                    # A ROUTER drops what it cannot deliver (a peer gone, or its queue full).
                    router.try_send_multipart([frames[0], frames[1], payload])

    async def scrape(self) -> str:
        """The deployment's ``/metrics``: this server's state merged with every peer's."""
        gathered = await self.gather()
        f = self.families()
        own = self.state(f)
        await self.save(own)  # before it is shown (rule 4)
        states = [own]
        up = {self.index: True}
        for peer in range(self.count):
            if peer == self.index:
                continue
            answer = gathered.get(peer)
            up[peer] = answer is not None
            if answer is None:
                answer = read_state(state_path(self.ipc_dir, peer))  # rule 4
            if answer is not None:
                states.append(answer)
        return self.metrics.render_states(f.gauges, f.counters, states, up, f.labelled)

    async def gather(self) -> dict[int, MetricsState]:
        """Every peer's answer to one request, those that came within ``timeout`` (rule 2). A call
        while a gather runs waits for that one and shares its answers."""
        if self._gathering is not None:
            await self._gathering.wait()
            return self._gathered
        self._gathering = done = trio.Event()
        try:
            self._gathered = await self._gather()
        finally:
            self._gathering = None
            done.set()
        return self._gathered

    async def _gather(self) -> dict[int, MetricsState]:
        self._seq += 1
        tag = self._seq.to_bytes(8, "big")
        got: dict[int, MetricsState] = {}
        asked: list[tuple[int, TrioZmqSocket]] = []
        for peer, sock in self.peers.items():
            while sock.try_recv_multipart() is not None:  # late answers to earlier gathers (rule 3)
                pass
            if sock.try_send_multipart([tag]):  # False: not connected (gone) or its queue is full
                asked.append((peer, sock))
        if not asked:
            return got

        async def receive(peer: int, sock: TrioZmqSocket) -> None:
            while True:
                frames = await sock.recv_multipart()
                if len(frames) == 2 and frames[0] == tag:
                    state = decode_state(frames[1])
                    if state is not None and state.index == peer:
                        got[peer] = state
                    return

        with trio.move_on_after(self.timeout):
            async with trio.open_nursery() as nursery:
                for peer, sock in asked:
                    nursery.start_soon(receive, peer, sock)
        return got
