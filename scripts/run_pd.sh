#!/usr/bin/env bash
# Single-node prefill/decode (P/D) disaggregation: one prefill instance, one decode instance and the router in
# front of them, all on 127.0.0.1, in the foreground. The OpenAI API is served on ROUTER_PORT.
#
#   MODEL=/path/to/model scripts/run_pd.sh [ROUTER_PORT] [extra launch.py flags for both instances...]
#
# Environment (all optional):
#   MODEL                 model directory or .gguf (default: launch.py's default model)
#   PREFILL_PORT          the prefill instance's HTTP port (default ROUTER_PORT + 1)
#   DECODE_PORT           the decode instance's HTTP port (default ROUTER_PORT + 2)
#   ROUTER_ARGS           more flags for python -m router (e.g. "--health-interval 1")
#   LOG_DIR               where prefill.log, decode.log and router.log go (default /tmp/fdserve-run-pd-<PORT>)
#   START_TIMEOUT         seconds the instances may take to become healthy (default 300)
#   STOP_TIMEOUT          seconds each process gets to stop after SIGTERM before SIGKILL (default 30)
#   FD_USE_KVCACHE_LOCK   passed through unchanged to every process (0 or 1)
#
# It prints "ready: ..." once GET /health on ROUTER_PORT answers 200. SIGINT (Ctrl-C) or SIGTERM stops the
# router, then both instances (SIGTERM: they drain and remove their shared memory), SIGKILLs what has not
# exited after STOP_TIMEOUT and removes any /dev/shm name the instances left. Exit code 0 after a clean stop,
# 1 if a process died on its own, did not start, or had to be killed, 2 for a busy port or a bad argument.
# No Mooncake master is needed: the KV transfer engine runs peer to peer (P2PHANDSHAKE metadata).
#
# Multi-node: run the instances yourself, each reachable by the others: on the prefill node
#   python launch.py --splitwise-role prefill --host 0.0.0.0 --port 8001 --pd-host <prefill node IP>
# on the decode node
#   python launch.py --splitwise-role decode --host 0.0.0.0 --port 8002 --pd-host <decode node IP>
# and the router anywhere: python -m router --prefill http://<prefill IP>:8001 --decode http://<decode IP>:8002
# (several --prefill/--decode/--mixed URLs are allowed). See the README, "Scale out".
set -euo pipefail
cd "$(dirname "$0")/.."

ROUTER_PORT=8000
if [ $# -gt 0 ] && [[ "$1" =~ ^[0-9]+$ ]]; then
    ROUTER_PORT="$1"
    shift
fi
PREFILL_PORT="${PREFILL_PORT:-$((ROUTER_PORT + 1))}"
DECODE_PORT="${DECODE_PORT:-$((ROUTER_PORT + 2))}"
LOG_DIR="${LOG_DIR:-/tmp/fdserve-run-pd-${ROUTER_PORT}}"
START_TIMEOUT="${START_TIMEOUT:-300}"
STOP_TIMEOUT="${STOP_TIMEOUT:-30}"
# Instance ids name the shared memory of each instance (fd.<id>.*); fixed here so a stop can check it is gone.
PREFILL_ID="pdp${PREFILL_PORT}"
DECODE_ID="pdd${DECODE_PORT}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

port_free() {
    python - "$1" <<'EOF'
import socket, sys
with socket.socket() as sock:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1", int(sys.argv[1])))
    except OSError:
        sys.exit(1)
EOF
}

for port in "$ROUTER_PORT" "$PREFILL_PORT" "$DECODE_PORT"; do
    if ! [[ "$port" =~ ^[0-9]+$ ]] || [ "$port" -lt 1 ] || [ "$port" -gt 65535 ]; then
        echo "run_pd: error: port $port is not in 1..65535" >&2
        exit 2
    fi
    if ! port_free "$port"; then
        echo "run_pd: error: port $port on 127.0.0.1 is in use" >&2
        exit 2
    fi
done
mkdir -p "$LOG_DIR"

model_args=()
[ -n "${MODEL:-}" ] && model_args=(--model "$MODEL")
declare -A PIDS=()  # name -> pid; each process leads its own group (setsid), so a SIGKILL reaches its children
FAILED=0
STOPPING=0

start() {  # start NAME INSTANCE_ID COMMAND...: in the background, its own session, output to LOG_DIR/NAME.log
    local name="$1" instance_id="$2"
    shift 2
    FD_INSTANCE_ID="$instance_id" setsid "$@" >"$LOG_DIR/$name.log" 2>&1 </dev/null &
    PIDS[$name]=$!
    echo "run_pd: started $name (pid ${PIDS[$name]}, log $LOG_DIR/$name.log)" >&2
}

alive() { kill -0 "$1" 2>/dev/null; }

stop() {  # stop NAME...: SIGTERM to each, then SIGKILL of the groups still there after STOP_TIMEOUT
    local name pid waited=0 pids=()
    for name in "$@"; do
        pid="${PIDS[$name]:-}"
        [ -n "$pid" ] || continue
        pids+=("$pid")
        kill -TERM "$pid" 2>/dev/null || true
    done
    while [ "$waited" -lt $((STOP_TIMEOUT * 10)) ]; do
        local running=0
        for pid in "${pids[@]}"; do alive "$pid" && running=1; done
        [ "$running" = 0 ] && break
        sleep 0.1
        waited=$((waited + 1))
    done
    for name in "$@"; do
        pid="${PIDS[$name]:-}"
        [ -n "$pid" ] || continue
        if alive "$pid"; then
            echo "run_pd: $name did not stop within ${STOP_TIMEOUT} s; killing it" >&2
            FAILED=1
        fi
        kill -KILL -- "-$pid" 2>/dev/null || true  # whatever is left of its group (normally nothing)
        wait "$pid" 2>/dev/null || true
        unset "PIDS[$name]"
    done
}

sweep() {  # sweep INSTANCE_ID: remove the /dev/shm names an instance left (it removes its own on a clean stop)
    local left
    left="$(ls /dev/shm 2>/dev/null | grep -E "^(sem\.)?fd\.$1\." || true)"
    if [ -n "$left" ]; then
        echo "run_pd: removing shared memory left by $1: $(echo $left)" >&2
        python -c "import sys; from inter_communicator.shm import sweep_stale; sweep_stale(sys.argv[1])" "$1"
        FAILED=1
    fi
}

cleanup() {
    [ "$STOPPING" = 1 ] && return
    STOPPING=1
    trap '' INT TERM  # a second Ctrl-C must not cut the clean-up short
    echo "run_pd: stopping" >&2
    stop router  # first: no new request reaches an instance that is stopping
    stop prefill decode
    sweep "$PREFILL_ID"
    sweep "$DECODE_ID"
}

on_signal() {
    cleanup
    echo "run_pd: stopped" >&2
    exit "$FAILED"
}
trap on_signal INT TERM
trap cleanup EXIT

start prefill "$PREFILL_ID" python launch.py --splitwise-role prefill --host 127.0.0.1 --port "$PREFILL_PORT" \
    "${model_args[@]}" "$@"
start decode "$DECODE_ID" python launch.py --splitwise-role decode --host 127.0.0.1 --port "$DECODE_PORT" \
    "${model_args[@]}" "$@"

healthy() { python -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" \
    "http://127.0.0.1:$1/health" >/dev/null 2>&1; }

wait_healthy() {  # wait_healthy NAME PORT
    local deadline=$((SECONDS + START_TIMEOUT))
    until healthy "$2"; do
        if ! alive "${PIDS[$1]}"; then
            echo "run_pd: $1 exited during start-up; last lines of $LOG_DIR/$1.log:" >&2
            tail -n 20 "$LOG_DIR/$1.log" >&2
            FAILED=1
            exit 1
        fi
        if [ "$SECONDS" -ge "$deadline" ]; then
            echo "run_pd: $1 not healthy after ${START_TIMEOUT} s (log $LOG_DIR/$1.log)" >&2
            FAILED=1
            exit 1
        fi
        sleep 0.5
    done
}

wait_healthy prefill "$PREFILL_PORT"
wait_healthy decode "$DECODE_PORT"
# shellcheck disable=SC2086  # ROUTER_ARGS is a list of flags
start router "" python -m router --host 127.0.0.1 --port "$ROUTER_PORT" \
    --prefill "http://127.0.0.1:$PREFILL_PORT" --decode "http://127.0.0.1:$DECODE_PORT" ${ROUTER_ARGS:-}
wait_healthy router "$ROUTER_PORT"
echo "run_pd: ready: OpenAI API on http://127.0.0.1:$ROUTER_PORT/v1 (prefill :$PREFILL_PORT, decode :$DECODE_PORT)"

# Foreground until a signal, or until one of the processes dies on its own.
while true; do
    for name in router prefill decode; do
        if ! alive "${PIDS[$name]}"; then
            echo "run_pd: $name exited on its own; stopping the rest (log $LOG_DIR/$name.log)" >&2
            FAILED=1
            cleanup
            exit 1
        fi
    done
    sleep 1 &
    wait $! || true  # a trapped signal interrupts this wait at once
done
