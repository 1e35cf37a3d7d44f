#!/usr/bin/env bash
# Multi-process (and multi-node) launch with torch's own launcher: every rank runs `lifecycle run`, sees
# RANK/WORLD_SIZE and runs as that one rank. The run id (TORCHELASTIC_RUN_ID) is identical on every rank, so
# all ranks share one run directory. Extra arguments are Hydra overrides.
#   examples/torchrun.sh 4 preset=moe train.steps=50
set -euo pipefail
NPROC=${1:-4}; shift || true
exec torchrun --standalone --nproc-per-node "$NPROC" -m lifecycle run "$@"
