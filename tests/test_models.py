"""labsupport.models: the one GPT against the released GPT-2 parameter counts and against
itself (fused and written-out attention, recomputation), the MLPs, the CNN, and the
data made in code."""

from __future__ import annotations

import math

import pytest
import torch

from labsupport.measure.memory import count_parameters, storage_bytes
from labsupport.models import (
    GPT,
    GPT2_LARGE,
    GPT2_MEDIUM,
    GPT2_SMALL,
    GPT2_XL,
    MLP,
    GPTConfig,
    MLPStack,
    SmallCNN,
    batch_share,
    mse_loss,
    random_tokens,
    regression_data,
    tiny_gpt,
    train_one_process,
)

# --------------------------------------------------------------------------- the GPT

# Parameter counts of the released GPT-2 checkpoints (tied embeddings), as counted from
# their weights; the GPT-2 paper's Table 2 rounds them differently (117M, 345M, ...).
GPT2_RELEASED = [
    (GPT2_SMALL, 124_439_808),
    (GPT2_MEDIUM, 354_823_168),
    (GPT2_LARGE, 774_030_080),
    (GPT2_XL, 1_557_611_200),
]


@pytest.mark.parametrize(("config", "released"), GPT2_RELEASED)
def test_gpt2_built_on_the_meta_device_has_the_released_parameter_count(config, released):
    with torch.device("meta"):
        model = GPT(config)
    assert all(p.is_meta for p in model.parameters())  # counted without any memory
    assert count_parameters(model) == released


def test_default_config_is_gpt2_small():
    assert GPTConfig() == GPT2_SMALL
    assert (GPT2_SMALL.vocab_size, GPT2_SMALL.block_size, GPT2_SMALL.n_embd) == (50257, 1024, 768)


def test_tied_weight_is_counted_and_stored_once():
    model = tiny_gpt()
    assert model.lm_head.weight is model.wte.weight
    extra = model.config.vocab_size * model.config.n_embd
    assert storage_bytes(model) == 4 * count_parameters(model)
    naive = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert naive == count_parameters(model) + extra  # what a careless count would say


def test_untied_output_layer_adds_a_second_vocab_by_width_matrix():
    tied, untied = tiny_gpt(), tiny_gpt(tie_weights=False)
    assert untied.lm_head.weight is not untied.wte.weight
    extra = tied.config.vocab_size * tied.config.n_embd
    assert count_parameters(untied) == count_parameters(tied) + extra
    assert storage_bytes(untied) == 4 * count_parameters(untied)


def test_tiny_gpt_runs_and_shapes():
    model = tiny_gpt()
    idx, targets = random_tokens(2, 64, 256, seed=0)
    logits, loss = model(idx, targets)
    assert logits.shape == (2, 64, 256)
    assert math.isclose(loss.item(), math.log(256), rel_tol=0.05)  # near-uniform at init
    logits_alone, no_loss = model(idx)
    assert no_loss is None and torch.equal(logits_alone, logits)
    with pytest.raises(ValueError, match="longer than block_size"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_embed_run_block_and_head_compose_to_forward():
    model = tiny_gpt()
    idx, targets = random_tokens(2, 16, 256, seed=3)
    x = model.embed(idx)
    for block in model.h:
        x = model.run_block(block, x)
    logits, loss = model.head(x, targets)
    want_logits, want_loss = model(idx, targets)
    assert torch.equal(logits, want_logits) and torch.equal(loss, want_loss)


def test_written_out_attention_gives_the_logits_and_loss_of_the_fused_one():
    fused = tiny_gpt(seed=0)
    math_attention = tiny_gpt(seed=0, attention="math")
    math_attention.load_state_dict(fused.state_dict())
    idx, targets = random_tokens(4, 64, 256, seed=1)
    logits, loss = fused(idx, targets)
    got_logits, got_loss = math_attention(idx, targets)
    # Both compute the same sums in float32, in different orders: they differ by
    # rounding only. A sum of n terms carries a relative error of at most n·u (Higham's
    # gamma_n, u = 2^-24); the longest reduction in the model is the MLP's second layer,
    # n = 4 · n_embd = 256 terms. So logits agree within 256·u of their magnitude (1.5e-5
    # relative; the two typically differ by 1e-7), and the mean cross-entropy, whose
    # gradient with respect to each token's logits sums to at most 2 in absolute value,
    # within twice that.
    n = 4 * fused.config.n_embd
    tol = n * 2.0**-24 * logits.abs().max().item()
    torch.testing.assert_close(got_logits, logits, rtol=0, atol=tol)
    torch.testing.assert_close(got_loss, loss, rtol=0, atol=2 * tol)


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputation_gives_the_same_gradients(recompute):
    """Recomputation reruns the same kernels on the same inputs, with the random state
    of dropout restored: the gradients are the same to the bit, dropout on."""
    idx, targets = random_tokens(4, 64, 256, seed=1)
    grads = {}
    for mode in ("none", recompute):
        model = tiny_gpt(seed=0, recompute=mode, dropout=0.1).train()
        torch.manual_seed(5)  # the same dropout masks in both runs
        model(idx, targets)[1].backward()
        grads[mode] = [p.grad for p in model.parameters()]
    for plain, recomputed in zip(grads["none"], grads[recompute], strict=True):
        assert torch.equal(plain, recomputed)


def test_tiny_gpt_given_a_whole_shape_is_that_gpt_drawn_from_the_seed():
    shape = {"vocab_size": 61, "block_size": 8, "n_layer": 3, "n_head": 2, "n_embd": 18}
    torch.manual_seed(4)
    want = GPT(GPTConfig(**shape, dropout=0.1))
    got = tiny_gpt(4, **shape, dropout=0.1)
    assert got.config == want.config
    for (name, p), q in zip(got.state_dict().items(), want.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    assert not torch.equal(tiny_gpt(5, **shape).wte.weight, want.wte.weight)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"n_embd": 100, "n_head": 12}, "n_embd=100 does not divide into n_head=12"),
        ({"attention": "flash"}, "attention must be one of"),
        ({"recompute": "some"}, "recompute must be one of"),
    ],
)
def test_a_config_that_cannot_be_built_is_refused_clearly(fields, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**fields)


# --------------------------------------------------------------------------- MLPs, CNN


def test_mlp_is_linear_layers_with_relu_between():
    model = MLP([10, 5, 2])
    assert [type(m).__name__ for m in model] == ["Linear", "ReLU", "Linear"]
    assert (model[0].in_features, model[0].out_features, model[2].out_features) == (10, 5, 2)
    assert model(torch.zeros(3, 10)).shape == (3, 2)


def test_mlp_stack_weights_depend_only_on_the_seed():
    a, b, c = MLPStack(3, 8, seed=0), MLPStack(3, 8, seed=0), MLPStack(3, 8, seed=1)
    assert len(a.blocks) == 3 and a.blocks[0].fc1.out_features == 4 * 8
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.blocks[0].fc1.weight, c.blocks[0].fc1.weight)


@pytest.mark.parametrize("segment", [1, 3, 4])
def test_checkpointing_the_mlp_stack_gives_the_same_output_and_gradients(segment):
    stack, x = MLPStack(8, 16), torch.randn(8, 16)
    plain = stack(x)
    plain.sum().backward()
    want = [p.grad.clone() for p in stack.parameters()]
    stack.zero_grad()
    checkpointed = stack(x, segment)
    checkpointed.sum().backward()
    assert torch.equal(checkpointed, plain)
    for got, expected in zip((p.grad for p in stack.parameters()), want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"in_channels": 3, "channels": (8, 16), "kernel": 3, "image_size": 32, "classes": 100}],
)
def test_cnn_classifies_images_of_its_size(kwargs):
    model = SmallCNN(**kwargs)
    side = kwargs.get("image_size", 28)
    out = model(torch.zeros(2, kwargs.get("in_channels", 1), side, side))
    assert out.shape == (2, kwargs.get("classes", 10))


# --------------------------------------------------------------------------- data


def test_random_tokens_are_next_token_pairs_fixed_by_the_seed():
    idx, targets = random_tokens(3, 16, 100, seed=7)
    assert idx.shape == targets.shape == (3, 16) and idx.dtype == torch.int64
    assert torch.equal(idx[:, 1:], targets[:, :-1])  # the targets are the text shifted by one
    assert int(torch.cat([idx, targets]).min()) >= 0
    assert int(torch.cat([idx, targets]).max()) < 100
    torch.manual_seed(123)  # the global random state does not matter
    again = random_tokens(3, 16, 100, seed=7)
    assert torch.equal(again[0], idx) and torch.equal(again[1], targets)
    assert not torch.equal(random_tokens(3, 16, 100, seed=8)[0], idx)


def test_regression_data_is_fixed_by_the_seed():
    x, y = regression_data(n=10, d_in=3, d_out=2, seed=4)
    assert x.shape == (10, 3) and y.shape == (10, 2)
    torch.manual_seed(123)
    again = regression_data(n=10, d_in=3, d_out=2, seed=4)
    assert torch.equal(again[0], x) and torch.equal(again[1], y)
    assert not torch.equal(regression_data(n=10, d_in=3, d_out=2, seed=5)[0], x)


@pytest.mark.parametrize(("n", "world"), [(8, 4), (12, 4), (10, 4), (7, 3), (5, 5), (2, 3)])
def test_the_ranks_shares_of_a_batch_are_contiguous_even_and_cover_it(n, world):
    shares = [batch_share(n, rank, world) for rank in range(world)]
    assert [i for s in shares for i in range(n)[s]] == list(range(n))  # in order, each once
    sizes = [s.stop - s.start for s in shares]
    assert max(sizes) - min(sizes) <= 1
    if n % world == 0:
        assert shares == [slice(r * n // world, (r + 1) * n // world) for r in range(world)]
    with pytest.raises(ValueError, match=f"rank {world} is not one of the {world} ranks"):
        batch_share(n, world, world)


# --------------------------------------------------------------------------- reference


def test_train_one_process_is_the_plain_training_loop():
    """Against the loop written out (Adam on the GPT's own loss; SGD on the MSE)."""
    shape = {"vocab_size": 32, "block_size": 8, "n_layer": 1, "n_head": 2, "n_embd": 16}
    batches = [random_tokens(4, 8, 32, seed=step) for step in range(3)]
    model, want = tiny_gpt(0, **shape), tiny_gpt(0, **shape)
    losses = train_one_process(model, torch.optim.Adam(model.parameters(), lr=1e-2), batches)
    opt, want_losses = torch.optim.Adam(want.parameters(), lr=1e-2), []
    for idx, targets in batches:
        opt.zero_grad()
        loss = want(idx, targets)[1]
        loss.backward()
        opt.step()
        want_losses.append(loss.item())
    assert losses == want_losses and losses[-1] < losses[0]
    for p, q in zip(model.parameters(), want.parameters(), strict=True):
        assert torch.equal(p, q)

    mlp, (x, y) = MLP([16, 8, 4]), regression_data()
    before = torch.nn.functional.mse_loss(mlp(x), y).item()
    sgd = torch.optim.SGD(mlp.parameters(), lr=0.1)
    losses = train_one_process(mlp, sgd, [(x, y)] * 2, mse_loss)
    assert losses[0] == before and losses[1] < losses[0]
