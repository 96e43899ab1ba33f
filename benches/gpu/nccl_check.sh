#!/usr/bin/env bash
# Exercises stoke-comm's `nccl` backend on a GPU machine: every operation, every element type, odd
# sizes and sub-groups (the same `check` as the shm and MPI tests), one process per GPU.
#
#   cargo build --release -p stoke-comm --features nccl --bin stoke-comm-worker   # on any machine
#   benches/gpu/nccl_check.sh [path/to/stoke-comm-worker]                        # on the GPU machine
#
# NCCL allows one rank per GPU in a communicator, so the world size is the GPU count (a 1-GPU
# machine checks world size 1: initialization, every kernel, host staging, the stream timeout
# path). libnccl.so.2 is looked for on the library path and in Python's nvidia-nccl wheels; the
# backend loads it as libnccl.so, so a symlink folder is put on LD_LIBRARY_PATH when needed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
WORKER="${1:-$ROOT/target/release/stoke-comm-worker}"
[ -x "$WORKER" ] || { echo "no worker binary at $WORKER" >&2; exit 2; }

GPUS="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
echo "GPUs: ${GPUS:-0}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || true

LINKS="$(mktemp -d)"
trap 'rm -rf "$LINKS"' EXIT
NCCL=""
for candidate in $(ldconfig -p 2>/dev/null | awk '/libnccl\.so/ {print $NF}') \
    $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, "nccl/lib/libnccl.so.2") for p in nvidia.__path__))' 2>/dev/null) \
    /usr/lib/x86_64-linux-gnu/libnccl.so.2 /usr/local/lib/libnccl.so.2; do
    if [ -f "$candidate" ]; then NCCL="$candidate"; break; fi
done
if [ -n "$NCCL" ]; then
    ln -s "$NCCL" "$LINKS/libnccl.so"
    export LD_LIBRARY_PATH="$LINKS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "NCCL: $NCCL"
else
    echo "NCCL: not found; the backend must say so"
fi

N="${GPUS:-0}"
[ "$N" -ge 1 ] || N=1
PORT=$((20000 + RANDOM % 20000))
pids=()
for rank in $(seq 0 $((N - 1))); do
    RANK=$rank WORLD_SIZE=$N LOCAL_RANK=$rank LOCAL_WORLD_SIZE=$N MASTER_ADDR=127.0.0.1 MASTER_PORT=$PORT \
        "$WORKER" check --backend nccl --timeout 120 &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
echo "nccl check exit: $status"
exit $status
