#!/usr/bin/env bash
# Start a Mooncake master (the metadata service of the Mooncake KV-cache store) on 127.0.0.1.
#
# Usage:
#   scripts/start_mooncake_master.sh [RPC_PORT]
#
#   RPC_PORT                     from $1, else $MOONCAKE_MASTER_PORT, else 50051
#   MOONCAKE_MASTER_METRICS_PORT its HTTP metrics/admin port (default RPC_PORT + 1; the binary's
#                                own default, 9003, would collide between two masters)
#   MOONCAKE_MASTER_LOG          log file (default /tmp/mooncake_master_<RPC_PORT>.log)
#   MOONCAKE_MASTER_BIN          the mooncake_master binary (default: the one shipped inside the
#                                installed mooncake Python package, then $PATH)
#
# The master runs detached in its own session. The script waits (at most 10 s) until the RPC
# port accepts connections, then prints the master's pid on stdout and exits 0; on failure it
# prints the log tail and exits 1. Stop it with: kill <pid>
#
# Point fdserve at it with:
#   MOONCAKE_MASTER_SERVER_ADDR=127.0.0.1:<RPC_PORT> python launch.py --kvcache-storage-backend mooncake
# Install the binary first with: bash .ci/install_system_deps.sh
set -euo pipefail

RPC_PORT="${1:-${MOONCAKE_MASTER_PORT:-50051}}"
METRICS_PORT="${MOONCAKE_MASTER_METRICS_PORT:-$((RPC_PORT + 1))}"
LOG_FILE="${MOONCAKE_MASTER_LOG:-/tmp/mooncake_master_${RPC_PORT}.log}"

find_master_binary() {
    if [ -n "${MOONCAKE_MASTER_BIN:-}" ]; then
        echo "$MOONCAKE_MASTER_BIN"
        return
    fi
    local packaged
    packaged="$(python - <<'EOF' 2>/dev/null || true
import importlib.util, os
spec = importlib.util.find_spec("mooncake")
if spec and spec.submodule_search_locations:
    print(os.path.join(list(spec.submodule_search_locations)[0], "mooncake_master"))
EOF
)"
    if [ -n "$packaged" ] && [ -x "$packaged" ]; then
        echo "$packaged"
        return
    fi
    command -v mooncake_master || true
}

MASTER_BIN="$(find_master_binary)"
if [ -z "$MASTER_BIN" ] || [ ! -x "$MASTER_BIN" ]; then
    echo "start_mooncake_master: mooncake_master not found; run: bash .ci/install_system_deps.sh" >&2
    exit 1
fi

setsid "$MASTER_BIN" \
    -rpc_address=127.0.0.1 \
    -rpc_port="$RPC_PORT" \
    -metrics_host=127.0.0.1 \
    -metrics_port="$METRICS_PORT" \
    -enable_metric_reporting=false \
    -rpc_thread_num=2 \
    </dev/null >"$LOG_FILE" 2>&1 &
MASTER_PID=$!

for _ in $(seq 1 100); do
    if ! kill -0 "$MASTER_PID" 2>/dev/null; then
        echo "start_mooncake_master: the master exited during start-up; log $LOG_FILE:" >&2
        tail -n 20 "$LOG_FILE" >&2
        exit 1
    fi
    if (exec 3<>"/dev/tcp/127.0.0.1/$RPC_PORT") 2>/dev/null; then
        echo "$MASTER_PID"
        exit 0
    fi
    sleep 0.1
done

echo "start_mooncake_master: port $RPC_PORT not accepting after 10 s; stopping pid $MASTER_PID; log $LOG_FILE:" >&2
kill "$MASTER_PID" 2>/dev/null || true
tail -n 20 "$LOG_FILE" >&2
exit 1
