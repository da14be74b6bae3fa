"""Optimizer-state offload in the solver: chosen only where nothing cheaper fits, only on the
devices that need it, costed alike by the evaluator and the simulator, bounded by host
memory, and named in the infeasible message (issue 11)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from hplan.planner.cost.evaluate import evaluate
from hplan.planner.cost.offload import offload_step_time_s
from hplan.planner.sim.spec import simulated_step_time_s
from hplan.planner.solve.search import SolveOptions, diagnose_infeasible
from hplan.planner.solve.solver import solve
from hplan.planner.solve.validate import layout_problems
from hplan.runtime.contract.errors import ConfigError, InfeasiblePlanError
from tests.fixtures.problems import GB, Dev, make_problem

FAST = SolveOptions(time_limit_s=30, watchdog=False, zero="never")
OFFLOAD_S = 0.5


def _problem(host_bytes: float = 100 * GB, capacity_gb: tuple[float, ...] = (24, 24, 10.5)):  # type: ignore[no-untyped-def]
    """Two 24 GB cards and a 10.5 GB card on one node, a one-unit model of 8 GB of
    parameters and gradients plus 8 GB of optimizer state: the small card holds a replica
    only with its state offloaded (16 GB of host memory, ``OFFLOAD_S`` per step)."""
    devices = [Dev("a", 2.0, c * GB) if c > 20 else Dev("a", 1.0, c * GB) for c in capacity_gb]
    problem = make_problem(
        devices,
        unit_work=[1.0],
        global_batch_size=40,
        micro_batch_sizes=(1, 2, 4, 8),
        static_bytes=16 * GB,
        act_bytes_per_sample=0.05 * GB,
        grad_bytes=4 * GB,
        intra_bandwidth=50e9,
    )
    d = len(devices)
    return replace(
        problem,
        optimizer_state_bytes=np.full(1, 8 * GB),
        offload_optimizer_time_s=np.full((d, 1), OFFLOAD_S),
        offload_saving_bytes=np.full(1, 8 * GB),
        offload_host_bytes=np.full(1, 16 * GB),
        host_capacity_bytes=np.full(d, host_bytes),
    )


def test_auto_offloads_only_the_card_that_needs_it_where_nothing_cheaper_fits() -> None:
    problem = _problem()
    never = solve(problem, replace(FAST, offload="never"))
    assert len(never.layout.device_indices) == 2 and not never.layout.optimizer_offload
    auto = solve(problem, FAST)
    assert auto.layout.optimizer_offload == (False, False, True)
    assert len(auto.layout.device_indices) == 3
    assert not layout_problems(problem, auto.layout) and auto.evaluation.memory_ok
    assert auto.evaluation.samples_per_s > never.evaluation.samples_per_s
    assert auto.evaluation.optimizer_time_s == pytest.approx(OFFLOAD_S)
    plain = replace(auto.layout, optimizer_offload=())
    assert not evaluate(problem, plain).memory_ok and layout_problems(problem, plain)
    always = solve(problem, replace(FAST, offload="always"))
    assert always.layout.optimizer_offload == (True, True, True)


def test_auto_does_not_offload_where_zero_or_the_plain_plan_fits() -> None:
    sharded = solve(_problem(), replace(FAST, zero="auto"))
    assert sharded.layout.optimizer_shard_weights and not any(sharded.layout.optimizer_offload)
    roomy = solve(_problem(capacity_gb=(24, 24, 24)), FAST)
    assert len(roomy.layout.device_indices) == 3 and not any(roomy.layout.optimizer_offload)


def test_host_memory_bounds_offload() -> None:
    problem = _problem(host_bytes=10 * GB)
    result = solve(problem, FAST)
    assert not any(result.layout.optimizer_offload) and len(result.layout.device_indices) == 2
    forced = replace(result.layout, optimizer_offload=(True, True, False))
    assert any("host memory" in p for p in layout_problems(problem, forced))


def test_the_simulator_charges_the_offloaded_step_as_the_evaluator_does() -> None:
    problem = _problem()
    layout = solve(problem, replace(FAST, offload="always")).layout
    plain = replace(layout, optimizer_offload=())
    evaluated = evaluate(problem, layout).step_time_s - evaluate(problem, plain).step_time_s
    simulated_offload = simulated_step_time_s(problem, layout)
    simulated_plain = simulated_step_time_s(problem, plain)
    assert simulated_offload is not None and simulated_plain is not None
    assert simulated_offload - simulated_plain == pytest.approx(evaluated, rel=1e-6)
    assert evaluated == pytest.approx(OFFLOAD_S)


def test_infeasible_messages_say_what_offload_leaves() -> None:
    small = _problem(capacity_gb=(12, 12, 10.5))
    with pytest.raises(InfeasiblePlanError) as never:
        solve(small, replace(FAST, offload="never"))
    assert "offloaded to host memory (--offload auto) it would need" in str(never.value)
    assert solve(small, FAST).layout.optimizer_offload  # and with auto it fits
    tiny = _problem(capacity_gb=(7, 7, 7))
    with pytest.raises(InfeasiblePlanError) as auto:
        solve(tiny, FAST)
    message = str(auto.value)
    assert "even with its optimizer state offloaded to host memory it needs 8" in message
    assert "largest device (a/0)" in message


def test_a_unit_that_offload_would_fit_is_not_blamed_the_host_memory_is() -> None:
    """9 GB cards: the 16 GB unit fits once its 8 GB of state is offloaded, but the node
    has 1 GB of host memory; the message names that, not the unit's size."""
    with pytest.raises(InfeasiblePlanError) as caught:
        solve(_problem(host_bytes=1 * GB, capacity_gb=(9, 9, 9)), FAST)
    message = str(caught.value)
    assert "even with its optimizer state offloaded" not in message
    assert "only with its optimizer state offloaded to host memory, but host memory" in message
    assert "\n" not in message


def test_the_offloaded_step_costs_pcie_both_ways_and_the_host_step() -> None:
    trainable = 12e9  # a 3B-parameter fp32 model under AdamW
    seconds = offload_step_time_s(trainable, 2.0, 25e9, 25e9)
    assert seconds == pytest.approx(2 * 12e9 / 25e9 + 12e9 * 7 / 25e9)


def test_a_cpu_device_never_offloads_its_memory_is_the_hosts() -> None:
    """The small device as a ``cpu``: offload frees nothing there (``contract.memory``
    counts its copies on the device), so auto leaves it idle rather than plan an offload
    the load check refuses, always offloads only the GPUs, and a cluster of cpu devices
    alone refuses ``always`` in one line."""
    problem = _problem()
    problem = replace(problem, device_kinds=(*problem.device_kinds[:2], "cpu"))
    auto = solve(problem, FAST)
    assert not any(auto.layout.optimizer_offload) and 2 not in auto.layout.device_indices
    always = solve(problem, replace(FAST, offload="always"))
    assert always.layout.optimizer_offload[2] is False
    cpus = replace(problem, device_kinds=("cpu", "cpu", "cpu"))
    with pytest.raises(ConfigError, match="--offload always: no device of this cluster can"):
        solve(cpus, replace(FAST, offload="always"))


def test_infeasible_message_names_host_memory_when_it_binds() -> None:
    """Four 8 GB units (4 GB of it optimizer state) on three 10 GB cards: offloaded, the
    devices hold the model; the offload needs >= 4 GB of host memory, the node has 1 GB."""
    devices = [Dev("a", 1.0, 10 * GB) for _ in range(3)]
    problem = make_problem(devices, unit_work=[1.0] * 4, global_batch_size=4, static_bytes=8 * GB)
    offloading = replace(
        problem,
        optimizer_state_bytes=np.full(4, 4 * GB),
        offload_optimizer_time_s=np.full((3, 4), OFFLOAD_S),
        offload_saving_bytes=np.full(4, 4 * GB),
        offload_host_bytes=np.full(4, 8 * GB),
        host_capacity_bytes=np.full(3, 1 * GB),
    )
    with pytest.raises(InfeasiblePlanError) as tight:
        solve(offloading, FAST)
    message = str(tight.value)
    assert "host memory binds" in message and "node a has 1.0 GB usable" in message
    assert "at least 4.0 GB of host memory" in message and "host_memory_gb" in message
    roomy = replace(offloading, host_capacity_bytes=np.full(3, 100 * GB))
    assert "host memory binds" not in diagnose_infeasible(roomy, "auto")
