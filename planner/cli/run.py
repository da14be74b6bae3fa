"""``hplan run`` (one rank of a plan, what the launch scripts call) and ``hplan rehearse``
(every rank here, emulated).

``hplan run`` is the runtime's own command (``python -m hplan.runtime run``,
``hplan.runtime.executor.cli``): its options and ``--help`` are the runtime's, passed
through unparsed. The planner reaches the executor only through it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.memory import load_checked


@click.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    add_help_option=False,
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def run(args: tuple[str, ...]) -> None:
    """Run this process's rank of a plan (what the launch scripts call under torchrun).

    `hplan run --help` lists the runtime's options (--node, default $HPLAN_NODE; --rank,
    --model, --steps, --metrics-dir, --checkpoint-dir, --master-port, --verify-dir).
    """
    from hplan.runtime.executor.cli import run_command

    sys.exit(run_command(list(args), prog="hplan run"))


@click.command("rehearse")
@click.argument("plan_path", type=click.Path(path_type=Path))
@click.option(
    "--steps",
    type=int,
    help="Optimizer steps to run (default: the plan's, from `hplan solve --steps`, else 10).",
)
@click.option(
    "--model", "model_path", type=click.Path(path_type=Path), help="model.py (default: the plan's)."
)
@click.option(
    "--verify",
    is_flag=True,
    help=(
        "Check step 0 against one process on the whole global batch: every synced gradient "
        "(relative L2 per parameter, 1e-4 in float32) and every parameter update (the "
        "model's optimizer replayed on the ranks' gradients). Dropout is off in step 0 in "
        "both runs, on from step 1. Prints the worst parameter of each; exits 1 on a failure."
    ),
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
@click.option(
    "--checkpoint-dir",
    type=click.Path(path_type=Path),
    help="The ranks save checkpoints here (at the end, and every --checkpoint-every-steps).",
)
@click.option("--checkpoint-every-steps", type=int, help="Save a checkpoint every N steps.")
@click.option(
    "--resume",
    is_flag=True,
    help="Continue from the latest checkpoint in --checkpoint-dir (whatever plan wrote it).",
)
@click.option(
    "--enforce-memory",
    is_flag=True,
    help="Fail, naming the rank, when a rank's measured training memory (its peak over what "
    "its process held before its stage was built) exceeds its device's memory less the "
    "device kind's reserve (for a GPU plan: its host memory standing in for the GPU's). "
    "The ranks then give freed memory back to the system at once (glibc's mmap threshold "
    "at 64 KiB), so CPU compute runs slower.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
def rehearse_command(
    plan_path: Path,
    steps: int | None,
    model_path: Path | None,
    verify: bool,
    metrics_dir: Path | None,
    dilation: float | None,
    time_scale: float | None,
    timeout_s: float,
    trace_path: Path | None,
    slowdowns: tuple[str, ...],
    checkpoint_dir: Path | None,
    checkpoint_every_steps: int | None,
    resume: bool,
    enforce_memory: bool,
    as_json: bool,
) -> None:
    """Run every rank of a plan on this machine (CPU, gloo), emulating its hardware."""
    from hplan.runtime.capture.model_file import plan_model_path
    from hplan.runtime.rehearsal.rehearse import (
        Checkpointing,
        parse_slowdown,
        rehearsal_steps,
        rehearse,
    )

    if steps is not None and steps < 1:
        raise ConfigError(f"--steps {steps} must be >= 1")
    if checkpoint_dir is None and (resume or checkpoint_every_steps is not None):
        raise ConfigError("--resume and --checkpoint-every-steps need --checkpoint-dir DIR")
    if checkpoint_every_steps is not None and checkpoint_every_steps < 1:
        raise ConfigError(f"--checkpoint-every-steps {checkpoint_every_steps} must be >= 1")
    checkpointing = (
        None
        if checkpoint_dir is None
        else Checkpointing(checkpoint_dir.absolute(), resume, checkpoint_every_steps)
    )
    plan = load_checked(plan_path)
    result = rehearse(
        plan,
        model_path=plan_model_path(plan.model.path, plan_path, model_path),
        steps=rehearsal_steps(plan, steps),
        verify=verify,
        metrics_dir=metrics_dir,
        dilation=dilation,
        time_scale=time_scale,
        timeout_s=timeout_s,
        trace_path=trace_path,
        slowdown=parse_slowdown(slowdowns),
        checkpointing=checkpointing,
        enforce_memory=enforce_memory,
    )
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    if verify and not result.verify_passed:
        raise SystemExit(1)
