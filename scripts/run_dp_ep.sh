#!/usr/bin/env bash
# Single-node DP+EP deployment: N data-parallel engine replicas behind one API server, with the experts of
# every MoE layer sharded across the replicas' workers (one expert-parallel group).
#
#   MODEL=/path/to/moe-checkpoint DP=2 PORT=8000 scripts/run_dp_ep.sh [extra launch.py flags...]
#
# Environment (all optional):
#   MODEL                 model directory or .gguf (default: launch.py's default model; EP needs a MoE model)
#   DP                    data-parallel size (default 2)
#   PORT, HOST            HTTP address (default 8000, 127.0.0.1)
#   EP                    1 (default) adds --enable-expert-parallel; 0 runs plain data parallelism
#   TP                    tensor-parallel workers per DP rank (default 1); TP > 1 needs a dense model and EP=0,
#                         e.g. MODEL=dense-checkpoint DP=2 TP=2 EP=0 (4 workers, the node's cores split between them)
#   FD_USE_KVCACHE_LOCK   passed through unchanged to every process (0 or 1)
#   STORAGE_DIR           if set, enables the file KV-cache storage tier in this directory
#
# Multi-node: run launch.py on each node with --nnodes, --node-rank and --master-addr/--master-port (see
# README, "Data and expert parallelism"); this script is the one-node shape of the same command. With TP, every
# DP rank's TP group stays on its node (the shared-memory all-reduce), so --tensor-parallel-size combines with
# --nnodes/--node-rank unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."

DP="${DP:-2}"
TP="${TP:-1}"
args=(--data-parallel-size "$DP" --tensor-parallel-size "$TP" --port "${PORT:-8000}" --host "${HOST:-127.0.0.1}")
[ -n "${MODEL:-}" ] && args+=(--model "$MODEL")
[ "${EP:-1}" = "1" ] && args+=(--enable-expert-parallel)
[ -n "${STORAGE_DIR:-}" ] && args+=(--kvcache-storage-backend file --file-backend-storage-dir "$STORAGE_DIR")

echo "launch.py ${args[*]} $* (FD_USE_KVCACHE_LOCK=${FD_USE_KVCACHE_LOCK:-0})" >&2
exec python launch.py "${args[@]}" "$@"
