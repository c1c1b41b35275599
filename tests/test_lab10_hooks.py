"""Lab 10's hooks section: PyTorch's communication hooks on both DDPs with their bytes
counted (against the formula of each compression), summing in bf16 against fp32, and
gradients as views of DDP's buckets."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from labsupport import launch
from labsupport.labs import lab10_hooks as hooks
from labsupport.labs.lab10_data_parallel import make_gpt


def counted_sum() -> list:
    t = torch.ones(5)
    with hooks.count_all_reduces() as calls:
        dist.all_reduce(t)
        dist.all_reduce(t.half())
    dist.all_reduce(t)  # after the block: not counted
    return calls


def test_count_all_reduces_sees_dtype_and_bytes_and_restores_all_reduce():
    original = dist.all_reduce
    assert launch(counted_sum, 2, timeout=60)[0] == [("float32", 20), ("float16", 10)]
    with pytest.raises(RuntimeError), hooks.count_all_reduces():
        raise RuntimeError("a failing step")
    assert dist.all_reduce is original


def test_hooks_send_what_their_compression_predicts_on_both_ddps():
    result = launch(hooks.hooked_training, 2, timeout=240)[0]
    model = make_gpt()
    full = 4 * sum(p.numel() for p in model.parameters())
    expected = {
        "fp32 (allreduce_hook)": [full] * 3,
        "fp16_compress_hook": [full // 2] * 3,
        "bf16_compress_hook": [full // 2] * 3,
        "PowerSGD, rank 4": [full, full, 4 * hooks.powersgd_numbers(model)],  # plain for 2 steps
    }
    for name, bytes_per_step in expected.items():
        for kind in ("ours", "torch"):
            run = result[(name, kind)]
            if "refused" in run:  # torch's bf16 hook without CUDA and NCCL
                assert (name, kind) == ("bf16_compress_hook", "torch") and "NCCL" in run["refused"]
                continue
            assert [s["bytes"] for s in run["steps"]] == bytes_per_step, (name, kind)
    assert 4 * hooks.powersgd_numbers(model) == 168_960
    assert result[("bf16_compress_hook", "ours")]["steps"][0]["dtypes"] == ["bfloat16"]
    # the runs end near the fp32 one, PowerSGD farthest
    reference = result[("fp32 (allreduce_hook)", "ours")]["params"]
    distance = {
        key: ((run["params"] - reference).norm() / reference.norm()).item()
        for key, run in result.items()
        if "params" in run
    }
    assert distance[("fp16_compress_hook", "ours")] < 1e-4
    assert distance[("bf16_compress_hook", "ours")] < 1e-3
    assert 1e-3 < distance[("PowerSGD, rank 4", "ours")] < 1e-2


def test_ring_sum_rounds_each_partial_sum_to_the_dtype():
    grads = torch.tensor([[1.0], [2.0**-8], [2.0**-8]], dtype=torch.float64)
    assert hooks.ring_sum(grads, torch.float64).item() == 1 + 2.0**-7
    # bf16's spacing at 1 is 2^-7: 1 + 2^-8 is a tie, rounded to the even 1, twice
    assert hooks.ring_sum(grads, torch.bfloat16).item() == 1.0
    assert hooks.ring_sum(grads[[1, 2, 0]], torch.bfloat16).item() == 1 + 2.0**-7  # order
    rows = hooks.reduction_errors(ranks=(2, 64), n=512)
    assert rows[0]["float32"] < 1e-6 < 1e-3 < rows[0]["bfloat16"] < rows[1]["bfloat16"]


def test_gradients_as_bucket_views_live_in_the_buckets():
    storage = launch(hooks.gradient_storage, 2, timeout=120)[0]
    grads = sum(1 for _ in make_gpt().parameters())
    assert storage[False] == {"grads": grads, "storages": grads, "bytes": storage[True]["bytes"]}
    assert storage[True]["storages"] == 7  # the buckets of 0.5 MiB
