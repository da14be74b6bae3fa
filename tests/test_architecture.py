"""The shape of the code: layers, no import circles, folders a reader can take in.

The layering is declared once, as import-linter contracts in pyproject.toml
(``[tool.importlinter]``): the runtime's packages bandwidth > rehearsal > executor > capture
> contract; the contract imports neither torch nor the rest of hplan; the runtime never
imports the planner; the planner's packages in the order of their passes; and the planner
reaches the executor only through the ``hplan run`` command. These tests run those
contracts and check what import-linter does not: module-level import circles, folder
sizes, the executor not reading the plan's report, no public name defined twice, the
packaging, and the import-time promises of the CLI and the runtime.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp
import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
MAX_MODULES_PER_FOLDER = 15
NAMES_DEFINED_PER_MODULE = frozenset({"main"})
"""Public top-level names every module may define: a module's entry point."""
REQUIRED_CONTRACTS = (
    "runtime: bandwidth > rehearsal > executor > capture > contract",
    "the runtime never imports the planner (plan.json is the contract)",
    "the contract imports no torch (a plan can be read and shown anywhere)",
    "the planner reaches the executor only through the `hplan run` command",
)


def test_the_declared_layering_is_kept() -> None:
    names = [c["name"] for c in PYPROJECT["tool"]["importlinter"]["contracts"]]
    assert all(required in names for required in REQUIRED_CONTRACTS), names
    assert any(name.startswith("planner: cli > ") for name in names)
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run(
        [str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert f"Contracts: {len(names)} kept, 0 broken." in done.stdout


def _graph() -> nx.DiGraph:
    imports = grimp.build_graph("hplan", exclude_type_checking_imports=True, cache_dir=None)
    graph: nx.DiGraph = nx.DiGraph()
    for module in imports.modules:
        graph.add_node(module)
        for imported in imports.find_modules_directly_imported_by(module):
            graph.add_edge(module, imported)
    return graph


def test_no_module_imports_itself_through_others() -> None:
    graph = _graph()
    assert len(graph) > 100  # the walk really saw hplan (through the hplan/ links)
    assert list(nx.simple_cycles(graph)) == []


def test_no_folder_of_planner_or_runtime_holds_more_than_fifteen_modules() -> None:
    sizes = {}
    for package in ("planner", "runtime"):
        for folder in [ROOT / package, *sorted((ROOT / package).glob("*/"))]:
            modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
            if modules:
                sizes[str(folder.relative_to(ROOT))] = len(modules)
    assert sizes and max(sizes.values()) <= MAX_MODULES_PER_FOLDER, sizes


def test_the_executor_never_reads_the_plans_report() -> None:
    readers = {}
    for path in sorted((ROOT / "runtime" / "executor").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        lines = [
            n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "report"
        ]
        if lines:
            readers[path.name] = lines
    assert readers == {}


def _defined_names(statements: list[ast.stmt]) -> set[str]:
    """Names bound at the top level of a module (in its top-level ``if``/``try`` too)."""
    names: set[str] = set()
    for node in statements:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.If | ast.Try):
            nested = [*node.body, *node.orelse, *getattr(node, "finalbody", [])]
            nested += [s for h in getattr(node, "handlers", []) for s in h.body]
            names |= _defined_names(nested)
    return names


def test_no_public_name_is_defined_in_two_modules() -> None:
    # One fact, one home: a name defined twice either says the same thing twice (import
    # it instead) or means two things (rename one to say what it is).
    homes: dict[str, list[str]] = {}
    for package in ("planner", "runtime"):
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for name in _defined_names(tree.body):
                if not name.startswith("_") and name not in NAMES_DEFINED_PER_MODULE:
                    homes.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert len(homes) > 500  # the walk really saw the code
    twice = {name: paths for name, paths in sorted(homes.items()) if len(paths) > 1}
    assert twice == {}, "public names defined in more than one module: " + "; ".join(
        f"{name} ({', '.join(paths)})" for name, paths in twice.items()
    )


def test_every_package_folder_is_packaged_and_linked_for_static_tools() -> None:
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    found = {"hplan.templates"}
    for package in ("planner", "runtime"):
        for init in (ROOT / package).rglob("__init__.py"):
            found.add("hplan." + ".".join(init.parent.relative_to(ROOT).parts))
    assert listed == found
    for name in ("planner", "runtime", "templates"):
        link = ROOT / "hplan" / name
        assert link.is_symlink() and link.resolve() == (ROOT / name).resolve()


def test_running_a_rank_loads_no_planner_module_and_no_nvml() -> None:
    # A CUDA build of torch imports `pynvml` itself when nvidia-ml-py is installed (seen on
    # an H200 machine), without initialising NVML: count only what hplan adds, and check
    # that NVML's library was never loaded (nvidia-ml-py sets `nvmlLib` in nvmlInit).
    code = (
        "import sys, torch\n"
        "before = set(sys.modules)\n"
        "import hplan.runtime.__main__, hplan.runtime.rehearsal.__main__\n"
        "import hplan.runtime.rehearsal.rehearse, hplan.runtime.executor.worker\n"
        "added = set(sys.modules) - before\n"
        "bad = sorted(m for m in added if m.startswith('hplan.planner') or 'nvml' in m)\n"
        "nvml = sys.modules.get('pynvml')\n"
        "print(bad, getattr(nvml, 'nvmlLib', None) is not None)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] False"


def test_importing_the_cli_does_not_initialise_nvml_or_torch() -> None:
    code = "import sys, hplan.planner.cli.main\nprint(sorted(m for m in sys.modules if 'nvml' in m or m == 'torch'))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_reading_a_plan_needs_no_torch() -> None:
    code = (
        "import sys\n"
        "from hplan.runtime.contract.plan import Plan\n"
        "import hplan.runtime.contract.holders, hplan.runtime.contract.schedule\n"
        "print('torch' in sys.modules)\n"
    )
    env = {**os.environ}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip() == "False"


def test_no_file_holds_merge_conflict_markers() -> None:
    """A conflict left in a docstring or a Markdown file passes every other check."""
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout.split()
    markers = ("<<<<<<< ", ">>>>>>> ")
    found = [
        f"{name}:{number}"
        for name in tracked
        if name.endswith((".py", ".md", ".toml", ".yaml", ".json", ".txt", ".j2", ".sh"))
        and (ROOT / name).is_file()
        for number, line in enumerate(
            (ROOT / name).read_text(encoding="utf-8", errors="replace").splitlines(), 1
        )
        if line.startswith(markers)
    ]
    assert not found, found
