"""Data parallelism from scratch against PyTorch's DistributedDataParallel and against one
process training on the whole batch, on several world sizes.

The model has what trips data-parallel implementations up (CS336's DDP tests use the
same): a frozen layer, an output layer tied to the embedding, and a bucket size that puts
a layer's weight and bias in different buckets.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labsupport import launch
from labsupport.parallel.data_parallel import (
    DistributedDataParallel,
    all_reduce_gradients,
    make_buckets,
)

STEPS, BATCH = 3, 12  # 12 samples split evenly over 2, 3 or 4 ranks
# float32 sums of at most a few hundred terms in another order: relative error
# ~ terms x 2^-24 < 1e-5; parameters of order 1, so 1e-5 also bounds the absolute error.
TOL = {"rtol": 1e-5, "atol": 1e-5}


class Tied(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(16, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.fc = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)  # only used when asked to
        self.out = nn.Linear(8, 16, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx, use_all: bool = True):
        h = torch.tanh(self.fc(self.frozen(self.emb(idx))))
        if use_all:
            h = h + self.unused(h)
        return self.out(h)


def data(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(16, (BATCH, 5), generator=g), torch.randint(16, (BATCH, 5), generator=g)


def loss_of(model, idx, targets, **kw):
    return F.cross_entropy(model(idx, **kw).reshape(-1, 16), targets.reshape(-1))


def train(wrap: str, bucket_cap_mb: float, use_all: bool = True):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = Tied(seed=rank)  # different on every rank: wrapping must broadcast rank 0's
    if wrap == "ours":
        ddp = DistributedDataParallel(
            model, bucket_cap_mb=bucket_cap_mb, find_unused_parameters=not use_all
        )
    elif wrap == "torch":
        ddp = nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=bucket_cap_mb, find_unused_parameters=not use_all
        )
    else:  # naive: rank 0's weights by hand, all-reduce after backward
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
        ddp = model
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    shard = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    for step in range(STEPS):
        idx, targets = data(step)
        opt.zero_grad()
        loss_of(ddp, idx[shard], targets[shard], use_all=use_all).backward()
        if wrap == "naive":
            all_reduce_gradients(model)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def single_process(use_all: bool = True):
    model = Tied(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for step in range(STEPS):
        idx, targets = data(step)
        opt.zero_grad()
        loss_of(model, idx, targets, use_all=use_all).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], **TOL, msg=name)


def bucket_cap_splitting_fc() -> float:
    """A cap (MiB) of exactly fc.weight's bytes: fc's weight and bias in two buckets."""
    return 8 * 8 * 4 / 2**20


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_bucketed_ddp_equals_torch_ddp_and_one_process(world_size):
    cap = bucket_cap_splitting_fc()
    ours = launch(train, world_size, args=("ours", cap), timeout=120)
    theirs = launch(train, world_size, args=("torch", cap), timeout=120)
    naive = launch(train, world_size, args=("naive", cap), timeout=120)
    reference = single_process()
    for rank in range(world_size):
        assert_same(ours[rank], theirs[rank])
        assert_same(ours[rank], reference)
        assert_same(naive[rank], reference)
        assert torch.equal(ours[rank]["frozen.weight"], reference["frozen.weight"])


def test_buckets_go_in_reverse_order_and_never_split_a_parameter():
    model = Tied()
    params = [p for p in model.parameters() if p.requires_grad]
    names = {id(p): n for n, p in model.named_parameters()}
    buckets = make_buckets(params, 8 * 8 * 4)
    layout = [[names[id(p)] for p in b.params] for b in buckets]
    reverse = ["unused.bias", "unused.weight", "fc.bias", "fc.weight", "emb.weight"]
    assert layout == [[name] for name in reverse]
    one = make_buckets(params, 2**20)
    assert len(one) == 1 and one[0].nbytes == sum(p.numel() * 4 for p in params)


def accumulate(wrap: str):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = Tied(seed=0)
    ddp = (DistributedDataParallel if wrap == "ours" else nn.parallel.DistributedDataParallel)(
        model, bucket_cap_mb=bucket_cap_splitting_fc()
    )
    idx, targets = data(0)
    shard = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    half = (shard.stop - shard.start) // 2
    first = slice(shard.start, shard.start + half)
    second = slice(shard.start + half, shard.stop)
    with ddp.no_sync():
        (loss_of(ddp, idx[first], targets[first]) / 2).backward()
    (loss_of(ddp, idx[second], targets[second]) / 2).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("wrap", ["ours", "torch"])
def test_no_sync_accumulation_equals_the_big_batch(wrap):
    model = Tied(seed=0)
    idx, targets = data(0)
    loss_of(model, idx, targets).backward()
    want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for got in launch(accumulate, 2, args=(wrap,), timeout=120):
        assert_same(got, want)


def unused_without_flag():
    model = Tied(seed=0)
    ddp = DistributedDataParallel(model)
    idx, targets = data(0)
    loss_of(ddp, idx, targets, use_all=False).backward()


def test_a_parameter_without_gradient_is_named_in_a_clear_error():
    from labsupport import LaunchError

    with pytest.raises(LaunchError, match="unused.weight, unused.bias|unused.bias, unused.weight"):
        launch(unused_without_flag, 2, timeout=120)


def test_find_unused_parameters_trains_like_torch():
    cap = bucket_cap_splitting_fc()
    ours = launch(train, 2, args=("ours", cap, False), timeout=120)
    theirs = launch(train, 2, args=("torch", cap, False), timeout=120)
    reference = single_process(use_all=False)
    for rank in range(2):
        assert_same(ours[rank], theirs[rank])
        assert_same(ours[rank], reference)
