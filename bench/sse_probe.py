"""SSE token probe: a few streaming requests beside someone else's load, counting token ids per event.

Runs alongside any load generator (ours, guidellm, aiperf, `vllm bench serve`) against any server that
honours ``return_token_ids`` (trioserve, vLLM >= 0.10): ``--probes`` clients each stream one request
after another for ``--duration`` seconds and record, per SSE event, how many token ids it carried. One
token per event means the server keeps up with its engine; more means deltas waited and were merged
(trioserve's ``merge`` policy) or the engine emits several per step. Stdlib only.

    .venv/bin/python bench/sse_probe.py --port 8000 --probes 4 --duration 20
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import sys
import threading
import time
from collections.abc import Iterable


def tokens_per_event(lines: Iterable[bytes]) -> list[int]:
    """Token ids carried by each ``data:`` event of a streamed completion (usage and [DONE] skipped)."""
    counts: list[int] = []
    for raw in lines:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            continue
        chunk = json.loads(payload)
        choices = chunk.get("choices") or []
        if not choices:
            continue  # the usage chunk
        counts.append(sum(len(c.get("token_ids") or ()) for c in choices))
    return counts


def probe(
    host: str, port: int, body: dict[str, object], deadline: float, out: list[int], errors: list[str]
) -> None:
    while time.monotonic() < deadline:
        conn = http.client.HTTPConnection(host, port, timeout=120)
        try:
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                errors.append(f"HTTP {response.status}")
                time.sleep(1.0)
                continue
            out.extend(tokens_per_event(response))
        except (OSError, ValueError) as exc:
            errors.append(repr(exc))
            time.sleep(1.0)
        finally:
            conn.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--model", default=None, help="default: the first id of /v1/models")
    ap.add_argument("--probes", type=int, default=4)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    model = args.model
    if model is None:
        conn = http.client.HTTPConnection(args.host, args.port, timeout=10)
        conn.request("GET", "/v1/models")
        model = json.loads(conn.getresponse().read())["data"][0]["id"]
        conn.close()
    body = {
        "model": model,
        "prompt": "Tell me a story.",
        "max_tokens": args.max_tokens,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    deadline = time.monotonic() + args.duration
    counts: list[list[int]] = [[] for _ in range(args.probes)]
    errors: list[str] = []
    threads = [
        threading.Thread(target=probe, args=(args.host, args.port, body, deadline, c, errors)) for c in counts
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    events = [n for c in counts for n in c]
    if not events:
        print(f"no events received; errors: {errors[:5]}", file=sys.stderr)
        return 1
    histogram = collections.Counter(events)
    result = {
        "events": len(events),
        "tokens": sum(events),
        "tokens_per_event": sum(events) / len(events),
        "max_tokens_per_event": max(events),
        "events_without_ids": histogram.get(0, 0),
        "histogram": dict(sorted(histogram.items())),
        "errors": len(errors),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
