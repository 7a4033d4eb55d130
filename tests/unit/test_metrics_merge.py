"""Merging API servers' metrics (design §11, metrics.py): totals, engine-wide values, per-server lines,
the state file, and a restarted server continuing its predecessor's counts."""

from __future__ import annotations

import math
import re
from pathlib import Path

import msgspec

from trioserve.metrics import (
    Metrics,
    MetricsState,
    decode_state,
    encode_state,
    read_state,
    state_path,
    write_state,
)

GAUGES = {
    "vllm:num_requests_running": ("Running.", 3),
    "vllm:kv_cache_usage_perc": ("KV.", 0.5),
    "trioserve:requests_in_flight": ("In flight.", 2),
}
COUNTERS = {
    "trioserve:renderer_jobs_total": ("Jobs.", 4),
    "vllm:prefix_cache_hits_total": ("Hits.", 10),
    "trioserve:engine_folded_steps_total": ("Folded.", 1),
}


def server(index: int, *, tokens: int, ttft: list[float], in_flight: int, proc: str = "/proc") -> Metrics:
    m = Metrics("tiny", max_model_len=512, proc=proc)
    m.generation_tokens = tokens
    m.stream_events = index + 1
    m.finished = {"length": index + 1}
    for value in ttft:
        m.ttft.observe(value)
    m.loop_lag.observe(0.002 * (index + 1))
    return m


def state_of(
    m: Metrics, index: int, *, in_flight: int, hits: int, running: int, engine_age: float
) -> MetricsState:
    gauges = {**GAUGES, "trioserve:requests_in_flight": ("In flight.", in_flight)}
    gauges["vllm:num_requests_running"] = ("Running.", running)
    counters = {**COUNTERS, "vllm:prefix_cache_hits_total": ("Hits.", hits)}
    return m.state(gauges, counters, {"queue_full": index + 1}, index=index, engine_age=engine_age)


def value(text: str, name: str, labels: str = "") -> float:
    pattern = re.escape(name) + r"\{[^}]*" + re.escape(labels) + r"[^}]*\} (\S+)"
    found = re.findall(pattern, text)
    assert len(found) == 1, f"{name} {labels}: {found}"
    return float(found[0])


def test_one_api_server_renders_as_one_process_with_no_api_server_label() -> None:
    m = server(0, tokens=5, ttft=[0.01], in_flight=2)
    text = m.render(GAUGES, COUNTERS, {"queue_full": 1})
    assert "api_server" not in text and "metrics_peers_missing" not in text
    again = m.render_states(GAUGES, COUNTERS, [m.state(GAUGES, COUNTERS, {"queue_full": 1})])

    def steady(t: str) -> list[str]:  # process_ values (CPU seconds, memory) move between two reads
        return [line for line in t.splitlines() if not line.startswith("process_")]

    assert steady(text) == steady(again)
    assert 'vllm:num_requests_running{model_name="tiny"} 3\n' in text
    assert 'vllm:time_to_first_token_seconds_count{model_name="tiny"} 1\n' in text
    assert re.search(r"^process_open_fds \d+$", text, re.MULTILINE)


def test_merge_sums_vllm_takes_engine_values_once_and_labels_trioserve_per_server() -> None:
    a = server(0, tokens=5, ttft=[0.003, 0.2], in_flight=2)
    b = server(1, tokens=7, ttft=[0.003], in_flight=9)
    own = state_of(a, 0, in_flight=2, hits=10, running=3, engine_age=0.4)
    peer = decode_state(encode_state(state_of(b, 1, in_flight=9, hits=12, running=4, engine_age=0.1)))
    assert peer is not None
    text = a.render_states(GAUGES, COUNTERS, [own, peer], {0: True, 1: True})

    assert value(text, "vllm:generation_tokens_total") == 12
    assert value(text, "vllm:request_success_total", 'finished_reason="length"') == 3
    assert value(text, "vllm:time_to_first_token_seconds_count") == 3
    assert value(text, "vllm:time_to_first_token_seconds_bucket", 'le="0.005"') == 2  # bucket-wise
    assert value(text, "vllm:time_to_first_token_seconds_bucket", 'le="+Inf"') == 3
    assert math.isclose(value(text, "vllm:time_to_first_token_seconds_sum"), 0.206)
    # The engines' own values: the freshest view's gauges (the peer's, 0.1 s old), the largest count.
    assert value(text, "vllm:num_requests_running") == 4
    assert value(text, "vllm:prefix_cache_hits_total") == 12
    # trioserve: one line per API server.
    assert value(text, "trioserve:requests_in_flight", 'api_server="0"') == 2
    assert value(text, "trioserve:requests_in_flight", 'api_server="1"') == 9
    assert value(text, "trioserve:stream_events_total", 'api_server="1"') == 2
    assert value(text, "trioserve:rejected_requests_total", 'api_server="1",reason="queue_full"') == 2
    assert value(text, "trioserve:event_loop_lag_seconds_count", 'api_server="0"') == 1
    assert len(re.findall(r'^process_open_fds\{api_server="\d"\} \d+$', text, re.MULTILINE)) == 2
    assert value(text, "trioserve:metrics_peers_missing") == 0
    assert value(text, "trioserve:metrics_peer_up", 'api_server="1"') == 1
    assert text.count("# TYPE trioserve:requests_in_flight gauge") == 1  # one family, two lines


def test_a_state_from_its_file_counts_but_its_stale_gauges_do_not() -> None:
    a = server(0, tokens=5, ttft=[0.01], in_flight=2)
    b = server(1, tokens=7, ttft=[0.01], in_flight=9)
    own = state_of(a, 0, in_flight=2, hits=10, running=3, engine_age=0.4)
    stale = msgspec.structs.replace(
        state_of(b, 1, in_flight=9, hits=12, running=50, engine_age=0.0), live=False
    )
    text = a.render_states(GAUGES, COUNTERS, [own, stale], {0: True, 1: False})
    assert value(text, "vllm:generation_tokens_total") == 12
    assert value(text, "trioserve:renderer_jobs_total", 'api_server="1"') == 4
    assert value(text, "vllm:num_requests_running") == 3  # not the stale view's 50
    assert 'trioserve:requests_in_flight{model_name="tiny",api_server="1"}' not in text
    assert 'process_open_fds{api_server="1"}' not in text
    assert value(text, "trioserve:metrics_peers_missing") == 1
    assert value(text, "trioserve:metrics_peer_up", 'api_server="1"') == 0


def test_a_restarted_server_continues_its_predecessors_counts(tmp_path: Path) -> None:
    old = server(1, tokens=7, ttft=[0.01, 0.02], in_flight=9)
    path = state_path(str(tmp_path), 1)
    write_state(path, state_of(old, 1, in_flight=9, hits=12, running=4, engine_age=0.1))
    saved = read_state(path)
    assert saved is not None and not saved.live

    new = server(1, tokens=1, ttft=[0.01], in_flight=0)
    new.restore(saved)
    state = state_of(new, 1, in_flight=0, hits=13, running=4, engine_age=0.1)
    assert state.counters["vllm:generation_tokens_total"] == 8
    assert state.counters["trioserve:renderer_jobs_total"] == 8  # 4 before the restart, 4 since
    ttft = state.histograms["ttft"]
    assert ttft.counts[2] == 2 and sum(ttft.counts) == 3  # le=0.01: one before, one since
    assert state.finished == {"length": 4} and state.rejected == {"queue_full": 4}
    # Counted by the engines, which did not restart: heard again, not added twice.
    assert state.counters["vllm:prefix_cache_hits_total"] == 13
    assert state.counters["trioserve:engine_folded_steps_total"] == 1
    assert state.gauges["trioserve:requests_in_flight"] == 0  # gauges are the new process's


def test_state_round_trip_keeps_ints_and_refuses_garbage(tmp_path: Path) -> None:
    m = server(0, tokens=5, ttft=[0.01], in_flight=2)
    state = m.state({"trioserve:x": ("x", True), "trioserve:y": ("y", 0.25)}, {}, {})
    back = decode_state(encode_state(state))
    assert back == state
    assert back is not None and type(back.gauges["trioserve:x"]) is int  # a bool is sent as 1
    assert decode_state(b"\x93garbage") is None
    (tmp_path / "bad.state").write_bytes(b"not msgpack")
    assert read_state(str(tmp_path / "bad.state")) is None
    assert read_state(str(tmp_path / "missing.state")) is None
