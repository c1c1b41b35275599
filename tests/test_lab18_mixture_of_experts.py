"""Lab 18, mixture of experts: the lab's layer on 4 ranks against one process with exact
routing, the bytes against the formula, the busiest rank's wait, EP x DP training against
one process, the balancing runs, and the exercises' checkers (against the notebook's
worked solutions, wrong answers, and one that hangs). The layers themselves are tested
in tests/test_models_moe.py and tests/test_parallel_expert.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from test_lab07_collectives import checks

from labsupport import launch
from labsupport.estimate.moe import all_to_all_bytes
from labsupport.labs import lab18_checks, lab18_training
from labsupport.labs import lab18_moe as lab
from labsupport.models.moe import dispatch_plan, keep_within_capacity

LAB = "18-mixture-of-experts.ipynb"


def test_the_lab_layer_on_4_ranks_equals_one_process_and_its_bytes_the_formula():
    results = launch(lab.compare_all, 4, timeout=240)
    for name, config in lab.CONFIGS.items():
        ranks = [r[name] for r in results]
        assert all(r["output"] and r["input gradient"] and r["expert gradients"] for r in ranks)
        assert all(r["router gradient"] for r in ranks)
        assert min(r["logit gap"] for r in ranks) >= 2**-10  # exact dyadic logits, no tie
        formula = all_to_all_bytes([r["sent"] for r in ranks], lab.N_EMBD)
        assert [r["bytes"] for r in ranks] == [b + lab.count_bytes(4) for b in formula]
        assert sum(sum(r["kept"]) + r["dropped"] for r in ranks) == 4 * lab.TOKENS * config.top_k
    # the lab's text: the busiest expert and rank of the top-2 routing, and the drops
    top2 = [r["top-2, dropless"]["kept"] for r in results]
    per_expert = [sum(c) for c in zip(*top2, strict=True)]
    per_rank = [sum(per_expert[i : i + 2]) for i in (0, 2, 4, 6)]
    assert max(per_expert) == 42 and per_rank == [58, 66, 69, 63]
    assert sum(r["top-2, capacity 1.0"]["dropped"] for r in results) == 28


def test_tokens_are_dyadic_so_every_logit_is_exact():
    x, w = lab.tokens(3, skew=1.0), lab.router_weight()
    assert torch.equal(x * 2**5, torch.round(x * 2**5)) and torch.equal(w * 32, torch.round(w * 32))
    exact = x.double() @ w.double().t()
    assert torch.equal((x @ w.t()).double(), exact)


def test_the_busiest_rank_sets_the_step():
    timed = launch(lab.busiest_rank, 4, timeout=240)
    for skew in (0.0, 1.0):
        ranks = [r[skew] for r in timed]
        assert sum(r["rows"] for r in ranks) == 4 * lab.TOKENS * 2
        assert ranks[0]["step"] >= max(r["waited"] for r in ranks)
    assert timed[0][1.0]["rows"] > 3 * timed[0][0.0]["rows"]  # the skew's tokens go to rank 0


def test_ep_dp_runs_equal_one_process_and_wrong_groups_do_not():
    single = lab18_training.train_single(3)
    for r in launch(lab18_training.ep_dp_runs, 4, args=(3,), timeout=300):
        assert r["ep group"] == [r["rank"] // 2 * 2, r["rank"] // 2 * 2 + 1]
        assert r["expert-dp group"] == [r["rank"] % 2, r["rank"] % 2 + 2]
        torch.testing.assert_close(
            torch.tensor(r["right"]), torch.tensor(single), rtol=0, atol=1e-5
        )
        for wrong in ("experts over all ranks", "rest over expert-dp"):
            assert max(abs(a - b) for a, b in zip(r[wrong], single, strict=True)) > 1e-4


def test_balancing_reports_the_imbalance_of_each_step():
    for mode in lab18_training.BALANCING:
        imbalance = lab18_training.balancing(3, mode)
        assert len(imbalance) == 3 and all(1.0 <= v <= 4.0 for v in imbalance)
    with pytest.raises(KeyError):
        lab18_training.balancing(1, "sinkhorn")


# --------------------------------------------------------------------------- exercises


def splits_per_expert(experts, n_expert, ep_size):
    _, order, inverse = dispatch_plan(experts, n_expert, ep_size)
    return torch.bincount(experts, minlength=n_expert).tolist(), order, inverse


def order_as_inverse(experts, n_expert, ep_size):
    splits, order, _ = dispatch_plan(experts, n_expert, ep_size)
    return splits, order, order


def experts_modulo_ranks(experts, n_expert, ep_size):
    _, order, inverse = dispatch_plan(experts, n_expert, ep_size)
    return torch.bincount(experts % ep_size, minlength=ep_size).tolist(), order, inverse


def sorted_by_rank_only(experts, n_expert, ep_size):
    splits, _, _ = dispatch_plan(experts, n_expert, ep_size)
    rank = experts // (n_expert // ep_size)
    order = torch.argsort(rank * n_expert - experts, stable=True)  # experts reversed per rank
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order))
    return splits, order, inverse


def test_check_dispatch_plan(capsys):
    mistakes = [
        (splits_per_expert, "you counted per expert"),
        (order_as_inverse, "that is order itself"),
        (experts_modulo_ranks, "consecutive experts"),
        (sorted_by_rank_only, "groups the rows by rank but not by expert"),
        (lambda experts, n_expert, ep_size: None, "return three things"),
    ]
    verified = "your plan moves the lab's tokens on 4 ranks"
    checks(capsys, lab18_checks.check_dispatch_plan, LAB, "dispatch_plan", verified, mistakes)


def waits_for_rank_0(experts, n_expert, ep_size):
    """Right on every routing, but rank 0 waits at a barrier the others never reach."""
    if dist.is_initialized() and dist.get_rank() == 0:
        dist.barrier()
    return dispatch_plan(experts, n_expert, ep_size)


def test_check_dispatch_plan_reports_a_hang():
    with pytest.raises(AssertionError, match="did not all finish within 10 s"):
        lab18_checks.check_dispatch_plan(waits_for_rank_0, timeout=10)


def keep_all(experts, n_expert, capacity_factor):
    return torch.ones_like(experts, dtype=torch.bool)


def rounds_down(experts, n_expert, capacity_factor):
    t, k = experts.shape
    return keep_within_capacity(experts, n_expert, math.floor(capacity_factor * t * k / n_expert))


def forgets_k(experts, n_expert, capacity_factor):
    t, _ = experts.shape
    return keep_within_capacity(experts, n_expert, math.ceil(capacity_factor * t / n_expert))


def token_by_token(experts, n_expert, capacity_factor):
    t, k = experts.shape
    capacity = math.ceil(capacity_factor * t * k / n_expert)
    return keep_within_capacity(experts.reshape(-1, 1), n_expert, capacity).view(t, k)


def test_check_keep(capsys):
    mistakes = [
        (keep_all, "nothing is dropped"),
        (rounds_down, "rounds up"),
        (forgets_k, "each token makes k choices"),
        (token_by_token, "first choices come first"),
        (lambda experts, n_expert, capacity_factor: experts[:, 0] >= 0, "mask of shape"),
    ]
    verified = "each expert keeps its first ceil(capacity_factor * T * k / E) choices"
    checks(capsys, lab18_checks.check_keep, LAB, "keep", verified, mistakes)
