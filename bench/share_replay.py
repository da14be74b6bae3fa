"""Replay the runtime's share re-balancing on the per-step times of kept cluster runs.

``bench/real_cluster.py --keep DIR`` keeps every rank's metrics of every run. For each
hplan round of each case whose plan's replicas are one stage each, this replays the steps
under three policies and prints the mean step of each:

- *fixed*: the plan's shares throughout;
- *runtime*: ``executor/control/rebalance.py``'s ``ShareBalancer`` (the runtime's own code), fed
  each step's speeds, deciding every ``--every`` steps on the speeds posted one decision
  earlier (the step control's one-exchange lag);
- *hindsight*: the single best split for the whole run, from every step's speeds (what no
  policy can know in advance).

A replayed step lasts its slowest rank's compute and fixed time at the replayed shares
(``rebalance.step_speed``): each rank's measured sustained compute a sample (CPU time over
its quota where the quota binds) times its share, plus its sustained time outside compute
(under a binding quota all its CPU time outside compute over the quota, else its optimizer
step). All-reduce and waits are left out, so the ratios
say how much closer to balance a policy keeps the ranks, not the run's speed.

    python bench/share_replay.py DIR [--every 5]

Where a run moved its shares (the runtime re-balanced it), its per-sample times are replayed
the same way: a sample's time hardly depends on the share.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from common import console, table

from hplan.runtime.contract.metrics_file import StepMetrics, read_rank_metrics
from hplan.runtime.contract.plan import Plan
from hplan.runtime.executor.control.rebalance import (
    ReplicaSpeed,
    ShareBalancer,
    balanced_shares,
    predicted_step_s,
    step_speed,
)

Speeds = list[list[ReplicaSpeed]]
"""Per step, per replica: the measured sustained seconds a sample and optimizer seconds."""


def step_speeds(metrics_dir: Path, plan: Plan) -> Speeds:
    """Each step's per-replica speeds (the first step, a warm-up, left out)."""
    by_replica: list[list[StepMetrics]] = []
    for replica in range(plan.num_replicas):
        (rank,) = plan.replica_ranks(replica)
        by_replica.append(read_rank_metrics(metrics_dir / f"rank-{rank.rank}.jsonl")[1:])
    steps = min(len(records) for records in by_replica)
    return [[step_speed(records[t]) for records in by_replica] for t in range(steps)]


def _record(replica: int, samples: int, speed: ReplicaSpeed) -> StepMetrics:
    return StepMetrics(
        rank=replica, replica=replica, stage=0, step=0, step_time_s=0.0,
        compute_time_s=speed.compute_per_sample_s * samples, p2p_time_s=0.0,
        wait_time_s=0.0, allreduce_time_s=0.0, optimizer_time_s=speed.fixed_s,
        other_time_s=0.0, loss=None, samples=samples, peak_memory_bytes=0,
    )  # fmt: skip


def replay_runtime(plan: Plan, speeds: Speeds, every: int) -> tuple[float, int]:
    """(mean step seconds, changes) under ``ShareBalancer``."""
    balancers = [
        ShareBalancer(plan, plan.replica_ranks(r)[0].rank) for r in range(plan.num_replicas)
    ]
    total_s, posted = 0.0, None
    for t, now in enumerate(speeds):
        shares = balancers[0].shares
        total_s += predicted_step_s(shares, now)
        for b, speed in zip(balancers, now, strict=True):
            b.observe(_record(b.replica, shares[b.replica], speed))
        if (t + 1) % every:
            continue
        if posted is not None:  # what was posted at the previous exchange
            epoch, values = posted
            for b in balancers:
                b.agreed(epoch, values, t + 1)
        values = [b.posted() for b in balancers]
        posted = (balancers[0].epoch, [None if v is None else v[1] for v in values])
    return total_s / len(speeds), len(balancers[0].changes)


def hindsight(plan: Plan, speeds: Speeds) -> tuple[float, tuple[int, ...]]:
    """(mean step seconds, shares) of the best fixed split for the whole run."""
    medians = [
        ReplicaSpeed(
            statistics.median(s[r].compute_per_sample_s for s in speeds),
            statistics.median(s[r].fixed_s for s in speeds),
        )
        for r in range(plan.num_replicas)
    ]
    batch = plan.global_batch_size
    shares = balanced_shares(batch, medians, [1] * len(medians), [batch] * len(medians))
    return statistics.fmean(predicted_step_s(shares, s) for s in speeds), shares


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("keep", type=Path, help="a folder `bench/real_cluster.py --keep` wrote")
    parser.add_argument(
        "--every", type=int, default=5, help="steps between two decisions (default: 5)"
    )
    args = parser.parse_args(argv)
    cases = sorted(args.keep.glob("case-*"))
    if not cases:
        parser.error(f"{args.keep} holds no case-* folders of bench/real_cluster.py --keep")
    out = table(
        "share policies replayed: mean step of the slowest rank's compute and fixed time",
        ["case", "run", "plan", "fixed ms", "runtime", "changes", "hindsight", "best split"],
    )
    for case in cases:
        plan = Plan.load(case / "plan" / "plan.json")
        if plan.fixed_shares_reason() is not None:
            continue
        shares = [plan.replica_ranks(r)[0].num_samples for r in range(plan.num_replicas)]
        for metrics in sorted(case.glob("metrics-r*")):
            speeds = step_speeds(metrics, plan)
            fixed_s = statistics.fmean(predicted_step_s(shares, s) for s in speeds)
            runtime_s, changes = replay_runtime(plan, speeds, args.every)
            best_s, best = hindsight(plan, speeds)
            out.add_row(
                case.name, metrics.name, "|".join(map(str, shares)), f"{fixed_s * 1e3:.1f}",
                f"{fixed_s / runtime_s:.3f}x", str(changes), f"{fixed_s / best_s:.3f}x",
                "|".join(map(str, best)),
            )  # fmt: skip
    console.print(out)


if __name__ == "__main__":
    sys.exit(main())
