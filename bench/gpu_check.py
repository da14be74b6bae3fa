"""GPU check: device discovery, microbenchmarks, the GPT example's unit profile, and the
runtime's CUDA/NCCL paths, on whatever CUDA machine this runs on. Prints what it measured.

    python bench/gpu_check.py [--out DIR] [--layers 12 --width 768 --heads 12 --seq 1024]

On a machine without a usable CUDA device it prints the discovery, says
``no CUDA device: skipped`` and exits 0. Steps (each prints PASS/FAIL/SKIP and numbers):

1. discovery (nvidia-ml-py if installed, torch.cuda; joined on PCI bus id);
2. microbenchmarks on every GPU: matmul TFLOP/s per dtype, copy GB/s;
3. per-unit profile of examples/gpt on cuda:0 (``hplan profile --model``) and its total;
4. the runtime on one GPU: solve the GPT for a one-GPU cluster with ``--profile``, run two
   optimizer steps with ``python -m hplan.runtime run`` (NCCL, world size 1): rank device
   placement, loss, step time and ``torch.cuda.max_memory_allocated`` from its metrics;
5. NCCL point to point: two processes on cuda:0 (NCCL usually refuses two ranks on one
   GPU, "Duplicate GPU detected"; the result is printed either way), then one process:
   a world-size-1 all-reduce and a send/recv to itself with ``batch_isend_irecv``.
Every child process runs under a timeout, so the check cannot hang.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "examples" / "gpt" / "model.py"
HPLAN = [sys.executable, "-c", "from hplan.planner.cli.main import main; main()"]
CHILD_TIMEOUT_S = 300
NCCL_TIMEOUT_S = 90


def say(step: str, status: str, text: str = "") -> None:
    print(f"[{status:4}] {step}: {text}", flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run(cmd: list[str], env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired as exc:
        return subprocess.CompletedProcess(cmd, 124, exc.stdout or "", f"timed out: {exc}")


def tail(text: str | bytes, lines: int = 6) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join(text.strip().splitlines()[-lines:])


# ------------------------------------------------------------------------------ steps
def step_discovery():
    from hplan.planner.hardware.discovery import discover_devices, iter_details

    found = discover_devices()
    for line in iter_details(found):
        print(f"        {line}")
    for gpu in found.gpus:
        print(f"        {gpu.kind}: {json.dumps(gpu.details(), sort_keys=True)}")
    say("discovery", "PASS", f"{len(found.gpus)} NVIDIA GPU(s), {len(found.usable_gpus)} usable")
    return found


def step_microbench(found) -> None:
    import torch

    from hplan.planner.profiling.microbench import benchmark_device

    for gpu in found.usable_gpus:
        started = time.monotonic()
        result = benchmark_device(torch.device("cuda", gpu.torch_index))
        flops = ", ".join(
            f"{dtype} {stat.median / 1e12:.1f} TFLOP/s (p10 {stat.p10 / 1e12:.1f}, "
            f"p90 {stat.p90 / 1e12:.1f}, n={stat.num_samples})"
            for dtype, stat in result.matmul_flops_per_s.items()
        )
        bw = result.memory_bandwidth_bytes_per_s
        say(
            f"microbench cuda:{gpu.torch_index} {gpu.name}",
            "PASS",
            f"{flops}; copy {bw.median / 1e9:.0f} GB/s (p10 {bw.p10 / 1e9:.0f}, p90 "
            f"{bw.p90 / 1e9:.0f}) in {time.monotonic() - started:.1f} s",
        )


def step_unit_profile(out: Path, env: dict[str, str]) -> Path | None:
    prof = out / "prof"
    started = time.monotonic()
    proc = run(
        [*HPLAN, "profile", "--model", str(GPT), "-o", str(prof), "--device", "cuda:0",
         "--micro-batch-sizes", "1,2,4,8", "--no-benchmark"],
        env, CHILD_TIMEOUT_S,
    )  # fmt: skip
    print(proc.stderr[-6000:])
    if proc.returncode != 0:
        say("unit profile", "FAIL", f"exit {proc.returncode}: {tail(proc.stderr)}")
        return None
    from hplan.planner.profiling.profile_file import Profile

    profile = Profile.load(prof)
    for size in sorted({t.micro_batch_size for t in profile.unit_timings}):
        timings = [t for t in profile.unit_timings if t.micro_batch_size == size]
        fwd = sum(t.forward_s.median for t in timings)
        bwd = sum(t.backward_s.median for t in timings)
        peak = max(t.peak_bytes for t in timings)
        print(
            f"        mbs {size}: whole model forward {fwd * 1e3:.2f} ms, backward "
            f"{bwd * 1e3:.2f} ms, largest unit peak {peak / 2**20:.0f} MiB"
        )
    say(
        "unit profile",
        "PASS",
        f"{len(profile.unit_timings)} timings in {time.monotonic() - started:.0f} s",
    )
    return prof


def _one_gpu_cluster(out: Path, found) -> Path:
    gpu = found.usable_gpus[0]
    memory_gib = max(gpu.memory_total_bytes / 2**30 - 2, 1)
    device = (
        f"type: {gpu.kind}"
        if gpu.in_catalog
        else f"custom: {gpu.kind}\n        memory_gib: {memory_gib:.0f}\n        peak_tflops: 500\n"
        "        memory_bandwidth_gb_per_s: 3000"
    )
    path = out / "one-gpu.yaml"
    path.write_text(
        f"name: one-gpu\nnodes:\n  - name: local\n    host: 127.0.0.1\n    devices:\n"
        f"      - {device}\n"
    )
    return path


def step_runtime(out: Path, env: dict[str, str], found, prof: Path | None) -> None:
    cluster = _one_gpu_cluster(out, found)
    plan_dir = out / "plan"
    profile_args = ["--profile", str(prof)] if prof is not None else []
    proc = run(
        [*HPLAN, "solve", str(GPT), "--cluster", str(cluster), "-o", str(plan_dir), "-b", "8",
         "--master-port", str(free_port()), *profile_args],
        env, CHILD_TIMEOUT_S,
    )  # fmt: skip
    if proc.returncode != 0:
        say("runtime: solve", "FAIL", f"exit {proc.returncode}: {tail(proc.stderr)}")
        return
    plan = json.loads((plan_dir / "plan.json").read_text())
    report = plan["report"]
    sources = sorted({r.get("cost_source", "?") for r in report["ranks"]})
    say(
        "runtime: solve",
        "PASS",
        f"backend {plan['training']['backend']}, predicted step "
        f"{report['predicted_step_time_s'] * 1e3:.2f} ms, costs from {report['cost_source']} "
        f"(ranks: {sources})",
    )
    from hplan.runtime.contract.plan import Plan
    from hplan.runtime.executor.rendezvous import rank_device

    loaded = Plan.load(plan_dir / "plan.json")
    say("runtime: rank device", "PASS", str(rank_device(loaded, loaded.ranks[0], None)))
    metrics = out / "metrics"
    proc = run(
        [sys.executable, "-m", "hplan.runtime", "run", str(plan_dir / "plan.json"), "--rank",
         "0", "--steps", "3", "--metrics-dir", str(metrics)],
        env, CHILD_TIMEOUT_S,
    )  # fmt: skip
    if proc.returncode != 0:
        say("runtime: run", "FAIL", f"exit {proc.returncode}: {tail(proc.stderr)}")
        return
    records = [json.loads(line) for f in metrics.glob("rank-*.jsonl") for line in f.open()]
    last = records[-1]
    say(
        "runtime: run",
        "PASS",
        f"{len(records)} steps, last loss {last['loss']}, step {last['step_time_s'] * 1e3:.2f} ms "
        f"(compute {last['compute_time_s'] * 1e3:.2f} ms), peak memory "
        f"{last['peak_memory_bytes'] / 2**20:.0f} MiB (torch.cuda.max_memory_allocated), "
        f"predicted {report['predicted_step_time_s'] * 1e3:.2f} ms",
    )


# ----------------------------------------------------------------------------- NCCL
def nccl_worker(rank: int, world: int, port: int, mode: str) -> None:
    """One process of an NCCL check (run as a child by :func:`step_nccl`)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=60), device_id=torch.device("cuda", 0),
    )  # fmt: skip
    payload = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    started = time.perf_counter()
    if mode == "pair":
        if rank == 0:
            dist.send(payload, dst=1)
        else:
            got = torch.empty_like(payload)
            dist.recv(got, src=0)
            assert torch.equal(got, payload)
    else:
        total = payload.clone()
        dist.all_reduce(total)
        torch.cuda.synchronize()
        assert torch.equal(total, payload)
        print(f"all-reduce (world size 1): ok in {(time.perf_counter() - started) * 1e3:.2f} ms")
        got = torch.empty_like(payload)
        try:  # torch may refuse a peer equal to the own rank
            ops = [dist.P2POp(dist.isend, payload, 0), dist.P2POp(dist.irecv, got, 0)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            torch.cuda.synchronize()
            print(f"send/recv to self: {'ok' if torch.equal(got, payload) else 'WRONG DATA'}")
        except Exception as exc:
            print(f"send/recv to self: not possible ({type(exc).__name__}: {exc})")
    torch.cuda.synchronize()
    print(f"rank {rank}: ok in {(time.perf_counter() - started) * 1e3:.2f} ms", flush=True)
    dist.destroy_process_group()


def step_nccl() -> None:
    port = free_port()
    script = str(Path(__file__).resolve())
    procs = [
        subprocess.Popen(
            [sys.executable, script, "--nccl-worker", str(r), "2", str(port), "pair"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outputs, codes = [], []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=NCCL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        outputs.append(out)
        codes.append(proc.returncode)
    status = "PASS" if codes == [0, 0] else "INFO"
    say("nccl: send/recv, 2 processes on cuda:0", status, f"exit codes {codes}")
    if status != "PASS":
        print("        " + tail("\n".join(outputs), 8).replace("\n", "\n        "))
    proc = run(
        [sys.executable, script, "--nccl-worker", "0", "1", str(free_port()), "self"], {},
        NCCL_TIMEOUT_S,
    )  # fmt: skip
    ok = proc.returncode == 0
    say(
        "nccl: 1 process all-reduce + self send/recv",
        "PASS" if ok else "FAIL",
        tail(proc.stdout + proc.stderr, 4 if ok else 10),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="keep outputs here (default: a temp dir)")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--nccl-worker", nargs=4, metavar=("RANK", "WORLD", "PORT", "MODE"))
    args = parser.parse_args()
    if args.nccl_worker:
        rank, world, port, mode = args.nccl_worker
        nccl_worker(int(rank), int(world), int(port), mode)
        return 0
    found = step_discovery()
    if not found.usable_gpus:
        print("no CUDA device: skipped (microbenchmarks, unit profile, runtime and NCCL checks)")
        return 0
    env = {
        "HPLAN_GPT_LAYERS": str(args.layers), "HPLAN_GPT_WIDTH": str(args.width),
        "HPLAN_GPT_HEADS": str(args.heads), "HPLAN_GPT_SEQ": str(args.seq),
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }  # fmt: skip
    print(f"GPT example: {json.dumps(env)}")
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        step_microbench(found)
        prof = step_unit_profile(out, env)
        step_runtime(out, env, found, prof)
        step_nccl()
    return 0


if __name__ == "__main__":
    sys.exit(main())
