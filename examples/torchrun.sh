#!/usr/bin/env bash
# Launch with torch's own launcher: every rank runs `lifecycle run`, sees RANK/WORLD_SIZE and runs as that one
# rank. The rendezvous id (--rdzv-id, TORCHELASTIC_RUN_ID on every rank) is the run id: it names the run
# directory, so running the same command again continues the run (attempt 2 resumes from the last checkpoint).
# Extra arguments are Hydra overrides.
#   examples/torchrun.sh 4 preset=moe train.steps=50
#   RUN_ID=exp7 examples/torchrun.sh 4 train.steps=50        # again after a crash: "attempt 2: resumed ..."
#   MAX_RESTARTS=3 examples/torchrun.sh 4 train.steps=50     # torchrun restarts failed ranks: each restart is the
#                                                            # next attempt, which resumes (restart.max_no_progress)
# Multi-node: run the same line on every node with NNODES=2 and RDZV_ENDPOINT=<node 0 address>:29400, and
# GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME set to the interface the nodes reach each other on.
set -euo pipefail
NPROC=${1:-4}; shift || true
RUN_ID=${RUN_ID:-lifecycle-local}
ENDPOINT=${RDZV_ENDPOINT:-localhost:${RDZV_PORT:-29400}}
exec torchrun --nnodes "${NNODES:-1}" --nproc-per-node "$NPROC" --rdzv-backend c10d \
  --rdzv-endpoint "$ENDPOINT" --rdzv-id "$RUN_ID" --max-restarts "${MAX_RESTARTS:-0}" -m lifecycle run "$@"
