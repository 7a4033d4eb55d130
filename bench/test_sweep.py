"""Checks of the sweep's pure parts (no servers): ``pytest bench/test_sweep.py``."""

from __future__ import annotations

import json
import math
from pathlib import Path

from sweep import (
    Point,
    counter_rate,
    detail_table,
    fmt_ms,
    frontend_table,
    make_point,
    notes,
    parse_metrics,
    report_only,
    seed_table,
    window_mean,
)

METRICS = """\
# HELP vllm:num_requests_running Requests in the engine's running batch.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="trioserve-mock"} 255.0
vllm:generation_tokens_total{model_name="trioserve-mock"} 1.5e3
trioserve:rejected_requests_total{model_name="m",reason="loop_lag"} 3
trioserve:rejected_requests_total{model_name="m",reason="pending_renders"} 4
vllm:request_success_total{model_name="m",finished_reason="length"} 10
vllm:time_to_first_token_seconds_bucket{model_name="m",le="0.01"} 7
"""


def test_parse_metrics_sums_label_sets_and_skips_others() -> None:
    m = parse_metrics(METRICS)
    assert m["vllm:num_requests_running"] == 255.0
    assert m["vllm:generation_tokens_total"] == 1500.0
    assert m["trioserve:rejected_requests_total"] == 7.0
    assert m["vllm:request_success_total"] == 10.0
    assert "vllm:time_to_first_token_seconds_bucket" not in m


def test_window_mean_and_counter_rate() -> None:
    samples = [(float(t), {"g": float(t * 10), "c": float(t * 100)}) for t in range(10)]
    assert window_mean(samples, "g", 2.0, 4.0) == 30.0  # samples at t = 2, 3, 4
    assert window_mean(samples, "g", 4.2, 4.4) == 40.0  # none inside: nearest to the middle
    assert math.isnan(window_mean([], "g", 0.0, 1.0))
    assert counter_rate(samples, "c", 1.0, 8.0) == 100.0
    assert math.isnan(counter_rate(samples, "c", 4.1, 4.9))


def _result(**over: object) -> dict[str, object]:
    r: dict[str, object] = {
        "window_s": 10.0,
        "tokens": 255_450,
        "token_events": 255_450,
        "sse_events": 256_000,
        "tokens_per_event_hist": {"1": 255_450},
        "cpu_s": {"server": 5.7, "engine": 1.0},
        "client_cpu_s": 2.0,
        "cpu_busy_s": {"0": 7.0, "1": 2.5},
        "window_start_unix": 100.0,
        "window_end_unix": 110.0,
        "ttft_p50_ms": 11.2,
        "ttft_p99_ms": 1234.5,
        "tpot_mean_ms": 10.004,
        "itl_p99_ms": None,  # msgspec writes nan as null
        "failures_total": {"connect": 3, "http 500": 2},
        "rejected_total": {"503": 4},
        "requests_sent": 1533,
        "requests_ok": 1526,
        "steady_state": True,
        "inflight_min": 250,
    }
    r.update(over)
    return r


def test_make_point_steady_state_math() -> None:
    metrics = [(100.0 + t, {"vllm:num_requests_running": 254.0 + (t % 2)}) for t in range(11)]
    metrics.append((200.0, {"vllm:num_requests_running": 1.0}))  # after the window: ignored
    p = make_point(256, 1536, _result(), metrics, server_cpus=[0], engine_cpus=[0], client_cpus=[1])
    assert p.tokens_per_s == 25_545.0
    assert p.engine_batch == (254 * 6 + 255 * 5) / 11
    assert p.tokens_per_event == 1.0 and p.max_tokens_per_event == 1
    assert math.isclose(p.api_cores, 0.57) and math.isclose(p.engine_cores, 0.1)
    assert math.isclose(p.api_us_per_token, 5.7e6 / 255_450)
    assert math.isclose(p.client_us_per_event, 2.0e6 / 256_000)
    assert p.failed_connect == 3 and p.failed_other == 2 and p.rejected == 4
    assert math.isclose(p.failed_connect_pct, 100 * 3 / 1536)
    # Busy time on the server's core not charged to the API server and the engine (both on cpu 0).
    assert math.isclose(p.other_load_server_core, (7.0 - 6.7) / 10)
    assert math.isclose(p.other_load_client_core, (2.5 - 2.0) / 10)
    assert math.isnan(p.itl_p99_ms)


def test_seed_table_layout() -> None:
    p = make_point(1024, 6144, _result(ttft_p50_ms=4431.4), [(105.0, {"vllm:num_requests_running": 347.0})])
    table = seed_table([p, Point(2048, 12288, error="boom")])
    assert table.splitlines() == [
        "| Clients | Client tokens/s | Engine batch | TTFT p50 | Mean TPOT | Tokens per SSE event "
        "| API server CPU |",
        "|---|---|---|---|---|---|---|",
        "| 1,024 | 25,545 | 347 | 4,431 ms | 10.00 ms | 1.0 | 0.57 cores |",
        "| 2,048 | error |  |  |  |  |  |",
    ]
    assert "Tokens per WebSocket message" in seed_table([p], "WebSocket message")
    front = frontend_table([p], "trioserve").splitlines()
    assert (
        front[0]
        == "| Frontend | Client tokens/s | Engine batch | TTFT p50 | Failed to connect | Frontend CPU |"
    )
    assert front[2] == "| trioserve (1,024 clients) | 25,545 | 347 | 4,431 ms | 0% | 0.57 cores |"
    detail = detail_table([p]).splitlines()
    assert len(detail) == 3 and detail[0].count("|") == detail[2].count("|")
    assert "| 1,526/1,533 | 10.0 s |" in detail[2] and "| n/a |" in detail[2]  # ITL p99 missing


def test_fmt_ms_and_notes() -> None:
    assert fmt_ms(11.4) == "11 ms" and fmt_ms(4431.4) == "4,431 ms" and fmt_ms(9.96) == "10.0 ms"
    assert fmt_ms(2.345) == "2.3 ms" and fmt_ms(math.nan) == "n/a"
    p = make_point(512, 3072, _result(steady_state=False), [])
    text = "\n".join(notes([p], 10_000))
    assert "no steady state" in text and "of the 51,200 tokens/s" in text


def test_report_only_rebuilds_markdown(tmp_path: Path) -> None:
    args = {
        "step_interval_us": 10_000,
        "server_cpu": 0,
        "client_cpu": 1,
        "input_len": 256,
        "output_len": 256,
        "num_prompts_factor": 6.0,
        "duration": None,
        "transport": "sse",
        "endpoint": "chat",
        "max_num_seqs": 1024,
        "server_arg": [],
        "request_rate": 400.0,
        "no_plots": True,
    }
    raw = [
        {
            "clients": 256,
            "num_prompts": 1536,
            "result": _result(),
            "metrics": [{"t": 105.0, "vllm:num_requests_running": 251.0}],
            "server_cpus": [0],
            "engine_cpus": [0],
            "client_cpus": [1],
        },
        {"clients": 512, "error": "server died"},
    ]
    meta = {"command": "bench/sweep.py", "when": "today", "machine": "m", "git": "abc"}
    saved = tmp_path / "ceiling.json"
    saved.write_text(json.dumps({**meta, "args": args, "raw": raw}))
    assert report_only(saved) == 0
    md = (tmp_path / "ceiling.md").read_text()
    assert "| 256 | 25,545 | 251 | 11 ms | 10.00 ms | 1.0 | 0.57 cores |" in md
    assert "| 512 | error |" in md and "- 512 clients: server died" in md
    assert "API server pinned to cpu 0" in md and "load generator" in md
    assert json.loads(saved.read_text())["points"][0]["tokens_per_s"] == 25_545.0
