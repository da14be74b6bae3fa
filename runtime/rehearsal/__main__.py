"""``python -m hplan.runtime.rehearsal PLAN --rank R ...``: one rank of a rehearsal.

What ``hplan rehearse`` starts for every rank of a plan (``launcher.py``): the executor's
own rank (``executor/training.run_rank``) on this machine's CPU, gloo on 127.0.0.1, one
thread, with the emulation plugged into its two seams (``emulation.py``). The options are
those of ``python -m hplan.runtime run`` plus the emulation's dilation and time scale.
"""

from __future__ import annotations

import argparse
import math
import os

from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.plan import Plan
from hplan.runtime.executor.cli import (
    OneLineErrors,
    add_run_arguments,
    exit_with,
    run_one_rank,
)


def rank_parser() -> argparse.ArgumentParser:
    """The command line of one rehearsal rank."""
    parser = OneLineErrors(
        prog="python -m hplan.runtime.rehearsal",
        description="Run one rank of a plan on this CPU (gloo on 127.0.0.1), emulating the "
        "plan's hardware; `hplan rehearse` starts one per rank.",
    )
    add_run_arguments(parser)
    parser.add_argument("--dilation", type=float, help="global time-dilation factor (>= 1)")
    parser.add_argument(
        "--time-scale", type=float, help="emulated seconds per second of plan hardware"
    )
    return parser


def _check_numbers(args: argparse.Namespace) -> None:
    """Reject option values that cannot mean anything (NaN, infinities, out of range)."""
    if args.dilation is not None and not (math.isfinite(args.dilation) and args.dilation >= 1):
        raise ConfigError(f"--dilation {args.dilation} must be a finite number >= 1")
    if args.time_scale is not None and not (math.isfinite(args.time_scale) and args.time_scale > 0):
        raise ConfigError(f"--time-scale {args.time_scale} must be a finite number > 0")


def _run(args: argparse.Namespace, plan: Plan, rank: int) -> None:
    import torch

    from hplan.runtime.capture.model_file import plan_model_path
    from hplan.runtime.executor.cli import run_options
    from hplan.runtime.executor.training import run_rank
    from hplan.runtime.executor.worker import check_environment
    from hplan.runtime.rehearsal.emulation import Emulation, recorded_emulation, rehearsal_seams
    from hplan.runtime.rehearsal.rehearse import default_dilation

    _check_numbers(args)
    torch.set_num_threads(1)
    dilation = args.dilation or default_dilation(plan, len(os.sched_getaffinity(0)))
    emulation = recorded_emulation(
        Emulation(dilation, args.time_scale or dilation), args.metrics_dir
    )
    options = run_options(
        args,
        plan,
        device="cpu",
        backend="gloo",
        master_host="127.0.0.1",
        warn_model_change=False,  # `hplan rehearse` warned once
        rebalance=False,  # its compute replays the plan's predictions: nothing to follow
    )
    check_environment(plan, rank, options)
    model = plan_model_path(plan.model.path, args.plan, args.model)
    run_rank(plan, rank, model, options, rehearsal_seams(plan, rank, emulation))


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (hplan errors: one line on stderr)."""
    from hplan.runtime.rehearsal.launcher import follow_supervisor

    follow_supervisor()
    return run_one_rank(rank_parser().parse_args(argv), _run)


if __name__ == "__main__":
    exit_with(main())
