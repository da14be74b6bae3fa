"""``python -m hplan.runtime run PLAN ...``: what the launch scripts run on every rank.

Thin: parse the options, load the plan, find this process's rank, call
:func:`hplan.runtime.executor.worker.run_rank`. An hplan error ends the process with one line on
stderr and the error class's exit code (no traceback).

The node comes from ``--node`` or the ``HPLAN_NODE`` environment variable (the launch
scripts export it: under torchrun an option spelled ``--node`` would be taken for an
abbreviation of torchrun's ``--node-rank``). torch's C++ warnings (``TORCH_CPP_LOG_LEVEL``)
are limited to errors unless the user set the variable: a rank that waits for its peers
would otherwise print a stack trace per connection retry.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import NoReturn

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import torch  # after TORCH_CPP_LOG_LEVEL: torch reads it when it loads

from hplan.runtime.capture.model_file import plan_model_path
from hplan.runtime.contract.errors import ConfigError, HplanError
from hplan.runtime.contract.plan import Plan
from hplan.runtime.executor.rendezvous import resolve_rank
from hplan.runtime.executor.worker import Emulation, RunOptions, check_environment, run_rank

NODE_ENV = "HPLAN_NODE"
"""Environment variable naming this node when ``--node`` is not given."""


class _OneLineErrors(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (no usage block), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see --help\n")


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineErrors(prog="python -m hplan.runtime")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineErrors)
    run = commands.add_parser("run", help="run this process's rank of a plan")
    run.add_argument("plan", type=Path, help="plan.json")
    run.add_argument(
        "--model",
        help="model.py (default: the path recorded in the plan, relative to plan.json's folder)",
    )
    run.add_argument(
        "--node",
        default=os.environ.get(NODE_ENV) or None,
        help=f"this node's name in the plan, rank from LOCAL_RANK (default: ${NODE_ENV})",
    )
    run.add_argument("--rank", type=int, help="plan rank (instead of --node)")
    run.add_argument("--steps", type=int, default=1, help="optimizer steps to run")
    run.add_argument("--metrics-dir", type=Path, help="write rank-<r>.jsonl here")
    run.add_argument("--checkpoint-dir", type=Path, help="resume from and save to here")
    run.add_argument(
        "--emulate",
        action="store_true",
        help="rehearsal: run on CPU with gloo on 127.0.0.1, emulating the plan's hardware",
    )
    run.add_argument("--dilation", type=float, help="emulation: global time-dilation factor")
    run.add_argument(
        "--time-scale", type=float, help="emulation: emulated s per s of plan hardware"
    )
    run.add_argument("--master-port", type=int, help="override the plan's master port")
    run.add_argument("--verify-dir", type=Path, help="dump grads and params after step one")
    return parser


def _check_numbers(args: argparse.Namespace) -> None:
    """Reject option values that cannot mean anything (NaN, infinities, out of range)."""
    if args.dilation is not None and not (math.isfinite(args.dilation) and args.dilation >= 1):
        raise ConfigError(f"--dilation {args.dilation} must be a finite number >= 1")
    if args.time_scale is not None and not (math.isfinite(args.time_scale) and args.time_scale > 0):
        raise ConfigError(f"--time-scale {args.time_scale} must be a finite number > 0")
    if args.master_port is not None and not 1 <= args.master_port <= 65534:
        raise ConfigError(f"--master-port {args.master_port} must be in 1..65534")


def _options(args: argparse.Namespace, plan: Plan) -> RunOptions:
    from hplan.runtime.rehearsal.rehearse import default_dilation

    _check_numbers(args)
    emulation = None
    if args.emulate:
        dilation = args.dilation or default_dilation(plan, len(os.sched_getaffinity(0)))
        emulation = Emulation(dilation, args.time_scale or dilation)
    return RunOptions(
        steps=args.steps,
        metrics_dir=args.metrics_dir,
        checkpoint_dir=args.checkpoint_dir,
        emulation=emulation,
        verify_dir=args.verify_dir,
        device="cpu" if args.emulate else None,
        backend="gloo" if args.emulate else None,
        master_host="127.0.0.1" if args.emulate else None,
        master_port=args.master_port,
    )


def _run(args: argparse.Namespace, plan: Plan, rank: int) -> None:
    if args.emulate:
        torch.set_num_threads(1)
    options = _options(args, plan)
    check_environment(plan, rank, options)  # before anything waits or loads user code
    model = plan_model_path(plan.model.path, args.plan, args.model)
    run_rank(plan, rank, model, options)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (hplan errors: one line on stderr)."""
    args = _parser().parse_args(argv)
    where = f" (node {args.node})" if args.node else ""
    try:
        plan = Plan.load(args.plan)
        local_rank = os.environ.get("LOCAL_RANK")
        rank = resolve_rank(plan, rank=args.rank, node=args.node, local_rank=local_rank)
        where = f" (rank {rank})"
        _run(args, plan, rank)
    except HplanError as exc:
        print(f"hplan run{where}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    return 0


def run_main() -> None:
    """Run :func:`main` as the process's entry point and exit with its code.

    After a failure the interpreter's teardown is skipped (``os._exit``): a broken process
    group can hang in it.
    """
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        os._exit(code)
    sys.exit(code)
