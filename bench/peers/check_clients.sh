#!/usr/bin/env bash
# Check that two real load generators, guidellm 0.8.1 and aiperf 0.13.0, run against trioserve's
# endpoint and report sane numbers (issue 6, item 6). Each is installed into its own virtual
# environment outside the repo (never the project's .venv); idempotent.
#
#   bash bench/peers/check_clients.sh [MODEL_DIR]
#
# MODEL_DIR: a Hugging Face folder whose tokenizer both the server and the clients use (default: the
# tiny SmolLM2-tokenizer Llama that bench/peers/tiny_model.py builds, made on first use under the
# cache folder). The server is `trioserve serve --engine mock` with that tokenizer (--tokenizer), the
# model name `tiny-smollm2` (--served-model-name), the folder's vocabulary (--vocab-size) and a 10 ms
# step clock (--step-interval-us), on 127.0.0.1, pinned to core 1; the clients run on core 0.
# Each client sends 200 streamed requests, 16 at a time, 128 prompt tokens, 64 output tokens
# (ignore_eos); the checks: no errors, 64 output tokens per request, inter-token latency within
# 0.8-1.5x the step, TTFT under a second. Every process started is stopped by PID.
#
# Environment: PEERS_DIR (default ${XDG_CACHE_HOME:-$HOME/.cache}/trioserve/peers), OUT_DIR (results;
# default a new temp folder), STEP_US (10000), CONCURRENCY (16), REQUESTS (200).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEERS_DIR="${PEERS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/trioserve/peers}"
MODEL_DIR="${1:-$PEERS_DIR/tiny-smollm2}"
OUT_DIR="${OUT_DIR:-$(mktemp -d -t check_clients.XXXXXX)}"
STEP_US="${STEP_US:-10000}"
CONCURRENCY="${CONCURRENCY:-16}"
REQUESTS="${REQUESTS:-200}"
PROMPT_TOKENS=128
OUTPUT_TOKENS=64
MODEL_NAME=tiny-smollm2
PY="$repo_root/.venv/bin/python"
GUIDELLM_VENV="$PEERS_DIR/guidellm-0.8.1"
AIPERF_VENV="$PEERS_DIR/aiperf-0.13.0"

say() { echo "[check_clients] $*" >&2; }

make_venv() { # VENV PIP-ARGS...
	local venv="$1"
	shift
	if [[ -x "$venv/bin/python" && -f "$venv/.installed" ]]; then
		return
	fi
	say "installing $* into $venv"
	python3 -m venv "$venv"
	"$venv/bin/pip" install -q -U pip
	"$venv/bin/pip" install -q "$@"
	touch "$venv/.installed"
}

# guidellm pulls a CUDA torch unless the CPU build is pinned in the same command.
make_venv "$GUIDELLM_VENV" guidellm==0.8.1 torch==2.13.0
make_venv "$AIPERF_VENV" aiperf==0.13.0

if [[ ! -f "$MODEL_DIR/tokenizer.json" ]]; then
	say "building $MODEL_DIR"
	# The tokenizer comes from the embedded SmolLM2 folder that trioserve converts itself (reading the
	# GGUF through transformers would need the gguf package, which the project does not install).
	smollm2="$("$PY" -c 'from trioserve.models.embedded_model import ensure_default_model; print(ensure_default_model())')"
	"$PY" "$repo_root/bench/peers/tiny_model.py" "$MODEL_DIR" --tokenizer-from "$smollm2"
fi
vocab="$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["vocab_size"])' "$MODEL_DIR/config.json")"
port="$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
mkdir -p "$OUT_DIR"

server_pid=""
stop_server() {
	if [[ -n "$server_pid" ]] && kill -0 "$server_pid" 2>/dev/null; then
		kill -TERM "$server_pid" 2>/dev/null || true
		for _ in $(seq 50); do
			kill -0 "$server_pid" 2>/dev/null || break
			sleep 0.1
		done
		kill -KILL "$server_pid" 2>/dev/null || true
	fi
}
trap stop_server EXIT
trap 'exit 130' INT TERM

say "trioserve (mock engine, ${STEP_US} us steps) on 127.0.0.1:$port, core 1; results in $OUT_DIR"
taskset -c 1 "$PY" -m trioserve serve --engine mock --host 127.0.0.1 --port "$port" \
	--tokenizer "$MODEL_DIR" --served-model-name "$MODEL_NAME" --vocab-size "$vocab" \
	--step-interval-us "$STEP_US" >"$OUT_DIR/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 120); do
	curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
	kill -0 "$server_pid" 2>/dev/null || {
		tail -20 "$OUT_DIR/server.log" >&2
		exit 1
	}
	sleep 0.5
done

# guidellm: chat. It sends content as a list of text parts, which trioserve joins into one string
# before the chat template (SmolLM2's concatenates content as a string).
say "guidellm run (/v1/chat/completions, concurrency $CONCURRENCY, $REQUESTS requests)"
mkdir -p "$OUT_DIR/guidellm"
HF_HUB_OFFLINE=1 taskset -c 0 "$GUIDELLM_VENV/bin/guidellm" run \
	--backend "kind=openai_http,target=http://127.0.0.1:$port,model=$MODEL_NAME,request_format=/v1/chat/completions" \
	--profile "kind=concurrent,streams=$CONCURRENCY" \
	--data "kind=synthetic_text,prompt_tokens=$PROMPT_TOKENS,output_tokens=$OUTPUT_TOKENS" \
	--constraint "kind=max_requests,count=$REQUESTS" \
	--tokenizer "kind=huggingface_auto,model=$MODEL_DIR" \
	--output "kind=json,path=$OUT_DIR/guidellm/benchmarks.json" \
	--disable-console-interactive >"$OUT_DIR/guidellm/run.log" 2>&1 || {
	tail -30 "$OUT_DIR/guidellm/run.log" >&2
	exit 1
}

# aiperf: chat, streaming. A local tokenizer path fails when HF_HUB_OFFLINE=1 is set, so unset it.
# --use-server-token-count: counting output tokens by re-tokenizing random-token text overcounts.
say "aiperf profile (chat, concurrency $CONCURRENCY, $REQUESTS requests)"
env -u HF_HUB_OFFLINE taskset -c 0 "$AIPERF_VENV/bin/aiperf" profile \
	--model "$MODEL_NAME" --url "http://127.0.0.1:$port" --endpoint-type chat --streaming \
	--tokenizer "$MODEL_DIR" --concurrency "$CONCURRENCY" --request-count "$REQUESTS" \
	--prompt-input-tokens-mean "$PROMPT_TOKENS" --prompt-input-tokens-stddev 0 \
	--prompt-output-tokens-mean "$OUTPUT_TOKENS" --prompt-output-tokens-stddev 0 \
	--extra-inputs ignore_eos:true --use-server-token-count --random-seed 0 --ui-type none \
	--output-artifact-dir "$OUT_DIR/aiperf" >"$OUT_DIR/aiperf.log" 2>&1 || {
	tail -30 "$OUT_DIR/aiperf.log" >&2
	exit 1
}

stop_server

"$PY" - "$OUT_DIR" "$STEP_US" "$OUTPUT_TOKENS" "$REQUESTS" "$CONCURRENCY" <<'EOF'
import json
import sys
from pathlib import Path

out, step_ms, osl, n, conc = Path(sys.argv[1]), int(sys.argv[2]) / 1000, int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
rows, bad = [], []

g = json.loads((out / "guidellm/benchmarks.json").read_text())["benchmarks"][0]["metrics"]
ok = g["request_totals"]
rows.append(("guidellm 0.8.1 (chat)", ok["successful"], ok["errored"] + ok["incomplete"],
             g["output_token_count"]["successful"]["mean"], g["output_tokens_per_second"]["successful"]["mean"],
             g["time_to_first_token_ms"]["successful"]["median"], g["inter_token_latency_ms"]["successful"]["median"],
             g["output_tokens_per_iteration"]["successful"]["mean"]))

a = json.loads((out / "aiperf/profile_export_aiperf.json").read_text())
errors = (a.get("error_request_count") or {}).get("avg", 0)
rows.append(("aiperf 0.13.0 (chat)", a["request_count"]["avg"], errors, a["output_sequence_length"]["avg"],
             a["output_token_throughput"]["avg"], a["time_to_first_token"]["p50"], a["inter_token_latency"]["p50"],
             float("nan")))

print(f"\nClient-reported, trioserve mock engine, {step_ms:g} ms steps, {conc} concurrent, {osl} output tokens:\n")
print("| client | requests ok | errors | output tokens/request | output tokens/s | TTFT p50 ms | ITL p50 ms | tokens/stream event |")
print("|---|---|---|---|---|---|---|---|")
for name, good, errs, tokens, tps, ttft, itl, tpi in rows:
    print(f"| {name} | {good:.0f} | {errs:.0f} | {tokens:.1f} | {tps:,.0f} | {ttft:.1f} | {itl:.2f} | "
          f"{'n/a' if tpi != tpi else f'{tpi:.2f}'} |")
    if good < n or errs:
        bad.append(f"{name}: {good:.0f}/{n} requests ok, {errs:.0f} errors")
    if abs(tokens - osl) > 0.5:
        bad.append(f"{name}: {tokens:.1f} output tokens per request, expected {osl}")
    if not 0.8 * step_ms <= itl <= 1.5 * step_ms:
        bad.append(f"{name}: ITL p50 {itl:.2f} ms, expected about {step_ms:g} ms")
    if not 0 < ttft < 1000:
        bad.append(f"{name}: TTFT p50 {ttft:.1f} ms")
    if not 0.5 * conc * osl / (osl * step_ms / 1000 + 0.2) <= tps <= 1.1 * conc * 1000 / step_ms:
        bad.append(f"{name}: {tps:,.0f} output tokens/s, expected up to {conc * 1000 / step_ms:,.0f}")
print()
print("\n".join(bad) if bad else "all sane: no errors, exact output lengths, ITL at the step clock")
sys.exit(1 if bad else 0)
EOF
