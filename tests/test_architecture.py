"""Project-wide rules: the runtime never needs the planner; importing hplan is side-effect free."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_runtime_source_never_imports_the_planner():
    offenders = {
        str(path.relative_to(ROOT)): sorted(
            n for n in _imported_modules(path) if "planner" in n.split(".")
        )
        for path in sorted((ROOT / "runtime").rglob("*.py"))
    }
    assert {k: v for k, v in offenders.items() if v} == {}
    assert len(offenders) >= 5  # the walk really saw the runtime package


def test_running_a_rank_loads_no_planner_module_and_no_nvml():
    # A CUDA build of torch imports `pynvml` itself when nvidia-ml-py is installed (seen on
    # an H200 machine), without initialising NVML: count only what hplan adds, and check
    # that NVML's library was never loaded (nvidia-ml-py sets `nvmlLib` in nvmlInit).
    code = (
        "import sys, torch\n"
        "before = set(sys.modules)\n"
        "import hplan.runtime.__main__, hplan.runtime.rehearsal.rehearse, hplan.runtime.executor.worker\n"
        "added = set(sys.modules) - before\n"
        "bad = sorted(m for m in added if m.startswith('hplan.planner') or 'nvml' in m)\n"
        "nvml = sys.modules.get('pynvml')\n"
        "print(bad, getattr(nvml, 'nvmlLib', None) is not None)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] False"


def test_importing_the_cli_does_not_initialise_nvml_or_torch():
    code = "import sys, hplan.planner.cli.main\nprint(sorted(m for m in sys.modules if 'nvml' in m or m == 'torch'))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
