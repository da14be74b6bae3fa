"""``hplan solve``: plan a model on a cluster and write the plan and its launch scripts.

A thin click layer over ``hplan.planner.api.plan_training`` and
``hplan.planner.emit.artifacts.emit``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from hplan.planner.cli.console import EnumChoice, parse_sizes, stderr
from hplan.planner.cli.progress import PhaseProgress
from hplan.planner.cost.problem import Policy
from hplan.planner.hardware.catalog import PrecisionRequest
from hplan.planner.solve.baselines import Strategy
from hplan.planner.solve.milp import MilpBackend
from hplan.planner.solve.sync_choice import (
    DEFAULT_MAX_LOCAL_STEPS,
    DEFAULT_MAX_OVERLAP_STEPS,
    SyncRequest,
    WireRequest,
)
from hplan.planner.textfmt import format_seconds
from hplan.runtime.contract.elastic import FAMILY_FILE
from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.holders import sync_summary
from hplan.runtime.contract.plan import Schedule

if TYPE_CHECKING:
    from hplan.planner.api import PlanningOutcome, SolveRequest
    from hplan.planner.family import FamilyOutcome, MemberPlan

# Options that `hplan replan` shares.
micro_batch_sizes_option = click.option(
    "--micro-batch-sizes",
    help="Candidate micro-batch sizes, e.g. 1,2,4,8 (default: powers of two).",
)
time_limit_option = click.option(
    "--time-limit",
    "time_limit_s",
    type=float,
    default=60.0,
    show_default=True,
    help="Wall-clock limit in seconds of the whole solve after the model's capture: every "
    "search, the evaluation, simulation and choice of the candidates, and the report; the "
    "best plan found by then is kept.",
)
bandwidth_option = click.option(
    "--bandwidth",
    "bandwidth_path",
    type=click.Path(path_type=Path),
    help="Measured link matrix (from `hplan bandwidth`); overrides the cluster's links it covers.",
)
leaf_module_option = click.option(
    "--leaf-module",
    "leaf_modules",
    multiple=True,
    help="Module path or class name to keep whole when tracing (repeatable; `hplan capture` "
    "and `hplan solve --capture` need the same).",
)
seed_option = click.option(
    "--seed", type=int, default=0, show_default=True, help="Seed for weights and data order."
)
precision_option = click.option(
    "--precision",
    type=EnumChoice(PrecisionRequest),
    help=(
        "What the devices compute in. auto (default): bf16 autocast on GPUs with bf16 "
        "tensor cores (Ampere and later), fp16 autocast with loss scaling on Volta/Turing, "
        "fp32 on CPUs. fp32: PyTorch's defaults (matmuls in float32, convolutions in TF32); "
        "tf32: matmuls in TF32 too. Parameters and optimizer state stay in the model's dtype."
    ),
)
sync_option = click.option(
    "--sync",
    type=EnumChoice(SyncRequest),
    default=SyncRequest.AUTO.value,
    show_default=True,
    help=(
        "How replicas on islands of nodes joined by slow links sync. auto: all-reduce every "
        "step, unless that costs more than 10% of the step or leaves devices idle and local "
        "SGD across islands is more than 5% faster; all_reduce: every step (one island); "
        "local_sgd: "
        "DiLoCo across islands, the outer sync every H steps (H the smallest whose sync "
        "costs <= 5% of H steps); streaming: local_sgd whose outer sync travels in fragments, "
        "each behind a few inner steps (the smallest H whose sync hides); async: as "
        "local_sgd, the outer sync hidden behind the next H steps and applied one round "
        "late. Under auto each holder set across islands takes streaming where it exposes "
        "less than local_sgd."
    ),
)
wire_option = click.option(
    "--wire",
    type=EnumChoice(WireRequest),
    default=WireRequest.AUTO.value,
    show_default=True,
    help=(
        "The format pseudo-gradients cross islands in. auto: per holder set, the least "
        "compressed that meets the sync rule (float32, bfloat16, then int8 and int4: "
        "block-quantized with error feedback); or one format for every set."
    ),
)
max_overlap_steps_option = click.option(
    "--max-overlap-steps",
    type=int,
    default=None,
    help="Most inner steps an overlapped outer sync may travel behind before it is applied "
    f"(its staleness; --sync streaming and auto only)  [default: {DEFAULT_MAX_OVERLAP_STEPS}]",
)


def _policy_option(flag: str, help_text: str) -> Callable[[Callable[..., Any]], Any]:
    """A ``--flag auto|never|always`` option (default ``auto``)."""
    return click.option(
        flag,
        type=EnumChoice(Policy),
        default=Policy.AUTO.value,
        show_default=True,
        help=help_text,
    )


recompute_option = _policy_option(
    "--recompute",
    "Activation recomputation per stage. auto: where keeping a stage's activations does "
    "not fit its device, it recomputes the fewest of its units that make it fit (cheapest "
    "forward per activation byte first; each keeps only its input and runs its forward "
    "again in the backward), else all of them, and the solver weighs the extra forward "
    "against other splits and micro-batch sizes; never; always: every stage, all units.",
)
zero_option = _policy_option(
    "--zero",
    "ZeRO: the ranks holding the same parameters split their optimizer state (stage 1), "
    "in uneven shards sized by each device's free memory (a rank with none keeps none), "
    "and all-gather the updated parameters after each step; where stage 1 does not fit, "
    "stage 2 also shards the summed gradients. auto: searched too when the best unsharded "
    "plan is bound by memory (a device idle, a stage recomputing or over 80% full), kept "
    "if faster; never; always.",
)
offload_option = _policy_option(
    "--offload",
    "Optimizer-state offload: a rank keeps its optimizer state and a copy of its "
    "parameters in host memory (pinned), copies its gradients there after the backward, "
    "steps on the CPU and copies the parameters back (costed over PCIe and the host's "
    "memory bandwidth). auto: searched when nothing cheaper fits (no plan, or a device "
    "idle), kept only on the devices that need it and only if faster; never; always: "
    "every rank. Not combined with ZeRO shards.",
)
tensor_parallel_option = _policy_option(
    "--tensor-parallel",
    "Tensor parallelism: a stage runs on a TP group of 2, 4 or 8 cards of one kind in one "
    "node, each holding its share of the modules of the model's TP plan (TP_PLAN in "
    "model.py, or the Hugging Face config's base_model_tp_plan). auto: inside NVLink "
    "nodes (cluster.yaml `nvlink`, SXM parts by default), and over PCIe on GeForce cards "
    "only where nothing else fits; never; always: only plans with TP groups (exit 2 "
    "where none is possible). Not combined with ZeRO, offload or local sync.",
)
max_local_steps_option = click.option(
    "--max-local-steps",
    type=int,
    default=DEFAULT_MAX_LOCAL_STEPS,
    show_default=True,
    help="Largest H (inner steps per outer sync) under local_sgd and async.",
)
profile_option = click.option(
    "--profile",
    "profile_paths",
    type=click.Path(path_type=Path),
    multiple=True,
    help="Measured profile (file or directory, from `hplan profile --model`; repeatable, the "
    "profiles of every node merged); replaces catalog estimates.",
)


@click.command("solve")
@click.argument("model", type=click.Path(path_type=Path))
@click.option(
    "--cluster",
    "-c",
    "cluster_path",
    required=True,
    type=click.Path(path_type=Path),
    help="cluster.yaml describing machines, GPUs and links.",
)
@click.option(
    "--out",
    "-o",
    "out_dir",
    type=click.Path(path_type=Path),
    default=Path("out"),
    show_default=True,
    help="Directory for plan.json, plan.dot, summary.txt and launch/.",
)
@click.option(
    "--global-batch-size",
    "-b",
    type=int,
    default=32,
    show_default=True,
    help="Samples per optimizer step, over all replicas.",
)
@micro_batch_sizes_option
@time_limit_option
@click.option(
    "--solver",
    type=EnumChoice(MilpBackend),
    help="MILP backend (default: HiGHS, else CBC, else the greedy planner).",
)
@click.option(
    "--max-stages", type=int, default=8, show_default=True, help="Longest pipeline to consider."
)
@click.option(
    "--schedule",
    type=EnumChoice(Schedule),
    default=Schedule.ONE_F_ONE_B.value,
    show_default=True,
    help="Pipeline schedule the runtime uses.",
)
@leaf_module_option
@click.option(
    "--strategy",
    type=EnumChoice(Strategy),
    default=Strategy.HPLAN.value,
    show_default=True,
    help="hplan: solve; ddp / uniform: emit that baseline's layout, to run it side by side.",
)
@seed_option
@click.option(
    "--master-port",
    type=int,
    default=29500,
    show_default=True,
    help="Rendezvous port on the first node.",
)
@click.option(
    "--steps",
    type=int,
    help="Optimizer steps the launch scripts train (recorded in plan.json; `--steps N` given "
    "to a launch script overrides it). Without --steps or --epochs, every run needs --steps.",
)
@click.option(
    "--epochs",
    type=int,
    help="Train this many passes over the model file's dataset() instead: steps = epochs x "
    "(len(dataset()) // global batch size), counted by the ranks at run time.",
)
@precision_option
@sync_option
@max_local_steps_option
@wire_option
@max_overlap_steps_option
@recompute_option
@zero_option
@offload_option
@tensor_parallel_option
@bandwidth_option
@profile_option
@click.option(
    "--capture",
    "capture_path",
    type=click.Path(path_type=Path),
    help=(
        "Capture file of MODEL (from `hplan capture`): plan from it instead of building and "
        "tracing the model again (same --seed and --leaf-module options)."
    ),
)
@click.option(
    "--previous",
    "previous_plan_path",
    type=click.Path(path_type=Path),
    help="The plan a calibrated run measured (with --profile CALIBRATED): keep its layout "
    "unless the search finds one predicted faster under the calibrated model.",
)
@click.option(
    "--dump-passes",
    "dump_dir",
    type=click.Path(path_type=Path),
    help="Write every planning pass's result to DIR/<NN>-<pass>.json (for debugging).",
)
@click.option(
    "--elastic",
    is_flag=True,
    help="Also solve ahead a plan for every node but one (family/, family.json, capture.json, "
    "cluster.yaml) and write elastic launch scripts for every node: a run goes on, re-planned, "
    "when nodes are lost, join or slow down (README: Elastic runs).",
)
@click.option(
    "--min-nodes",
    type=int,
    help="With --elastic: the fewest nodes the run goes on with (default: the smallest "
    "membership solved ahead that holds the model).",
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
def solve_command(
    model: Path,
    cluster_path: Path,
    out_dir: Path,
    global_batch_size: int,
    micro_batch_sizes: str | None,
    time_limit_s: float,
    solver: MilpBackend | None,
    max_stages: int,
    schedule: Schedule,
    leaf_modules: tuple[str, ...],
    strategy: Strategy,
    seed: int,
    master_port: int,
    steps: int | None,
    epochs: int | None,
    precision: PrecisionRequest | None,
    sync: SyncRequest,
    max_local_steps: int,
    wire: WireRequest,
    max_overlap_steps: int | None,
    recompute: Policy,
    zero: Policy,
    offload: Policy,
    tensor_parallel: Policy,
    profile_paths: tuple[Path, ...],
    bandwidth_path: Path | None,
    capture_path: Path | None,
    previous_plan_path: Path | None,
    dump_dir: Path | None,
    elastic: bool,
    min_nodes: int | None,
    as_json: bool,
) -> None:
    """Plan training of MODEL (a model.py) on a cluster and write the plan and launch scripts."""
    started_s = time.monotonic()
    from hplan.planner.api import SolveRequest, phase_of, plan_training
    from hplan.planner.emit.artifacts import check_out_dir

    if min_nodes is not None and not elastic:
        raise ConfigError(f"--min-nodes {min_nodes} needs --elastic (it sizes an elastic run)")

    request = SolveRequest(
        model_path=model,
        cluster_path=cluster_path,
        global_batch_size=global_batch_size,
        micro_batch_sizes=parse_sizes(micro_batch_sizes),
        time_limit_s=time_limit_s,
        solver=solver,
        max_stages=max_stages,
        schedule=schedule,
        seed=seed,
        master_port=master_port,
        leaf_modules=leaf_modules,
        strategy=strategy,
        out_dir=out_dir,
        profile_paths=profile_paths,
        bandwidth_path=bandwidth_path,
        precision=precision or PrecisionRequest.AUTO,
        capture_path=capture_path,
        previous_plan_path=previous_plan_path,
        steps=steps,
        epochs=epochs,
        sync=sync,
        max_local_steps=max_local_steps,
        wire=wire,
        max_overlap_steps=max_overlap_steps,
        recompute=recompute,
        zero=zero,
        offload=offload,
        tensor_parallel=tensor_parallel,
    )
    request.verify()  # every option checked before the model file is imported
    check_out_dir(out_dir)
    if elastic:
        from hplan.planner.family import check_min_nodes

        check_min_nodes(min_nodes, cluster_path)
    with PhaseProgress(stderr, phase_of) as progress:
        outcome = plan_training(request, progress=progress, dump_dir=dump_dir)
        family = solve_ahead(request, outcome, progress, min_nodes) if elastic else None
        written = write_files(outcome, out_dir, progress, family)
    extra = None if family is None else {"family": family_summary(family, out_dir)}
    print_plan(outcome, out_dir, written, progress, started_s, as_json=as_json, extra=extra)


def solve_ahead(
    request: SolveRequest, outcome: PlanningOutcome, progress: PhaseProgress, min_nodes: int | None
) -> FamilyOutcome:
    """The ``family`` phase of ``--elastic``: every node but one solved ahead, one line each."""
    from hplan.planner.family import solve_family

    assert request.out_dir is not None
    with progress.phase("family", "solving ahead for every node but one"):
        return solve_family(
            request, outcome, request.out_dir, min_nodes=min_nodes, tell=progress.tell,
            solved=_print_member,
        )  # fmt: skip


def _print_member(member: MemberPlan) -> None:
    """One line for a membership solved ahead: its ranks and speed, or why none fits."""
    names = ", ".join(member.members)
    if member.plan is None:
        stderr.print(f"family {names}: infeasible: {member.reason}", markup=False, soft_wrap=True)
        return
    speed = member.plan.report.predicted_samples_per_s
    stderr.print(
        f"family {names}: {member.plan.world_size} ranks, {speed:,.1f} samples/s predicted "
        f"({format_seconds(member.solve_time_s)})",
        markup=False,
        soft_wrap=True,
    )


def family_summary(family: FamilyOutcome, out_dir: Path) -> dict[str, Any]:
    """The ``--json`` summary's ``family``: the index and every membership solved ahead."""
    members = [
        {
            "members": list(m.members),
            "plan": None if m.plan is None else str(out_dir / family.family.plans[m.key]),
            "ranks": None if m.plan is None else m.plan.world_size,
            "predicted_samples_per_s": (
                None if m.plan is None else m.plan.report.predicted_samples_per_s
            ),
            "infeasible": m.reason,
            "solve_time_s": m.solve_time_s,
        }
        for m in family.members
    ]
    return {
        "file": str(out_dir / FAMILY_FILE),
        "min_nodes": family.family.min_nodes,
        "run_id": family.family.run_id,
        "plans": family.family.plans,
        "infeasible": family.family.infeasible,
        "members": members,
    }


def write_files(
    outcome: PlanningOutcome,
    out_dir: Path,
    progress: PhaseProgress,
    family: FamilyOutcome | None = None,
) -> list[Path]:
    """Write the plan's files under ``out_dir`` as the ``write`` phase (with ``family``,
    elastic launch scripts for every node); their paths (the family's files first)."""
    from hplan.planner.emit.artifacts import ElasticLaunch, emit

    elastic = None if family is None else ElasticLaunch(family.family)
    with progress.phase("write", f"writing the plan files to {out_dir}/"):
        written = emit(outcome.plan, out_dir, elastic)
    return written if family is None else [*family.files, *written]


def print_plan(
    outcome: PlanningOutcome,
    out_dir: Path,
    written: list[Path],
    progress: PhaseProgress,
    started_s: float,
    *,
    as_json: bool,
    extra: dict[str, Any] | None = None,
) -> None:
    """Print the plan's summary and the command's total wall time (since ``started_s``,
    ``time.monotonic``) on stderr: the command's start (imports, option checks), each
    phase's time and the solver's steps' (``solve 3.1 s (generate 2.8 s, ...)``); with
    ``as_json`` a JSON summary with every phase's and pass's time on stdout."""
    from hplan.planner.api import SOLVE_PASSES
    from hplan.planner.emit.render import print_text, wide_console

    print_text(outcome.plan, wide_console(stderr=True))
    total_s = time.monotonic() - started_s
    phase_times_s = progress.times_s
    steps = ", ".join(
        f"{name} {format_seconds(progress.pass_times_s[name])}"
        for name in SOLVE_PASSES
        if name in progress.pass_times_s
    )
    start_s = progress.created_s - started_s
    phases = f"start {format_seconds(start_s)} · " + " · ".join(
        f"{name} {format_seconds(t)}" + (f" ({steps})" if name == "solve" and steps else "")
        for name, t in phase_times_s.items()
    )
    stderr.print(
        f"planned in {format_seconds(total_s)} ({phases}); wrote {len(written)} files to {out_dir}/"
    )
    if as_json:
        report = outcome.plan.report
        summary = {
            "plan": str(out_dir / "plan.json"),
            "files": [str(p) for p in written],
            "predicted_step_time_s": report.predicted_step_time_s,
            "predicted_samples_per_s": report.predicted_samples_per_s,
            "physical_bound_samples_per_s": report.physical_bound_samples_per_s,
            "efficiency": report.efficiency,
            "solver_status": report.solver_status.value,
            "optimality_gap": report.optimality_gap,
            "simulated_step_time_s": report.simulated_step_time_s,
            "solve_time_s": outcome.solve_time_s,
            "idle_devices": [
                {"device": idle.device, "kind": idle.kind, "reason": idle.reason}
                for idle in report.idle_devices
            ],
            "sync": sync_summary(outcome.plan),
            "sync_choices": [asdict(choice) for choice in report.sync_choices],
            "devices_used": outcome.plan.world_size,
            "num_devices": len(outcome.plan.cluster.devices),
            "phase_times_s": phase_times_s,
            "pass_times_s": progress.pass_times_s,
            "start_time_s": start_s,
            "total_time_s": total_s,
            **(extra or {}),
        }
        click.echo(json.dumps(summary, indent=2))
