"""``make gpu-check``: what a machine with one GPU can check of the course's CUDA path.

NCCL refuses two ranks on one GPU, so a one-GPU machine checks what runs on one rank:

1. the launcher: ``backend="auto"`` gives the rank ``cpu:gloo,cuda:nccl`` and
   :func:`labsupport.device` its GPU; a CUDA tensor is all-reduced over NCCL and a CPU
   tensor over gloo;
2. every strategy of :mod:`labsupport.parallel` at world size 1 over NCCL, its model on
   the GPU, against one process (placement bugs show here: a tensor made on the CPU and
   used with a CUDA model): DDP (the course's and torch's), ZeRO stages 1-3, the pipeline
   executor, the tensor-parallel GPT, 3D training, a verified checkpoint of ZeRO's state;
   the parameter server needs a server and a worker, two ranks: not checked here;
3. the single-device labs' GPU paths, with their numbers printed: lab 1's roofline
   kernels and lab 4's mixed precision, fusion and activation checkpointing on CUDA;
4. with two GPUs or more, ``tests/test_gpu.py`` (the launcher and every collective on
   several GPUs);
5. ``make bench``'s all-reduce line on CUDA/NCCL (:mod:`tools.gpu_bandwidth`): the copy
   and the all-reduce against the datasheet's memory and link bandwidths.

``python -m tools.gpu_check --cpu`` runs 1, 2 and 5's all-reduce (2 ranks) on the CPU
(gloo), so that the script itself is tested where there is no GPU (``tests/test_tools.py``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from labsupport import device, launch
from labsupport.launch.runtime import GPU_BACKEND
from labsupport.models import GPT, random_tokens, tiny_gpt
from tools.gpu_bandwidth import bandwidth_lines

CONFIG = {"vocab_size": 64, "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 16}
STEPS, BATCH, LR = 3, 8, 1e-2
#: SGD with momentum and weight decay: unlike Adam, its step scales with the gradient, so
#: a gradient summed where it should be averaged shows.
OPTIMIZER = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}
TOL = {"rtol": 1e-4, "atol": 1e-5}


def _model() -> GPT:
    return tiny_gpt(0, **CONFIG).to(device())


def _batch(step: int):
    idx, targets = random_tokens(BATCH, CONFIG["block_size"], CONFIG["vocab_size"], seed=step)
    return idx.to(device()), targets.to(device())


def _params(model) -> dict:
    return {n: p.detach().cpu() for n, p in model.named_parameters()}


def _train(model, step, zero_grad) -> list[float]:
    """``STEPS`` steps of ``model`` (which returns logits and loss); the losses."""
    losses = []
    for k in range(STEPS):
        idx, targets = _batch(k)
        loss = model(idx, targets)[1]
        loss.backward()
        step()
        zero_grad()
        losses.append(loss.item())
    return losses


def _sgd(model):
    opt = torch.optim.SGD(model.parameters(), **OPTIMIZER)
    return opt.step, opt.zero_grad


def reference() -> dict:
    """One process, plain SGD, on the device: what every strategy must reproduce."""
    model = _model()
    losses = _train(model, *_sgd(model))
    return {"params": _params(model), "losses": losses}


def backend_and_device() -> dict:
    cpu, gpu = torch.ones(1), torch.ones(1, device=device())
    dist.all_reduce(cpu)
    dist.all_reduce(gpu)
    return {
        "backend": dist.get_backend(),
        "device": str(device()),
        "sums": [cpu.item(), gpu.item()],
    }


def data_parallel() -> dict:
    from labsupport.parallel.data_parallel import DistributedDataParallel

    out = {}
    for name, wrap in {
        "course DDP": DistributedDataParallel,
        "torch DDP": torch.nn.parallel.DistributedDataParallel,
    }.items():
        model = _model()
        _train(wrap(model), *_sgd(model))
        out[name] = _params(model)
    return out


def zero_stages() -> dict:
    from labsupport.parallel.zero import ZeRO

    out = {}
    for stage in (1, 2, 3):
        model = _model()
        zero = ZeRO(model, stage, optimizer_class=torch.optim.SGD, **OPTIMIZER)
        _train(model, zero.step, zero.zero_grad)
        for _, unit in zero.units:
            unit.gather()
        out[f"ZeRO-{stage}"] = _params(model)
    return out


def pipeline_and_tensor_parallel() -> dict:
    from labsupport.parallel import pipeline_parallel, schedules
    from labsupport.parallel.hybrid import train_3d, train_single
    from labsupport.parallel.tensor_parallel_model import ParallelGPT

    model = _model()
    chunks = pipeline_parallel.stage_modules(model, 1, 0)
    opt = torch.optim.SGD(chunks[0].parameters(), **OPTIMIZER)
    actions = schedules.one_f_one_b(1, 2, 0)
    for step in range(STEPS):
        idx, targets = _batch(step)
        shape = (BATCH // 2, CONFIG["block_size"], CONFIG["n_embd"])
        pipeline_parallel.run(chunks, actions, list(idx.split(BATCH // 2)),
                              list(targets.split(BATCH // 2)), shape)  # fmt: skip
        opt.step()
        opt.zero_grad()
    pipe = {n.removeprefix("embedding."): p for n, p in _params(chunks[0]).items()}
    tp_model = ParallelGPT(_model())
    return {
        "pipeline": pipe,
        "tensor parallel": _train(tp_model, *_sgd(tp_model)),
        "3D": train_3d(CONFIG, 1, 1, 1, 2, STEPS, BATCH, LR)["losses"],
        "one process (Adam)": train_single(CONFIG, STEPS, BATCH, LR),
    }


def checkpoint_round_trip(folder: str) -> dict:
    from labsupport.parallel import checkpoint as ck
    from labsupport.parallel.zero import ZeRO

    model = _model()
    zero = ZeRO(model, 2, optimizer_class=torch.optim.AdamW, lr=LR)  # zero_state: Adam's
    _train(model, zero.step, zero.zero_grad)
    saved = _params(model)
    ck.save({"zero": ck.zero_state(zero)}, folder)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for _, unit in zero.units:
            unit.shard.zero_()
    ck.load({"zero": ck.zero_state(zero)}, folder)
    ck.restore_zero(zero)
    return {"saved": saved, "loaded": _params(model)}


def _close(got: dict, want: dict) -> bool:
    return all(torch.allclose(got[n], want[n], **TOL) for n in want)


def check_ranks(backend: str) -> list[tuple[str, bool, str]]:
    """Run every one-rank check; returns (what, passed, detail) rows."""
    rows = []
    info = launch(backend_and_device, 1, backend=backend, timeout=300)[0]
    rows.append(("backend and device", info["sums"] == [1.0, 1.0], f"{info}"))
    ref = launch(reference, 1, backend=backend, timeout=300)[0]
    want = ref["params"]
    for name, got in launch(data_parallel, 1, backend=backend, timeout=300)[0].items():
        rows.append((name, _close(got, want), "parameters vs one process (SGD)"))
    for name, got in launch(zero_stages, 1, backend=backend, timeout=300)[0].items():
        rows.append((name, _close(got, want), "parameters vs one process (SGD)"))
    out = launch(pipeline_and_tensor_parallel, 1, backend=backend, timeout=300)[0]
    pipe = out["pipeline"]
    rows.append(("pipeline, 1F1B, 2 micro-batches", set(pipe) == set(want) and _close(pipe, want),
                 "parameters vs one process (SGD)"))  # fmt: skip
    for name, base in (("tensor parallel", ref["losses"]), ("3D", out["one process (Adam)"])):
        ok = torch.allclose(torch.tensor(out[name]), torch.tensor(base), **TOL)
        rows.append((name, ok, f"losses {[round(x, 4) for x in out[name]]} vs one process's"))
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "ckpt")
        round_trip = launch(checkpoint_round_trip, 1, args=(path,), backend=backend, timeout=300)[0]
    rows.append(("checkpoint (ZeRO-2, verified)", _close(round_trip["loaded"], round_trip["saved"]),
                 "saved, zeroed, loaded"))  # fmt: skip
    return rows


def single_device_numbers() -> list[str]:
    """Lab 1's roofline kernels and lab 4's techniques on the GPU, as numbers."""
    from labsupport.labs import lab01_hardware, lab04_checkpointing, lab04_fusion
    from labsupport.measure.probe import measure_bandwidth, measure_matmul_flops
    from labsupport.models import MLPStack

    lines, gpu = [], "cuda:0"
    bw = measure_bandwidth(2**30, device=gpu)
    lines.append(f"copy bandwidth: {bw['bandwidth'] / 1e9:,.0f} GB/s")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        flops = measure_matmul_flops(8192, dtype=dtype, device=gpu)
        lines.append(f"matmul 8192^2 {flops['dtype']}: {flops['flops_per_s'] / 1e12:,.0f} TFLOP/s")
    for name, row in lab01_hardware.roofline_side_by_side(gpu).items():
        lines.append(f"roofline {name}: {row['seconds'] * 1e6:,.0f} us, {row['vs add']:.2f}x add")
    x = torch.randn(2**24, device=gpu)
    fused, how = lab04_fusion.fused_chain(x)
    ratio = lab04_fusion.chain_seconds(fused, x)["ratio"]
    lines.append(f"fusion ({how}): eager takes {ratio['eager']:.1f}x the fused chain's time")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = torch.randn(256, 256, device=gpu) @ torch.randn(256, 256, device=gpu)
    lines.append(f"autocast matmul dtype: {y.dtype}")
    stack = MLPStack(layers=8, d=1024).to(gpu)
    inp = torch.randn(64, 1024, device=gpu, requires_grad=True)
    for segment in (None, 2):
        torch.cuda.reset_peak_memory_stats(gpu)
        lab04_checkpointing.training_step(stack, inp, segment)
        peak = torch.cuda.max_memory_allocated(gpu)
        saved = lab04_checkpointing.saved_bytes(stack, inp, segment)
        lines.append(f"checkpointing segment={segment}: saved {saved:,} B, peak {peak:,} B")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run the rank checks on the CPU")
    args = parser.parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPUs visible: {gpus}")
    if not args.cpu and gpus == 0:
        print(
            "no CUDA GPU here: nothing to check (python -m tools.gpu_check --cpu checks the script)"
        )
        return 2
    if gpus:
        print(f"GPU 0: {torch.cuda.get_device_name(0)}")
    start = time.perf_counter()
    backend = "gloo" if args.cpu else GPU_BACKEND
    rows = check_ranks(backend)
    if not args.cpu:
        rows[0] = (rows[0][0], rows[0][1] and "cuda:0" in rows[0][2], rows[0][2])
    for what, ok, detail in rows:
        print(f"{'PASS' if ok else 'FAIL'}  {what}: {detail}")
    failed = [what for what, ok, _ in rows if not ok]
    nbytes, rounds = (4 * 2**20, 3) if args.cpu else (2**30, 10)
    for line in bandwidth_lines(gpus if not args.cpu else 0, backend, nbytes, rounds):
        print(f"      {line}")
    if not args.cpu:
        for line in single_device_numbers():
            print(f"      {line}")
        if gpus >= 2:
            code = subprocess.call([sys.executable, "-m", "pytest", "tests/test_gpu.py", "-q"])
            failed += ["tests/test_gpu.py"] if code else []
    seconds = time.perf_counter() - start
    print(f"{len(rows) - len(failed)} of {len(rows)} checks passed in {seconds:.0f} s")
    if failed:
        print(f"FAILED: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
