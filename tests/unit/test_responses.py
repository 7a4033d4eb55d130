"""Responses without trio or sockets: built whole, told of a drain by their sink, gauges of their own."""

from __future__ import annotations

import msgspec

from trioserve.config import AdmissionConfig, StreamPolicy
from trioserve.frontend.edge.sinks import Sink
from trioserve.frontend.output.chunks import ChunkEncoder
from trioserve.frontend.output.responses import CollectingResponse, Response, StreamingResponse
from trioserve.frontend.request.admission import Admission
from trioserve.frontend.request.validate import OutputOptions
from trioserve.protocol.messages import SamplingParams


class FakeSink(Sink):
    """A transport whose peer is behind while ``behind`` is True; keeps what was written."""

    def __init__(self) -> None:
        super().__init__()
        self.behind = False
        self.written: list[bytes] = []
        self.ended = False

    @property
    def backlogged(self) -> bool:
        return self.behind

    @property
    def backlog_bytes(self) -> int:
        return 100 if self.behind else 0

    def events(self, payloads: list[bytes]) -> None:
        self.written += payloads

    def end(self) -> None:
        self.ended = True

    def full(self, status: int, body: bytes) -> None:
        self.written.append(body)


def _options(stream: bool) -> OutputOptions:
    return OutputOptions("m", 1, stream, False, False, True, (), False, True)


def _streaming(sink: FakeSink, done: list[Response]) -> StreamingResponse:
    ticket = Admission(AdmissionConfig()).admit()
    encoder = ChunkEncoder("completion", "cmpl-1", 0, "m", return_token_ids=True)
    built = (sink, encoder, _options(True), [1, 2], SamplingParams(8), 3, ticket, done.append)
    return StreamingResponse(*built, policy=StreamPolicy())


def test_a_response_is_built_whole_and_attaches_to_its_sink() -> None:
    sink, done = FakeSink(), list[Response]()
    response = _streaming(sink, done)
    assert sink.response is response
    assert (response.params, response.priority, response.policy) == (SamplingParams(8), 3, StreamPolicy())
    assert response.ticket is not None and not response.ticket.released  # Serving releases it
    assert response.stalled is None


def test_the_sink_tells_its_response_when_the_transport_drained() -> None:
    sink, done = FakeSink(), list[Response]()
    response = _streaming(sink, done)
    response.on_delta(0, "a", [5], None, None)
    assert len(sink.written) == 1
    sink.behind = True  # the peer is behind: deltas merge instead of being written
    response.on_delta(0, "b", [6], None, None)
    response.on_delta(0, "c", [7], "length", None)
    assert len(sink.written) == 1 and not done
    assert (response.backlogged, response.backlog_bytes, response.merged_tokens) == (True, 100, 2)
    woken: list[bool] = []
    response.on_caught_up = lambda: woken.append(True)  # a waiter (the output handler under stall)
    sink.behind = False
    sink.drained()  # all a transport does: the sink tells the response
    assert woken == [True]
    merged = msgspec.json.decode(sink.written[1])["choices"][0]
    assert (merged["text"], merged["token_ids"], merged["finish_reason"]) == ("bc", [6, 7], "length")
    assert sink.ended and done == [response]
    sink.drained()  # once more: nothing left to write, and the waiter was woken once only
    assert len(sink.written) == 2 and woken == [True]
    assert (response.backlogged, response.backlog_bytes, response.merged_tokens) == (False, 0, 0)


def test_a_full_response_never_shows_a_backlog() -> None:
    sink, done = FakeSink(), list[Response]()
    sink.behind = True  # e.g. a WebSocket whose other requests fill the socket
    encoder = ChunkEncoder("completion", "cmpl-2", 0, "m", return_token_ids=False)
    ticket = Admission(AdmissionConfig()).admit()
    response = CollectingResponse(
        sink, encoder, _options(False), [1], SamplingParams(8), 0, ticket, done.append
    )
    response.on_delta(0, "a", [5], None, None)
    sink.drained()  # a no-op for a full response
    assert (response.backlogged, response.backlog_bytes, response.merged_tokens) == (False, 0, 0)
    response.on_delta(0, "b", [6], "stop", None)
    assert msgspec.json.decode(sink.written[0])["choices"][0]["text"] == "ab" and done == [response]
