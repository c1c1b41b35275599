"""Lab 14, ZeRO and FSDP: the notebook's training loop on real ranks, its memory and
traffic rows against the formulas, activations against states, FSDP2's full state dict
on rank 0 only, and the exercises' checkers against the notebook's worked solutions and
wrong answers, one of which hangs the ranks and must come back as a timeout. (DeepSpeed
is in tests/test_parallel_zero_deepspeed.py, ZeRO itself in tests/test_parallel_zero.py.)"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from notebook_solutions import notebook_function, solution, stub
from test_lab07_collectives import checks

from labsupport import launch
from labsupport.estimate.memory import training_memory
from labsupport.labs import lab14_exercises, lab14_frameworks, lab14_zero

LAB = "14-zero.ipynb"


def test_the_notebooks_loop_on_two_ranks_gives_the_memory_and_traffic_rows():
    """The training loop of the notebook's cell, with lab.Record's books."""
    zero_runs = notebook_function(LAB, "zero_runs")
    runs = {2: launch(zero_runs, 2, timeout=300)}
    reference = lab14_zero.plain_adam()
    for stage, run in runs[2][0].items():  # the loop trains as one process does
        assert run["losses"] == pytest.approx(reference["losses"], abs=lab14_zero.LOSS_TOL)
        assert not lab14_zero.param_mismatches(run["params"], reference["params"]), stage
    rows = lab14_zero.memory_rows(runs)
    assert [(r["ranks"], r["stage"]) for r in rows] == [(2, 1), (2, 2), (2, 3)]
    for row in rows:  # 9,522 is even: no padding on 2 ranks
        assert row["parameters"] == row["formula p"]
        assert row["optimizer"] == row["formula o"]
        assert row["gradients"] == row["formula g"]  # stage 1 keeps them whole, as counted
    for row in lab14_zero.traffic_rows(runs[2], world=2):
        assert row["bytes sent"] == row["formula"]
        assert row["flag bytes"] == row["formula f"] == 28  # 28 tensors, a byte each
        # per step: stage 1 one reduce-scatter and one all-gather of the whole model;
        # stages 2 and 3 one per unit (2 blocks and the root), stage 3 a second gather;
        # and one all-reduce of the flags
        assert row["calls"] == {1: 3, 2: 7, 3: 10}[row["stage"]]


def test_activations_grow_with_the_micro_batch_and_states_do_not():
    rows = lab14_zero.states_and_activations(batches=(1, 4), world=4)
    numel = 9522
    for row in rows:
        for stage in range(4):
            want = sum(training_memory(numel, "fp32", stage, 4).values())
            assert row[f"states, stage {stage}"] == round(want)
    assert 3.5 < rows[1]["activations"] / rows[0]["activations"] < 4.5


def test_fsdp2_trains_like_adam_and_gathers_the_full_state_on_rank_0_only():
    reference = lab14_zero.plain_adam()
    results = launch(lab14_frameworks.train_fsdp2, 2, timeout=300)
    numel = sum(p.numel() for p in reference["params"].values())
    for r in results:
        assert r["losses"] == pytest.approx(reference["losses"], abs=lab14_zero.LOSS_TOL)
        assert not lab14_zero.param_mismatches(r["params"], reference["params"])
    assert results[0]["full_state_dict_bytes"] >= 12 * numel
    assert results[1]["full_state_dict_bytes"] == 0
    assert sum(r["sharded_weight_bytes"] for r in results) >= 4 * numel


@pytest.mark.parametrize(
    ("check", "name"),
    [
        (lab14_zero.check_state_bytes, "state_bytes"),
        (lab14_zero.check_traffic, "traffic"),
        (lab14_zero.check_min_ranks, "min_ranks"),
    ],
)
def test_checkers_accept_the_solutions_and_say_not_attempted_to_the_stub(check, name, capsys):
    assert check(solution(LAB, name))
    assert "Correct" in capsys.readouterr().out
    assert not check(stub(name))
    assert "Not attempted yet" in capsys.readouterr().out


def test_state_bytes_checker_rejects_sharding_everything_and_sharding_nothing():
    with pytest.raises(AssertionError, match="which states stay whole"):
        lab14_zero.check_state_bytes(lambda n, stage, dp: 16 * n / dp if stage else 16 * n)
    with pytest.raises(AssertionError, match="divides some"):
        lab14_zero.check_state_bytes(lambda n, stage, dp: 16 * n)


def test_traffic_checker_rejects_whole_tensors_and_one_gather():
    with pytest.raises(AssertionError, match=r"\(N-1\)/N"):
        lab14_zero.check_traffic(lambda n, stage, dp, e: (3 if stage == 3 else 2) * n * e)
    with pytest.raises(AssertionError, match="twice"):
        lab14_zero.check_traffic(lambda n, stage, dp, e: 2 * n * e * (dp - 1) / dp)


def test_min_ranks_checker_rejects_rounding_down_and_ignoring_what_stays_whole():
    def round_down(n, stage, memory):
        whole = {0: 16, 1: 4, 2: 2, 3: 0}[stage]
        room = memory - whole * n
        return None if room <= 0 else max(1, math.floor((16 - whole) * n / room))

    def all_sharded(n, stage, memory):
        return math.ceil(16 * n / memory)

    with pytest.raises(AssertionError, match="round up"):
        lab14_zero.check_min_ranks(round_down)
    with pytest.raises(AssertionError, match="stays whole"):
        lab14_zero.check_min_ranks(all_sharded)


def test_fsdp2_in_practice_and_zero3_prefetch():
    """One launch: HSDP on a 2 x 2 mesh, FSDP2 with explicit prefetching, and gradient
    accumulation with the first micro-batch's sync off all train as plain Adam does;
    reshard_after_forward keeps a quarter, all, or half of the blocks after forward;
    bf16 compute with fp32 storage, gradients and reduction; ZeRO-3 holds the root and
    1 + k blocks with k prefetched, and trains the same whatever k."""
    from labsupport.labs import lab14_fsdp2

    reference, one_step = lab14_zero.plain_adam(), lab14_zero.plain_adam(1)
    ranks = launch(lab14_fsdp2.fsdp2_practice, 4, timeout=300)
    # after forward, the four ranks hold the blocks once between them (rows split 4 ways)
    assert sum(r["after forward"]["True"] for r in ranks) == ranks[0]["whole blocks"]
    for r in ranks:
        hsdp = r["hsdp"]
        assert hsdp["placements"] == "(Replicate(), Shard(dim=0))"
        assert hsdp["local"] == (36, 18) and hsdp["whole"] == (72, 18)  # sharded over 2
        for run in (hsdp, r["prefetch"]):
            assert not lab14_zero.param_mismatches(run["params"], reference["params"])
            for got, want in zip(run["losses"], reference["losses"], strict=True):
                assert abs(got - want) < lab14_zero.LOSS_TOL
        assert not lab14_zero.param_mismatches(r["accumulated"], one_step["params"])
        whole, kept = r["whole blocks"], r["after forward"]
        assert kept["False"] == whole and kept["2"] * 2 == whole
        mixed = r["mixed"]
        assert mixed["compute"] == ("torch.bfloat16", "torch.bfloat16")
        assert mixed["stored"] == mixed["gradient"] == "torch.float32"
        assert abs(mixed["loss"] - mixed["fp32 loss"]) < 0.05  # bf16: 3 significant digits
        zero3 = r["zero3"]
        *blocks, root = zero3[0]["units"]
        for k, run in zero3.items():
            assert run["peak"] == root + (1 + k) * blocks[0]
            assert run["loss"] == zero3[0]["loss"]
            assert all(torch.equal(run["params"][n], p) for n, p in zero3[0]["params"].items())


# --------------------------------------------------------------------------- exercise 4


class Sharded:
    """The worked solution's ZeRO-1, with the usual mistakes as switches: how many times
    the summed gradient is divided by the world size, which shard rank r holds (r +
    ``offset``), and whether the flat buffer is padded (without, the shards differ)."""

    divisions, offset, padded = 1, 0, True

    def __init__(self, params, lr):
        self.params = list(params)
        self.world, rank = dist.get_world_size(), dist.get_rank()
        flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        if self.padded:
            self.n = math.ceil(flat.numel() / self.world)
            self.pad = self.n * self.world - flat.numel()
            start = (rank + self.offset) % self.world * self.n
            mine = F.pad(flat, (0, self.pad))[start : start + self.n]
        else:
            mine = torch.tensor_split(flat, self.world)[rank]
            self.n, self.pad = mine.numel(), 0
        self.shard = torch.nn.Parameter(mine.clone())
        self.adam = torch.optim.Adam([self.shard], lr=lr)

    def step(self):
        grad = F.pad(torch.cat([p.grad.reshape(-1) for p in self.params]), (0, self.pad))
        self.shard.grad = torch.empty_like(self.shard)
        dist.reduce_scatter_single(self.shard.grad, grad)
        self.shard.grad /= self.world**self.divisions
        self.adam.step()
        self.gather()

    def gather(self):
        full = torch.empty(self.n * self.world, device=self.shard.device)
        dist.all_gather_single(full, self.shard.detach())
        with torch.no_grad():
            start = 0
            for p in self.params:
                p.copy_(full[start : start + p.numel()].view_as(p))
                start += p.numel()


class ForgetsToDivide(Sharded):
    divisions = 0


class DividesTwice(Sharded):
    divisions = 2


class StepsTheNextShard(Sharded):
    offset = 1


class Unpadded(Sharded):
    padded = False


class AllReduces:
    """Data parallelism with Adam on every rank: right values, the whole model's states."""

    def __init__(self, params, lr):
        self.params = list(params)
        self.flat = torch.nn.Parameter(torch.cat([p.detach().reshape(-1) for p in self.params]))
        self.adam = torch.optim.Adam([self.flat], lr=lr)

    def step(self):
        self.flat.grad = torch.cat([p.grad.reshape(-1) for p in self.params])
        dist.all_reduce(self.flat.grad)
        self.flat.grad /= dist.get_world_size()
        self.adam.step()
        with torch.no_grad():
            start = 0
            for p in self.params:
                p.copy_(self.flat[start : start + p.numel()].view_as(p))
                start += p.numel()


class GathersOnRankZero(Sharded):
    """Only rank 0 all-gathers (as if it collected the shards for the others)."""

    def gather(self):
        if dist.get_rank() == 0:
            super().gather()


def test_check_zero1(capsys):
    mistakes = [
        (ForgetsToDivide, r"exp_avg of your shard after step 1 differs .*\(2 times the average"),
        (DividesTwice, r"1/2 of the average: the sum is divided by the world size twice"),
        (StepsTheNextShard, r"rank 0: the shard your Adam steps, .* holds shard 1"),
        (Unpadded, r"on 2 ranks the shards your Adams step have sizes \[27, 26\], for 53"),
        (
            AllReduces,
            r"each rank holds \[424, 424\] bytes of Adam's states, one .*: 2.0 times ZeRO-1's",
        ),
    ]
    verified = "on 2 and 3 ranks, 3 steps give plain Adam's parameters"
    checks(capsys, lab14_exercises.check_zero1, LAB, "ZeRO1", verified, mistakes)
    with pytest.raises(AssertionError, match="did not all finish within 10 s") as info:
        lab14_exercises.check_zero1(GathersOnRankZero, timeout=10)
    assert "is one of yours under an `if rank == ...`?" in str(info.value)
