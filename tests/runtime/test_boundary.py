"""Boundary tensors: checks against the plan, byte transport, a real 2-process exchange, and
a pipeline whose real tensors differ from its plan."""

from __future__ import annotations

import traceback
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hplan.runtime.contract.errors import PlanFileError, PlanMismatchError
from hplan.runtime.contract.plan import DTYPE_BYTES, TensorSpec
from hplan.runtime.executor.comm import (
    Boundary,
    StageComm,
    check_boundary_tensors,
    from_wire,
    spec_nbytes,
    to_wire,
    wire_buffer,
)
from hplan.runtime.rehearsal.emulation import EmulatedLink, EmulatedLinks
from tests.fixtures.plans import NUMBERED_DATASET, ReplicaShape, make_plan, write_model
from tests.fixtures.plans import run_ranks as run_plan
from tests.fixtures.processes import join_gloo, run_ranks

HIDDEN = TensorSpec(name="h", shape=(1, 4, 3), dtype="float32", batch_dim=0, requires_grad=True)
MASK = TensorSpec(name="mask", shape=(1, 4), dtype="bool", batch_dim=0, requires_grad=False)
POS = TensorSpec(name="pos", shape=(1, 4), dtype="int64", batch_dim=0, requires_grad=False)
HALF = TensorSpec(name="hb", shape=(3, 1), dtype="bfloat16", batch_dim=1, requires_grad=True)
TABLE = TensorSpec(name="table", shape=(5,), dtype="float32", batch_dim=None, requires_grad=False)
SPECS = (HIDDEN, MASK, POS, HALF, TABLE)


def _tensors(mb_size: int, seed: int) -> dict[str, torch.Tensor]:
    """Boundary tensors as a stage would produce them: several of them non-contiguous."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(mb_size, 3, 4, generator=g)
    return {
        "h": base.transpose(1, 2),  # non-contiguous
        "mask": torch.randn(mb_size, 8, generator=g)[:, ::2] > 0,  # strided slice
        "pos": torch.arange(mb_size * 4).reshape(mb_size, 4).cumsum(1),
        "hb": torch.randn(mb_size, 3, generator=g).t().to(torch.bfloat16),
        "table": torch.randn(10, generator=g)[::2],
    }


def test_tensors_matching_the_plan_pass_the_check() -> None:
    check_boundary_tensors(SPECS, _tensors(3, 0), 3, where="cut after a")


def test_a_shape_mismatch_names_the_tensor_expected_and_actual_shape() -> None:
    tensors = _tensors(3, 0)
    tensors["h"] = torch.zeros(3, 4, 2)
    with pytest.raises(PlanMismatchError, match=r"'h' has shape \(3, 4, 2\).*expects \(3, 4, 3\)"):
        check_boundary_tensors(SPECS, tensors, 3, where="cut after a")


def test_a_dtype_mismatch_names_the_tensor_expected_and_actual_dtype() -> None:
    tensors = _tensors(2, 0)
    tensors["pos"] = tensors["pos"].int()
    with pytest.raises(PlanMismatchError, match="'pos' has dtype int32, the plan expects int64"):
        check_boundary_tensors(SPECS, tensors, 2, where="cut after a")


def test_a_missing_tensor_or_an_unplanned_gradient_is_a_mismatch() -> None:
    tensors = _tensors(2, 0)
    del tensors["mask"]
    with pytest.raises(PlanMismatchError, match="'mask' is not produced"):
        check_boundary_tensors(SPECS, tensors, 2, where="cut")
    tensors = _tensors(2, 0)
    tensors["table"] = tensors["table"].clone().requires_grad_(True)
    with pytest.raises(PlanMismatchError, match="'table' needs a gradient"):
        check_boundary_tensors(SPECS, tensors, 2, where="cut")


@pytest.mark.parametrize("mb_size", [1, 3])
def test_bytes_on_the_wire_rebuild_every_dtype_and_layout_exactly(mb_size: int) -> None:
    for spec in SPECS:
        sent = _tensors(mb_size, 1)[spec.name]
        buffer = wire_buffer(spec, mb_size, torch.device("cpu"))
        buffer.copy_(to_wire(sent))
        received = from_wire(buffer, spec, mb_size)
        assert received.dtype == sent.dtype
        assert torch.equal(received, sent)


def test_the_plan_dtype_table_agrees_with_torch_element_sizes() -> None:
    for name, num_bytes in DTYPE_BYTES.items():
        dtype = getattr(torch, name)
        assert isinstance(dtype, torch.dtype), name
        assert dtype.itemsize == num_bytes, name


@pytest.mark.parametrize("mb_size", [1, 3])
def test_num_bytes_is_the_byte_size_of_the_tensor_at_that_micro_batch_size(mb_size: int) -> None:
    for spec in SPECS:
        sent = _tensors(mb_size, 1)[spec.name]
        assert spec.num_bytes(mb_size) == sent.numel() * sent.element_size()
        assert spec_nbytes(spec, mb_size) == spec.num_bytes(mb_size)
    assert TABLE.num_bytes(mb_size) == 5 * 4  # not batched: same size at every micro-batch


def test_num_bytes_of_an_unknown_dtype_is_a_plan_file_error_naming_it() -> None:
    odd = TensorSpec(name="odd", shape=(1, 2), dtype="float4", batch_dim=0, requires_grad=False)
    with pytest.raises(PlanFileError, match=r"'odd'.*'float4'"):
        odd.num_bytes(2)


def test_a_dtype_torch_lacks_is_a_plan_mismatch_on_the_wire() -> None:
    odd = TensorSpec(name="odd", shape=(1, 2), dtype="float4", batch_dim=0, requires_grad=False)
    with pytest.raises(PlanMismatchError, match="'float4', which this torch does not have"):
        wire_buffer(odd, 2, torch.device("cpu"))


# --------------------------------------------------------------------------- 2 processes
def _exchange(rank: int, port: int, out_dir: str, post_ahead: bool) -> None:
    """Rank 0 is a stage that sends; rank 1 the next stage that receives and sends grads.

    With ``post_ahead`` both post receives before earlier ones complete (gloo matches them
    by tag, whatever the order)."""
    try:
        join_gloo(rank, port)
        link = EmulatedLinks({1 - rank: EmulatedLink(1e-4, 1e8, time_scale=1.0)})
        cpu = torch.device("cpu")
        if rank == 0:
            comm = StageComm(
                0, cpu, None, Boundary(1, SPECS, "cut after a"), delay=link, post_ahead=post_ahead
            )
            sizes = (3, 1)
            if post_ahead:
                for mb, size in enumerate(sizes):
                    posted = comm.post_grads_recv(mb, size)
                    assert comm.post_grads_recv(mb, size) is posted  # posted once
            for mb, size in enumerate(sizes):
                comm.send_activations(mb, size, _tensors(size, mb))
            grads = [comm.recv_grads(mb, size) for mb, size in enumerate(sizes)]
            comm.wait_sends()
            torch.save(grads, Path(out_dir) / "grads.pt")
        else:
            comm = StageComm(
                1, cpu, Boundary(0, SPECS, "cut after a"), None, delay=link, post_ahead=post_ahead
            )
            if post_ahead:  # micro-batch 1's receive first, then 0's, then complete both
                ahead = comm.post_activations_recv(1, 1)
                first = comm.recv_activations(0, 3)
                assert comm.post_activations_recv(1, 1) is ahead  # still pending, posted once
                received = [first, comm.recv_activations(1, 1)]
            else:
                received = [comm.recv_activations(mb, size) for mb, size in enumerate((3, 1))]
            for mb, (size, got) in enumerate(zip((3, 1), received, strict=True)):
                (got["h"].sum() * 2 + got["hb"].float().sum() * 3).backward()
                comm.send_grads(mb, size, got)
            comm.wait_sends()
            detached = [{k: v.detach() for k, v in r.items()} for r in received]
            flags = [{k: v.requires_grad for k, v in r.items()} for r in received]
            torch.save((detached, flags), Path(out_dir) / "received.pt")
        dist.destroy_process_group()
    except Exception:
        (Path(out_dir) / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise


@pytest.mark.parametrize("post_ahead", [False, True], ids=["in-order", "posted-ahead"])
def test_two_processes_exchange_boundary_tensors_bit_exactly_with_gradients_for_floats(
    tmp_path: Path, post_ahead: bool
) -> None:
    assert run_ranks(_exchange, 2, tmp_path, post_ahead) == [0, 0]
    received, flags = torch.load(tmp_path / "received.pt")
    for mb, size in enumerate((3, 1)):
        expected = _tensors(size, mb)
        for name, tensor in expected.items():
            assert received[mb][name].dtype == tensor.dtype
            assert torch.equal(received[mb][name], tensor), name
        assert flags[mb] == {"h": True, "mask": False, "pos": False, "hb": True, "table": False}
    grads = torch.load(tmp_path / "grads.pt")
    for mb, size in enumerate((3, 1)):
        assert set(grads[mb]) == {"h", "hb"}  # only tensors that need a gradient get one
        assert torch.equal(grads[mb]["h"], torch.full((size, 4, 3), 2.0))
        assert grads[mb]["hb"].dtype == torch.bfloat16
        assert torch.equal(grads[mb]["hb"], torch.full((3, size), 3.0, dtype=torch.bfloat16))


# --------------------------------------------------------------------------- a pipeline's ranks
def test_a_boundary_dtype_that_differs_from_the_plan_is_one_line_on_both_ranks(
    tmp_path: Path,
) -> None:
    # plan.json says the cut's tensor is float64, the stage computes float32: the sender
    # checks the real tensor before any cast (a cast to the plan's dtype would hide it and
    # fail the receiver's compute with a dtype error); the receiver names the sender
    path = write_model(tmp_path, NUMBERED_DATASET)
    plan = make_plan(path, [ReplicaShape((1, 1), micro_batch_size=2, num_samples=4)])
    cut = plan.cuts[0]
    edited = replace(cut, tensors=(replace(cut.tensors[0], dtype="float64"),))
    plan = replace(plan, cuts=(edited,))
    sender, receiver = run_plan(plan, tmp_path / "run", "--steps", "1", timeout_s=60.0)
    assert sender.returncode == 2, sender.stderr[-2000:]
    line = sender.stderr.strip().splitlines()[-1]
    assert line.startswith("hplan run (rank 0): PlanMismatchError: cut after "), line
    assert "(rank 0 -> rank 1): tensor 'relu' has dtype float32, the plan expects float64; " in line
    assert line.endswith("re-run `hplan solve` with this model file"), line
    assert receiver.returncode == 1, receiver.stderr[-2000:]
    line = receiver.stderr.strip().splitlines()[-1]
    assert line.startswith("hplan run (rank 1): PeerFailureError: ") and "rank 0" in line, line
    assert "internal error" not in sender.stderr + receiver.stderr
