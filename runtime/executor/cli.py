"""``python -m hplan.runtime run PLAN ...``: what the launch scripts run on every rank.

Thin: parse the options, load the plan, find this process's rank, check the options once
(:func:`run_options`) and this machine, call :func:`hplan.runtime.executor.training.run_rank`.
An hplan error ends the process with one line on stderr and the error class's exit code (no
traceback). ``hplan run`` is this same command. The node comes from ``--node`` or
``HPLAN_NODE`` (the launch scripts export it: under torchrun ``--node`` would be taken for
an abbreviation of ``--node-rank``). torch's C++ warnings are limited to errors unless the
user set ``TORCH_CPP_LOG_LEVEL`` (a waiting rank would print a stack trace per retry).

``python -m hplan.runtime torchrun ARGS`` is torchrun itself, in this process; the launch
scripts run it so that a failed rank is one line: one the kernel killed (SIGKILL: out of
memory, most likely) with its node, device, predicted peak and last measured memory
(``contract/memory_use.py``), not torchrun's ``exitcode: -9`` table and traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from hplan.runtime.contract.errors import (
    ConfigError,
    HplanError,
    ModelFileError,
    PreemptedError,
    error_reason,
    report_internal_error,
)
from hplan.runtime.contract.memory import load_checked
from hplan.runtime.contract.memory_use import (
    killed_description,
    last_record,
    oom_cause,
    oom_kill_counts,
)
from hplan.runtime.contract.metrics_file import (
    check_fresh_metrics_dir,
    metrics_path,
    read_rank_metrics,
)
from hplan.runtime.contract.plan import Plan
from hplan.runtime.contract.quantities import S_PER_MIN

if TYPE_CHECKING:
    from hplan.runtime.executor.worker import RunOptions

NODE_ENV = "HPLAN_NODE"
"""Environment variable naming this node when ``--node`` is not given."""
PROG = "python -m hplan.runtime"
RUN_DESCRIPTION = (
    "Run this process's rank of a plan (what the launch scripts call under torchrun, one "
    "process per rank). Each rank runs (usable CPUs of its node) / (its ranks) torch threads "
    "unless OMP_NUM_THREADS is yours, and talks over its node's interface (the plan's, else "
    "the one holding its address) unless GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME is set. Rank "
    "0 prints progress (step, loss, samples/s, ETA) and a summary against the plan's "
    "prediction."
)


class OneLineErrors(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (no usage block), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see --help\n")


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of running one rank of a plan (shared with the rehearsal's ranks)."""
    parser.add_argument("plan", type=Path, help="plan.json")
    parser.add_argument(
        "--model",
        help="model.py (default: the path recorded in the plan, relative to plan.json's folder)",
    )
    parser.add_argument(
        "--node",
        default=os.environ.get(NODE_ENV) or None,
        help=f"this node's name in the plan; the rank comes from LOCAL_RANK (default: ${NODE_ENV})",
    )
    parser.add_argument("--rank", type=int, help="plan rank (instead of --node)")
    parser.add_argument(
        "--steps",
        type=int,
        help="optimizer steps to train (after --resume: from the checkpoint on); default: the "
        "plan's (`hplan solve --steps N` or --epochs E)",
    )
    parser.add_argument("--metrics-dir", type=Path, help="write rank-<r>.jsonl here")
    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        help="save checkpoints here (every --checkpoint-every-* and at the end)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint in --checkpoint-dir, whatever plan wrote it",
    )
    parser.add_argument(
        "--checkpoint-every-steps", type=int, help="save a checkpoint every N steps"
    )
    parser.add_argument(
        "--checkpoint-every-min",
        type=float,
        help="save a checkpoint every M minutes (default 10 when no interval is given)",
    )
    parser.add_argument(
        "--sync-checkpoints",
        action="store_true",
        help="write checkpoints while training waits (default: in the background)",
    )
    parser.add_argument(
        "--heartbeat-timeout-s",
        type=float,
        default=30.0,
        help="end the job when a peer shows no sign of life for this long (default 30)",
    )
    parser.add_argument(
        "--master-port",
        type=int,
        help="rendezvous port when not under torchrun (default: $MASTER_PORT, else the plan's)",
    )
    parser.add_argument(
        "--no-rebalance",
        action="store_true",
        help="keep the plan's batch shares for the whole run (default: replicas of one stage "
        "that sync every step move samples to the faster ones as measured; the training "
        "is the same)",
    )
    parser.add_argument(
        "--elastic",
        action="store_true",
        help="one process of an elastic run (the launch scripts of `hplan solve --elastic` "
        "pass it): take the plan of the family for the nodes torchrun's rendezvous brought, "
        "resume from the newest checkpoint in --checkpoint-dir (required: a folder every node "
        "reads and writes), count --steps over the whole run",
    )
    parser.add_argument(
        "--join-probation-s",
        type=float,
        default=20.0,
        help="elastic: how long a node that arrives while the run trains must wait, alive, "
        "before the run takes it in (doubled for each loss of that node in the last 30 "
        "minutes, so a flapping node cannot restart the run over and over; default 20)",
    )
    parser.add_argument(
        "--verify-dir",
        type=Path,
        help="run step one with dropout off and dump its synced gradients and updated "
        "parameters here (what `hplan rehearse --verify` compares)",
    )


def run_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m hplan.runtime`` (one command: ``run``)."""
    parser = OneLineErrors(prog=PROG)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineErrors)
    run = commands.add_parser(
        "run",
        help="run this process's rank of a plan",
        description=RUN_DESCRIPTION,
    )
    add_run_arguments(run)
    check = commands.add_parser(
        "check",
        help="check a node's ranks of a plan before torchrun starts",
        description="Check what `run` checks before joining, for every rank of this node "
        "(the options, the training length, the plan's backend and devices on this "
        "machine, the network interface, the model file), so that a mistake is one line "
        "and exit code 2 before torchrun starts; the launch scripts run it first.",
    )
    add_run_arguments(check)
    commands.add_parser(
        "torchrun",
        help="torchrun itself, reporting each failed rank in one line",
        description="Run torchrun (torch.distributed.run, same arguments) in this process; "
        "each rank that fails is then one line, and a rank the kernel killed (SIGKILL) names "
        "its node, device, predicted peak and last measured memory (the launch scripts use "
        "it). See `torchrun --help` for the arguments.",
        add_help=False,
    )
    return parser


def command_parser(prog: str) -> argparse.ArgumentParser:
    """The ``run`` command's own parser, under another program name (``hplan run``)."""
    parser = OneLineErrors(
        prog=prog,
        description=RUN_DESCRIPTION,
    )
    add_run_arguments(parser)
    return parser


def run_options(
    args: argparse.Namespace,
    plan: Plan,
    *,
    device: str | None = None,
    backend: str | None = None,
    master_host: str | None = None,
    warn_model_change: bool = True,
    rebalance: bool = True,
) -> RunOptions:
    """The run options of :func:`add_run_arguments`' arguments, checked against ``plan``: a
    launch's one validation of its options (the keywords are what the launcher sets beyond
    the command line; ``rebalance=False`` overrides ``--no-rebalance``'s absence).

    Raises:
        ConfigError: a value out of range, or one the plan cannot run with.
    """
    from hplan.runtime.executor.worker import RunOptions

    minutes = args.checkpoint_every_min
    if minutes is not None and not (math.isfinite(minutes) and minutes > 0):
        raise ConfigError(f"--checkpoint-every-min {minutes} must be a finite number > 0")
    options = RunOptions(
        steps=args.steps,
        metrics_dir=args.metrics_dir,
        checkpoint_dir=args.checkpoint_dir,
        verify_dir=args.verify_dir,
        device=device,
        backend=backend,
        master_host=master_host,
        master_port=args.master_port,
        warn_model_change=warn_model_change,
        resume=args.resume,
        checkpoint_every_steps=args.checkpoint_every_steps,
        checkpoint_every_s=None if minutes is None else minutes * S_PER_MIN,
        async_checkpoints=not args.sync_checkpoints,
        heartbeat_timeout_s=args.heartbeat_timeout_s,
        rebalance=rebalance and not args.no_rebalance,
    )
    return options.for_plan(plan)


def _run(args: argparse.Namespace, plan: Plan, rank: int) -> None:
    from hplan.runtime.capture.model_file import plan_model_path
    from hplan.runtime.executor.training import run_rank
    from hplan.runtime.executor.worker import check_environment

    options = run_options(args, plan)  # before anything waits or loads user code
    check_environment(plan, rank, options)
    if options.metrics_dir is not None:
        check_fresh_metrics_dir(options.metrics_dir, [rank])
    run_rank(plan, rank, plan_model_path(plan.model.path, args.plan, args.model), options)


def check_node(args: argparse.Namespace, plan: Plan) -> None:
    """``check``: what :func:`_run` checks before anything waits, for every rank of the
    node (``--node``/``HPLAN_NODE``, or ``--rank``), without joining or loading user code.

    Raises:
        HplanError: the first problem, naming the option or the file and the fix.
    """
    from hplan.runtime.capture.model_file import plan_model_path
    from hplan.runtime.executor.machine import bind_interface
    from hplan.runtime.executor.rendezvous import resolve_rank
    from hplan.runtime.executor.worker import check_environment, run_backend

    options = run_options(args, plan)
    first = resolve_rank(plan, rank=args.rank, node=args.node, local_rank="0")
    node = plan.ranks[first].node
    ranks = [first] if args.rank is not None else [r.rank for r in plan.ranks if r.node == node]
    for rank in ranks:
        check_environment(plan, rank, options)
    if options.metrics_dir is not None:
        check_fresh_metrics_dir(options.metrics_dir, ranks)
    bind_interface(plan.node(node), run_backend(plan, options), {})
    model = plan_model_path(plan.model.path, args.plan, args.model)  # checks the plan's own
    if not model.is_file():
        raise ModelFileError(f"--model {str(model)!r} is not a file; pass the path of model.py")


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (hplan errors: one line on stderr)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["torchrun"]:
        return torchrun_main(argv[1:])
    args = run_parser().parse_args(argv)
    if args.command == "check":
        return _check_main(args)
    if args.elastic:
        return run_elastic_process(args)
    return run_one_rank(args, _run)


def _check_main(args: argparse.Namespace) -> int:
    from hplan.runtime.executor.elastic.entry import check_elastic

    where = f" (node {args.node})" if args.node else ""
    try:
        if args.elastic:
            check_elastic(args, run_options)
        else:
            check_node(args, load_checked(args.plan))
    except KeyboardInterrupt:
        return 130
    except HplanError as exc:
        print(f"hplan run{where}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    return 0


def run_command(argv: list[str], *, prog: str) -> int:
    """``run``'s arguments (without the word ``run``) under the name ``prog``; returns the
    exit code. ``--help`` prints the runtime's options."""
    args = command_parser(prog).parse_args(argv)
    if args.elastic:
        return run_elastic_process(args)
    return run_one_rank(args, _run)


def run_elastic_process(args: argparse.Namespace) -> int:
    """``run --elastic``: one process of an elastic run (``executor/elastic/entry.py``);
    returns the exit code. A run that ends on every node (no plan fits the nodes there)
    exits 0, so that torchrun's agent does not restart it: the launch script's torchrun
    wrapper then exits with the run's code (:func:`torchrun_main`)."""
    from hplan.runtime.executor.elastic.entry import run_elastic
    from hplan.runtime.executor.elastic.start import ElasticEnd

    where = f" (node {args.node})" if args.node else ""

    def run() -> None:
        try:
            run_elastic(args, run_options)
        except ElasticEnd as end:
            print(f"hplan run{where}: {end}", file=sys.stderr, flush=True)
        except PreemptedError as stop:  # a node joins (or the whole job was stopped)
            print(
                f"hplan run{where}: torchrun's agent stopped this round (a node joins, or the "
                f"job was stopped): {stop}".replace("; resume with --resume", ""),
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(stop.exit_code) from None

    return exit_code_of(run, lambda: where)


def exit_code_of(run: Callable[[], None], where: Callable[[], str]) -> int:
    """Run ``run``; its exit code: 0, an hplan error's (its one line on stderr, prefixed by
    ``hplan run`` and ``where()``), 130 on Ctrl-C, or an internal error's one line."""
    try:
        run()
    except HplanError as exc:
        print(f"hplan run{where()}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        if os.environ.get("HPLAN_DEBUG"):
            for note in getattr(exc, "__notes__", ()):
                print(note, file=sys.stderr, flush=True)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a bug: one line, the traceback only when asked for
        return report_internal_error(exc, f"hplan run{where()}")
    return 0


def run_one_rank(
    args: argparse.Namespace, run: Callable[[argparse.Namespace, Plan, int], None]
) -> int:
    """Load the plan, find this process's rank and ``run`` it; hplan errors become one line
    on stderr and their exit code."""
    from hplan.runtime.executor.rendezvous import resolve_rank

    where = {"at": f" (node {args.node})" if args.node else ""}

    def run_rank() -> None:
        plan = load_checked(args.plan)
        local_rank = os.environ.get("LOCAL_RANK")
        rank = resolve_rank(plan, rank=args.rank, node=args.node, local_rank=local_rank)
        where["at"] = f" (rank {rank})"
        run(args, plan, rank)

    return exit_code_of(run_rank, lambda: where["at"])


def torchrun_main(argv: list[str]) -> int:
    """``torchrun ARGV`` in this process; returns its exit code: 0, the first failed
    rank's own (1 when a signal ended it), or 128 + N when signal N stopped torchrun.

    Each failed rank is one line on stderr (:func:`failure_line`); its own error is the
    ``hplan run (rank R)`` line above it.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    ranks = _RankContext.of(args)
    oom_before = oom_kill_counts()
    started_unix_s = time.time()
    try:
        run(args)
    except RendezvousError as exc:  # elastic: too few nodes, or the rendezvous host is gone
        print(rendezvous_failure_line(args, exc), file=sys.stderr, flush=True)
        return 1
    except ChildFailedError as exc:
        for _, failure in sorted(exc.failures.items()):
            line = ranks.failure_line(failure.local_rank, failure.exitcode, oom_before)
            print(line, file=sys.stderr, flush=True)
        first = exc.get_first_failure()[1].exitcode
        return first if first > 0 else 1
    except SignalException as exc:  # torchrun stopped its ranks (SIGTERM: they checkpoint)
        return 128 + int(exc.sigval)
    return ranks.elastic_end_code(started_unix_s)


def rendezvous_failure_line(args: argparse.Namespace, exc: Exception) -> str:
    """One line for an elastic rendezvous that failed: too few nodes within the join
    timeout, or its store (on the rendezvous host, the run's one single point of failure)
    gone."""
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    where = args.rdzv_endpoint
    if isinstance(exc, RendezvousTimeoutError):
        conf = dict(item.split("=", 1) for item in str(args.rdzv_conf).split(",") if "=" in item)
        within = conf.get("join_timeout", "600")
        return (
            f"hplan: elastic: fewer than {str(args.nnodes).split(':')[0]} nodes met at the "
            f"rendezvous {where} within {within} s (HPLAN_JOIN_TIMEOUT_S); start more nodes' "
            "launch scripts (the run resumes from its newest checkpoint)"
        )
    return (
        f"hplan: elastic: the rendezvous at {where} failed ({error_reason(exc)}): its host "
        "is the run's one single point of failure; when it is lost, start every node's "
        "launch script again (the run resumes from its newest checkpoint)"
    )


@dataclass(frozen=True)
class _RankContext:
    """What :func:`torchrun_main` knows of the ranks it starts: the plan, this node and the
    metrics folder of ``-m hplan.runtime run PLAN ...`` (None each when it cannot tell)."""

    plan: Plan | None
    node: str | None
    rank: int | None
    metrics_dir: Path | None
    checkpoint_dir: Path | None = None
    """An elastic run's shared folder (None: not elastic)."""

    @classmethod
    def of(cls, args: argparse.Namespace) -> _RankContext:
        """From torchrun's parsed arguments (its ``training_script_args``)."""
        script_args = list(args.training_script_args)
        if not (args.module and args.training_script == "hplan.runtime" and script_args):
            return cls(None, None, None, None)
        if script_args[0] != "run":
            return cls(None, None, None, None)
        try:
            known, _ = command_parser(PROG).parse_known_args(script_args[1:])
            plan = Plan.load(known.plan)
        except (SystemExit, HplanError):  # the ranks say what is wrong, each in one line
            return cls(None, None, None, None)
        shared = known.checkpoint_dir if known.elastic else None
        return cls(plan, known.node, known.rank, known.metrics_dir, shared)

    def elastic_end_code(self, since_unix_s: float) -> int:
        """An elastic run's exit code once its ranks exited 0: the code of the run's
        ``ended`` event since ``since_unix_s`` (its line printed when not 0); 0 otherwise."""
        from hplan.runtime.contract.elastic import RunEventKind, SharedRunDir

        if self.checkpoint_dir is None:
            return 0
        ended = [
            e
            for e in SharedRunDir(self.checkpoint_dir).events()
            if e.kind is RunEventKind.ENDED and e.unix_s >= since_unix_s
        ]
        if not ended or not ended[-1].exit_code:
            return 0
        print(f"hplan: elastic: the run ended: {ended[-1].detail}", file=sys.stderr, flush=True)
        return ended[-1].exit_code

    def failure_line(self, local_rank: int, exit_code: int, oom_before: dict[str, int]) -> str:
        """One line on how the rank of ``local_rank`` ended with ``exit_code`` (negative: a
        signal)."""
        from hplan.runtime.executor.rendezvous import resolve_rank

        rank = None
        if self.plan is not None:
            try:
                rank = resolve_rank(
                    self.plan, rank=self.rank, node=self.node, local_rank=str(local_rank)
                )
            except HplanError:
                rank = None
        who = f"rank {rank}" if rank is not None else f"local rank {local_rank}"
        prefix = f"hplan run ({who}"
        prefix += f", node {self.node})" if self.node else ")"
        if exit_code > 0:
            return f"{prefix}: exited with code {exit_code} (its error is above)"
        if exit_code != -signal.SIGKILL:
            return f"{prefix}: stopped by {_signal_name(-exit_code)}"
        cause = oom_cause(oom_before, oom_kill_counts())
        if self.plan is None or rank is None:
            return f"{prefix}: killed by SIGKILL ({cause})"
        metrics = metrics_path(self.metrics_dir, rank) if self.metrics_dir else None
        last = None
        if metrics is not None and metrics.is_file():
            with contextlib.suppress(HplanError, OSError):
                last = last_record(read_rank_metrics(metrics))
        return f"{prefix}: {killed_description(self.plan, rank, cause, last, metrics)}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def exit_with(code: int) -> NoReturn:
    """Exit with ``code``; after a failure skip the interpreter's teardown (``os._exit``):
    a broken process group can hang in it."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        os._exit(code)
    sys.exit(code)


def run_main() -> None:
    """Run :func:`main` as the process's entry point and exit with its code."""
    exit_with(main())
