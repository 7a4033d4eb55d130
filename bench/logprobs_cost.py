"""The API server's per-token cost of logprobs, without sockets: decode one engine step's msgpack frame
(``EngineOutputs`` of N streamed chat requests, one token each, as the mock engine makes them), run the
output handler over it (detokenize, stop check, render the chunk into a null sink), and report the time
per token, for requests without logprobs and with ``top_logprobs`` K. One process, one core; no trio
run is needed (``OutputHandler.process`` never awaits; it reads ``trio.current_time`` only inside a
run, so the step is processed under ``trio.run`` once per repetition).

    python bench/logprobs_cost.py --requests 256 --steps 200 --top 0,5,20
"""

from __future__ import annotations

import argparse
import random
import time

import msgspec
import trio

from trioserve.config import AdmissionConfig, StreamPolicy
from trioserve.frontend.edge.sinks import Sink
from trioserve.frontend.output.chunks import ChunkEncoder
from trioserve.frontend.output.logprobs import LogprobsFormat, TokenStrings
from trioserve.frontend.output.output_handler import ChoiceState, OutputHandler
from trioserve.frontend.output.responses import Response, StreamingResponse
from trioserve.frontend.request.admission import Admission
from trioserve.frontend.request.validate import OutputOptions
from trioserve.frontend.text.tokenizer import load_tokenizer
from trioserve.metrics import Metrics
from trioserve.mock.core import mock_logprobs
from trioserve.protocol.messages import EngineOutputs, EngineStats, RequestOutput, SamplingParams


class NullSink(Sink):
    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    @property
    def backlogged(self) -> bool:
        return False

    def event(self, payload: bytes) -> None:
        self.bytes += len(payload)

    def events(self, payloads: list[bytes]) -> None:
        self.bytes += sum(len(p) for p in payloads)

    def end(self) -> None:
        pass

    def full(self, status: int, body: bytes) -> None:
        pass


def measure(requests: int, steps: int, top: int | None, vocab: int = 32000) -> tuple[float, float]:
    """Microseconds per token, and chunk bytes per token, for ``top`` alternatives (None: none)."""
    tokenizer = load_tokenizer(None)
    handler = OutputHandler(lambda ids: None, Metrics("m"))
    admission = Admission(AdmissionConfig(max_num_seqs_waiting=requests * 2))
    options = OutputOptions("m", 1, True, False, False, False, (), False, True, logprobs=top)
    sinks = []
    # One per API server, as Serving holds it, and warm (a running server's is): the mock's uniform
    # ids would otherwise measure cache misses, which real text's skewed token counts rarely makes.
    strings = TokenStrings(tokenizer.token_bytes)
    for token_id in range(vocab):
        strings.get(token_id)
    for r in range(requests):
        sink = NullSink()
        sinks.append(sink)
        fmt = None if top is None else LogprobsFormat("chat", strings)
        encoder = ChunkEncoder("chat", f"chatcmpl-{r}", 0, "m", False)
        response: Response = StreamingResponse(
            sink,
            encoder,
            options,
            [1, 2, 3],
            SamplingParams(steps + 10),
            0,
            admission.admit(),
            lambda _: None,
            policy=StreamPolicy(),
            logprobs=fmt,
        )
        response._role_pending = [False]  # type: ignore[attr-defined]  # measure content chunks only
        detok = tokenizer.detokenizer()
        handler.register(
            ChoiceState(response.request_ids[0], 0, response, detok, None, extras=top is not None)
        )
    rng = random.Random(0)
    encode = msgspec.msgpack.Encoder().encode
    decode = msgspec.msgpack.Decoder(EngineOutputs).decode
    frames = []
    for step in range(steps):
        outs = []
        for r in range(requests):
            token = rng.randrange(vocab)
            out = RequestOutput(f"chatcmpl-{r}-0", [token])
            if top is not None:
                out.logprobs = [mock_logprobs(rng, token, top, vocab)]
            outs.append(out)
        frames.append(encode(EngineOutputs(0, step, 0.0, outs, EngineStats(0, requests))))

    async def run() -> float:
        start = time.perf_counter()
        for frame in frames:
            handler.process(decode(frame))
        return time.perf_counter() - start

    elapsed = trio.run(run)
    tokens = requests * steps
    return elapsed / tokens * 1e6, sum(s.bytes for s in sinks) / tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--top", default="0,5,20", help="top_logprobs values to measure, besides none")
    ap.add_argument("--repeat", type=int, default=3, help="best of this many runs")
    args = ap.parse_args()
    cases: list[int | None] = [None, *(int(k) for k in args.top.split(","))]
    print(f"| logprobs | µs/token (best of {args.repeat}) | bytes/chunk |")
    print("|---|---|---|")
    for top in cases:
        runs = [measure(args.requests, args.steps, top) for _ in range(args.repeat)]
        us = min(r[0] for r in runs)
        label = "none" if top is None else f"top_logprobs {top}"
        print(f"| {label} | {us:.2f} | {runs[0][1]:.0f} |")


if __name__ == "__main__":
    main()
