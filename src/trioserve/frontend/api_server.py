"""One API server: its tasks, all in one nursery (design §3).

accept loop, owner of every connection (``HttpServer``) · ASGI host (the quart-trio app, called per
request for the routes off the hot path, and its lifespan) · engine client
(handshake, request sender with the abort fast path, output pump) · output handler. The renderer pool
is ``trio.to_thread`` under a ``CapacityLimiter`` owned by ``Serving``.
"""

from __future__ import annotations

import logging
import math
import socket
from dataclasses import dataclass
from functools import partial

import trio
import zmq

from trioserve.config import FrontendConfig, ModelConfig
from trioserve.frontend.access_log import AccessLog
from trioserve.frontend.coordinator_link import LinkStats, follow_coordinator
from trioserve.frontend.dispatch import make_policy
from trioserve.frontend.edge.accept_balance import AcceptBalance
from trioserve.frontend.edge.access import Gate
from trioserve.frontend.edge.app import create_app
from trioserve.frontend.edge.asgi_host import AsgiHost
from trioserve.frontend.edge.http_server import HttpServer
from trioserve.frontend.edge.ws_server import websocket_upgrade
from trioserve.frontend.engine_client import EngineClient
from trioserve.frontend.metrics_peers import Families, MetricsPeers
from trioserve.frontend.output.output_handler import OutputHandler, StampedStepQueue
from trioserve.frontend.replica_health import OutlierRules
from trioserve.frontend.replica_pool import ReplicaPool
from trioserve.frontend.replica_slots import ReplicaSlots
from trioserve.frontend.serving import Serving
from trioserve.frontend.text.tokenizer import Tokenizer
from trioserve.frontend.thread_metrics import thread_families
from trioserve.metrics import Metrics

log = logging.getLogger("trioserve.frontend")


@dataclass(frozen=True, slots=True)
class EngineAddresses:
    handshake: str | None  # None: the supervisor greets engines (several API servers)
    input: str
    output: str


LOOP_LAG_INTERVAL = 0.05  # seconds between loop-lag samples
DRAIN_FLUSH = 1.0  # seconds drain waits, after its deadline, for the error events it wrote to go out


class ApiServer:
    def __init__(
        self,
        model: ModelConfig,
        frontend: FrontendConfig,
        tokenizer: Tokenizer,
        ctx: zmq.Context[zmq.Socket[bytes]],
        addresses: EngineAddresses,
        *,
        engine_output_hwm: int,
        engine_ready_timeout: float,
        num_engines: int = 1,
        client_index: int = 0,
        api_server_count: int = 1,
        ipc_dir: str | None = None,
        coordinator_address: str = "",
        accept_balance: AcceptBalance | None = None,
        restarted: bool = False,
        replica_slots: ReplicaSlots | None = None,
        devices: tuple[str, ...] = (),
        batch_limits: tuple[int, int] | None = None,
        desired: int | None = None,
        roster_epoch: int = 0,
    ) -> None:
        """``engine_output_hwm``: the receiving end of the engines' output sockets (their section's
        setting, as both ends of a ZMQ pair set it); ``engine_ready_timeout``: how long ``run`` waits
        for the engines. Under a supervisor: this server's ``client_index`` of ``api_server_count``,
        the supervisor's ``ipc_dir``, the DP coordinator's PUB (``coordinator_address``), the
        accept balance shared with the other API servers, and whether it replaces one that died;
        ``replica_slots``: least-outstanding-bytes' table shared by every API server; ``devices``:
        where each replica runs (the inventory shows it); ``batch_limits``: the engines'
        ``max_num_seqs`` and ``max_num_batched_tokens`` as configured (a replica reporting others is
        kept out of dispatch); ``desired``: the replicas wanted now, of the ``num_engines`` the tree is
        sized for (None: all), as the supervisor's roster ``roster_epoch`` said."""
        self.engine_ready_timeout = engine_ready_timeout
        self.frontend = frontend
        self.client_index = client_index
        self.api_server_count = api_server_count
        self.ipc_dir = ipc_dir
        self.coordinator_address = coordinator_address
        self.coordinator = LinkStats()
        self.policy = (
            make_policy(frontend.dispatch.dispatch, num_engines, api_server_count, client_index)
            if num_engines > 1
            else None
        )
        dispatch = frontend.dispatch
        rules = OutlierRules(
            consecutive_timeouts=dispatch.consecutive_timeouts,
            base_ejection_s=dispatch.base_ejection_ms / 1000,
            max_ejection_s=dispatch.max_ejection_ms / 1000 or None,
            max_ejection_percent=dispatch.max_ejection_percent,
        )
        timeout = dispatch.request_timeout_ms / 1000 or None
        self.pool = ReplicaPool(rules, num_engines, timeout, client_index=client_index)
        self.engine = EngineClient(
            ctx,
            handshake_address=addresses.handshake,
            input_address=addresses.input,
            output_address=addresses.output,
            num_engines=num_engines,
            client_index=client_index,
            output_hwm=engine_output_hwm,
            policy=self.policy,
            # At start every engine is up (the supervisor waited for them): wait for all, or the first
            # requests would all go to whichever said Ready first. A restarted API server serves
            # through the engines that are up while another may be away.
            ready_with_one=restarted,
            pool=self.pool,
            devices=devices,
            batch_limits=batch_limits,
            desired=desired,
            roster_epoch=roster_epoch,
        )
        self._ctx = ctx
        streams = frontend.streams
        self.steps = StampedStepQueue(streams.output_queue_size, streams.output_queue_policy)
        self.metrics = Metrics(model.model_names[0], max_model_len=model.max_model_len)
        self.handler = OutputHandler(self.engine.abort, self.metrics)
        # Several API servers: /metrics on any of them merges every one's (frontend/metrics_peers.py).
        # Built before any traffic: a restarted server's counts start from its predecessor's file.
        self.metrics_peers: MetricsPeers | None = None
        if api_server_count > 1 and ipc_dir is not None:
            self.metrics_peers = MetricsPeers(
                ctx,
                self.metrics,
                self.metric_families,
                ipc_dir=ipc_dir,
                index=client_index,
                count=api_server_count,
            )
        self.serving = Serving(
            model, frontend.request, frontend.admission, streams, tokenizer, self.engine, self.handler
        )
        self.serving.slots = replica_slots
        self.serving.slot_cap = dispatch.max_inflight_per_replica
        self.engine.on_joined = lambda ready: self.serving.on_engine_ready()  # a restarted engine too
        self.engine.on_timeout = lambda ids, why: self.handler.fail(ids, 504, why)
        self.engine_restarts = 0  # counted by the engine supervisor (launch/engine_supervisor.py)
        http = frontend.http
        self.asgi = AsgiHost(create_app(self.serving, self.metrics_text, http.max_request_body_bytes))
        self.http = HttpServer(
            self.serving,
            self.asgi,
            http.max_request_body_bytes,
            upgrade=websocket_upgrade(self.serving, http.max_request_body_bytes),
            max_connections=http.max_connections,
            gate=Gate(frontend.access),
            access_log=None
            if frontend.access.disable_access_log
            else AccessLog(frontend.access.disable_access_log_for_endpoints),
            accept_balance=accept_balance,
        )

    async def run(
        self,
        listener: socket.socket | None,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Start every task; ``started`` once engines are ready and the listener (if any) accepts."""
        async with trio.open_nursery() as nursery:
            if self.coordinator_address and self.policy is not None:
                await nursery.start(
                    partial(
                        follow_coordinator,
                        self._ctx,
                        self.coordinator_address,
                        self.policy,
                        stats=self.coordinator,
                    )
                )
            with trio.fail_after(self.engine_ready_timeout):
                await nursery.start(self.engine.run, self.steps, self._engine_dead)
            nursery.start_soon(self.handler.run, self.steps)
            if self.serving.renderer is not None:
                await nursery.start(self.serving.renderer.run)
            nursery.start_soon(self._watch_loop_lag)
            if self.metrics_peers is not None:
                await nursery.start(self.metrics_peers.serve)
            await nursery.start(self.asgi.run)
            if listener is not None:
                await nursery.start(self.http.serve, listener)
            task_status.started()

    def _engine_dead(self, reason: str, request_ids: list[str] | None, retry_after: int | None) -> None:
        self.serving.on_engine_dead(reason, request_ids, retry_after=retry_after)

    async def drain(self, timeout: float) -> None:
        """Graceful shutdown (SIGTERM). At once: the listener closes, idle connections close,
        ``/health`` and every new request (a keep-alive one too, then closed) answer 503. Requests in
        flight run on for ``timeout`` seconds; any still running then ends with an error event
        ("the server is shutting down", 503) and a proper end of its body, or of its WebSocket
        message stream. Returns when those ends have been written (at most ``DRAIN_FLUSH`` more);
        the caller then cancels everything, which closes WebSockets with code 1001 and a reason."""
        self.serving.draining = True
        self.http.drain()
        with trio.move_on_after(timeout):
            await self.serving.drained()
        if self.serving.active:
            log.warning("drain deadline: ending %d requests still running", len(self.serving.active))
            self.serving.shut_down()
            with trio.move_on_after(DRAIN_FLUSH):
                await self.http.http_closed()

    async def _watch_loop_lag(self) -> None:
        """How late a short sleep wakes up is how far behind the event loop is: every task (and
        every stream) on this loop waits that long. Admission sheds new requests above the limit."""
        admission = self.serving.admission
        while True:
            due = trio.current_time() + LOOP_LAG_INTERVAL
            await trio.sleep_until(due)
            admission.loop_lag = lag = max(0.0, trio.current_time() - due)
            self.metrics.loop_lag.observe(lag)

    def _stream_backlog(self) -> dict[str, tuple[str, float]]:
        """What waits in each streamed response for its client, summarized over the responses (one
        per connection on HTTP/1.1). Read at scrape time: O(responses), nothing on the token path."""
        backlogged = merging = 0
        bytes_sum = bytes_max = tokens_sum = tokens_max = 0
        for response in self.serving.active:
            if response.backlogged:  # each response's own gauges (a full response's are all 0)
                backlogged += 1
                # WebSocket sinks share their socket's writer; its bytes are not counted here.
                size = response.backlog_bytes
                bytes_sum += size
                bytes_max = max(bytes_max, size)
            tokens = response.merged_tokens
            if tokens:
                merging += 1
                tokens_sum += tokens
                tokens_max = max(tokens_max, tokens)
        return {
            "trioserve:streams_backlogged": (
                "Streamed responses whose client has not taken every byte written yet.",
                backlogged,
            ),
            "trioserve:streams_merging": (
                "Streamed responses holding merged deltas for a client that is behind.",
                merging,
            ),
            "trioserve:streams_stalled": (
                "Slow clients the output handler is waiting on (stream policy stall).",
                self.handler.stalled_waiting,
            ),
            "trioserve:stream_backlog_bytes": (
                "Bytes written but not yet taken by clients, summed over streamed responses.",
                bytes_sum,
            ),
            "trioserve:stream_backlog_bytes_max": ("The largest of those per response.", bytes_max),
            "trioserve:stream_merged_tokens": (
                "Tokens merged and waiting for clients to catch up, summed over streamed responses.",
                tokens_sum,
            ),
            "trioserve:stream_merged_tokens_max": ("The largest of those per response.", tokens_max),
        }

    async def metrics_text(self) -> str:
        """``/metrics``: this API server's alone when it is the only one (unlabelled, as ever), else
        the deployment's, merged from every API server's at scrape time (``frontend/metrics_peers.py``)."""
        peers = self.metrics_peers
        if peers is not None:
            return await peers.scrape()
        f = self.metric_families()
        return self.metrics.render(f.gauges, f.counters, f.rejected, f.labelled)

    def _scale_out_families(
        self, gauges: dict[str, tuple[str, float]], counters: dict[str, tuple[str, float]]
    ) -> None:
        """The accept balance's and the coordinator link's series, where there are several API servers
        or engines (a lone API server's /metrics stays as it was)."""
        balance = self.http.accept_balance
        if balance is not None:
            counters["trioserve:accept_deferrals_total"] = (
                "1 ms waits before accept because another API server had fewer connections.",
                balance.deferrals,
            )
            counters["trioserve:accept_lost_races_total"] = (
                "Wakes whose accept found the connection taken by another API server.",
                balance.lost_races,
            )
        pool = self.pool
        book = pool.book
        counters["trioserve:request_timeouts_total"] = (
            "Engine requests that gave no output within their deadline (answered 504).",
            sum(pool.timeouts_total),
        )
        if pool.n > 1:
            now = trio.current_time()
            states = [book.state(r, now) for r in range(book.n_replicas)]
            counters["trioserve:replica_ejections_total"] = (
                "Times a replica was ejected from dispatch for consecutive timeouts.",
                book.ejections_total,
            )
            counters["trioserve:replica_readmissions_total"] = (
                "Times an ejected replica returned (it answered, or its cool-down ended).",
                book.readmissions_total,
            )
            counters["trioserve:replica_ejections_withheld_total"] = (
                "Ejections a rule held back (single replica, no other answered, max percent).",
                book.withheld_total,
            )
            counters["trioserve:replica_probes_total"] = (
                "One-token probes sent to replicas.",
                pool.probes_total,
            )
            gauges["trioserve:replicas_ejected"] = ("Replicas ejected now.", states.count("ejected"))
            gauges["trioserve:replicas_backed_off"] = ("Replicas in a backoff now.", states.count("backoff"))
        if self.coordinator_address:
            link = self.coordinator
            age = link.age(trio.current_time())
            gauges["trioserve:coordinator_snapshot_age_seconds"] = (
                "Seconds since the DP coordinator's last load snapshot arrived (-1: none yet).",
                -1.0 if age is None else age,
            )
            counters["trioserve:coordinator_snapshots_total"] = (
                "Load snapshots read from the DP coordinator.",
                link.received,
            )
            counters["trioserve:coordinator_kv_gaps_total"] = (
                "Times prefix-cache events from the coordinator were lost (the prefix index is a stale "
                "hint until the next re-sync).",
                link.kv_gaps,
            )

    def metric_families(self) -> Families:
        """Every value ``/metrics`` shows that is read live (at scrape time, off the token path)."""
        stats = self.handler.engine_stats.values()
        ages = [age for _, age in self.handler.engine_stats_ages(trio.current_time())]
        admission = self.serving.admission
        renderer = self.serving.renderer
        output_delay = self.handler.output_delay()
        admission.observe_output_delay(output_delay)  # the gate as of now, not of the last request
        gauges: dict[str, tuple[str, float]] = {
            "vllm:num_requests_running": (
                "Requests running in the engines.",
                sum(s.num_running for s in stats),
            ),
            "vllm:num_requests_waiting": (
                "Requests waiting in the engines.",
                sum(s.num_waiting for s in stats),
            ),
            "vllm:kv_cache_usage_perc": (
                "KV cache usage, 0..1 (the largest across engines).",
                max((s.kv_usage for s in stats), default=0.0),
            ),
            "trioserve:requests_in_flight": ("Admitted requests this API server holds.", admission.in_flight),
            "trioserve:open_connections": (
                "Client connections open on this API server.",
                self.http.connections,
            ),
            "trioserve:pending_renders": ("Requests waiting for or in the renderer.", admission.rendering),
            "trioserve:output_queue_depth": ("Engine steps queued for the output handler.", self.steps.depth),
            "trioserve:output_queue_depth_max": (
                "The most engine steps ever queued for the output handler at once (since start).",
                self.steps.max_depth,
            ),
            "trioserve:engine_send_queue_depth": ("Requests queued for the engine.", self.engine.queued_adds),
            "trioserve:event_loop_lag_current_seconds": ("Latest loop-lag sample.", admission.loop_lag),
            "trioserve:output_delay_current_seconds": (
                "How long engine output produced now would wait for the output handler (estimate).",
                output_delay,
            ),
            "trioserve:output_delay_shedding": (
                "1 while new requests are refused because engine output waits too long here.",
                int(admission.output_delay.shut),
            ),
            "trioserve:engine_stalled": (
                "1 while an engine is stalled: silent for its stall bound, or its running step overdue.",
                int(self.engine.stall() is not None),
            ),
            "trioserve:engine_silence_seconds": (
                "Seconds since anything arrived from an engine (the largest across engines).",
                max((h.silence(trio.current_time()) for h in self.engine.health.values()), default=0.0),
            ),
            "trioserve:engine_stall_bound_seconds": (
                "Silence after which an engine counts as stalled (the largest across engines).",
                max((h.bound() for h in self.engine.health.values()), default=0.0),
            ),
            "trioserve:engine_stats_age_seconds": (
                "Age of the oldest engine stats here (admission ignores stats older than 3 s).",
                max(ages, default=0.0),
            ),
            **self._stream_backlog(),
        }
        counters: dict[str, tuple[str, float]] = {
            "trioserve:output_queue_coalesced_total": (
                "Engine steps folded into a queued step (output queue full).",
                self.steps.coalesced,
            ),
            "trioserve:renderer_jobs_total": (
                "Prompts rendered on the renderer threads (0 with --renderer-num-workers 0).",
                renderer.jobs if renderer is not None else 0,
            ),
            "trioserve:renderer_batches_total": (
                "Hand-overs from the renderer threads to the event loop; jobs / batches is the batching.",
                renderer.batches if renderer is not None else 0,
            ),
            "trioserve:output_delay_shedding_episodes_total": (
                "Times engine output came to wait longer than --max-output-delay-ms (shedding began).",
                admission.output_delay.shut_count,
            ),
            "trioserve:connections_refused_total": (
                "Connections closed as soon as accepted: --max-connections were open.",
                self.http.refused_connections,
            ),
            "trioserve:accept_errors_total": (
                "Times accepting a connection failed for want of a resource (EMFILE, ENFILE, ...).",
                self.http.accept_errors,
            ),
            "trioserve:engine_restarts_total": (
                "Engine cores started again by this API server after one died (--engine-restart).",
                self.engine_restarts,
            ),
            "trioserve:bad_engine_frames_total": (
                "Engine frames that failed to decode.",
                self.engine.bad_frames,
            ),
            "trioserve:engine_stall_episodes_total": (
                "Times an engine stalled (silent for its stall bound, or its running step overdue).",
                sum(h.stall_count for h in self.engine.health.values()),
            ),
            "trioserve:engine_adds_dropped_total": (
                "Requests aborted before their add left for the engine (so it was never sent).",
                self.engine.dropped_adds,
            ),
            "trioserve:engine_folded_steps_total": (
                "Steps the engines' output pumps folded into a held one (their socket to us was full).",
                sum(s.folded_steps for s in stats),
            ),
            # Cumulative counts the engines report with every step.
            "vllm:num_preemptions_total": (
                "Requests preempted by the engines.",
                sum(s.num_preemptions for s in stats),
            ),
            "vllm:prefix_cache_queries_total": (
                "Prompt tokens looked up in the prefix cache.",
                sum(s.prefix_cache_queries for s in stats),
            ),
            "vllm:prefix_cache_hits_total": (
                "Prompt tokens found in the prefix cache.",
                sum(s.prefix_cache_hits for s in stats),
            ),
        }
        self._scale_out_families(gauges, counters)
        # No engine stats yet: the least fresh view, so a peer's that has some wins (metrics.py).
        return Families(
            gauges,
            counters,
            dict(admission.rejected),
            max(ages, default=math.inf),
            thread_families(self.handler.engine_stats),
        )
