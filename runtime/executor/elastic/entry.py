"""``run --elastic`` and ``check --elastic``: what an elastic launch script's processes do.

``check --elastic`` runs once per node before its torchrun agent starts: the usual checks of
the options, then the family's (this node's model file and hplan version), then, when a run
trains without this node, the wait to be taken in (``joining.py``). ``run --elastic`` is one
process under the agent: it starts a segment (``start.py``), trains its plan rank from the
newest checkpoint, or waits for the end when the plan gives it nothing to do.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from hplan.runtime.contract.elastic import PlanFamily, SharedRunDir
from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.executor.elastic.joining import check_joiner, wait_to_join
from hplan.runtime.executor.elastic.segment import ElasticSegment
from hplan.runtime.executor.elastic.start import start_segment

if TYPE_CHECKING:
    from hplan.runtime.contract.plan import Plan
    from hplan.runtime.executor.worker import RunOptions

    OptionsOf = Callable[[argparse.Namespace, Plan], RunOptions]
    """``cli.run_options``: the run's options from its arguments, checked against a plan."""

__all__ = ["check_elastic", "run_elastic"]

NEEDS_DIR = (
    "--elastic needs --checkpoint-dir DIR: a folder every node reads and writes (NFS or any "
    "shared file system; on one machine, any folder): the run's checkpoints and state live "
    "there across restarts"
)


def _required(args: argparse.Namespace) -> tuple[Path, str]:
    """The checkpoint folder and node name an elastic process needs.

    Raises:
        ConfigError: either is missing.
    """
    if args.checkpoint_dir is None:
        raise ConfigError(NEEDS_DIR)
    if not args.node:
        raise ConfigError("--elastic needs this node's name: --node NAME or HPLAN_NODE=NAME")
    if args.rank is not None:
        raise ConfigError("--elastic takes its rank from the plan for the nodes there; drop --rank")
    if not (math.isfinite(args.join_probation_s) and args.join_probation_s >= 0):
        raise ConfigError(
            f"--join-probation-s {args.join_probation_s} must be a finite number of seconds >= 0"
        )
    args.plan = Path(os.path.abspath(args.plan))  # paths other nodes read: no "..", no cwd
    return Path(os.path.abspath(args.checkpoint_dir)), args.node


def check_elastic(args: argparse.Namespace, options_of: OptionsOf) -> None:
    """``check --elastic``: this node may start its agent (waits while a run admits it).

    Raises:
        HplanError: the first problem (one line); a refused joiner's ``ConfigError``.
    """
    from hplan.runtime.capture.model_file import plan_model_path
    from hplan.runtime.contract.memory import load_checked

    checkpoint_dir, node = _required(args)
    plan = load_checked(args.plan)
    options_of(args, plan)  # the options' own checks
    family = PlanFamily.load(args.plan.parent)
    model = plan_model_path(plan.model.path, args.plan, args.model)
    check_joiner(family, args.plan.parent, node, model)
    wait_to_join(family, SharedRunDir(checkpoint_dir), node)


def run_elastic(args: argparse.Namespace, options_of: OptionsOf) -> None:
    """``run --elastic``: one process of a segment (see the module docstring).

    Raises:
        ElasticEnd: the members cannot train; caught by the caller (exit 0, the wrapper
            reports it).
        HplanError: this process failed (torchrun's agent restarts the round).
    """
    from hplan.runtime.capture.model_file import plan_model_path
    from hplan.runtime.executor.training import run_rank
    from hplan.runtime.executor.worker import check_environment

    checkpoint_dir, node = _required(args)
    start = start_segment(args.plan, node, checkpoint_dir)
    if start.rank is None:
        print(
            f"hplan: elastic: node {node} local rank {start.env.local_rank} has no rank in the "
            f"plan for {', '.join(start.members)}; it waits for the end",
            file=sys.stderr,
            flush=True,
        )
        start.wait_for_end()
        start.finish()
        return
    plan = start.plan
    options = replace(options_of(args, plan), resume=True)
    check_environment(plan, start.rank, options)
    metrics_root = args.metrics_dir or start.shared.root / "metrics"
    segment = ElasticSegment(start, metrics_root, args.join_probation_s)
    options = replace(options, metrics_dir=segment.metrics_dir)
    model = plan_model_path(plan.model.path, start.plan_path, args.model)
    run_rank(plan, start.rank, model, options, elastic=segment)
    if start.rank == 0:
        start.announce_end()
    start.finish()
