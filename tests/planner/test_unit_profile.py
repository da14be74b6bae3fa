"""Per-unit profiling: every unit timed on its real inputs, identical units shared, memory
measured; and `hplan profile --model` -> `hplan solve --profile` end to end."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import ClassVar

import pytest
import torch
from torch import nn

from hplan.planner.cli.main import main
from hplan.planner.frontend.capture import CaptureTensors
from hplan.planner.frontend.cost_graph import build_model_graph
from hplan.planner.profiling.microbench import Stopwatch, one_cpu_thread
from hplan.planner.profiling.profile_file import Profile
from hplan.planner.profiling.unit_memory import LiveBytes, measure_unit_memory
from hplan.planner.profiling.unit_profile import (
    UnitProfileOptions,
    first_sweep_sizes,
    profile_units,
    whole_model_notes,
)
from hplan.planner.profiling.windows import apportion, run_window, sustained
from hplan.runtime.capture.model_file import load_model_file
from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.plan import Plan
from tests.fixtures.clusters import two_cpu_nodes_yaml
from tests.fixtures.models import REPO_ROOT, write_model_file

GPT = REPO_ROOT / "examples" / "gpt" / "model.py"
FAST = UnitProfileOptions(micro_batch_sizes=(1, 2), num_warmup=1, window_s=0.0)
CPU_CLUSTER = """\
name: two-cpus
nodes:
  - name: a
    host: 127.0.0.1
    devices:
      - type: cpu
        count: 2
"""


@pytest.fixture
def tiny_gpt(monkeypatch):
    for name, value in {"LAYERS": "3", "WIDTH": "16", "HEADS": "2", "SEQ": "8"}.items():
        monkeypatch.setenv(f"HPLAN_GPT_{name}", value)
    return GPT


def test_every_unit_is_timed_and_identical_blocks_are_timed_once(tiny_gpt):
    model_file = load_model_file(tiny_gpt)
    graph = build_model_graph(model_file, tensors=CaptureTensors.CPU)
    steps = []
    result = profile_units(
        model_file, graph, torch.device("cpu"), "cpu", FAST, lambda *a: steps.append(a)
    )
    names = [u.name for u in graph.units]
    assert [(t.unit, t.micro_batch_size) for t in result.timings] == [
        (n, s) for n in names for s in (1, 2)
    ]
    assert result.shared_with == {"blocks.1": "blocks.0", "blocks.2": "blocks.0"}
    rounds = FAST.rounds
    assert rounds > 1  # every size is swept once per round, the rounds' medians combined
    assert len(steps) == rounds * 2 * len(names)
    assert all(total == len(steps) for *_, total in steps)
    assert [timed for unit, timed, _ in steps if unit == "blocks.2"] == [False] * (2 * rounds)
    assert all(t.forward_s.num_samples == rounds for t in result.timings)  # a window a round
    by_key = {(t.unit, t.micro_batch_size): t for t in result.timings}
    for timing in result.timings:
        assert timing.device == "cpu"
        assert timing.forward_s.median > 0 and timing.backward_s.median > 0
        assert timing.optimizer_s is not None and timing.optimizer_s > 0
        assert timing.peak_bytes >= timing.activation_bytes
    block_1, block_2 = by_key[("blocks.0", 1)], by_key[("blocks.0", 2)]
    assert block_2.activation_bytes == 2 * block_1.activation_bytes > 0
    assert by_key[("blocks.2", 2)].forward_s == block_2.forward_s


class _TickingClock:
    """A clock that advances by ``step_s`` each time it is read (exact in binary)."""

    def __init__(self, step_s: float = 2**-10) -> None:
        self.now_s = 0.0
        self.step_s = step_s

    def __call__(self) -> float:
        self.now_s += self.step_s
        return self.now_s


class _RecordingWatch(Stopwatch):
    """A CPU stopwatch on a ticking clock that records how long each window lasted."""

    windows: ClassVar[list[tuple[float, float]]] = []

    def __init__(self, device: torch.device, quota_cores: float | None = None) -> None:
        super().__init__(device, clock=_TickingClock(), cpu_clock=_TickingClock())

    def window(self, calls, window_s):
        started_s = self.clock()
        means = super().window(calls, window_s)
        self.windows.append((self.clock() - started_s, window_s))
        return means


@pytest.fixture
def ticking(monkeypatch):
    """Unit profiles timed on a ticking clock: every lap takes 2**-10 s."""
    import hplan.planner.profiling.unit_profile as unit_profile

    monkeypatch.setattr(unit_profile, "Stopwatch", _RecordingWatch)
    _RecordingWatch.windows = []
    return _RecordingWatch.windows


def test_a_window_lasts_at_least_its_minimum_and_reports_mean_laps():
    now = [0.0]

    def laps():
        now[0] += 0.1
        return [0.04, 0.06]

    assert run_window(laps, 2, 0.35, clock=lambda: now[0]) == pytest.approx([0.04, 0.06])
    assert now[0] == pytest.approx(0.4)  # four runs: the first check after >= 0.35 s stops
    now[0] = 0.0
    assert run_window(laps, 2, 0.0, clock=lambda: now[0]) == [0.04, 0.06]
    assert now[0] == pytest.approx(0.1)  # once at least
    watch = Stopwatch(torch.device("cpu"), clock=_TickingClock(), cpu_clock=_TickingClock())
    assert watch.window([lambda: None, lambda: None], 0.05) == [2**-10, 2**-10]


def test_a_cpu_windows_pauses_are_shared_out_by_cpu_time():
    # a quota's pause of 0.4 s landed in the second call: both used 0.1 s of CPU
    assert apportion([0.1, 0.5], [0.1, 0.1]) == pytest.approx([0.3, 0.3])
    assert apportion([0.1, 0.5], [0.05, 0.15]) == pytest.approx([0.15, 0.45])
    assert apportion([0.2, 0.1], [0.0, 0.0]) == [0.2, 0.1]  # no CPU time: as measured
    wall, cpu = _TickingClock(), _TickingClock(2**-12)
    pauses = iter([0.5])

    def paused() -> None:
        wall.now_s += next(pauses)  # the window's one run of this call is paused

    watch = Stopwatch(torch.device("cpu"), clock=wall, cpu_clock=cpu)
    first, second = watch.window([lambda: None, paused], 0.0)
    assert first == second == pytest.approx((2 * 2**-10 + 0.5) / 2)


def test_under_a_binding_cpu_quota_a_call_takes_its_cpu_time_over_the_quota():
    # a 0.45-core quota and one thread: 0.0315 s of CPU is 0.07 s sustained, whatever the
    # window's wall time (a burst at a full core's speed, or a pause landing in it)
    assert sustained([0.0315], [0.0315], 0.45, 1) == pytest.approx([0.07])
    assert sustained([0.1, 0.5], [0.1, 0.1], 0.45, 1) == pytest.approx([0.1 / 0.45] * 2)
    # no quota, or one that does not bind (1.5 cores for one thread): the wall time, shared
    assert sustained([0.1, 0.5], [0.1, 0.1], None, 1) == pytest.approx([0.3, 0.3])
    assert sustained([0.1, 0.5], [0.1, 0.1], 1.5, 1) == pytest.approx([0.3, 0.3])
    assert sustained([0.1, 0.5], [0.1, 0.1], 1.5, 2) == pytest.approx([0.1 / 1.5] * 2)
    wall, cpu = _TickingClock(), _TickingClock(2**-12)
    watch = Stopwatch(torch.device("cpu"), clock=wall, cpu_clock=cpu, quota_cores=0.5)
    with one_cpu_thread(torch.device("cpu")):
        assert watch.window([lambda: None], 0.0) == [pytest.approx(2**-12 / 0.5)]


def test_every_unit_timing_is_the_mean_of_a_window_of_at_least_the_minimum(tiny_gpt, ticking):
    model_file = load_model_file(tiny_gpt)
    graph = build_model_graph(model_file, tensors=CaptureTensors.CPU)
    options = UnitProfileOptions(
        micro_batch_sizes=(1, 2), num_warmup=0, window_s=0.05, whole_model=False
    )
    result = profile_units(model_file, graph, torch.device("cpu"), "cpu", options)
    # one window per size and round over every unit, one per round over the optimizers
    assert len(ticking) == options.rounds * 2 + options.rounds
    assert all(elapsed_s >= window_s == 0.05 for elapsed_s, window_s in ticking)
    for timing in result.timings:
        assert timing.forward_s.median == timing.backward_s.median == 2**-10
        assert timing.optimizer_s == 2**-10
        assert timing.forward_s.num_samples == options.rounds


def test_unit_times_are_scaled_to_sum_to_the_whole_models_window(tiny_gpt, ticking):
    # on the ticking clock every lap takes 2**-10 s: each unit alone, and the whole model's
    # forward (every unit in order) and backward (in reverse) as one call each. So the
    # units' times at each size must sum to the whole model's, in their timed proportions
    model_file = load_model_file(tiny_gpt)
    graph = build_model_graph(model_file, tensors=CaptureTensors.CPU)
    options = UnitProfileOptions(micro_batch_sizes=(1, 2), num_warmup=0, window_s=0.05)
    result = profile_units(model_file, graph, torch.device("cpu"), "cpu", options)
    # per size and round a window over the units and one over the whole model; optimizers
    assert len(ticking) == options.rounds * 2 * 2 + options.rounds
    num_units = len(graph.units)
    for size in (1, 2):
        at_size = [t for t in result.timings if t.micro_batch_size == size]
        assert len(at_size) == num_units > 1
        assert sum(t.forward_s.median for t in at_size) == pytest.approx(2**-10)
        assert sum(t.backward_s.median for t in at_size) == pytest.approx(2**-10)
        assert [t.forward_s.median for t in at_size] == pytest.approx(
            [2**-10 / num_units] * num_units
        )
    factor = f"x{1 / num_units:.2f}"
    (note,) = [n for n in result.notes if n.startswith("unit times scaled")]
    assert note.endswith(f"1: forward {factor}, backward {factor}, 2: forward {factor}, "
                         f"backward {factor}")  # fmt: skip
    assert whole_model_notes({4: [], 8: [(1.1, 1.0)]}) == (
        "unit times scaled to the whole model's forward + backward at each micro-batch size "
        "(each unit had run alone, its backward right after its forward): 8: forward x1.10, "
        "backward x1.00",
        "the whole model ran out of memory at micro-batch sizes 4: their unit times stand as "
        "timed alone",
    )


class _WholeModelOutOfMemory(_RecordingWatch):
    """The ticking stopwatch, whose whole-model windows (two calls: every forward, every
    backward) run out of memory as the CPU allocator reports it; unit windows time."""

    def window(self, calls, window_s):
        if len(calls) == 2:
            calls[0]()  # the whole model's forward holds every unit's activations
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to ...")
        return super().window(calls, window_s)


def test_a_whole_model_out_of_memory_keeps_the_unit_times_and_says_so(tiny_gpt, monkeypatch):
    import hplan.planner.profiling.unit_profile as unit_profile

    monkeypatch.setattr(unit_profile, "Stopwatch", _WholeModelOutOfMemory)
    model_file = load_model_file(tiny_gpt)
    graph = build_model_graph(model_file, tensors=CaptureTensors.CPU)
    options = UnitProfileOptions(micro_batch_sizes=(1, 2), num_warmup=0, window_s=0.0)
    result = profile_units(model_file, graph, torch.device("cpu"), "cpu", options)
    # the sizes stay, each unit as timed alone (one tick), with a note naming the sizes
    assert result.micro_batch_sizes == (1, 2)
    assert {t.forward_s.median for t in result.timings} == {2**-10}
    assert {t.backward_s.median for t in result.timings} == {2**-10}
    assert result.notes[-1] == (
        "the whole model ran out of memory at micro-batch sizes 1, 2: their unit times stand "
        "as timed alone"
    )


def _sweep(tiny_gpt, **options):
    model_file = load_model_file(tiny_gpt)
    graph = build_model_graph(model_file, tensors=CaptureTensors.CPU)
    chosen = UnitProfileOptions(
        num_warmup=0, window_s=0.0, optimizer=False, rounds=1, whole_model=False, **options
    )
    return profile_units(model_file, graph, torch.device("cpu"), "cpu", chosen)


def test_without_sizes_the_first_sweep_doubles_up_to_the_largest_allowed(tiny_gpt, ticking):
    result = _sweep(tiny_gpt, max_micro_batch_size=6, time_budget_s=1.0)
    assert result.micro_batch_sizes == (1, 2, 4, 6)
    assert {t.micro_batch_size for t in result.timings} == {1, 2, 4, 6}
    assert result.notes == ("micro-batch sizes up to 6 (the largest allowed)",)
    assert first_sweep_sizes(24) == [1, 2, 4, 8, 16, 24] and first_sweep_sizes(1) == [1]


def test_the_first_sweep_stops_past_the_time_budget_with_two_sizes_at_least(tiny_gpt, ticking):
    result = _sweep(tiny_gpt, time_budget_s=1e-6)  # every size takes longer
    assert result.micro_batch_sizes == (1, 2)
    (note,) = result.notes
    assert note.startswith("micro-batch sizes up to 2: forward + backward of the whole model")


def test_the_first_sweep_stops_before_a_size_that_runs_out_of_memory(tiny_gpt, monkeypatch):
    import hplan.planner.profiling.unit_profile as unit_profile

    real = unit_profile._sample

    def sample(model_file, size):
        if size >= 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model_file, size)

    monkeypatch.setattr(unit_profile, "_sample", sample)
    result = _sweep(tiny_gpt, time_budget_s=10.0)
    assert result.micro_batch_sizes == (1, 2)
    assert result.notes == ("micro-batch size 4 ran out of memory on cpu; sizes up to 2 timed",)
    with pytest.raises(ConfigError, match="micro-batch size 4 runs out of memory on cpu"):
        _sweep(tiny_gpt, micro_batch_sizes=(2, 4))


def test_rounds_combine_by_the_median_of_their_medians():
    from hplan.planner.profiling.profile_file import Stat, UnitTiming
    from hplan.planner.profiling.unit_profile import _merged

    def timing(forward_s: float, optimizer_s: float) -> UnitTiming:
        stat = Stat(median=forward_s, p10=forward_s * 0.9, p90=forward_s * 1.1, num_samples=5)
        return UnitTiming(
            device="cpu", unit="u", micro_batch_size=1, forward_s=stat, backward_s=stat,
            optimizer_s=optimizer_s, activation_bytes=10, peak_bytes=20,
        )  # fmt: skip

    merged = _merged([timing(1.0, 3.0), timing(9.0, 1.0), timing(2.0, 2.0)])  # one slow round
    assert merged.forward_s == Stat.of([1.0, 9.0, 2.0])  # each round's window a sample
    assert merged.forward_s.median == 2.0 and merged.forward_s.num_samples == 3
    assert merged.optimizer_s == 2.0 and merged.activation_bytes == 10


def test_units_receive_int_ids_and_bool_masks_across_their_cuts(tmp_path):
    model_file = load_model_file(write_model_file(tmp_path, "mixed_dtype_boundary"))
    graph = build_model_graph(model_file, tensors=CaptureTensors.CPU)
    crossing = {t.dtype for cut in graph.cuts for t in cut}
    assert {"int64", "bool"} <= crossing  # the case really sends non-float tensors
    result = profile_units(model_file, graph, torch.device("cpu"), "cpu", FAST)
    assert len(result.timings) == 2 * len(graph.units)
    assert all(t.forward_s.median > 0 for t in result.timings)


def test_live_bytes_follow_allocations_and_frees():
    mib = 2**20
    with LiveBytes() as live:
        big = torch.ones(mib // 4)  # 1 MiB
        del big
        small = torch.ones(1024)  # the big storage is found freed at this op
        assert live.current_bytes == small.untyped_storage().nbytes()
    assert live.peak_bytes >= mib


def test_activations_count_what_backward_keeps_but_not_parameters():
    layer = nn.Linear(64, 64)
    x = torch.randn(32, 64, requires_grad=True)
    memory = measure_unit_memory(
        lambda: torch.relu(layer(x)).sum(),
        lambda loss: loss.backward(),
        device=torch.device("cpu"),
        resident=[x, *layer.parameters()],
    )
    out_bytes = 32 * 64 * 4
    assert memory.activation_bytes == out_bytes  # relu's output; x and the weight excluded
    resident_bytes = x.numel() * 4 + sum(p.numel() * 4 for p in layer.parameters())
    assert memory.peak_bytes >= resident_bytes + out_bytes


def _run(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


def test_profile_then_solve_uses_the_measurements_and_says_so(tiny_gpt, tmp_path, capsys):
    prof = tmp_path / "prof"
    code, out, err = _run(
        ["profile", "--model", str(tiny_gpt), "-o", str(prof), "--micro-batch-sizes", "1,2",
         "--no-benchmark", "--json", "--device", "cpu", "--window", "0.01"],  # the cluster below is of cpus
        capsys,
    )  # fmt: skip
    assert code == 0, err
    (written,) = prof.glob("*-cpu.json")
    profile = Profile.load(written)
    assert Profile.from_json(out) == profile
    assert profile.model is not None and profile.model.units[0] == "tok_emb"
    assert "blocks.0" in err and "reuse the timings of blocks.0" in err
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CPU_CLUSTER)
    out_dir = tmp_path / "out"
    code, _, err = _run(
        ["solve", str(tiny_gpt), "--cluster", str(cluster), "--profile", str(prof),
         "-b", "8", "--micro-batch-sizes", "2,4,8", "-o", str(out_dir)],
        capsys,
    )  # fmt: skip
    assert code == 0, err
    plan = Plan.load(out_dir / "plan.json")
    report = plan.report
    assert report.cost_source.startswith(f"profile {prof.as_posix()}: ")
    sources = {r.cost_source for r in report.ranks}
    assert sources and all(s.startswith("measured") for s in sources)
    size = plan.ranks[0].micro_batch_size
    assert (size == 2) == (sources == {"measured"})
    raw = json.loads((out_dir / "plan.json").read_text())
    assert all("cost_source" in r for r in raw["report"]["ranks"])


def test_a_profile_of_another_model_is_refused_naming_both(tiny_gpt, tmp_path, capsys, monkeypatch):
    prof = tmp_path / "prof"
    args = ["profile", "--model", str(tiny_gpt), "-o", str(prof), "--micro-batch-sizes", "1",
            "--window", "0.01"]  # fmt: skip
    assert _run([*args, "--no-benchmark"], capsys)[0] == 0
    monkeypatch.setenv("HPLAN_GPT_LAYERS", "2")  # another model from the same file
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CPU_CLUSTER)
    code, _, err = _run(
        ["solve", str(tiny_gpt), "--cluster", str(cluster), "--profile", str(prof), "-o",
         str(tmp_path / "out")],
        capsys,
    )  # fmt: skip
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "was measured on model" in lines[0]
    path = tiny_gpt.as_posix()
    assert f"was measured on model {path} (graph" in lines[0]
    assert f"not on {path} (graph" in lines[0]
    graphs = re.findall(r"\(graph ([0-9a-f]{12})\)", lines[0])
    assert len(graphs) == 2 and graphs[0] != graphs[1]


def test_a_profile_error_on_a_pipe_is_one_line_with_no_bar_residue(tmp_path, capsys):
    code, _, err = _run(["profile", "--model", str(tmp_path / "nope.py")], capsys)
    assert code == 2
    assert err.splitlines() == [f"hplan: error: model file '{tmp_path / 'nope.py'}' does not "
                                "exist; pass a path to model.py"]  # fmt: skip


TWO_NODES = two_cpu_nodes_yaml(bandwidth_gbit_per_s=1, name="two-nodes")


def _on_node(profile: Profile, node: str, factor: float) -> Profile:
    """``profile`` as if measured on ``node``, ``factor`` times slower."""

    def scaled(stat):
        return replace(stat, median=stat.median * factor, p10=stat.p10 * factor,
                       p90=stat.p90 * factor)  # fmt: skip

    key = f"cpu@{node}"
    return replace(
        profile,
        devices=tuple(replace(d, key=key) for d in profile.devices),
        unit_timings=tuple(
            replace(t, device=key, forward_s=scaled(t.forward_s), backward_s=scaled(t.backward_s))
            for t in profile.unit_timings
        ),
    )


def test_per_node_profiles_combine_and_each_node_plans_with_its_own_times(
    tiny_gpt, tmp_path, capsys
):
    from hplan.planner.api import SolveRequest, plan_training

    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(TWO_NODES)
    prof = tmp_path / "prof"
    code, _, err = _run(
        ["profile", "--model", str(tiny_gpt), "-o", str(prof), "--node", "left", "--cluster",
         str(cluster), "--micro-batch-sizes", "1,2", "--no-benchmark", "--device", "cpu",
         "--window", "0.01"],
        capsys,
    )  # fmt: skip
    assert code == 0, err
    (written,) = prof.glob("*.json")
    assert written.name == "left-cpu.json"  # named after the node, not the host
    left = Profile.load(written)
    assert {d.key for d in left.devices} | {t.device for t in left.unit_timings} == {"cpu@left"}
    # the right node measured the same units twice as slow (a half-core quota), elsewhere
    right = tmp_path / "elsewhere" / "right-cpu.json"
    right.parent.mkdir()
    right.write_text(_on_node(left, "right", 2.0).to_json())
    out_dir = tmp_path / "out"
    args = ["solve", str(tiny_gpt), "--cluster", str(cluster), "-b", "4",
            "--micro-batch-sizes", "1,2", "--profile", str(prof), "--profile", str(right)]  # fmt: skip
    code, _, err = _run([*args, "-o", str(out_dir)], capsys)
    assert code == 0, err
    sources = {r.cost_source for r in Plan.load(out_dir / "plan.json").report.ranks}
    assert sources and all(s.startswith("measured") for s in sources)
    request = SolveRequest(
        model_path=tiny_gpt,
        cluster_path=cluster,
        global_batch_size=4,
        micro_batch_sizes=(1, 2),
        profile_paths=(prof, right),
    )
    problem = plan_training(request).problem
    assert problem.device_names == ("left/0", "right/0")
    assert problem.fwd_time_s[1] == pytest.approx(2 * problem.fwd_time_s[0])
    # a profile of a node the cluster lacks (a typo'd --node) is refused, naming it
    stray = tmp_path / "stray.json"
    stray.write_text(_on_node(left, "lfet", 1.0).to_json())
    code, _, err = _run([*args, "--profile", str(stray), "-o", str(tmp_path / "o2")], capsys)
    assert code == 2
    (line,) = [line for line in err.splitlines() if line.strip()]
    assert (
        "measures cpu@lfet" in line and "no node or device 'lfet' (its nodes: left, right)" in line
    )


def test_profile_for_a_node_the_cluster_lacks_is_one_line_naming_its_nodes(tmp_path, capsys):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(TWO_NODES)
    code, _, err = _run(
        ["profile", "--node", "lft", "--cluster", str(cluster), "--no-benchmark"], capsys
    )
    assert code == 2
    assert err.splitlines() == [
        f"hplan: error: --node 'lft' is not a node of '{cluster}' (its nodes: left, right)"
    ]
    code, _, err = _run(["profile", "--node", "a/b", "--no-benchmark"], capsys)
    assert code == 2 and "--node 'a/b': 'a/b' is not a valid name" in err
