"""The generation service shared by every transport (HTTP SSE and full responses, WebSocket).

``start`` does the per-request work, in order: stamp arrival (before rendering, so TTFT includes the
renderer queue), decode and validate the body, render and tokenize on the renderer pool, build the
response, register its choices with the output handler and queue them for the engine. Everything that
can be refused is refused before a byte is written, as an ``ApiError``.

A completions request with several prompts is one response with ``len(prompts) * n`` choices (choice
``i``: sample ``i % n`` of prompt ``i // n``, as OpenAI numbers them), each an engine request of its
own; admission counts the whole request as one (one ticket, one slot of ``--max-concurrent-requests``),
so ``MAX_CHOICES`` bounds what one ticket may ask of the engine.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from typing import Any, Literal

import msgspec
import trio

from trioserve.config import AdmissionConfig, ModelConfig, RequestConfig, StreamsConfig
from trioserve.frontend.engine_client import EngineClient
from trioserve.frontend.output.chunks import ChunkEncoder, Kind
from trioserve.frontend.output.logprobs import LogprobsFormat, TokenStrings
from trioserve.frontend.output.output_handler import ChoiceState, OutputHandler
from trioserve.frontend.output.responses import CollectingResponse, Response, ResponseSink, StreamingResponse
from trioserve.frontend.output.tool_calls import ToolChunkEncoder
from trioserve.frontend.replica_slots import ReplicaSlots
from trioserve.frontend.request.admission import Admission, Ticket
from trioserve.frontend.request.errors import ApiError
from trioserve.frontend.request.openai_schema import ChatCompletionRequest, ChatMessage, CompletionRequest
from trioserve.frontend.request.renderer import RendererPool
from trioserve.frontend.request.structured import (
    GrammarCache,
    checked_grammar,
    grammar_source,
    refuse_beside_grammar,
)
from trioserve.frontend.request.tools import ToolsPlan, tool_calls_of, tools_plan
from trioserve.frontend.request.validate import (
    MAX_CHOICES,
    bad_words_token_ids,
    decode_body,
    output_options,
    refuse_unsupported_in_message,
    requested_max_tokens,
    sampling_params,
)
from trioserve.frontend.text.chat_template import (
    ChatTemplate,
    ChatTemplateCache,
    TemplateRenderError,
    compile_chat_template,
)
from trioserve.frontend.text.stop_strings import StopStringMatcher
from trioserve.frontend.text.tokenizer import Tokenizer
from trioserve.frontend.thread_metrics import thread_inventory
from trioserve.protocol.messages import AddRequest
from trioserve.runtime.sync import Waker

log = logging.getLogger("trioserve.frontend")

_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template sees them (``name`` only where the client gave one).

    OpenAI's content rule: every message needs content, except an assistant message that has
    ``tool_calls``. No content is a missing or null ``content`` or an empty list of parts; an empty
    string is content. ``tool_calls`` and ``tool_call_id`` reach the template as they came, checked.
    """
    if not messages:
        raise ApiError(400, "messages must contain at least one message", param="messages")
    out = []
    for i, m in enumerate(messages):
        if m.role not in _ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {sorted(_ROLES)}", param="messages")
        content = m.content
        if (content is None or content == []) and not (m.role == "assistant" and m.tool_calls):
            rule = " (an assistant message may omit it only when it has tool_calls)"
            raise ApiError(
                400,
                f"messages[{i}].content is required for a {m.role} message"
                + (rule if m.role == "assistant" else ""),
                param=f"messages[{i}].content",
            )
        refuse_unsupported_in_message(m, i)
        message: dict[str, Any] = {
            "role": m.role,
            "content": content
            if content is None or isinstance(content, str)
            else [{"type": "text", "text": part.text} for part in content],
        }
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = tool_calls_of(m.tool_calls, i)
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


class Serving:
    def __init__(
        self,
        model: ModelConfig,
        request: RequestConfig,
        admission: AdmissionConfig,
        streams: StreamsConfig,
        tokenizer: Tokenizer,
        engine: EngineClient,
        handler: OutputHandler,
    ) -> None:
        self.model = model  # what is served: names and the context length
        self.request = request
        self.tokenizer = tokenizer
        self.token_strings = TokenStrings(tokenizer.token_bytes)  # logprobs' per-token JSON, shared
        self.engine = engine
        self.handler = handler
        self.dead_reason: str | None = None
        self.engine_retry_after = 1  # Retry-After (s) of the 503s while the engine is unavailable
        self.draining = False  # shutting down: /health 503, new requests 503
        # 0 workers: render on the event loop itself (no thread handoff, but a long prompt holds up
        # every stream while it renders; deterministic under a MockClock).
        workers = request.renderer_num_workers
        self.renderer = RendererPool(workers) if workers else None
        self.stream_policy = streams.policy
        # --chat-template (the command line checked that it compiles), and the request templates
        # accepted under --trust-request-chat-template, compiled once per distinct text.
        text = request.chat_template
        self.chat_template = None if text is None else compile_chat_template(text)
        self.request_templates = ChatTemplateCache()
        self.grammars = GrammarCache()  # structured output's checked grammars, by their source
        self.admission = Admission(admission)
        self.active: set[Response] = set()
        # Response ids: a random per-process part and a counter (unique without a uuid4 per request).
        self._id_base = secrets.token_hex(8)
        self._id_counter = itertools.count()
        self._finished = Waker()  # set whenever a response leaves ``active``
        # least-outstanding-bytes: the table every API server reserves replicas in, and its cap
        # (set together by ApiServer from --max-inflight-per-replica)
        self.slots: ReplicaSlots | None = None
        self.slot_cap = 0

    def new_request_id(self) -> str:
        """An id no other request of the deployment has: 64 random bits per API server process and
        a counter (a response's ``id`` is its kind's prefix and this; its engine requests add ``-i``)."""
        return f"{self._id_base}{next(self._id_counter):08x}"

    # ---- rendering (on the renderer pool) -------------------------------------------------------------

    async def render(self, fn: Any, *args: Any) -> Any:
        try:
            if self.renderer is None:
                await trio.lowlevel.checkpoint()
                return fn(*args)
            return await self.renderer.render(fn, *args)
        except ValueError as exc:  # the tokenizer's word for "these messages cannot be rendered"
            raise ApiError(400, f"could not render the prompt: {exc}") from None

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        *,
        template: ChatTemplate | None = None,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The tokenizer's ``apply_chat_template`` with the server's template (``--chat-template``)
        unless ``template`` is given: every route that renders messages renders them the same way."""
        return self.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt,
            chat_template_kwargs,
            template=template or self.chat_template,
            continue_final_message=continue_final_message,
            tools=tools,
        )

    def _chat_prompt(self, req: ChatCompletionRequest, plan: ToolsPlan | None = None) -> list[int]:
        messages = message_dicts(req.messages)
        template = None
        if req.chat_template is not None:  # validate refused it unless --trust-request-chat-template
            try:
                template = self.request_templates.get(req.chat_template)
            except ValueError as exc:
                raise ApiError(400, f"chat_template: {exc}", param="chat_template") from None
        try:
            ids = self.apply_chat_template(
                messages,
                req.add_generation_prompt,
                req.chat_template_kwargs,
                template=template,
                continue_final_message=bool(req.continue_final_message),
                tools=None if plan is None else plan.tools,
            )
        except TemplateRenderError as exc:
            if template is None:
                raise
            raise ApiError(400, f"chat_template: {exc}", param="chat_template") from None
        return self._truncate(ids, req.truncate_prompt_tokens)

    def _truncate(self, ids: list[int], keep: int | None) -> list[int]:
        """vLLM's ``truncate_prompt_tokens``: the last ``keep`` tokens (-1: the context window)."""
        if keep is None:
            return ids
        if keep == -1:
            keep = self.model.max_model_len
        return ids[len(ids) - keep :] if len(ids) > keep else ids

    def _completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        """Each prompt's tokens: ``prompt`` is a string, a list of token ids, or a list of several
        prompts (all strings, or all lists of token ids); each is truncated on its own."""
        prompt = req.prompt
        several = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
        prompts: list[Any] = list(prompt) if several else [prompt]
        if len(prompts) * req.n > MAX_CHOICES:
            raise ApiError(
                400,
                f"at most {MAX_CHOICES} choices per request (prompts x n); this one asks for "
                f"{len(prompts)} x {req.n}",
                param="prompt",
            )
        if several and len({isinstance(p, str) for p in prompts}) > 1:
            mixed = "prompt: a list of prompts must be all strings or all token-id lists"
            raise ApiError(400, mixed, param="prompt")
        vocab = self.tokenizer.vocab_size
        out = []
        for i, item in enumerate(prompts):
            param = f"prompt[{i}]" if several else "prompt"
            if isinstance(item, str):
                ids = self.tokenizer.encode(item)
            elif isinstance(item, list) and all(isinstance(t, int) for t in item):
                if any(not 0 <= t < vocab for t in item):
                    raise ApiError(400, f"{param}: token ids must be in [0, {vocab})", param=param)
                ids = list(item)
            else:
                raise ApiError(
                    400,
                    "prompt must be a string, a list of token ids, or a list of strings or of token-id lists",
                    param="prompt",
                )
            out.append(self._truncate(ids, req.truncate_prompt_tokens))
        return out

    def _check_each_prompt(self, req: CompletionRequest, prompts: list[list[int]]) -> None:
        """Several prompts: each against the context window, with a 400 that names it."""
        max_tokens = requested_max_tokens(req)  # completions: never None (OpenAI's default is 16)
        assert max_tokens is not None
        limit = self.model.max_model_len
        for i, ids in enumerate(prompts):
            if not ids or len(ids) + max_tokens > limit:
                try:
                    sampling_params(req, self.model, len(ids))  # the length checks come first
                except ApiError as exc:
                    raise ApiError(400, f"prompt[{i}]: {exc.message}", param=f"prompt[{i}]") from None

    # ---- the request lifecycle --------------------------------------------------------------------------

    async def start(
        self, kind: Kind, body: bytes, sink: ResponseSink, *, request_id: str | None = None
    ) -> Response:
        """``request_id``: the request's id, unique across the deployment (the edge builds it from
        ``new_request_id`` and the client's X-Request-Id); None: ``new_request_id()``."""
        arrival = time.time()
        if self.draining:
            raise ApiError(503, "the server is shutting down", retry_after=1)
        if self.dead_reason is not None:
            raise self.engine_unavailable()
        admission = self.admission
        now = trio.current_time()
        admission.engine_stall = self.engine.stall(now)
        admission.observe_engine_stats(self.handler.engine_stats_ages(now))
        admission.observe_output_delay(self.handler.output_delay())
        ticket = admission.admit()  # reserved before rendering ...
        try:
            with admission.rendering_slot():
                response = await self._prepare(kind, body, sink, arrival, ticket, request_id)
            if self.draining:  # drain began while it rendered: it would outlive drain's deadline
                raise ApiError(503, "the server is shutting down", retry_after=1)
        except BaseException:
            ticket.release()  # ... and released on every path that does not produce a response
            self._finished.set()
            raise
        # From here on, the response releases the ticket when it leaves ``active``.
        self.handler.metrics.prompt_tokens += response.prompt_tokens
        self.active.add(response)
        try:
            if self.slots is not None:
                self._place(response, len(body))
            self._submit(response, arrival)
        except BaseException:
            self.cancel(response)
            raise
        return response

    async def _prepare(
        self,
        kind: Kind,
        body: bytes,
        sink: ResponseSink,
        arrival: float,
        ticket: Ticket,
        request_id: str | None = None,
    ) -> Response:
        """Decode, validate and render; everything that can refuse the request happens here."""
        req: ChatCompletionRequest | CompletionRequest
        if kind == "chat":
            req = decode_body(body, ChatCompletionRequest)
        else:
            req = decode_body(body, CompletionRequest)
        options = output_options(req, self.model, self.request)
        plan = tools_plan(req, self.request) if isinstance(req, ChatCompletionRequest) else None
        source = grammar_source(req)
        if plan is not None and plan.grammar is not None:
            if source is not None:
                raise ApiError(
                    400,
                    f"tool_choice {plan.mode!r} cannot be combined with `{source.param}`",
                    param=source.param,
                )
            source = plan.grammar
        if source is not None:
            refuse_beside_grammar(req, source)
        grammar = None
        if source is not None:  # checked before rendering: a bad schema costs no tokenizing
            grammar = self.grammars.cached(source) or await self.render(
                checked_grammar, self.grammars, source
            )
        prompts: list[list[int]]
        if isinstance(req, ChatCompletionRequest):
            prompts = [await self.render(self._chat_prompt, req, plan)]
        else:
            prompts = await self.render(self._completion_prompts, req)
            if len(prompts) > 1:
                self._check_each_prompt(req, prompts)
        # max_tokens is the same for every prompt, so the longest one bounds it.
        params = sampling_params(req, self.model, max(len(p) for p in prompts))
        if grammar is not None:
            params = msgspec.structs.replace(params, grammar=grammar)
        if req.bad_words:  # tokenized once per request, on the renderer pool
            vocab = self.model.vocab_size
            words = await self.render(bad_words_token_ids, req.bad_words, self.tokenizer, vocab)
            params = msgspec.structs.replace(params, bad_words_token_ids=words)
        if self.dead_reason is not None:  # the engine may have gone while we rendered
            raise self.engine_unavailable()

        prefix: Literal["chatcmpl-", "cmpl-"] = "chatcmpl-" if kind == "chat" else "cmpl-"
        response_id = f"{prefix}{request_id or self.new_request_id()}"
        continuous = sum(len(p) for p in prompts) if options.continuous_usage else None
        tool_format = None if plan is None else plan.output_format()
        encoder: ChunkEncoder
        if tool_format is not None and options.stream:
            encoder = ToolChunkEncoder(
                kind, response_id, int(arrival), options.model, options.return_token_ids, continuous,
                tool_format, options.n,
            )  # fmt: skip
        else:
            encoder = ChunkEncoder(
                kind, response_id, int(arrival), options.model, options.return_token_ids, continuous
            )
        built = (sink, encoder, options, prompts[0], params, req.priority, ticket, self._on_done)
        # logprobs: rendered from the tokenizer's own bytes per token (frontend/output/logprobs.py)
        lp = (
            None
            if options.logprobs is None and options.prompt_logprobs is None
            else LogprobsFormat(kind, self.token_strings)
        )
        response: Response
        if not options.stream:
            response = CollectingResponse(*built, prompts=prompts, logprobs=lp)
        else:
            policy = self.stream_policy
            stalled = self.handler.stalled if policy.kind == "stall" else None
            response = StreamingResponse(*built, policy=policy, stalled=stalled, prompts=prompts, logprobs=lp)
        if req.timeout_ms:
            response.timeout_s = req.timeout_ms / 1000
        response.tool_format = tool_format
        return response

    def _place(self, response: Response, nbytes: int) -> None:
        """least-outstanding-bytes: reserve the replica this request runs on (every choice on the
        same one), or refuse it now with 503: every ready replica has ``slot_cap`` requests in flight
        and there is no pool queue (docs/replicas.md says why 503 and not 429)."""
        assert self.slots is not None
        engine = self.engine
        ready = engine.pool.up_flags(engine.dispatchable(trio.current_time()))
        if not any(ready):
            raise ApiError(503, "no replica is ready", retry_after=1)
        reservation = self.slots.reserve(engine.client_index, ready, self.slot_cap, nbytes)
        if reservation is None:
            raise ApiError(
                503,
                f"every ready replica has {self.slot_cap} requests in flight (--max-inflight-per-replica)",
                retry_after=1,
            )
        response.reservation = reservation

    def inventory(self, now: float) -> dict[str, object]:
        """``GET /v1/replicas``: the engine client's view, with least-outstanding-bytes' shared
        counts (every API server's requests) where that policy runs."""
        inventory = self.engine.inventory(now)
        data = inventory["data"]
        assert isinstance(data, list)
        if len(data) == 1:
            data[0]["in_flight"] = len(self.active)
        for entry in data:  # its workers' threads (docs/threads.md), as of its latest stats
            entry["threads"] = thread_inventory(self.handler.engine_stats.get(entry["index"]))
        if self.slots is not None:
            for entry in data:
                entry["in_flight"], entry["outstanding_bytes"] = self.slots.totals(entry["index"])
            inventory["max_inflight_per_replica"] = self.slot_cap
        return inventory

    def _submit(self, response: Response, arrival: float) -> None:
        """Register every choice with the output handler and queue it for the engine. Choice ``i`` is
        sample ``i % n`` of prompt ``i // n`` (OpenAI's numbering of a request with several prompts)."""
        options, params, n = response.options, response.params, response.options.n
        eos = self.tokenizer.eos_token_id
        extra_eos = self.tokenizer.extra_eos_ids
        if extra_eos and not params.ignore_eos:
            params = msgspec.structs.replace(params, stop_token_ids=[*params.stop_token_ids, *extra_eos])
        # Built once per request (up to ~20 ms at the caps), forked per choice.
        matcher = (
            StopStringMatcher(options.stop, options.include_stop_str_in_output) if options.stop else None
        )
        # echo: each prompt's text as the model saw it (after truncation), special tokens included.
        decode = self.tokenizer.decode
        echo = [decode(p, skip_special_tokens=False) for p in response.prompts] if options.echo else []
        for i, request_id in enumerate(response.request_ids):
            prompt_ids, sample = response.prompts[i // n], i % n
            stop = matcher if matcher is None or i == 0 else matcher.fork()
            detok = self.tokenizer.detokenizer(options.skip_special_tokens, prompt_ids=prompt_ids)
            include = options.include_stop_str_in_output
            self.handler.register(
                ChoiceState(
                    request_id,
                    i,
                    response,
                    detok,
                    stop,
                    include,
                    arrival,
                    extras=response.token_format is not None or options.echo,
                    echo=echo[i // n] if echo else None,
                )
            )
            # Parallel samples with a seed get distinct but reproducible seeds (as vLLM does); each
            # prompt's samples get the seeds it would get alone.
            sp = (
                params
                if params.seed is None or sample == 0
                else msgspec.structs.replace(params, seed=params.seed + sample)
            )
            self.engine.add(
                AddRequest(
                    request_id,
                    prompt_ids,
                    sp,
                    arrival,
                    client_index=self.engine.client_index,
                    priority=response.priority,
                    eos_token_id=eos,
                ),
                timeout_s=response.timeout_s,
                replica=None if response.reservation is None else response.reservation.replica,
            )

    def cancel(self, response: Response) -> None:
        """The client went away (or the server is stopping): stop its engine requests now."""
        self.engine.abort(self.handler.forget(response.request_ids))
        response.done = True
        self._retire(response)

    def _on_done(self, response: Response) -> None:
        # A response can finish while some choices still run (an engine error on one choice).
        self.engine.abort(self.handler.forget(response.request_ids))
        self._retire(response)

    def _retire(self, response: Response) -> None:
        response.ticket.release()
        if response.reservation is not None and self.slots is not None:
            self.slots.release(response.reservation)
        metrics = self.handler.metrics
        first = response.first_token_time
        # Once per request. Its decode time only when every choice ran to its end (the last token
        # has just arrived): a cancelled or failed request's would measure the cut, not the decode.
        decode = time.time() - first if first and response.remaining == 0 else None
        metrics.observe_request(
            response.prompt_tokens, response.completion_tokens, len(response.request_ids), decode
        )
        if isinstance(response, StreamingResponse):
            metrics.stream_events += response.content_events
            metrics.stream_tokens += response.completion_tokens
            metrics.merged_deltas += response.merged_deltas
        self.active.discard(response)
        self._finished.set()

    async def drained(self) -> None:
        """Returns once no request is in flight, rendering ones included (graceful shutdown waits
        on this)."""
        while self.active or self.admission.in_flight:
            await self._finished.wait()

    def shut_down(self) -> None:
        """Drain's deadline: every response still running ends now with an error the client sees
        (an error event and a proper end of the stream), and its engine requests are aborted.
        Requests still rendering are refused with 503 when their rendering ends."""
        self.draining = True
        self.handler.fail_all(503, "the server is shutting down")

    def on_engine_dead(
        self, reason: str, request_ids: list[str] | None = None, *, retry_after: int | None = None
    ) -> None:
        """An engine is gone. ``request_ids`` (others still serve): the requests it held fail now.
        None (no engine is left): every running request fails now, and new ones get 503 (with
        ``retry_after``, when the caller knows when a replacement is due) until ``on_engine_ready``.
        The first reason stands until then; later reports only fail what is still running."""
        if request_ids is not None:
            log.error("%s; %d requests on it fail, the other engines serve", reason, len(request_ids))
            self.handler.fail(request_ids, 503, f"the engine is unavailable: {reason}")
            return
        if retry_after is not None:
            self.engine_retry_after = retry_after
        if self.dead_reason is None:
            log.error("engine unavailable: %s", reason)
            self.dead_reason = reason
        self.handler.fail_all(503, f"the engine is unavailable: {reason}")

    def on_engine_ready(self) -> None:
        """An engine (re)joined: serve again."""
        if self.dead_reason is not None:
            log.warning("engine available again (it was unavailable: %s)", self.dead_reason)
            self.dead_reason = None
            self.engine_retry_after = 1

    def engine_unavailable(self) -> ApiError:
        return ApiError(
            503, f"the engine is unavailable: {self.dead_reason}", retry_after=self.engine_retry_after
        )
