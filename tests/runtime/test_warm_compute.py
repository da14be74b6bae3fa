"""Warm compute times for the stretched emulation of cpu plans (runtime/rehearsal/warm_compute.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from hplan.planner.api import SolveRequest, plan_training
from hplan.runtime.executor.data import MicroBatch
from hplan.runtime.rehearsal.rehearse import rehearse
from hplan.runtime.rehearsal.warm_compute import REPEATS, Sample, WarmTimer, WarmTimes

ROOT = Path(__file__).resolve().parents[2]
GPT = ROOT / "examples" / "gpt" / "model.py"
CLUSTERS = ROOT / "examples" / "clusters"


class _Stage(nn.Module):
    is_last = False

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 64)
        self.dropout = nn.Dropout(0.5)

    def forward(self, inputs: dict, received: dict) -> dict:
        return {"h": self.dropout(self.linear(received["x"]))}


def test_measuring_times_every_size_on_a_copy_and_leaves_the_run_untouched():
    torch.manual_seed(0)
    stage = _Stage()
    before = {n: p.detach().clone() for n, p in stage.named_parameters()}
    samples = {
        size: Sample(
            inputs={},
            received={"x": torch.randn(size, 64, requires_grad=True)},
            microbatch=MicroBatch(0, size, {}, None),
            grads={"h": torch.ones(size, 64)},
        )
        for size in (2, 8)
    }
    calls = []

    def forward(work, sample, received):
        calls.append(work)
        return work({}, received), None

    def pairs(outputs, loss, grads):
        return [outputs["h"]], [grads["h"]]

    rng = torch.get_rng_state()
    timer = WarmTimer(
        stage, samples, forward, pairs, lambda p: torch.optim.AdamW(p, lr=0.1),
        recompute=False, device=torch.device("cpu"),
    )  # fmt: skip
    with pytest.raises(ValueError, match="no warm-compute round"):
        timer.result()
    rounds = [timer.time_round() for _ in range(3)]
    warm = timer.result()
    assert set(warm.forward_s) == set(warm.backward_s) == {2, 8}
    assert all(v > 0 for v in (*warm.forward_s.values(), *warm.backward_s.values()))
    assert warm.optimizer_s > 0
    for size in (2, 8):  # each figure is the median of the rounds' figures
        assert warm.forward_s[size] == sorted(r.forward_s[size] for r in rounds)[1]
        assert warm.backward_s[size] == sorted(r.backward_s[size] for r in rounds)[1]
    assert warm.optimizer_s == sorted(r.optimizer_s for r in rounds)[1]
    assert len(calls) == 3 * 2 * (REPEATS + 1) and all(c is not stage for c in calls)
    assert torch.equal(torch.get_rng_state(), rng)  # dropout drew from a forked stream
    assert all(p.grad is None for p in stage.parameters())
    assert all(torch.equal(p, before[n]) for n, p in stage.named_parameters())
    assert all(s.received["x"].grad is None for s in samples.values())
    again = WarmTimer(
        stage, samples, forward, pairs, lambda p: torch.optim.AdamW(p, lr=0.1),
        recompute=True, device=torch.device("cpu"),
    )  # fmt: skip
    again.time_round()
    assert again.result().backward_s[8] > again.result().forward_s[8]  # recomputed forward
    assert "micro-batch 2: forward" in warm.describe()


def test_a_rehearsed_cpu_plan_replays_each_ranks_warm_times_after_the_first_step(tmp_path):
    request = SolveRequest(
        model_path=GPT, cluster_path=CLUSTERS / "cpu-rehearsal.yaml", global_batch_size=16
    )
    plan = plan_training(request).plan
    dilation = 3.0
    rehearse(plan, steps=3, metrics_dir=tmp_path, dilation=dilation, timeout_s=240)
    assert "cold_factor" not in json.loads((tmp_path / "emulation.json").read_text())
    for rank in plan.ranks:
        log = (tmp_path / f"rank-{rank.rank}.log").read_text()
        assert f"rank {rank.rank}: warm compute (CPU ms)" in log
        line = next(x for x in log.splitlines() if "warm compute" in x)
        forward_ms = float(line.split("forward ")[1].split(",")[0])
        events = [json.loads(x) for x in (tmp_path / f"timeline-rank-{rank.rank}.jsonl").open()]
        later = [e for rec in events if rec["step"] >= 1 for e in rec["events"]]
        forwards = [e for e in later if e["track"] == "compute" and ".F." in e["name"]]
        assert forwards
        for event in forwards:  # each forward lasts at least dilation x the warm forward
            assert (event["end_s"] - event["start_s"]) * 1e3 >= dilation * forward_ms * 0.999
        metrics = [json.loads(x) for x in (tmp_path / f"rank-{rank.rank}.jsonl").open()]
        assert all(0 < m["forward_time_s"] < m["compute_time_s"] for m in metrics)


def test_warm_times_describe_themselves_in_cpu_milliseconds():
    warm = WarmTimes({4: 0.001}, {4: 0.002}, 0.0005)
    assert warm.describe() == (
        "warm compute (CPU ms) micro-batch 4: forward 1.000, backward 2.000; optimizer 0.500"
    )
