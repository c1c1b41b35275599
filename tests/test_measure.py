"""labsupport.measure: timing (on a fake clock, where what is checked is the arithmetic
on the times), memory read from real tensors, FLOPs counted by PyTorch, and the
probes run for real on this machine.

A measured time or rate depends on the machine and its load. The tests assert on one
only where the claim holds under any load: a sleep lasts at least its duration, a
physical peak bounds a rate from above, and two kernels timed side by side, round after
round, keep their ratio when a burst of load slows both.
"""

from __future__ import annotations

import itertools
import os
import time

import psutil
import pytest
import torch
from fake_clock import FakeClock

from labsupport.estimate import datasheets
from labsupport.estimate.flops import transformer_training_flops
from labsupport.estimate.memory import training_memory
from labsupport.estimate.params import gpt_params
from labsupport.estimate.roofline import roofline
from labsupport.estimate.units import MiB
from labsupport.measure import memory, probe, timing
from labsupport.measure.flops import count_flops
from labsupport.models import GPT, GPT2_SMALL, MLP, tiny_gpt

# --------------------------------------------------------------------------- timing


@pytest.fixture
def clock(monkeypatch):
    """A fake clock in place of the one labsupport.measure.timing reads."""
    fake = FakeClock()
    monkeypatch.setattr(timing, "time", fake)
    return fake


def test_time_op_takes_the_median_or_the_shortest_sample(clock):
    def run(durations, **kwargs):
        steps = iter(durations)
        return timing.time_op(lambda: clock.advance(next(steps)), repeats=3, **kwargs)

    # a warm-up call, a probe call, then 3 samples of one call each (all >= 2 ms);
    # durations in powers of two, which the clock adds up exactly
    samples = [0.5, 2.0**-8, 2.0**-8, 2.0**-6, 2.0**-7]
    assert run(samples) == 2.0**-7
    assert run(samples, best=True) == 2.0**-8


def test_time_op_repeats_a_fast_function_to_fill_a_sample(clock):
    calls = itertools.count(1)

    def fast():
        next(calls)
        clock.advance(2.0**-12)  # 0.24 ms: 8 calls fill a sample of 2 ms (2^-9 s)

    assert timing.time_op(fast, repeats=3, min_sample_s=2.0**-9) == 2.0**-12
    assert next(calls) - 1 == 1 + 1 + 3 * 8  # warm-up, probe, 3 samples of 8 calls
    calls = itertools.count(1)
    timing.time_op(lambda: next(calls), repeats=2)  # takes no time on the fake clock
    assert next(calls) - 1 == 1 + 1 + 2 * 10_000, "at most 10,000 calls per sample"


def test_time_op_on_the_real_clock_is_at_least_the_time_slept():
    # A sleep lasts at least what it asks for, however loaded the machine: no upper bound.
    assert timing.time_op(lambda: time.sleep(0.004), repeats=3) >= 0.004


def test_side_by_side_ratios_survive_load_that_medians_do_not(clock):
    base = {"a": 1.0, "b": 2.0, "c": 0.5}
    load = [1, 10, 10, 1, 10]  # a burst of load slows every function of a round alike
    order = []

    def timed(name):
        def fn():
            order.append(name)
            sample = len(order) - 1 - 2 * len(base)  # after a warm-up and a probe each
            clock.advance(base[name] * (load[sample // len(base)] if sample >= 0 else 1))

        return fn

    t = timing.side_by_side({name: timed(name) for name in base}, rounds=5, min_sample_s=1e-9)
    assert (t["a"], t["b"], t["c"]) == (10.0, 20.0, 5.0)  # medians follow the load
    assert t["ratio"] == {"a": 1.0, "b": 2.0, "c": 0.5}  # ratios to "a" do not
    # the order rotates from round to round, so that no function always follows another
    assert order[6:] == list("abcbcacababcbca")


# --------------------------------------------------------------------------- memory


def test_count_parameters_trainable_only():
    model = MLP([10, 5, 2])
    model[0].weight.requires_grad_(False)
    assert memory.count_parameters(model) == 10 * 5 + 5 + 5 * 2 + 2
    assert memory.count_parameters(model, trainable_only=True) == 5 + 5 * 2 + 2


def test_storage_bytes_counts_a_shared_storage_once():
    base = torch.zeros(100)
    assert memory.storage_bytes([base, base[:10], base.view(10, 10)]) == 400
    assert memory.storage_bytes([base, torch.zeros(100)]) == 800
    assert memory.storage_bytes([base.to(torch.bfloat16)]) == 200


def test_storage_bytes_of_a_model_on_the_meta_device_allocates_nothing():
    with torch.device("meta"):
        model = GPT(GPT2_SMALL)
    assert memory.storage_bytes(model) == 4 * 124_439_808  # GPT-2 small, tied weight once


@pytest.mark.parametrize(
    "fields",
    [{}, {"vocab_size": 100, "block_size": 16, "n_layer": 3, "n_head": 2, "n_embd": 32}],
    ids=["tiny", "odd"],
)
def test_adam_keeps_16_bytes_per_parameter_in_fp32(fields):
    model = tiny_gpt(**fields)
    c = model.config
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(c.vocab_size, (2, c.block_size))
    model(idx, idx)[1].backward()
    optimizer.step()
    measured = memory.model_state_bytes(model, optimizer)
    want = training_memory(gpt_params(c.vocab_size, c.block_size, c.n_embd, c.n_layer), "fp32")
    for part in ("weights", "gradients", "momentum", "variance"):
        assert measured[part] == want[part], part
    assert measured["step counters"] == 4 * len(list(model.parameters()))


def test_saved_tensors_counts_what_autograd_keeps_for_backward():
    a = torch.randn(100, requires_grad=True)
    b = torch.randn(100, requires_grad=True)
    with memory.saved_tensors() as saved:
        (a * b).sum()  # the product's gradient needs both factors
    assert saved.nbytes == 2 * 400
    with memory.saved_tensors() as saved:
        (a[:50] * a[50:]).sum()  # two views of one storage: counted once
    assert saved.nbytes == 400
    layer, x = torch.nn.Linear(10, 5), torch.randn(3, 10, requires_grad=True)
    with memory.saved_tensors(exclude=layer) as saved:
        layer(x).sum()  # saves its input and its weight; the weight is the model's state
    assert saved.nbytes == 3 * 10 * 4


def test_saved_bytes_counts_saved_tensors_until_they_are_freed():
    layer = torch.nn.Linear(8, 8)
    held = memory.SavedBytes(exclude=layer)
    x = torch.randn(4, 8, requires_grad=True)
    with held.saving():
        y = layer(x).relu()  # saves x (linear) and the output (relu): 2 x 128 bytes
    assert held.live == held.peak == held.nbytes == 2 * 4 * 8 * 4
    y.sum().backward()
    del y
    assert held.live == 128  # x itself is still alive here
    del x
    assert held.live == 0 and held.peak == held.nbytes == 256
    with held.saving():  # counting again adds up
        z = layer(torch.randn(4, 8, requires_grad=True))
    assert held.live == 128 and held.nbytes == 384 and held.peak == 256
    del z


def test_saved_bytes_watches_only_the_modules_it_is_given():
    inner, outer = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    held = memory.SavedBytes()
    handles = held.watch([inner])
    x = torch.randn(4, 8, requires_grad=True)
    y = outer(inner(x).relu())  # inner saves x and its weight; relu and outer: unwatched
    assert held.nbytes == 128 + 256

    def fail(*_):
        raise RuntimeError("boom")

    failing = inner.register_forward_hook(fail)
    with pytest.raises(RuntimeError, match="boom"):
        inner(torch.randn(4, 8, requires_grad=True))  # saves a new input: 128 bytes
    assert held.nbytes == 128 + 256 + 128
    outer(y)  # a failed forward left no counting behind: outer is still not watched
    assert held.nbytes == 128 + 256 + 128
    for handle in [*handles, failing]:
        handle.remove()
    inner(torch.randn(4, 8, requires_grad=True))  # no longer watched
    assert held.nbytes == 128 + 256 + 128


def test_live_memory_counts_new_tensors_and_frees_them():
    tracker = memory.LiveMemory()
    a = torch.ones(1000)
    with tracker:
        b = a * 2  # 4000 bytes
        c = b.view(10, 100)  # a view: nothing new
        b.add_(1)  # in place: nothing new
        d = torch.zeros(500)  # 2000 bytes
        del d
    assert tracker.peak == 6000
    assert tracker.live == 4000
    assert c.sum().item() == 3000


# --------------------------------------------------------------------------- FLOPs


def test_count_flops_counts_matmuls_and_backward_costs_twice_the_forward():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    assert count_flops(torch.matmul, a, b) == 2 * 8 * 16 * 4
    model = tiny_gpt(vocab_size=100, block_size=16, n_layer=3, n_head=2, n_embd=32,
                     attention="math")  # fmt: skip
    idx = torch.randint(100, (2, 16))
    losses = []
    forward = count_flops(lambda: losses.append(model(idx, idx)[1]))
    backward = count_flops(lambda: losses[0].backward())
    # every matmul of the forward pass: a third of the training step's (Narayanan et al.)
    assert 3 * forward == transformer_training_flops(2 * 16, 3, 32, 16, 100)
    assert backward == 2 * forward


# --------------------------------------------------------------------------- probes


def test_machine_info_describes_this_machine():
    info = probe.machine_info()
    assert 1 <= info["cores"] <= os.cpu_count()
    assert info["ram_bytes"] == psutil.virtual_memory().total > 2**28
    assert len(info["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert isinstance(info["cpu_model"], str) and info["cpu_model"]
    assert info["torch_threads"] == torch.get_num_threads()
    assert probe.devices()[0] == "cpu"
    assert len(probe.devices()) == 1 + len(info["gpus"])


def test_cpu_bf16_flags_are_known_names():
    flags = probe.cpu_bf16_flags()
    assert set(flags) <= {"avx512_bf16", "amx_bf16", "avx_vnni_bf16", "bf16"}
    assert flags == sorted(flags)


def physical_limits(device: str) -> dict:
    """Bounds on what ``device`` can measure, from physics and datasheets, with margin.

    CPU: no core moves more than 192 bytes per cycle (two 64-byte loads and a 64-byte
    store, AVX-512) or computes more than 64 fp32 FLOPs per cycle (two 16-lane fused
    multiply-adds), at 6 GHz at most; at the low end, any machine of the last 15 years
    copies memory at several GB/s and multiplies at tens of GFLOP/s per core; the floor
    of 0.1 G/s leaves a factor of 100 for a machine so loaded that this process gets a
    few percent of a core, and still catches a rate off by a unit (a factor 1,000).
    GPU: its L2 cache, which may hold part of a 32 MiB tensor, streams at most about 10x
    the fastest HBM of the datasheets (the H200's 4.8 TB/s); none computes faster than
    the fastest 16-bit tensor rate of the datasheets.
    """
    if device == "cpu":
        cores = probe.usable_cores()
        return {"bandwidth": (1e8, cores * 6e9 * 192), "fp32": (1e8, cores * 6e9 * 64)}
    fastest = max(e["bandwidth"] for e in datasheets.DEVICES.values())
    tensor = max(e["tensor"] or 0 for e in datasheets.DEVICES.values())
    return {"bandwidth": (1e10, 10 * fastest), "fp32": (1e10, tensor)}


@pytest.mark.parametrize("device", probe.devices())
def test_measure_bandwidth_counts_read_and_write(device):
    result = probe.measure_bandwidth(32 * MiB, device=device, repeats=3)
    assert result["nbytes"] == 32 * MiB
    assert result["bytes_moved"] == 2 * 32 * MiB  # STREAM's copy: read once, written once
    assert result["bandwidth"] == result["bytes_moved"] / result["seconds"]
    low, high = physical_limits(device)["bandwidth"]
    assert low < result["bandwidth"] < high


@pytest.mark.parametrize("device", probe.devices())
def test_measure_matmul_flops_counts_2n_cubed(device):
    result = probe.measure_matmul_flops(256, device=device, repeats=3)
    assert (result["n"], result["flops"], result["dtype"]) == (256, 2 * 256**3, "float32")
    assert result["flop_per_s"] == result["flops"] / result["seconds"]
    low, high = physical_limits(device)["fp32"]
    assert low < result["flop_per_s"] < high
    # bf16 on a CPU without bf16 instructions is emulated, and can be very slow: no bound
    bf16 = probe.measure_matmul_flops(128, dtype=torch.bfloat16, device=device, repeats=3)
    assert (bf16["dtype"], bf16["flops"]) == ("bfloat16", 2 * 128**3)
    assert bf16["flop_per_s"] == bf16["flops"] / bf16["seconds"]


def test_measure_kernel_counts_each_kernel_and_derives_its_rates():
    add = probe.measure_kernel("add", numel=2**20, repeats=3)
    assert (add["flops"], add["bytes"], add["intensity"]) == (2**20, 12 * 2**20, 1 / 12)
    assert add["label"] == "add, 1 Mi elements"
    assert add["flop_per_s"] == add["flops"] / add["seconds"]
    assert add["bandwidth"] == add["bytes"] / add["seconds"]
    small = probe.measure_kernel("matmul", m=32, k=16, n=8, dtype=torch.bfloat16, repeats=3)
    assert (small["flops"], small["bytes"]) == (2 * 32 * 16 * 8, 2 * (32 * 16 + 16 * 8 + 32 * 8))
    copy = probe.measure_kernel("copy", numel=2**20, repeats=3)
    assert copy["flop_per_s"] == 0 and copy["bytes"] == 8 * 2**20
    with pytest.raises(ValueError, match="unknown kernel"):
        probe.measure_kernel("conv", numel=4)


def test_measured_kernels_sit_under_the_measured_roof():
    """The roofline on this CPU: a copy gives the memory roof, a 512³ matmul the compute
    roof; an add and a 32³ matmul stay under it. All four are timed side by side, so
    only ratios are compared, and load slows all of them alike."""
    n = 2**22  # 16 MiB per fp32 tensor: more than most caches
    src, dst, other = torch.randn(n), torch.empty(n), torch.randn(n)
    big = [torch.randn(512, 512) for _ in range(3)]
    small = [torch.randn(32, 32) for _ in range(3)]
    t = timing.side_by_side({
        "copy": lambda: dst.copy_(src),
        "add": lambda: torch.add(src, other, out=dst),
        "matmul 512": lambda: torch.matmul(big[0], big[1], out=big[2]),
        "matmul 32": lambda: torch.matmul(small[0], small[1], out=small[2]),
    })  # fmt: skip
    ratio = t["ratio"]  # each kernel's time over the copy's, in the same round
    bandwidth = 8 * n  # bytes per copy time
    peak = 2 * 512**3 / ratio["matmul 512"]
    add_bandwidth = 12 * n / ratio["add"]
    # an add is memory-bound: it streams at a rate comparable to a copy (about 1.3 here)
    assert 0.2 < add_bandwidth / bandwidth < 3
    for flops, time_ratio, intensity in [
        (n, ratio["add"], 1 / 12),
        (2 * 32**3, ratio["matmul 32"], 2 * 32**3 / (4 * 3 * 32**2)),
    ]:
        assert flops / time_ratio < 3 * roofline(peak, bandwidth, intensity)
