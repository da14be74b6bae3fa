"""``hplan``: the command line. A thin click layer: parse, call one library function, print.

Human output goes to stderr (rich); machine output (``--json``) and requested artifacts
(``hplan show``) go to stdout. Exit codes: 0 ok, 2 usage or invalid input, 3 infeasible,
4 environment, 1 anything else. Errors are one line, never a traceback.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from hplan.planner.cli.bandwidth import bandwidth
from hplan.planner.cli.calibrate import calibrate
from hplan.planner.cli.profile import profile
from hplan.planner.cli.simulate import simulate
from hplan.runtime.contract.errors import ConfigError, HplanError, Terminated
from hplan.runtime.contract.plan import Plan, Schedule

stderr = Console(stderr=True, highlight=False, soft_wrap=True)


def _sizes(text: str | None) -> tuple[int, ...] | None:
    """``--micro-batch-sizes``: None when not given; otherwise comma-separated integers >= 1."""
    if text is None:
        return None
    items = [x.strip() for x in text.split(",")]
    if not all(items):
        raise ConfigError(
            f"--micro-batch-sizes {text!r} has an empty item; give integers like 1,2,4"
        )
    try:
        sizes = tuple(sorted({int(x) for x in items}))
    except ValueError:
        raise ConfigError(f"--micro-batch-sizes {text!r} must be integers like 1,2,4") from None
    if sizes[0] < 1:
        raise ConfigError(f"--micro-batch-sizes {text!r} must be integers >= 1")
    return sizes


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="hplan")
def cli() -> None:
    """hplan: plan and run PyTorch training on heterogeneous GPU pools.

    \b
    Typical use:
      hplan solve model.py --cluster cluster.yaml -o out/   # plan + launch scripts
      hplan show out/plan.json                             # what was planned, and why
      hplan rehearse out/plan.json --steps 20              # run every rank here, emulated
      bash out/launch/node-<name>.sh                       # on each real node

    Loading model.py executes it, with your rights.
    """


@cli.command()
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
@click.option(
    "--micro-batch-sizes",
    help="Candidate micro-batch sizes, e.g. 1,2,4,8 (default: powers of two).",
)
@click.option(
    "--time-limit",
    "time_limit_s",
    type=float,
    default=60.0,
    show_default=True,
    help="Wall-clock limit of the solver in seconds; the best plan found by then is kept.",
)
@click.option(
    "--solver",
    type=click.Choice(["highs", "cbc", "heuristic"]),
    help="MILP backend (default: HiGHS, else CBC, else the greedy planner).",
)
@click.option(
    "--max-stages", type=int, default=8, show_default=True, help="Longest pipeline to consider."
)
@click.option(
    "--schedule",
    type=click.Choice([s.value for s in Schedule]),
    default=Schedule.ONE_F_ONE_B.value,
    show_default=True,
    help="Pipeline schedule the runtime uses.",
)
@click.option(
    "--leaf-module",
    "leaf_modules",
    multiple=True,
    help="Module path or class name to keep whole when tracing (repeatable).",
)
@click.option(
    "--strategy",
    type=click.Choice(["hplan", "ddp", "uniform"]),
    default="hplan",
    show_default=True,
    help="hplan: solve; ddp / uniform: emit that baseline's layout, to run it side by side.",
)
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Seed for weights and data order."
)
@click.option(
    "--master-port",
    type=int,
    default=29500,
    show_default=True,
    help="Rendezvous port on the first node.",
)
@click.option(
    "--bandwidth",
    "bandwidth_path",
    type=click.Path(path_type=Path),
    help="Measured link matrix (from `hplan bandwidth`); overrides the cluster's links it covers.",
)
@click.option(
    "--profile",
    "profile_path",
    type=click.Path(path_type=Path),
    help="Measured profile (file or directory, from `hplan profile --model`); replaces catalog estimates.",
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
def solve(
    model: Path,
    cluster_path: Path,
    out_dir: Path,
    global_batch_size: int,
    micro_batch_sizes: str | None,
    time_limit_s: float,
    solver: str | None,
    max_stages: int,
    schedule: str,
    leaf_modules: tuple[str, ...],
    strategy: str,
    seed: int,
    master_port: int,
    profile_path: Path | None,
    bandwidth_path: Path | None,
    as_json: bool,
) -> None:
    """Plan training of MODEL (a model.py) on a cluster and write the plan and launch scripts."""
    from hplan.planner.api import SolveRequest, Strategy, plan_training
    from hplan.planner.emit.artifacts import check_out_dir, emit
    from hplan.planner.emit.render import print_text, wide_console

    request = SolveRequest(
        model_path=model,
        cluster_path=cluster_path,
        global_batch_size=global_batch_size,
        micro_batch_sizes=_sizes(micro_batch_sizes),
        time_limit_s=time_limit_s,
        solver=solver,
        max_stages=max_stages,
        schedule=Schedule(schedule),
        seed=seed,
        master_port=master_port,
        leaf_modules=leaf_modules,
        strategy=Strategy(strategy),
        out_dir=out_dir,
        profile_path=profile_path,
        bandwidth_path=bandwidth_path,
    )
    check_out_dir(out_dir)
    with stderr.status("planning...") as status:
        outcome = plan_training(request, progress=lambda msg: status.update(f"{msg}..."))
    written = emit(outcome.plan, out_dir)
    print_text(outcome.plan, wide_console(stderr=True))
    stderr.print(
        f"solved in {outcome.solve_time_s:.1f} s; wrote {len(written)} files to {out_dir}/"
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
        }
        click.echo(json.dumps(summary, indent=2))


@cli.command()
@click.argument("plan_path", type=click.Path(path_type=Path))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["text", "json", "dot", "svg", "png"]),
    default="text",
    show_default=True,
    help="text: a summary table; json: plan.json; dot: graphviz; svg / png: the simulated "
    "per-rank timeline (redirect stdout to a file).",
)
def show(plan_path: Path, fmt: str) -> None:
    """Show a plan: devices, stages, units, batch shares, predicted time and memory."""
    if fmt in ("svg", "png"):
        _show_image(Plan.load(plan_path), fmt)
        return
    from hplan.planner.emit.render import (
        print_text,
        render_dot,
        render_json,
        render_text,
        wide_console,
    )

    plan = Plan.load(plan_path)
    if fmt == "text" and sys.stdout.isatty():
        print_text(plan, wide_console(stderr=False))
    elif fmt == "text":
        click.echo(render_text(plan), nl=False)  # the bytes of summary.txt
    elif fmt == "json":
        click.echo(render_json(plan), nl=False)
    else:
        click.echo(render_dot(plan), nl=False)


def _show_image(plan: Plan, fmt: str) -> None:
    """Write the simulated timeline image to stdout (PNG only when stdout is not a terminal)."""
    from hplan.planner.cli.simulate import plan_timeline_image

    if fmt == "png" and sys.stdout.isatty():
        raise ConfigError("--format png writes binary data; redirect stdout to a file (> t.png)")
    image = plan_timeline_image(plan, fmt)
    if fmt == "svg":
        click.echo(image.decode("utf-8"), nl=False)
        return
    sys.stdout.flush()
    sys.stdout.buffer.write(image)
    sys.stdout.buffer.flush()


@cli.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.argument("plan_path", type=click.Path(path_type=Path))
@click.pass_context
def run(ctx: click.Context, plan_path: Path) -> None:
    """Run this process's rank of a plan (what the launch scripts call under torchrun).

    Options are those of `python -m hplan.runtime run` (--node, default $HPLAN_NODE;
    --rank, --model, --steps, --metrics-dir, --checkpoint-dir); see
    `python -m hplan.runtime run --help`.
    """
    from hplan.runtime.executor.cli import main as runtime_main

    sys.exit(runtime_main(["run", str(plan_path), *ctx.args]))


@cli.command()
@click.argument("plan_path", type=click.Path(path_type=Path))
@click.option("--steps", type=int, default=10, show_default=True, help="Optimizer steps to run.")
@click.option(
    "--model", "model_path", type=click.Path(path_type=Path), help="model.py (default: the plan's)."
)
@click.option(
    "--verify",
    is_flag=True,
    help="Also run step one as a single process and compare every updated parameter (fails above 1e-4).",
)
@click.option(
    "--metrics-dir",
    type=click.Path(path_type=Path),
    help="Keep per-rank metrics here (default: a temporary directory).",
)
@click.option(
    "--dilation",
    type=float,
    help=(
        "Global time-dilation factor (default: at least 4, more where the ranks' CPU demand "
        "needs it to fit this machine's cores; larger is more faithful and slower)."
    ),
)
@click.option(
    "--time-scale",
    type=float,
    help="Emulated seconds per second of the plan's hardware (default: from the dilation and "
    "a CPU timing); give two rehearsals the same value to compare plans under one emulation.",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=float,
    default=600.0,
    show_default=True,
    help="Kill the rehearsal after this many seconds.",
)
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(path_type=Path),
    help="Write the last step's measured per-rank timeline as Chrome trace JSON, in seconds "
    "of the plan's hardware (compare with `hplan simulate --trace`).",
)
@click.option(
    "--slowdown",
    "slowdowns",
    multiple=True,
    metavar="DEVICE=FACTOR",
    help="Emulate a straggler: DEVICE's compute runs FACTOR times slower (box-b/1=1.4; repeatable).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
def rehearse(
    plan_path: Path,
    steps: int,
    model_path: Path | None,
    verify: bool,
    metrics_dir: Path | None,
    dilation: float | None,
    time_scale: float | None,
    timeout_s: float,
    trace_path: Path | None,
    slowdowns: tuple[str, ...],
    as_json: bool,
) -> None:
    """Run every rank of a plan on this machine (CPU, gloo), emulating its hardware."""
    from hplan.runtime.capture.model_file import plan_model_path
    from hplan.runtime.rehearsal.rehearse import parse_slowdown
    from hplan.runtime.rehearsal.rehearse import rehearse as run_rehearsal

    if steps < 1:
        raise ConfigError(f"--steps {steps} must be >= 1")
    plan = Plan.load(plan_path)
    result = run_rehearsal(
        plan,
        model_path=plan_model_path(plan.model.path, plan_path, model_path),
        steps=steps,
        verify=verify,
        metrics_dir=metrics_dir,
        dilation=dilation,
        time_scale=time_scale,
        timeout_s=timeout_s,
        trace_path=trace_path,
        slowdown=parse_slowdown(slowdowns),
    )
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    if verify and not result.verify_passed:
        raise SystemExit(1)


cli.add_command(bandwidth)


cli.add_command(profile)


cli.add_command(simulate)


cli.add_command(calibrate)


def _one_line(message: str) -> str:
    """Collapse whitespace so an error is exactly one line (library messages may wrap)."""
    return " ".join(message.split())


def _report_crash(exc: BaseException) -> int:
    if os.environ.get("HPLAN_DEBUG"):
        traceback.print_exception(exc)
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    at = f" at {Path(where.filename).name}:{where.lineno}" if where else ""
    print(
        f"hplan: internal error: {type(exc).__name__}: {_one_line(str(exc))}{at} "
        "(a bug; rerun with HPLAN_DEBUG=1 for the traceback and report it)",
        file=sys.stderr,
        flush=True,
    )
    return 1


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    """SIGTERM handler: unwind like Ctrl-C, so that ``finally`` blocks stop child processes."""
    raise Terminated(128 + signum)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: maps hplan errors to one line and an exit code.

    SIGTERM raises ``SystemExit(143)`` in the main thread, so a terminated ``hplan rehearse``
    (or ``solve``) runs its clean-up and stops the processes it started.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    code = _invoke(lambda: cli.main(args=argv, prog_name="hplan", standalone_mode=False))
    sys.exit(code)


def _invoke(call: Callable[[], Any]) -> int:
    try:
        result = call()
    except HplanError as exc:
        print(f"hplan: error: {_one_line(str(exc))}", file=sys.stderr, flush=True)
        return exc.exit_code
    except click.exceptions.Exit as exc:
        return int(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Abort:
        stderr.print("hplan: aborted")
        return 130
    except KeyboardInterrupt:
        return 130
    except Terminated as exc:
        stderr.print("hplan: terminated")
        return exc.code if isinstance(exc.code, int) else 143
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except Exception as exc:
        return _report_crash(exc)
    return result if isinstance(result, int) else 0
