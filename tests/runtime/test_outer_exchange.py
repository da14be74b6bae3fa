"""The outer sync's update math, exact: delayed (overlapped) applies and quantized wire
formats (``outer_sync.py``, ``outer_exchange.py``) against a one-process reference.

Three gloo ranks run ``build_outer_sync`` and ``OuterSync.after_step`` of real plans (island
box-a: a 2-stage pipeline, ranks 0 and 1, both holding the tied embedding; box-b: rank 2),
with a synthetic inner step (seeded noise added to each island's parameters) in place of
training, so that the reference sees the very same local values: every island's parameters
after every step must be equal bit for bit.
"""

from __future__ import annotations

import re
import shutil
import time
import zlib
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hplan.runtime.capture.model_file import ModelFile, load_model_file
from hplan.runtime.contract.errors import PeerFailureError
from hplan.runtime.contract.holders import (
    applied_after,
    island_of_rank,
    island_samples,
    outer_fragments,
    outer_groups,
    parameter_holders,
    parameter_order,
    syncs_after,
)
from hplan.runtime.contract.link_model import sync_order
from hplan.runtime.contract.plan import Plan, PseudoGradientDtype, SyncMode, wire_payload_bytes
from hplan.runtime.executor.outer.outer_sync import build_outer_sync
from hplan.runtime.executor.outer.pseudo_gradient_codec import encode
from hplan.runtime.executor.seams import LinkDelay
from tests.fixtures.processes import join_gloo
from tests.fixtures.processes import run_ranks as run_processes
from tests.runtime.test_local_sgd import _flat as _flat_tree
from tests.runtime.test_local_sgd import _model, _pipeline_and_single, _read, _train, _two_single

STEPS = 7
INT8, INT4 = PseudoGradientDtype.INT8, PseudoGradientDtype.INT4
CASES: dict[str, dict[str, object]] = {
    "int8 blocking": dict(mode=SyncMode.LOCAL_SGD, local_steps=3, wire_dtype=INT8),
    "int4 overlapped F=2": dict(
        mode=SyncMode.LOCAL_SGD, local_steps=4, num_fragments=2, overlap_steps=2, wire_dtype=INT4
    ),
    "float32 overlapped F=2": dict(
        mode=SyncMode.LOCAL_SGD, local_steps=4, num_fragments=2, overlap_steps=1
    ),
    "int4 async": dict(mode=SyncMode.ASYNC, local_steps=2, wire_dtype=INT4),
    "int8 overlapped H=2 F=2": dict(
        mode=SyncMode.LOCAL_SGD, local_steps=2, num_fragments=2, overlap_steps=1, wire_dtype=INT8
    ),
}
"""Over 7 steps: H=4 F=2 overlap 2 launches fragment 1 after steps 1, 5 (applied after 3,
and at the close) and fragment 0 after step 3 (applied after 5); async applies and launches
at once; H=2 F=2 overlap 1 launches fragment 1 after the last step (the close applies it
alone) and fragment 0 after step 5 (applied after the last step, then the close syncs the
rest)."""
FLOOR_S = 0.25
"""The emulated time of each outer collective in the floored case."""

Values = dict[str, torch.Tensor]


def _noise(island: str, step: int, name: str, like: torch.Tensor) -> torch.Tensor:
    """The synthetic inner step of ``island``'s copy of ``name`` at ``step``."""
    seed = zlib.crc32(f"{island}/{step}/{name}".encode())
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(like.shape, generator=generator) * 0.05


class _Floors(LinkDelay):
    """Every outer collective lasts at least ``FLOOR_S``; records what it was asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[tuple[int, ...], int]] = []

    def all_reduce_floor_s(self, ranks: Sequence[int], num_bytes: int) -> float:
        self.asked.append((tuple(ranks), num_bytes))
        return FLOOR_S if num_bytes > 0 else 0.0


def _run_cases(rank: int, port: int, out_dir: str, model_path: str, plans: list[str]) -> None:
    try:
        join_gloo(rank, port, world_size=3)
        model_file = load_model_file(model_path)
        results: dict[str, object] = {}
        for idx, text in enumerate(plans):
            plan = Plan.from_json(text)
            floored = idx == len(plans) - 1
            results[str(idx)] = _one_case(plan, rank, model_file, floored=floored)
        torch.save(results, Path(out_dir) / f"rank-{rank}.pt")
        dist.destroy_process_group()
    except Exception:
        import traceback

        (Path(out_dir) / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise


def _one_case(plan: Plan, rank: int, model_file: ModelFile, *, floored: bool) -> dict:
    torch.manual_seed(plan.training.seed)
    model = model_file.build_model()
    held = parameter_holders(plan)
    named = [(n, p) for n, p in model.named_parameters() if rank in held[n]]
    delay = _Floors() if floored else LinkDelay()
    outer = build_outer_sync(plan, rank, named, model_file, delay=delay, keep_resume_state=False)
    assert outer is not None
    island = island_of_rank(plan)[rank]
    num_steps = 1 if floored else STEPS
    steps, took = [], []
    for step in range(num_steps):
        with torch.no_grad():
            for name, param in named:
                param.add_(_noise(island, step, name, param))
        begin_s = time.monotonic()
        outer.after_step(step, last=step == num_steps - 1)
        took.append(time.monotonic() - begin_s)
        steps.append({n: p.detach().clone() for n, p in named})
    asked = delay.asked if isinstance(delay, _Floors) else []
    return {"steps": steps, "took_s": took, "asked": asked}


# --------------------------------------------------------------------------- the reference
class _Fragment:
    """One fragment of one local group in the reference: G, its outer SGD, and per island
    A and the residual."""

    def __init__(self, names: tuple[str, ...], start: Values, model_file: ModelFile) -> None:
        self.names = names
        self.glob = [start[n].clone() for n in names]
        momentum = model_file.outer_momentum
        self.outer = torch.optim.SGD(self.glob, lr=model_file.outer_lr, momentum=momentum,
                                     nesterov=momentum > 0)  # fmt: skip
        self.anchor: dict[str, list[torch.Tensor]] = {}
        self.residual: dict[str, torch.Tensor] = {}
        self.pending: torch.Tensor | None = None

    def outer_step(self, average: torch.Tensor) -> None:
        offset = 0
        for g in self.glob:
            g.grad = average[offset : offset + g.numel()].view_as(g).clone()
            offset += g.numel()
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _average(plan: Plan, wire: PseudoGradientDtype, frag: _Fragment,
             deltas: dict[str, list[torch.Tensor]]) -> torch.Tensor:  # fmt: skip
    """Σ_i (n_i / N) Δ_i over the islands in order: summed in float32 as sent, or each
    island's weighted Δ plus its residual quantized, decoded and summed in island order."""
    weights = {i: n / plan.global_batch_size for i, n in island_samples(plan).items()}
    total: torch.Tensor | None = None
    for island, delta in deltas.items():
        value = _flat(delta) * weights[island]
        if wire.quantized:
            value = value + frag.residual.setdefault(island, torch.zeros_like(value))
            decoded = encode(value, wire).decoded
            frag.residual[island] = value - decoded
            value = decoded
        total = value.clone() if total is None else total + value
    assert total is not None
    return total


def _reference(plan: Plan, model_file: ModelFile, steps: int) -> list[dict[str, Values]]:
    """Each island's parameters after each step: the synthetic inner steps, and per
    fragment the rule of ``OuterSyncSpec.overlap_steps`` (launch Δ = G - L and A = L after
    step s; after step s + τ: G ← outer(G, avg), L ← G - (A - L); with a launch on that same
    step its Δ is A - L; τ = 0: L ← G), then the closing sync."""
    torch.manual_seed(plan.training.seed)
    start = {n: p.detach().clone() for n, p in model_file.build_model().named_parameters()}
    islands = list(dict.fromkeys(island_of_rank(plan).values()))
    local = {i: {n: v.clone() for n, v in start.items()} for i in islands}
    held = parameter_holders(plan)
    groups = sorted(outer_groups(plan).values(), key=lambda g: sync_order(g.ranks))
    fragments = []
    for spec in groups:
        names = [n for n in parameter_order(plan) if held[n] == spec.ranks]
        sizes = {n: wire_payload_bytes(spec.wire_dtype, start[n].numel()) for n in names}
        for idx, cut in enumerate(outer_fragments(spec, names, sizes)):
            fragments.append((spec, idx, _Fragment(cut, start, model_file)))
    history = []
    for step in range(steps):
        for island in islands:
            for name, value in local[island].items():
                value += _noise(island, step, name, value)
        for spec, idx, frag in fragments:
            own = {i: [local[i][n] for n in frag.names] for i in islands}
            deltas = None
            if frag.pending is not None and applied_after(spec, idx, step):
                change = {i: [a - v for a, v in zip(frag.anchor[i], own[i], strict=True)]
                          for i in islands}  # fmt: skip
                frag.outer_step(frag.pending)
                frag.pending = None
                for i in islands:
                    for n, g, c in zip(frag.names, frag.glob, change[i], strict=True):
                        local[i][n] = g - c
                deltas = change
            if syncs_after(spec, idx, step):
                own = {i: [local[i][n] for n in frag.names] for i in islands}
                if deltas is None:
                    deltas = {i: [g - v for g, v in zip(frag.glob, own[i], strict=True)]
                              for i in islands}  # fmt: skip
                average = _average(plan, spec.wire_dtype, frag, deltas)
                if spec.delay_steps == 0:
                    frag.outer_step(average)
                    for i in islands:
                        local[i].update(
                            (n, g.clone()) for n, g in zip(frag.names, frag.glob, strict=True)
                        )
                else:
                    frag.pending = average
                    frag.anchor = {i: [v.clone() for v in own[i]] for i in islands}
        if step == steps - 1:
            _close(plan, fragments, local, islands, step)
        history.append({i: {n: v.clone() for n, v in local[i].items()} for i in islands})
    return history


def _close(plan: Plan, fragments: list, local: dict[str, Values], islands: list[str],
           step: int) -> None:  # fmt: skip
    """The run's end: the change since the last launch (A - L with an average pending, else
    G - L) synced blocking after the pending average, every island ← G."""
    for spec, idx, frag in fragments:
        own = {i: [local[i][n] for n in frag.names] for i in islands}
        deltas = None
        if not syncs_after(spec, idx, step):
            base = frag.anchor if frag.pending is not None else {i: frag.glob for i in islands}
            deltas = {i: [b - v for b, v in zip(base[i], own[i], strict=True)] for i in islands}
        if frag.pending is not None:
            frag.outer_step(frag.pending)
            frag.pending = None
        if deltas is not None:
            frag.outer_step(_average(plan, spec.wire_dtype, frag, deltas))
        for i in islands:
            local[i].update((n, g.clone()) for n, g in zip(frag.names, frag.glob, strict=True))


# --------------------------------------------------------------------------- the checks
@pytest.fixture(scope="module")
def exchanged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Plan], list[dict]]:
    """Every case of ``CASES`` (then one floored int8 step), run by three ranks in one job."""
    directory = tmp_path_factory.mktemp("exchange")
    path = _model(directory)
    plans = [_pipeline_and_single(path, **sync) for sync in CASES.values()]
    plans.append(_pipeline_and_single(path, mode=SyncMode.LOCAL_SGD, local_steps=1,
                                      wire_dtype=INT8))  # fmt: skip
    out = directory / "out"
    out.mkdir()
    args = (str(path), [p.to_json() for p in plans])
    assert run_processes(_run_cases, 3, out, *args) == [0, 0, 0]
    ranks = [torch.load(out / f"rank-{r}.pt") for r in range(3)]
    return path, plans, ranks


@pytest.mark.xdist_group("outer-exchange")  # one worker builds `exchanged`
@pytest.mark.parametrize("case", list(CASES))
def test_every_island_after_every_step_equals_the_reference_bit_for_bit(
    exchanged: tuple[Path, list[Plan], list[dict]], case: str
) -> None:
    path, plans, ranks = exchanged
    idx = list(CASES).index(case)
    plan = plans[idx]
    want = _reference(plan, load_model_file(path), STEPS)
    where = island_of_rank(plan)
    for rank, result in enumerate(ranks):
        got = result[str(idx)]["steps"]
        for step, (values, expected) in enumerate(zip(got, want, strict=True)):
            for name, value in values.items():
                assert torch.equal(value, expected[where[rank]][name]), (rank, step, name)
    islands = want[-1]
    assert all(torch.equal(islands["box-a"][n], islands["box-b"][n]) for n in islands["box-a"])
    if idx:  # the islands differ between the points (nothing was synced in vain)
        assert any(not torch.equal(want[3]["box-a"][n], want[3]["box-b"][n])
                   for n in want[3]["box-a"])  # fmt: skip


@pytest.mark.xdist_group("outer-exchange")
def test_a_quantized_exchange_lasts_its_floors_counted_on_its_real_bytes(
    exchanged: tuple[Path, list[Plan], list[dict]],
) -> None:
    # blocking int8 over one step: the leads' all-gather (ranks 0, 2) is floored on the
    # payload bytes, the tied embedding's broadcast inside box-a (ranks 0, 1) on its float32
    ranks = exchanged[2]
    tied = 16 * 8  # VOCAB x WIDTH
    asked = {(tuple(r), b) for r, b in ranks[0][str(len(CASES))]["asked"]}
    assert ((0, 2), wire_payload_bytes(INT8, tied)) in asked  # 2 payloads: k P / 2 = P
    assert ((0, 1), 4 * tied) in asked
    for rank in (0, 1, 2):  # every rank waits at least a floor at the point
        assert ranks[rank][str(len(CASES))]["took_s"][0] >= FLOOR_S


def test_an_overlapped_quantized_run_resumes_exactly_as_one_uninterrupted_run(
    tmp_path: Path,
) -> None:
    # H = 4, F = 2, overlap 2, int4: after 3 steps fragment 1's average (launched after
    # step 1) is pending, with its A and every island's residuals; the resume applies it
    # after step 3 and closes fragment 0's, launched then, at the end
    plan = _pipeline_and_single(_model(tmp_path), **CASES["int4 overlapped F=2"])
    whole = _read(_train(plan, tmp_path / "whole", 5) / "step-5")
    first = _train(plan, tmp_path / "first", 3)
    shutil.copytree(first, tmp_path / "pieces" / "ckpt")
    saved = _read(first / "step-3")
    assert saved["outer"]["pending"] and saved["island"]["box-a"]["start"]
    residuals = saved["island"]["box-b"]["residual"].values()
    assert any(r.abs().max() > 0 for r in residuals)  # what int4 lost after step 1, carried
    resumed = _read(_train(plan, tmp_path / "pieces", 2, "--resume") / "step-5")
    for key in ("model", "outer", "island"):
        flat_whole, flat_resumed = _flat_tree(whole[key]), _flat_tree(resumed[key])
        assert flat_whole.keys() == flat_resumed.keys()
        for name, value in flat_whole.items():
            assert torch.equal(flat_resumed[name], value), (key, name)


def _island_leaves(rank: int, port: int, out_dir: str, model_path: str, plan_text: str) -> None:
    """Both ranks build the outer sync; rank 1 (island box-b) then leaves the job, and rank
    0 writes the error of its first outer sync."""
    import os

    try:
        join_gloo(rank, port)
        plan = Plan.from_json(plan_text)
        model_file = load_model_file(model_path)
        named = list(model_file.build_model().named_parameters())
        outer = build_outer_sync(plan, rank, named, model_file, delay=LinkDelay(),
                                 keep_resume_state=False)  # fmt: skip
        assert outer is not None
        if rank == 1:
            os._exit(0)  # its sockets close: the all-gather fails at once, no timeout
        try:
            outer.after_step(0, last=True)
        except PeerFailureError as exc:
            (Path(out_dir) / "failure.txt").write_text(str(exc))
        os._exit(0)
    except Exception:
        import traceback

        (Path(out_dir) / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise


def test_an_island_gone_from_a_quantized_exchange_is_named_in_one_line(tmp_path: Path) -> None:
    path = _model(tmp_path)
    plan = _two_single(path, timeout_s=20.0, mode=SyncMode.LOCAL_SGD, wire_dtype=INT8)
    assert run_processes(_island_leaves, 2, tmp_path, str(path), plan.to_json()) == [0, 0]
    message = (tmp_path / "failure.txt").read_text()
    assert re.fullmatch(
        r"outer sync \(local_sgd\) of ranks \[0, 1\] across islands box-a, box-b failed: .*; "
        r"island box-b probably fell behind or failed; check its logs",
        message,
    ), message
