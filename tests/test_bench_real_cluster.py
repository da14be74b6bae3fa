"""bench/real_cluster.py's options without a cluster (the benchmark itself needs root and
namespaces; `make test` does not run it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import real_cluster  # noqa: E402


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--models", "mlp,bert"], "--models: unknown 'bert'; valid: mlp, gpt"),
        (["--cases", "hetero,weird"], "--cases: unknown 'weird'; valid: hetero, homogeneous"),
    ],
)
def test_an_unknown_model_or_case_is_one_line_with_the_valid_ones(
    monkeypatch, capsys, argv, line
) -> None:
    monkeypatch.setattr(sys, "argv", ["real_cluster.py", *argv])
    monkeypatch.setattr(real_cluster, "available", lambda: pytest.fail("not checked first"))
    with pytest.raises(SystemExit) as exit_:
        real_cluster.main()
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"real_cluster.py: error: {line}"


def test_a_machine_without_namespaces_is_one_line_and_exit_0(monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["real_cluster.py"])
    monkeypatch.setattr(real_cluster, "available", lambda: "needs root")
    real_cluster.main()
    assert capsys.readouterr().out == "real_cluster: skipped: needs root\n"


def test_share_replay_reads_a_kept_run_and_replays_the_runtimes_policy(tmp_path, capsys) -> None:
    import share_replay

    from hplan.runtime.contract.metrics_file import StepMetrics, metrics_line
    from tests.fixtures.plans import ReplicaShape, make_plan

    model = ROOT / "examples" / "mlp" / "model.py"
    plan = make_plan(model, [ReplicaShape((-1,), micro_batch_size=8, num_samples=8)] * 2)
    case = tmp_path / "case-0"
    (case / "plan").mkdir(parents=True)
    (case / "plan" / "plan.json").write_text(plan.to_json(), encoding="utf-8")
    metrics = case / "metrics-r0"
    metrics.mkdir()
    for rank, per_sample_s in ((0, 0.001), (1, 0.0015)):  # rank 1 a third slower
        lines = [
            StepMetrics(
                rank=rank, replica=rank, stage=0, step=step, step_time_s=0.1,
                compute_time_s=per_sample_s * 8, p2p_time_s=0.0, wait_time_s=0.0,
                allreduce_time_s=0.0, optimizer_time_s=0.0, other_time_s=0.0, loss=None,
                samples=8, peak_memory_bytes=0,
            )
            for step in range(40)
        ]  # fmt: skip
        (metrics / f"rank-{rank}.jsonl").write_text(
            "".join(metrics_line(line) for line in lines), encoding="utf-8"
        )
    speeds = share_replay.step_speeds(metrics, plan)
    assert len(speeds) == 39  # the warm-up step left out
    mean_s, changes = share_replay.replay_runtime(plan, speeds, every=5)
    assert changes == 1 and mean_s < 0.012  # 8 | 8 ends at 12 ms; moved to 10 | 6: 10 ms
    best_s, best = share_replay.hindsight(plan, speeds)
    assert best == (10, 6) and best_s == pytest.approx(0.010)
    share_replay.main([str(tmp_path)])
    assert "1.200x" in capsys.readouterr().out
