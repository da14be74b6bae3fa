"""Plans on slow links: how close `hplan solve` with its defaults gets to the bound (issue 38).

Every figure is predicted by hplan's cost model (no GPU runs here): each row is a real
``hplan solve --json`` in a child process, from one ``hplan capture`` of the model per run
(kept in a temporary folder). "Efficiency" is the plan's predicted samples/s over the
physical bound its own report gives (every device's standalone samples/s summed, no bubble
or sync); "devices" counts the cluster's devices the plan gives a stage.

Pools (written as cluster.yaml files):

- ``desktops``: two desktops over 1 GbE, an RTX 4090 + RTX 3090 and an RTX 3090 + RTX 3060
  12 GB;
- ``sites``: three sites over 100 Mbit/s, 2x RTX 4090, 2x RTX 3090 and an RTX 3060 + RTX
  2080 Ti (each site one node: its cards talk over PCIe).

Models (``bench/models/``): GPT-2 124M (``gpt2_124m.py``, global batch 512), Stable
Diffusion 1.5's UNet (``sd_unet.py``, 860M, batch 256; skipped when ``diffusers`` is
missing) and ViT-B/16 (``vit_b16.py``, batch 256): the batches at which the issue's "before"
figures were taken. Targets (issue 38, "Done when"): efficiency >= 0.95 with every device
used for GPT-2 on both pools, >= 0.90 for the UNet on the three sites; the ViT has none
(reported). Each case is solved under every ``--sync`` value of ``--sync`` (default
``auto``, the default of ``hplan solve``); ``--solve-args`` adds options to every solve
(``--solve-args='--wire bfloat16'`` for the old wire format).

    python bench/slow_link_plans.py [--cases gpt2-desktops,...] [--sync auto,local_sgd]
        [--time-limit S] [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common import HPLAN, ROOT, console, table, write_cluster

MODELS = ROOT / "bench" / "models"

POOLS = {
    "desktops": """\
name: desktops-1gbe
nodes:
  - {name: desk-a, host: 192.168.1.10, devices: [{type: rtx4090}, {type: rtx3090}]}
  - {name: desk-b, host: 192.168.1.11, devices: [{type: rtx3090}, {type: rtx3060}]}
links:
  inter_node: {bandwidth_gbit_per_s: 1, latency_us: 200}
""",
    "sites": """\
name: three-sites-100mbit
nodes:
  - {name: site-a, host: 10.1.0.1, devices: [{type: rtx4090, count: 2}]}
  - {name: site-b, host: 10.2.0.1, devices: [{type: rtx3090, count: 2}]}
  - {name: site-c, host: 10.3.0.1, devices: [{type: rtx3060}, {type: rtx2080ti}]}
links:
  inter_node: {bandwidth_gbit_per_s: 0.1, latency_us: 20000}
""",
}
"""The pools of issue 38, by name: cluster.yaml text."""


@dataclass(frozen=True)
class Model:
    name: str
    path: Path
    global_batch_size: int
    needs: str = ""
    """A module the model file imports that may be missing (the case is then skipped)."""


@dataclass(frozen=True)
class Case:
    """One (model, pool) and its target: efficiency at least ``target``, with every device
    used where ``all_devices``; no target (0) is reported only."""

    name: str
    model: Model
    pool: str
    target: float = 0.0
    all_devices: bool = True


GPT2 = Model("gpt2-124m", MODELS / "gpt2_124m.py", 512, "transformers")
SD_UNET = Model("sd15-unet", MODELS / "sd_unet.py", 256, "diffusers")
VIT = Model("vit-b16", MODELS / "vit_b16.py", 256, "transformers")

CASES = {
    c.name: c
    for c in (
        Case("gpt2-desktops", GPT2, "desktops", 0.95),
        Case("gpt2-sites", GPT2, "sites", 0.95),
        Case("unet-sites", SD_UNET, "sites", 0.90),
        Case("vit-sites", VIT, "sites"),
    )
}


@dataclass(frozen=True)
class GroupSync:
    """How one holder set spanning islands syncs (``plan.training.sync.groups``)."""

    ranks: tuple[int, ...]
    mode: str
    local_steps: int
    wire: str
    num_fragments: int = 1
    overlap_steps: int = 0
    exposed_s: float | None = None
    """Its outer sync per inner step left exposed (the report's ``sync_choices``)."""

    def text(self) -> str:
        words = [self.mode]
        if self.mode != "all_reduce":
            words.append(f"H={self.local_steps}")
            words.append(self.wire)
            if self.num_fragments > 1:
                words.append(f"F={self.num_fragments}")
            if self.overlap_steps:
                words.append(f"overlap {self.overlap_steps}")
        if self.exposed_s:
            words.append(f"exposed {self.exposed_s * 1e3:.0f} ms/step")
        return " ".join(words)


@dataclass(frozen=True)
class Row:
    case: str
    sync: str
    target: float
    all_devices: bool
    devices_used: int = 0
    num_devices: int = 0
    efficiency: float | None = None
    samples_per_s: float | None = None
    step_s: float | None = None
    groups: tuple[GroupSync, ...] = ()
    idle: tuple[str, ...] = ()
    """Each idle device and why (the report's ``idle_devices``)."""
    error: str = ""
    skipped: str = ""

    @property
    def verdict(self) -> str:
        """PASS / FAIL against the target, ``-`` without one (or when skipped)."""
        if self.skipped or self.target <= 0:
            return "-"
        if self.error or self.efficiency is None:
            return "FAIL"
        used = not self.all_devices or self.devices_used == self.num_devices
        return "PASS" if used and self.efficiency >= self.target else "FAIL"


def groups_of(plan: dict) -> tuple[GroupSync, ...]:
    """The plan's spanning holder sets and how each syncs; empty for one island."""
    sync = plan["training"].get("sync") or {}
    exposed = {
        tuple(c["ranks"]): c.get("exposed_time_per_step_s")
        for c in plan["report"].get("sync_choices") or ()
    }
    return tuple(
        GroupSync(
            ranks=tuple(g["ranks"]),
            mode=g["mode"],
            local_steps=g.get("local_steps", 1),
            wire=g.get("wire_dtype", "float32"),
            num_fragments=g.get("num_fragments", 1),
            overlap_steps=g.get("overlap_steps", 0),
            exposed_s=exposed.get(tuple(g["ranks"])),
        )
        for g in sync.get("groups") or ()
    )


def idle_of(report: dict) -> tuple[str, ...]:
    """``device: reason`` for each idle device of the report, the reason on one line."""
    out = []
    for item in report.get("idle_devices") or ():
        reason = " ".join(str(item.get("reason", "")).split())
        out.append(f"{item.get('device', '?')}: {reason}")
    return tuple(out)


def row_from(case: Case, sync: str, summary: dict, plan: dict) -> Row:
    """A :class:`Row` from ``hplan solve --json``'s summary and the plan it wrote."""
    report = plan["report"]
    return Row(
        case=case.name,
        sync=sync,
        target=case.target,
        all_devices=case.all_devices,
        devices_used=int(summary["devices_used"]),
        num_devices=int(summary["num_devices"]),
        efficiency=report.get("efficiency"),
        samples_per_s=report.get("predicted_samples_per_s"),
        step_s=report.get("predicted_step_time_s"),
        groups=groups_of(plan),
        idle=idle_of(report),
    )


@dataclass(frozen=True)
class Ran:
    """What one ``hplan`` command did."""

    returncode: int
    stdout: str
    stderr: str


Runner = Callable[[Sequence[str]], Ran]
"""Runs ``hplan ARGS`` (the arguments after ``hplan``)."""


def run_hplan(args: Sequence[str]) -> Ran:
    """``hplan ARGS`` in a child process: what a user gets."""
    proc = subprocess.run([*HPLAN, *args], capture_output=True, text=True)
    return Ran(proc.returncode, proc.stdout, proc.stderr)


def capture(model: Model, folder: Path, runner: Runner = run_hplan) -> Path | None:
    """``hplan capture`` of the model into ``folder``; None where it fails (then each solve
    captures the model itself)."""
    out = folder / f"{model.name}.capture.json"
    ran = runner(["capture", str(model.path), "-o", str(out)])
    return out if ran.returncode == 0 else None


def solve(
    case: Case,
    cluster: Path,
    sync: str,
    *,
    capture_path: Path | None,
    time_limit_s: float,
    extra: Sequence[str] = (),
    runner: Runner = run_hplan,
) -> Row:
    """``hplan solve --json --sync SYNC`` of one case."""
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(tmp)
        args = [
            "solve",
            str(case.model.path),
            "--cluster",
            str(cluster),
            "-o",
            str(out_dir),
            "-b",
            str(case.model.global_batch_size),
            "--time-limit",
            str(time_limit_s),
            "--sync",
            sync,
            "--json",
            *(["--capture", str(capture_path)] if capture_path else []),
            *extra,
        ]
        ran = runner(args)
        if ran.returncode != 0:
            lines = ran.stderr.strip().splitlines()
            error = lines[-1].removeprefix("hplan: error: ") if lines else ""
            return Row(case.name, sync, case.target, case.all_devices, error=error or "failed")
        summary = json.loads(ran.stdout)
        plan = json.loads((out_dir / "plan.json").read_text())
    return row_from(case, sync, summary, plan)


def missing_module(model: Model) -> str:
    """Why the model cannot be built here (a module it needs is missing), else empty."""
    if model.needs and importlib.util.find_spec(model.needs) is None:
        return f"{model.needs} is not installed"
    return ""


@dataclass
class Run:
    """One run of the benchmark: its captures (one per model) and its rows."""

    folder: Path
    time_limit_s: float
    extra: tuple[str, ...] = ()
    runner: Runner = run_hplan
    captures: dict[str, Path | None] = field(default_factory=dict)
    clusters: dict[str, Path] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)

    def case(self, case: Case, syncs: Sequence[str]) -> list[Row]:
        """Solve ``case`` under each of ``syncs``; one skipped row when the model cannot be
        built here."""
        why = missing_module(case.model)
        if why:
            rows = [Row(case.name, "-", case.target, case.all_devices, skipped=why)]
            self.rows += rows
            return rows
        if case.model.name not in self.captures:
            self.captures[case.model.name] = capture(case.model, self.folder, self.runner)
        if case.pool not in self.clusters:
            self.clusters[case.pool] = write_cluster(POOLS[case.pool])
        rows = [
            solve(
                case,
                self.clusters[case.pool],
                sync,
                capture_path=self.captures[case.model.name],
                time_limit_s=self.time_limit_s,
                extra=self.extra,
                runner=self.runner,
            )
            for sync in syncs
        ]
        self.rows += rows
        return rows


def print_rows(rows: Sequence[Row]) -> None:
    out = table(
        "Slow links: planned efficiency (predicted; plan / bound)",
        ["case", "sync", "devices", "efficiency", "samples/s", "step", "target", "verdict"],
    )
    for r in rows:
        if r.skipped or r.error:
            out.add_row(r.case, r.sync, "", "", "", "", "", r.skipped or f"error: {r.error}")
            continue
        out.add_row(
            r.case,
            r.sync,
            f"{r.devices_used}/{r.num_devices}",
            f"{r.efficiency:.3f}" if r.efficiency is not None else "?",
            f"{r.samples_per_s:.1f}" if r.samples_per_s is not None else "?",
            f"{r.step_s:.3g} s" if r.step_s is not None else "?",
            f">= {r.target:.2f}" if r.target else "-",
            r.verdict,
        )
    console.print(out)
    for r in rows:
        for g in r.groups:
            console.print(f"  {r.case} [{r.sync}] ranks {list(g.ranks)}: {g.text()}")
        for line in r.idle:
            console.print(f"  {r.case} [{r.sync}] idle {line}")


def _names(text: str, valid: Sequence[str], what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in valid]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown {what} {bad}; valid: {', '.join(valid)}")
    return names


SYNCS = ("auto", "all_reduce", "local_sgd", "streaming", "async")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cases",
        type=lambda t: _names(t, list(CASES), "case"),
        default=list(CASES),
        help=f"comma-separated, of {', '.join(CASES)} (default: all)",
    )
    parser.add_argument(
        "--sync",
        type=lambda t: _names(t, SYNCS, "sync"),
        default=["auto"],
        help="comma-separated --sync values to solve each case under (default: auto)",
    )
    parser.add_argument("--time-limit", type=float, default=60.0, help="hplan solve --time-limit")
    parser.add_argument(
        "--solve-args", default="", help="more options for every hplan solve (one string)"
    )
    parser.add_argument("--json", type=Path, help="write the rows here as JSON")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the cases; exit 1 when a case with a target fails it."""
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        run = Run(Path(tmp), args.time_limit, tuple(shlex.split(args.solve_args)))
        for name in args.cases:
            run.case(CASES[name], args.sync)
    print_rows(run.rows)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in run.rows], indent=2) + "\n")
    return 1 if any(r.verdict == "FAIL" for r in run.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
