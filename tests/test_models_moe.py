"""labsupport.models.moe in one process: the MoE against the sum over each token's chosen
experts, top-k gating, capacity and dropping in GShard's order, Switch's auxiliary loss,
DeepSeek-V3's bias, the GPT option (one expert is the dense MLP), and the parameter
counts of estimate.moe against models built on the meta device and published figures."""

from __future__ import annotations

import math

import pytest
import torch

from labsupport.estimate.moe import (
    DEEPSEEK_V3,
    MIXTRAL_8X7B,
    all_to_all_bytes,
    balanced_all_to_all_bytes,
    gpt_moe_params,
    moe_params,
)
from labsupport.models import GPT, GPTConfig, MoE, MoEConfig, random_tokens
from labsupport.models import moe as moe_model

TOL = {"rtol": 1e-5, "atol": 1e-6}


def layer(**config) -> MoE:
    torch.manual_seed(0)
    return MoE(8, MoEConfig(**({"n_expert": 4, "top_k": 2} | config)))


def by_hand(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """``Σ_j gate_j · expert_{e_j}(x)`` over each token's kept choices, token by token."""
    r = moe.routing
    rows = []
    for t, token in enumerate(x):
        chosen = [j for j in range(r.experts.shape[1]) if r.kept[t, j]]
        terms = [r.gates[t, j] * moe.experts[int(r.experts[t, j])](token) for j in chosen]
        rows.append(sum(terms, torch.zeros_like(token)))
    return torch.stack(rows)


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_moe_adds_each_tokens_kept_experts_weighted_by_their_gates(top_k, capacity_factor):
    moe = layer(top_k=top_k, capacity_factor=capacity_factor)
    x = torch.randn(24, 8, generator=torch.Generator().manual_seed(1))
    y = moe(x)
    torch.testing.assert_close(y, by_hand(moe, x), **TOL)
    dropped = int((~moe.routing.kept).sum())
    assert (dropped > 0) == (capacity_factor is not None)  # 48 choices, 12 places per expert
    assert moe.routing.tokens_per_expert.sum() == 24 * top_k - dropped


def test_gates_are_switchs_probability_for_one_expert_and_renormalized_for_two():
    x = torch.randn(10, 8)
    one, two = layer(top_k=1), layer(top_k=2)
    r1, r2 = one.router(x), two.router(x)
    torch.testing.assert_close(r1.gates[:, 0], r1.probs.max(1).values)
    torch.testing.assert_close(r2.gates.sum(1), torch.ones(10))
    top2 = r2.probs.topk(2).values
    torch.testing.assert_close(r2.gates, top2 / top2.sum(1, keepdim=True))


def test_capacity_drops_first_choices_last_in_token_order_then_second_choices():
    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0], [3, 0]])
    assert moe_model.capacity(5, MoEConfig(4, 2, capacity_factor=1.0)) == 3  # ceil(2.5)
    kept = moe_model.keep_within_capacity(experts, 4, 3)
    # expert 0: the first choices of tokens 0, 1, 2 fill it; tokens 3 and 4's seconds drop
    assert kept.tolist() == [[True, True], [True, True], [True, True], [True, False], [True, False]]
    assert moe_model.keep_within_capacity(experts, 4, None).all()


def test_a_token_dropped_by_every_expert_gets_only_the_shared_expert():
    moe = layer(top_k=1, capacity_factor=0.25, shared_expert=True)  # 1 place per 4 experts
    x = torch.randn(16, 8)
    y = moe(x)
    dropped = ~moe.routing.kept[:, 0]
    assert dropped.sum() == 16 - 4 + (moe.routing.load == 0).sum()
    torch.testing.assert_close(y[dropped], moe.shared_expert(x[dropped]), **TOL)


def test_aux_loss_is_switchs_formula():
    moe = layer(top_k=2, aux_loss_coef=0.01)
    x = torch.randn(32, 8)
    moe(x)
    r = moe.routing
    f = [sum(int((r.experts[t] == i).sum()) for t in range(32)) / (32 * 2) for i in range(4)]
    p = [float(r.probs[:, i].mean().detach()) for i in range(4)]
    assert moe.aux_loss.item() == pytest.approx(
        0.01 * 4 * sum(a * b for a, b in zip(f, p, strict=True))
    )
    # perfectly balanced: alpha; only P carries a gradient
    probs = torch.full((8, 4), 0.25, requires_grad=True)
    balanced = moe_model.switch_aux_loss(probs, torch.arange(8).remainder(4).view(8, 1), 0.01)
    assert balanced.item() == pytest.approx(0.01)
    balanced.backward()
    torch.testing.assert_close(probs.grad, torch.full((8, 4), 0.01 * 4 * 0.25 / 8))


def test_the_bias_chooses_the_experts_but_does_not_weigh_them():
    moe = layer(top_k=2)
    x = torch.randn(16, 8)
    before = moe.router(x)
    moe.router.expert_bias[3] = 10.0
    after = moe.router(x)
    assert (after.experts == 3).any(1).all()  # every token now picks expert 3
    chosen = after.probs.gather(1, after.experts)
    torch.testing.assert_close(after.gates, chosen / chosen.sum(1, keepdim=True))
    assert not torch.equal(before.experts, after.experts)


def test_update_expert_bias_moves_each_bias_against_its_load():
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            vocab_size=32,
            block_size=8,
            n_layer=1,
            n_head=2,
            n_embd=16,
            moe=MoEConfig(4, 1, bias_update_speed=0.5),
        )
    )
    moe_model.update_expert_bias(model, [torch.tensor([5, 1, 1, 1])])  # mean 2
    assert model.h[0].mlp.router.expert_bias.tolist() == [-0.5, 0.5, 0.5, 0.5]
    model(random_tokens(2, 8, 32)[0])
    load = model.h[0].mlp.routing.load
    moe_model.update_expert_bias(model)  # from the last forward pass
    want = torch.tensor([-0.5, 0.5, 0.5, 0.5]) + 0.5 * torch.sign(load.float().mean() - load)
    torch.testing.assert_close(model.h[0].mlp.router.expert_bias, want)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"n_expert": 4, "top_k": 5}, "top_k=5 with n_expert=4"),
        ({"n_expert": 0}, "n_expert must be at least 1"),
        ({"capacity_factor": 0.0}, "capacity_factor must be positive"),
    ],
)
def test_bad_configurations_are_refused(config, message):
    with pytest.raises(ValueError, match=message):
        MoEConfig(**config)


def test_dispatch_plan_groups_rows_by_expert_and_splits_them_by_rank():
    experts = torch.tensor([5, 0, 3, 0, 7, 2, 5, 1])
    splits, order, inverse = moe_model.dispatch_plan(experts, 8, 4)
    assert splits == [3, 2, 2, 1]  # experts 0-1, 2-3, 4-5, 6-7
    assert experts[order].tolist() == [0, 0, 1, 2, 3, 5, 5, 7]
    assert torch.equal(experts[order][inverse], experts)


def test_one_expert_is_the_dense_mlp():
    """A GPT whose MoE has one expert, top-1, is the dense GPT: the gate is 1."""
    c = {"vocab_size": 32, "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 16}
    torch.manual_seed(0)
    dense = GPT(GPTConfig(**c))
    moe = GPT(GPTConfig(**c, moe=MoEConfig(1, 1)))
    state = {k.replace(".mlp.", ".mlp.experts.0."): v for k, v in dense.state_dict().items()}
    missing = moe.load_state_dict(state, strict=False).missing_keys
    assert all(k.endswith(("router.gate.weight", "router.expert_bias")) for k in missing)
    idx, targets = random_tokens(2, 8, 32)
    torch.testing.assert_close(moe(idx, targets)[1], dense(idx, targets)[1], **TOL)


def test_the_course_gpt_with_moe_has_the_closed_form_parameter_counts():
    with torch.device("meta"):
        model = GPT(
            GPTConfig(
                vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, moe=MoEConfig(8, 2)
            )
        )
    counts = gpt_moe_params(64, 16, 32, 2, 8, 2)
    assert sum(p.numel() for p in model.parameters()) == counts["total"]
    expert = sum(p.numel() for p in model.h[0].mlp.experts[0].parameters())
    assert counts["total"] - counts["active"] == 2 * (8 - 2) * expert


def test_published_total_and_active_parameters():
    mixtral, deepseek = moe_params(MIXTRAL_8X7B), moe_params(DEEPSEEK_V3)
    # Mistral AI: 46.7B total, 12.9B per token; DeepSeek-V3: 671B total, 37B activated
    assert round(mixtral["total"] / 1e9, 1) == 46.7 and round(mixtral["active"] / 1e9, 1) == 12.9
    assert round(deepseek["total"] / 1e9) == 671 and math.floor(deepseek["active"] / 1e9) == 37
    assert deepseek["routed experts"] / deepseek["total"] > 0.97


def test_all_to_all_bytes_count_rows_sent_and_received_twice():
    rows_to = [[5, 3], [1, 7]]  # rank 0 sends 3 rows to rank 1, gets 1 back from it
    assert all_to_all_bytes(rows_to, hidden=2, bytes_per_value=4) == [2 * 2 * 4 * 4] * 2
    even = [[4, 4], [4, 4]]
    assert all_to_all_bytes(even, 2) == [balanced_all_to_all_bytes(8, 1, 2, 2)] * 2


# --------------------------------------------------------------------------- DeepSpeed


def deepspeed_gates(gating, logits, **kwargs) -> tuple:
    """DeepSpeed's gating (``deepspeed.moe.sharded_moe``) as ``(T, E)`` gates and its
    auxiliary loss (Switch's sum, before the coefficient)."""
    from deepspeed.moe import sharded_moe

    l_aux, combine, dispatch, _ = getattr(sharded_moe, gating)(logits.clone(), **kwargs)
    return combine.sum(-1), dispatch.sum(-1).bool(), l_aux


def ours_as_matrix(routing, n_expert: int) -> tuple:
    gates = torch.zeros(len(routing.experts), n_expert)
    kept = torch.zeros(len(routing.experts), n_expert, dtype=torch.bool)
    gates.scatter_(1, routing.experts, routing.gates * routing.kept)
    kept.scatter_(1, routing.experts, routing.kept)
    return gates, kept


def test_routing_matches_deepspeeds_gating():
    """DeepSpeed's top1gating (no random token selection) and top2gating (no sampling of
    the second expert) choose, keep and weigh as ours: the same capacity, first choices
    before second ones. Two differences, by design: DeepSpeed renormalizes a token's gates
    after dropping one of its two choices (ours, as GShard and Megatron, before), and its
    top-2 auxiliary loss counts first choices only (GShard's; ours, Megatron's, all k)."""
    torch.manual_seed(0)
    router = moe_model.Router(8, MoEConfig(4, 1))
    x = torch.randn(32, 8)
    logits = router.gate(x).detach()
    # top-1, nothing dropped: the same gates, and Switch's loss
    gates, kept, l_aux = deepspeed_gates(
        "top1gating", logits, capacity_factor=4.0, min_capacity=0, use_rts=False
    )
    ours = router(x)
    torch.testing.assert_close(ours_as_matrix(ours, 4)[0], gates)
    torch.testing.assert_close(moe_model.switch_aux_loss(ours.probs, ours.experts, 1.0), l_aux)
    # top-2 with a capacity: the same choices kept; the same gates where both are kept
    router.config = MoEConfig(4, 2, capacity_factor=0.75)
    ours = router(x)
    gates, kept, _ = deepspeed_gates(
        "top2gating", logits, capacity_factor=0.75, min_capacity=0, top2_2nd_expert_sampling=False
    )
    our_gates, our_kept = ours_as_matrix(ours, 4)
    assert torch.equal(our_kept, kept) and not kept.sum(1).eq(2).all()
    both = ours.kept.all(1)
    torch.testing.assert_close(our_gates[both], gates[both])
