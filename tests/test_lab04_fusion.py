"""Lab 4, section 4: operator fusion, the chain eager, in place, tiled and compiled,
checked to rounding, timed side by side, and the bytes each moves."""

from __future__ import annotations

import torch

from labsupport.labs import lab04_fusion


def test_chain_variants_agree():
    x = torch.randn(100_003)
    want = lab04_fusion.elementwise_chain(x)
    assert torch.allclose(lab04_fusion.tiled_chain(x, block=1000), want)
    out = torch.empty_like(x)
    assert torch.allclose(lab04_fusion.unfused_into(x, out), want)
    assert torch.allclose(lab04_fusion.chain_in_place(x.clone()), want)
    # by hand: x = -1 -> -2 -> -1 -> 0 -> 0 -> -1 -> 1 -> 3 -> 5
    assert lab04_fusion.elementwise_chain(torch.tensor([-1.0])).item() == 5.0


def test_chain_matches_allows_rounding_and_no_more():
    x = torch.randn(100_003, generator=torch.Generator().manual_seed(0))
    want = lab04_fusion.elementwise_chain(x)
    assert lab04_fusion.chain_matches(want, x)
    # an FMA for 3·|c| + 2 rounds once instead of twice: within the bound
    c = (torch.relu(2 * x.double() + 1) * 0.5 - 1).abs()
    assert lab04_fusion.chain_matches(
        torch.addcmul(torch.full_like(x, 2.0), c.float(), torch.tensor(3.0)), x
    )
    assert lab04_fusion.chain_matches((3 * c + 2).float(), x)  # rounded once, from exact
    assert not lab04_fusion.chain_matches(want * (1 + 2**-20), x)  # 16 ulps off
    assert not lab04_fusion.chain_matches(want[:-1], x)
    broken = want.clone()
    broken[len(x) // 2 :] = 0  # half the elements never written
    assert not lab04_fusion.chain_matches(broken, x)


def test_fused_chain_agrees_with_eager():
    x = torch.randn(4096)
    fused, how = lab04_fusion.fused_chain(x)
    assert lab04_fusion.chain_matches(fused(x), x)
    assert how.startswith(("torch.compile", "tiled"))


def test_fused_chain_falls_back_when_the_compiler_fails_or_is_wrong(monkeypatch):
    x = torch.randn(1000)

    def failing(fn):
        def compiled(t):
            raise RuntimeError("no C++ compiler")

        return compiled

    monkeypatch.setattr(torch, "compile", failing)
    fused, how = lab04_fusion.fused_chain(x)
    assert fused is lab04_fusion.tiled_chain and "failed" in how
    monkeypatch.setattr(torch, "compile", lambda fn: lambda t: fn(t) * (1 + 2**-18))
    fused, how = lab04_fusion.fused_chain(x)
    assert fused is lab04_fusion.tiled_chain and "wrong" in how


def test_chain_seconds_times_the_three_side_by_side(monkeypatch):
    x = torch.randn(1000)
    seen = {}

    def one_round(fns, rounds):
        seen.update((name, fn()) for name, fn in fns.items())
        return {"rounds": rounds}

    monkeypatch.setattr(lab04_fusion, "side_by_side", one_round)
    assert lab04_fusion.chain_seconds(lab04_fusion.tiled_chain, x, rounds=3) == {"rounds": 3}
    assert list(seen) == ["fused", "eager", "eager, no allocation"]
    for result in seen.values():
        assert lab04_fusion.chain_matches(result, x)


def test_chain_bytes():
    assert lab04_fusion.chain_bytes(2**20) == 8 * 2 * 2**20 * 4
    assert lab04_fusion.chain_bytes(2**20, fused=True) == 2 * 2**20 * 4
    assert (
        lab04_fusion.chain_bytes(10, ops=3) / lab04_fusion.chain_bytes(10, ops=3, fused=True) == 3
    )
