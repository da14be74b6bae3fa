#!/usr/bin/env bash
# Rehearse this plan on this machine: `hplan rehearse` runs each of its 3 ranks as a local CPU
# process (gloo) and emulates the speed, memory and links of the devices of the plan.
# Generated from plan.json by `hplan solve`; do not edit: re-run `hplan solve` instead.
# Extra arguments are passed on to `hplan rehearse` (for example --steps 20 --verify).
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
if ! command -v hplan >/dev/null 2>&1; then
  echo "hplan: 'hplan' is not on PATH; activate the environment hplan is installed in (for example: source .venv/bin/activate)" >&2
  exit 4
fi
exec hplan rehearse "$HERE"/../plan.json "$@"
