#!/usr/bin/env bash
# GPU check for issue 3: device discovery, microbenchmarks, the GPT example's per-unit
# profile, and the runtime's CUDA/NCCL paths (see bench/gpu_check.py). Prints what it
# measured; exits 0 with "no CUDA device: skipped" on a machine without one.
#
#   bash bench/gpu_check.sh [--out DIR] [--layers 12 --width 768 --heads 12 --seq 1024]
#
# Uses .venv/bin/python when present, else python3. When hplan is not installed, the
# checkout's hplan/ folder of links is put on the path (no install, no network); its
# dependencies (torch, click, rich, pydantic, pyyaml, jinja2, networkx, pulp, highspy,
# pydot, numpy) must be importable. nvidia-ml-py (`pip install 'hplan[nvml]'`) adds clocks,
# power limits, NVLink and peer access to the discovery.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY=python3; fi
fi
if ! "$PY" -c "import hplan.planner.hardware.discovery" 2>/dev/null; then
  # the checkout's hplan/ folder links planner/, runtime/ and templates/ under their names
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
missing="$("$PY" - <<'PYEOF'
import importlib.util
need = ["torch", "click", "rich", "pydantic", "yaml", "jinja2", "networkx", "pulp", "highspy", "pydot", "numpy"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
PYEOF
)"
if [[ -n "$missing" ]]; then
  echo "gpu_check: missing Python packages: $missing (pip install them, or pip install -e .)" >&2
  exit 4
fi
export PYTHONUNBUFFERED=1
exec "$PY" "$ROOT/bench/gpu_check.py" "$@"
