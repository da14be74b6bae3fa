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
