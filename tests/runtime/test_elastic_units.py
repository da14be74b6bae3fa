"""The elastic run's parts on their own: the shared folder, joins and their probation, the
joiner's refusals, the segment's cause (the whole path: ``test_elastic.py``)."""

from __future__ import annotations

import argparse
import hashlib
import math
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hplan.runtime.contract.elastic import (
    JoinRequest,
    PlanFamily,
    RunEvent,
    RunEventKind,
    RunState,
    SharedRunDir,
    hplan_version,
    members_key,
)
from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.executor.elastic import joining
from hplan.runtime.executor.elastic.joining import (
    FINISHED_EXIT_CODE,
    RunFinished,
    check_joiner,
    running_state,
    wait_to_join,
)
from hplan.runtime.executor.elastic.segment import PROBATION_S, admission_due, probation_s
from hplan.runtime.executor.elastic.start import TorchrunEnv
from hplan.runtime.rehearsal.launcher import free_port

NOW_S = 1_000_000.0


@pytest.fixture
def rendezvous() -> Iterator[int]:
    """A port where something listens, as the run's rendezvous store does."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield server.getsockname()[1]


def _family(model_digest: str = "m" * 64, **changes: object) -> PlanFamily:
    fields: dict[str, object] = dict(
        schema_version=1, hplan_version=hplan_version(), nodes=("a", "b", "c"),
        processes_per_node={"a": 1, "b": 1, "c": 1}, min_nodes=2,
        rendezvous_host="127.0.0.1", rendezvous_port=29500, run_id="hplan-x",
        cluster_file="cluster.yaml", capture_file="capture.json", model_digest=model_digest,
        plans={"a+b+c": "plan.json", "a+b": "family/a+b/plan.json"},
    )  # fmt: skip
    fields.update(changes)
    return PlanFamily(**fields)  # type: ignore[arg-type]


def _state(members: tuple[str, ...], updated_unix_s: float, family_digest: str) -> RunState:
    return RunState(
        segment=1, members=members, plan_path="p", plan_digest="d",
        family_digest=family_digest, steps_done=40, first_step=35,
        started_unix_s=updated_unix_s - 10, updated_unix_s=updated_unix_s,
    )  # fmt: skip


def _lost(node: str, unix_s: float) -> RunEvent:
    return RunEvent(kind=RunEventKind.LOST, unix_s=unix_s, node=node)


def test_members_key_is_the_sorted_names() -> None:
    assert members_key(["c", "a", "b", "a"]) == "a+b+c"


def test_a_family_round_trips_and_a_missing_one_is_one_line(tmp_path: Path) -> None:
    family = _family()
    family.save(tmp_path / "family.json")
    assert PlanFamily.load(tmp_path) == family
    assert family.plan_path(tmp_path, ["b", "a"]) == tmp_path / "family/a+b/plan.json"
    assert family.plan_path(tmp_path, ["a"]) is None
    with pytest.raises(ConfigError, match=r"hplan solve \.\.\. --elastic"):
        PlanFamily.load(tmp_path / "nowhere")


def test_the_shared_folder_keeps_state_events_and_join_requests(tmp_path: Path) -> None:
    shared = SharedRunDir(tmp_path)
    assert shared.read_state() is None and shared.events() == []
    state = _state(("a", "b"), NOW_S, "f")
    shared.write_state(state)
    assert shared.read_state() == state
    shared.append_event(_lost("c", NOW_S))
    with shared.events_file.open("a") as out:
        out.write("{half a line\n")  # a torn or foreign line is skipped, not fatal
    shared.append_event(RunEvent(kind=RunEventKind.ENDED, unix_s=NOW_S + 1, exit_code=0))
    assert [e.kind for e in shared.events()] == [RunEventKind.LOST, RunEventKind.ENDED]
    shared.write_join_request(JoinRequest("c", "f", NOW_S, NOW_S))
    assert shared.join_requests() == [JoinRequest("c", "f", NOW_S, NOW_S)]
    shared.admit("c")
    shared.clear_join("c")
    assert shared.join_requests() == [] and not shared.admit_file("c").exists()


def test_probation_doubles_for_each_recent_loss_of_the_node_up_to_a_cap() -> None:
    assert probation_s("c", [], NOW_S) == PROBATION_S
    recent = [_lost("c", NOW_S - 60), _lost("c", NOW_S - 600), _lost("b", NOW_S - 60)]
    assert probation_s("c", recent, NOW_S) == 4 * PROBATION_S
    old = [_lost("c", NOW_S - 7200)]  # long ago: forgiven
    assert probation_s("c", old, NOW_S) == PROBATION_S
    flapping = [_lost("c", NOW_S - i) for i in range(1, 30)]
    assert probation_s("c", flapping, NOW_S) == 600.0


def test_only_fresh_requests_of_this_family_past_their_probation_are_admitted() -> None:
    def request(node: str, waited_s: float, beat_age_s: float = 0.5, digest: str = "f"):
        return JoinRequest(node, digest, NOW_S - waited_s, NOW_S - beat_age_s)

    requests = [
        request("c", PROBATION_S + 1),  # due
        request("d", PROBATION_S - 1),  # still on probation
        request("e", PROBATION_S + 1, beat_age_s=30),  # stale: it left
        request("f", PROBATION_S + 1, digest="other"),  # another family
        request("a", PROBATION_S + 1),  # a member's script started again: it is gone
    ]
    due = admission_due(
        requests, members=("a", "b"), family_digest="f", events=[], now_unix_s=NOW_S
    )
    assert [r.node for r in due] == ["c", "a"]
    lost_recently = [_lost("c", NOW_S - 60)]
    again = admission_due(
        requests, members=("a", "b"), family_digest="f", events=lost_recently, now_unix_s=NOW_S
    )
    assert [r.node for r in again] == ["a"]  # c, lost a minute ago, waits twice as long


def test_a_joiner_with_another_model_file_or_version_or_node_is_refused(tmp_path: Path) -> None:
    model = tmp_path / "model.py"
    model.write_text("x = 1\n")
    digest = hashlib.sha256(model.read_bytes()).hexdigest()
    check_joiner(_family(digest), tmp_path, "c", model)  # the same file: fine
    with pytest.raises(ConfigError, match="is not the one the plan family was solved for"):
        check_joiner(_family("0" * 64), tmp_path, "c", model)
    with pytest.raises(ConfigError, match="install the same version on every node"):
        check_joiner(_family(digest, hplan_version="0.0.1"), tmp_path, "c", model)
    with pytest.raises(ConfigError, match="is not in the plan family"):
        check_joiner(_family(digest), tmp_path, "z", model)


def test_a_joiner_of_another_family_is_refused_and_the_refusal_recorded(
    tmp_path: Path, rendezvous: int
) -> None:
    shared = SharedRunDir(tmp_path)
    shared.write_state(_state(("a", "b"), time.time(), "another-family"))
    with pytest.raises(ConfigError, match="the run goes on without it"):
        wait_to_join(_family(rendezvous_port=rendezvous), shared, "c")
    assert [e.kind for e in shared.events()] == [RunEventKind.REFUSED]


def test_a_joiner_waits_for_its_admission_then_leaves_no_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rendezvous: int
) -> None:
    monkeypatch.setattr(joining, "BEAT_S", 0.05)
    family = _family(rendezvous_port=rendezvous)
    shared = SharedRunDir(tmp_path)
    shared.write_state(_state(("a", "b"), time.time(), family.digest()))

    def run_admits() -> None:
        while not shared.join_requests():
            time.sleep(0.02)
        shared.admit("c")

    admitter = threading.Thread(target=run_admits)
    admitter.start()
    wait_to_join(family, shared, "c")
    admitter.join()
    assert shared.join_requests() == []
    assert [e.kind for e in shared.events()] == [RunEventKind.JOIN_WAITING]


def test_no_run_training_means_no_wait(tmp_path: Path) -> None:
    family = _family()
    shared = SharedRunDir(tmp_path)
    wait_to_join(family, shared, "c")  # nothing there: at once
    shared.write_state(_state(("a", "b"), time.time() - 3600, family.digest()))
    assert running_state(shared, time.time()) is None  # silent for an hour: not running
    shared.write_state(_state(("a", "b"), time.time(), family.digest()))
    assert running_state(shared, time.time()) is not None
    shared.append_event(RunEvent(kind=RunEventKind.ENDED, unix_s=time.time() + 1, exit_code=0))
    assert running_state(shared, time.time()) is None  # ended


def test_an_elastic_process_outside_torchrun_is_told_how_to_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(ConfigError, match=r"launch script from `hplan solve \.\.\. --elastic`"):
        TorchrunEnv.read()


def test_a_rendezvous_that_fails_is_one_line_naming_the_fix() -> None:
    import argparse

    from torch.distributed.elastic.rendezvous.api import (
        RendezvousConnectionError,
        RendezvousTimeoutError,
    )

    from hplan.runtime.executor.cli import rendezvous_failure_line

    args = argparse.Namespace(
        rdzv_endpoint="10.0.0.1:29500",
        nnodes="2:3",
        rdzv_conf="last_call_timeout=3,join_timeout=60",
    )
    few = rendezvous_failure_line(args, RendezvousTimeoutError("timed out"))
    assert "fewer than 2 nodes met at the rendezvous 10.0.0.1:29500 within 60 s" in few
    gone = rendezvous_failure_line(args, RendezvousConnectionError("store gone"))
    assert "single point of failure" in gone and "\n" not in gone


def test_a_joiner_of_a_finished_run_is_told_so_and_one_of_a_run_whose_host_is_gone_starts(
    tmp_path: Path,
) -> None:
    family = _family(rendezvous_port=free_port())  # nothing listens there: the host is gone
    shared = SharedRunDir(tmp_path)
    shared.write_state(_state(("a", "b"), time.time(), family.digest()))
    assert running_state(shared, time.time()) is not None  # fresh, by its state alone
    assert running_state(shared, time.time(), family) is None
    wait_to_join(family, shared, "c")  # at once: start the agent, meet whoever is there
    shared.append_event(
        RunEvent(
            kind=RunEventKind.ENDED, unix_s=time.time() + 1, detail="trained 8 steps", exit_code=0
        )
    )
    with pytest.raises(RunFinished, match=r"has ended \(trained 8 steps\); nothing to join"):
        wait_to_join(family, shared, "c")
    assert RunFinished.exit_code == FINISHED_EXIT_CODE


@pytest.mark.parametrize("probation_s", [-1.0, math.nan, math.inf])
def test_a_join_probation_that_is_not_a_time_is_one_line(probation_s: float) -> None:
    from hplan.runtime.executor.elastic.entry import _required

    args = argparse.Namespace(
        checkpoint_dir=Path("ck"), node="a", rank=None, join_probation_s=probation_s,
        plan=Path("plan.json"),
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"--join-probation-s .* must be a finite number"):
        _required(args)
