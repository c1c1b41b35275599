"""DeepSpeed's ZeRO, stages 1 to 3, on CPU ranks (DS_ACCELERATOR=cpu, gloo): the same
training as plain single-process Adam and as labsupport.parallel.zero (in lab 14's
training loop), and DeepSpeed's own memory estimator against the ZeRO paper's count.

World sizes 2 and 3: the lab's GPT has 9,522 parameters, which 4 divides into 2,380.5
and 3 into 3,174, so both pad some buffer."""

from __future__ import annotations

import pytest
from notebook_solutions import notebook_function

from labsupport import launch
from labsupport.estimate.memory import training_memory
from labsupport.labs import lab14_frameworks, lab14_zero

STAGES = (1, 2, 3)


@pytest.mark.parametrize("world", [2, 3])
def test_deepspeed_zero_trains_like_plain_adam_and_like_ours(world):
    reference = lab14_zero.plain_adam()
    theirs = launch(lab14_frameworks.train_deepspeed, world, args=(STAGES,), timeout=600)
    ours = launch(notebook_function("14-zero.ipynb", "zero_runs"), world, timeout=300)
    for stage in STAGES:
        for rank in range(world):
            ds, mine = theirs[rank][stage], ours[rank][stage]
            assert ds["losses"] == pytest.approx(reference["losses"], abs=lab14_zero.LOSS_TOL)
            assert ds["losses"] == pytest.approx(mine["losses"], abs=lab14_zero.LOSS_TOL)
            assert not lab14_zero.param_mismatches(ds["params"], reference["params"])
            assert not lab14_zero.param_mismatches(ds["params"], mine["params"])


def test_deepspeeds_adam_is_adamw_unless_told():
    """The lab's configuration turns adam_w_mode off: DeepSpeed's "Adam" with torch_adam
    is torch.optim.AdamW otherwise, whose default weight decay is 0.01."""
    config = lab14_frameworks.deepspeed_config(stage=2, world=3)
    assert config["optimizer"]["params"]["adam_w_mode"] is False
    assert config["optimizer"]["params"]["torch_adam"] is True
    assert config["zero_optimization"] == {"stage": 2}
    assert config["train_batch_size"] == 3 * config["train_micro_batch_size_per_gpu"]


@pytest.mark.parametrize(("num_params", "gpus_per_node", "nodes"), [(7.5e9, 8, 8), (1e9, 4, 1)])
def test_deepspeeds_estimator_counts_four_more_bytes(num_params, gpus_per_node, nodes):
    """deepspeed/runtime/zero/stage_1_and_2.py: "18 = 2_grads_16bit + 4_grads_32bit +
    4_params_32bit + 8_optimizer_states_32bit", beside 2 bytes of 16-bit weights that
    ZeRO-2 keeps whole; the ZeRO paper shards 2 + 12 = 14 of its 16."""
    n = gpus_per_node * nodes
    estimate = lab14_frameworks.deepspeed_zero2_estimate(num_params, gpus_per_node, nodes)
    paper = sum(training_memory(num_params, "mixed", 2, n).values())
    assert estimate == int(2 * num_params + 18 * num_params / n)
    assert estimate - paper == pytest.approx(4 * num_params / n)
