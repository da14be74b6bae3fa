#!/usr/bin/env bash
# hplan launch script for node box-b (host 10.0.0.2), node rank 1 of 2.
# Generated from plan.json by `hplan solve`; do not edit: re-run `hplan solve` instead.
# Ranks on this node (3 of 5):
#   rank 2 (local 0): box-b/0 rtx3090, replica 1 stage 0, units tok_emb, blocks.0-blocks.4
#   rank 3 (local 1): box-b/1 rtx3090, replica 1 stage 1, units blocks.5-blocks.9
#   rank 4 (local 2): box-b/2 rtx3060, replica 1 stage 2, units blocks.10-blocks.11, lm_head
# The model file is examples/gpt/model.py as recorded by `hplan solve` (a relative path is
# relative to the directory of plan.json); pass --model PATH to override it.
# Training length: 3 epochs of the model file's dataset(), from `hplan solve --epochs`
# (--steps N overrides).
# Extra arguments are passed on to `python -m hplan.runtime run` (for example --steps N,
# --metrics-dir DIR, --checkpoint-dir DIR --resume); `hplan run --help` lists them.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
PLAN="$HERE"/../plan.json
# The runtime finds this node's ranks by HPLAN_NODE and torchrun's LOCAL_RANK (an option
# such as --node would be taken by torchrun as an abbreviation of its own --node-rank).
export HPLAN_NODE=box-b

# Number GPUs in PCI bus order, as the plan does (device local_index).
export CUDA_DEVICE_ORDER=PCI_BUS_ID
# torch threads: each rank takes this node's usable CPUs (its CPU affinity, capped by its
# cgroup CPU quota) divided by its 3 ranks, unless you set OMP_NUM_THREADS. torchrun
# sets OMP_NUM_THREADS=1 itself for several ranks per node, so HPLAN_AUTO_THREADS tells the
# ranks that the value below is this script's, not yours.
if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
  export OMP_NUM_THREADS=1 HPLAN_AUTO_THREADS=1
fi
# Network: the ranks talk over the interface that holds 10.0.0.2 on this machine, through
# GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME (set the variable yourself to override).
# Backend from plan.json: nccl.
# GeForce cards on this node (rtx3060, rtx3090): PCIe peer-to-peer
# between GeForce cards is unsupported or unreliable and can hang NCCL or corrupt its
# transfers, so NCCL P2P is disabled. Set NCCL_P2P_DISABLE=0 before running to override.
export NCCL_P2P_DISABLE="${NCCL_P2P_DISABLE:-1}"

if ! command -v torchrun >/dev/null 2>&1; then
  echo "hplan: 'torchrun' is not on PATH; activate the environment hplan and torch are installed in (for example: source .venv/bin/activate)" >&2
  exit 4
fi
# Check the options, the plan and this machine before torchrun starts, so that a mistake
# (no training length, a missing model file, an interface this machine lacks) is one line
# and exit code 2 rather than a traceback from every rank. The Python next to torchrun is
# the environment's; a Python that cannot run the check (exit 1) leaves it to the ranks.
# Where it passes, torchrun runs inside hplan's wrapper (the same torchrun, in that Python),
# which reports each failed rank in one line: a rank the kernel killed (SIGKILL, most
# likely out of memory) with its device, its predicted and its last measured memory.
PYTHON="$(dirname "$(command -v torchrun)")/python"
[ -x "$PYTHON" ] || PYTHON="$(command -v python3 || command -v python || true)"
TORCHRUN=(torchrun)
if [ -n "$PYTHON" ]; then
  status=0
  "$PYTHON" -m hplan.runtime check "$PLAN" "$@" || status=$?
  if [ "$status" -ge 2 ]; then exit "$status"; fi
  if [ "$status" -eq 0 ]; then TORCHRUN=("$PYTHON" -m hplan.runtime torchrun); fi
fi
exec "${TORCHRUN[@]}" \
  --nnodes 2 \
  --node-rank 1 \
  --nproc-per-node 3 \
  --master-addr 10.0.0.1 \
  --master-port 29500 \
  -m hplan.runtime run "$PLAN" \
  "$@"
