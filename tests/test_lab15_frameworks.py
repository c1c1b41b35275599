"""Lab 15, frameworks: the DeepSpeed config against DeepSpeed's own parser, the loss
comparison's tolerance, the hostfile and the two launchers' command lines, a real
DeepSpeed-vs-course run on 2 ranks, and the exercises' checkers against the notebook's
worked solutions and wrong answers."""

from __future__ import annotations

import ast
import os
import time
from pathlib import Path

import pytest
from notebook_solutions import solution, stub
from test_lab07_collectives import checks

from labsupport import launch
from labsupport.labs import lab15_exercises as exercises
from labsupport.labs import lab15_frameworks as lab
from labsupport.labs import lab15_launcher as launcher
from labsupport.labs import lab15_megatron as megatron
from labsupport.parallel.deepspeed_setup import (
    BUILDING_SHM_COMM,
    cpu_accelerator,
    shm_comm_needs_building,
)

LAB = "15-frameworks.ipynb"


@pytest.fixture(scope="module")
def deepspeed_runner():
    with cpu_accelerator():
        from deepspeed.launcher import runner
    return runner


# ----------------------------------------------------------------------- the config


@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize(("stage", "offload"), [(1, False), (2, False), (2, True), (3, False)])
def test_config_batch_sizes_multiply_out(stage, offload, world):
    config = lab.deepspeed_config(stage, offload, world)
    assert config["train_batch_size"] == lab.BATCH
    assert config["train_batch_size"] == (
        config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * world
    )
    zero = config["zero_optimization"]
    assert zero["stage"] == stage
    assert ("offload_optimizer" in zero) == offload
    assert config["optimizer"] == {
        "type": "Adam",
        "params": {"lr": lab.LR, "torch_adam": True, "adam_w_mode": False},
    }
    assert config["bf16"] == {"enabled": False}


@pytest.mark.parametrize(("stage", "offload", "defaults"), [(r[1], r[2], r[3]) for r in lab.RUNS])
def test_deepspeeds_parser_reads_the_config_as_the_lab_explains_it(stage, offload, defaults):
    """DeepSpeedConfig outside a process group counts one rank: the config for 1 rank."""
    with cpu_accelerator():
        from deepspeed.runtime.config import DeepSpeedConfig

    parsed = DeepSpeedConfig(lab.deepspeed_config(stage, offload, 1, defaults))
    assert parsed.zero_optimization_stage == stage
    assert parsed.train_batch_size == lab.BATCH
    assert parsed.gradient_accumulation_steps == 1
    assert not parsed.bfloat16_config.enabled
    assert (parsed.zero_config.offload_optimizer is not None) == offload
    if stage == 3:  # the docstring's numbers: DeepSpeed's defaults, or the lab's small ones
        bucket, threshold = (5 * 10**8, 10**5) if defaults else (2**14, 0)
        assert parsed.zero_config.reduce_bucket_size == bucket
        assert parsed.zero_config.param_persistence_threshold == threshold


def test_deepspeed_config_stays_out_of_the_environment():
    before = os.environ.get("DS_ACCELERATOR")
    with cpu_accelerator():
        assert os.environ["DS_ACCELERATOR"] == "cpu"
    assert os.environ.get("DS_ACCELERATOR") == before


# ------------------------------------------------------------------ the comparison


def test_same_losses_tolerates_roundings_and_nothing_more():
    losses = [5.557610511779785, 5.572310447692871, 5.563796043395996]
    assert lab.same_losses(losses, list(losses))
    # the worst this lab measures: 3 units of 2^-24, relative
    assert lab.same_losses(losses, [x * (1 + 3 * 2**-24) for x in losses])
    assert not lab.same_losses(losses, [x * (1 + 1e-5) for x in losses])
    assert not lab.same_losses(losses, losses[:2])


def compare_then_budget_case(runs, steps):
    """Section 4's runs, then exercise 4's checker on section 4's ZeRO-3 config."""
    rows = lab.compare(runs, steps)
    return rows, exercises.budget_case(lambda world: lab.deepspeed_config(3, world_size=world))


def test_deepspeed_trains_like_the_course_zero_on_two_ranks():
    """One short run of each engine (stages 1 and 3, 2 steps) on 2 ranks, and exercise 4's
    checker on the same ZeRO-3 config: section 4's count and the checker's are the model
    states and DeepSpeed's buffers, nothing of the batch (they once differed by the last
    micro-batch's logits, held by section 4's loop, less the batch and the causal masks of
    the checker's GPT)."""
    runs = [("ZeRO-1", 1, False, False), ("ZeRO-3", 3, False, False)]
    start = time.perf_counter()
    rows, case = launch(compare_then_budget_case, 2, args=(runs, 2), timeout=300)[0]
    params = sum(p.numel() for p in lab.tiny_gpt(0, block_size=lab.SEQ).parameters())
    assert [row["run"] for row in rows] == ["ZeRO-1", "ZeRO-3"]
    for row in rows:
        ours, theirs = row["course"], row["deepspeed"]
        assert len(theirs["losses"]) == 2
        assert lab.same_losses(ours["losses"], theirs["losses"])
        assert ours["adam_bytes"] == theirs["adam_bytes"] == 8 * params // 2
        assert theirs["weight_decay"] == 0
    assert rows[0]["deepspeed"]["optimizer"] == "DeepSpeedZeroOptimizer(Adam)"
    assert rows[1]["deepspeed"]["optimizer"] == "DeepSpeedZeroOptimizer_Stage3(Adam)"
    assert rows[1]["course"]["bytes"] < rows[0]["course"]["bytes"]  # ZeRO-3 shards weights
    # ZeRO-1 after a step (stage_1_and_2.py): the whole fp32 weights, flat; this rank's
    # fp32 partition and Adam's two moments of it; Adam's step and _global_grad_norm
    assert rows[0]["deepspeed"]["bytes"] == 4 * params + 3 * 4 * params // 2 + 2 * 4
    assert case["stage"] == 3 and case["optimizer steps"] == 1
    assert case["held"] == rows[1]["deepspeed"]["bytes"]  # exercise 4 counts as section 4
    print(f"2 ranks, 2 runs of each engine: {time.perf_counter() - start:.1f} s")


def test_deepspeeds_op_needs_building_until_this_installation_built_it(monkeypatch, tmp_path):
    import deepspeed
    from torch.utils.cpp_extension import _get_build_directory, include_paths

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # a machine that never built it
    with cpu_accelerator():
        assert shm_comm_needs_building()
        folder = Path(_get_build_directory("deepspeed_shm_comm", verbose=False))
        assert folder.is_relative_to(tmp_path)
        (folder / "deepspeed_shm_comm.so").touch()  # as an earlier build leaves it
        elsewhere = "-I/elsewhere/deepspeed/ops/csrc -isystem /elsewhere/torch/include"
        (folder / "build.ninja").write_text(f"cflags = {elsewhere}\n")
        assert shm_comm_needs_building(), "ninja rebuilds what another installation built"
        here = f"-I{Path(deepspeed.__file__).parent}/ops/csrc -isystem {include_paths()[0]}"
        (folder / "build.ninja").write_text(f"cflags = {here}\n")
        assert not shm_comm_needs_building()


@pytest.mark.parametrize("needed", [True, False])
def test_the_op_build_is_announced_before_it_starts_and_only_if_needed(needed, monkeypatch, capsys):
    monkeypatch.setattr(lab, "shm_comm_needs_building", lambda: needed)
    built = lab.build_deepspeed_ops()
    assert built["op"] == "deepspeed_shm_comm"
    assert capsys.readouterr().out == (f"{BUILDING_SHM_COMM}\n" if needed else "")


# -------------------------------------------------------------------- the launchers


def test_hostfile_text_is_what_deepspeed_parses(deepspeed_runner):
    hosts = {"node0": 4, "node1": 4, "gpu-12": 8}
    text = launcher.hostfile_text(hosts)
    assert text == "node0 slots=4\nnode1 slots=4\ngpu-12 slots=8\n"
    assert dict(deepspeed_runner._parse_hostfile(text.splitlines())) == hosts


def test_deepspeed_command_parses_as_the_lab_says(deepspeed_runner):
    command = launcher.deepspeed_command("hf", node_rank=1, port=29511, num_nodes=2, num_gpus=3)
    assert command[1:3] == ["-m", "deepspeed.launcher.runner"]
    args = deepspeed_runner.parse_args(command[3:])
    assert (args.hostfile, args.num_nodes, args.num_gpus) == ("hf", 2, 3)
    assert (args.no_ssh, args.node_rank) == (True, 1)
    assert (args.master_addr, args.master_port) == ("127.0.0.1", 29511)
    assert (args.module, args.user_script) == (True, "labsupport.labs.lab15_launcher")


def test_torchrun_command_is_the_same_launch():
    from torch.distributed.run import get_args_parser

    command = launcher.torchrun_command(node_rank=1, port=29511, num_nodes=2, num_gpus=3)
    args = get_args_parser().parse_args(command[3:])
    assert (args.nnodes, args.nproc_per_node, args.node_rank) == ("2", "3", 1)
    assert (args.master_addr, args.master_port) == ("127.0.0.1", 29511)
    assert args.rdzv_backend == "static"  # --node-rank counts only with static rendezvous
    rows = launcher.side_by_side(node_rank=1, port=29511, num_nodes=2, num_gpus=3)
    for row in rows[1:]:
        assert str(row["parsed"]) == str(row["parsed "]), row["setting"]


def test_a_failing_deepspeed_node_is_reported_as_such():
    """Three "nodes" of a two-host hostfile: the third launcher's --node_rank is out of
    range, DeepSpeed's runner refuses it, and the others are stopped."""
    with pytest.raises(RuntimeError, match="a DeepSpeed launcher failed") as err:
        launcher.deepspeed_nodes({"a": 1, "b": 1}, num_nodes=3, num_gpus=1, timeout=120)
    assert "--node_rank is not set correctly" in str(err.value)


def test_bloom_table_gives_the_layout_of_exercise_2():
    values = {arg: value for arg, value, _, _ in megatron.BLOOM_LAUNCH}
    layout = lab.bloom_layout(
        int(values["#SBATCH --nodes"]),
        int(values["#SBATCH --gres=gpu:"]),
        int(values["--tensor-model-parallel-size"]),
        int(values["--pipeline-model-parallel-size"]),
        int(values["--global-batch-size"]),
        int(values["--micro-batch-size"]),
    )
    assert layout == {"data_parallel": 8, "gpus_per_replica": 48, "micro_batches": 128}
    assert megatron.BLOOM_SCRIPT.endswith("train/tr11-176B-ml/tr11-176B-ml.slurm")


# -------------------------------------------------------------------- the exercises


@pytest.mark.parametrize(
    ("check", "name"),
    [
        (lab.check_accumulation_steps, "accumulation_steps"),
        (lab.check_bloom_layout, "bloom_layout"),
        (launcher.check_rank_layout, "rank_layout"),
    ],
)
def test_checkers_accept_the_solutions_and_say_not_attempted_to_the_stub(check, name, capsys):
    assert check(solution(LAB, name))
    assert "Correct" in capsys.readouterr().out
    assert not check(stub(name))
    assert "Not attempted yet" in capsys.readouterr().out


def test_accumulation_checker_rejects_forgetting_the_ranks_and_not_raising():
    with pytest.raises(AssertionError, match="all the GPUs together"):
        lab.check_accumulation_steps(lambda batch, micro, world: batch // micro)
    with pytest.raises(AssertionError, match="raise ValueError"):
        lab.check_accumulation_steps(lambda batch, micro, world: batch // (micro * world))


def test_bloom_checker_rejects_forgetting_the_pipeline_and_the_replicas():
    def no_pipeline(nodes, gpus, tp, pp, batch, micro):
        dp = nodes * gpus // tp
        return {"data_parallel": dp, "gpus_per_replica": tp, "micro_batches": batch // (micro * dp)}

    def one_replica(nodes, gpus, tp, pp, batch, micro):
        dp = nodes * gpus // (tp * pp)
        return {"data_parallel": dp, "gpus_per_replica": tp * pp, "micro_batches": batch // micro}

    with pytest.raises(AssertionError, match="a replica holds one copy"):
        lab.check_bloom_layout(no_pipeline)
    with pytest.raises(AssertionError, match="micro_batches"):
        lab.check_bloom_layout(one_replica)


def _parse(hostfile):
    lines = [line.split() for line in hostfile.splitlines() if line and line[0] != "#"]
    return {host: int(slots.removeprefix("slots=")) for host, slots in lines}


def test_rank_layout_checker_rejects_round_robin_and_ignoring_num_gpus():
    def round_robin(hostfile, num_nodes, num_gpus):
        slots = _parse(hostfile)
        hosts = list(slots)[:num_nodes] if num_nodes > 0 else list(slots)
        per = num_gpus if num_gpus > 0 else min(slots[h] for h in hosts)
        return [(h, i) for i in range(per) for h in hosts]

    def all_slots(hostfile, num_nodes, num_gpus):
        slots = _parse(hostfile)
        hosts = list(slots)[:num_nodes] if num_nodes > 0 else list(slots)
        return [(h, i) for h in hosts for i in range(slots[h])]

    def slot_index(hostfile, num_nodes, num_gpus):  # right on hosts of equal size only
        slots = _parse(hostfile)
        hosts = list(slots)[:num_nodes] if num_nodes > 0 else list(slots)
        return [(h, i) for h in hosts for i in range(num_gpus if num_gpus > 0 else slots[h])]

    with pytest.raises(AssertionError, match="in which order"):
        launcher.check_rank_layout(round_robin)
    with pytest.raises(AssertionError, match="how many slots"):
        launcher.check_rank_layout(all_slots)
    with pytest.raises(AssertionError, match=r"local ranks \[0, 1, 2, 0, 1\], where"):
        launcher.check_rank_layout(slot_index)


def test_deepspeeds_rank_layout_numbers_node_by_node():
    text = "worker-0 slots=4\nworker-1 slots=4\n"
    assert launcher.deepspeed_rank_layout(text, num_nodes=2, num_gpus=2) == [
        ("worker-0", 0),
        ("worker-0", 1),
        ("worker-1", 0),
        ("worker-1", 1),
    ]
    # launch.py: local_rank = dist_rank % num_local_procs, a rotation on unequal hosts
    assert launcher.deepspeed_rank_layout("a slots=3\nb slots=2\n") == [
        ("a", 0),
        ("a", 1),
        ("a", 2),
        ("b", 1),
        ("b", 0),
    ]


def test_deepspeeds_launcher_places_ranks_as_the_reference_says():
    """The real launcher, as two "nodes" of 3 and 2 processes: every process's host
    (its CROSS_RANK) and LOCAL_RANK are those of :func:`deepspeed_rank_layout`."""
    hosts = {"a": 3, "b": 2}
    lines = launcher.deepspeed_nodes(hosts, num_nodes=2, num_gpus=-1, timeout=120)
    ranks = [ast.literal_eval(line.split(" -> ", 1)[1]) for line in lines]
    got = [(list(hosts)[r["node_rank"]], r["local_rank"]) for r in ranks]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3, 4]
    assert got == launcher.deepspeed_rank_layout(launcher.hostfile_text(hosts))
    assert all(r["--local_rank"] == r["local_rank"] for r in ranks)


# --------------------------------------------------------------------------- exercise 4


def budget(stage: int, micro: int, accumulation: int | None = None, **zero):
    """A config for exercise 4: ZeRO ``stage`` with the lab's small buffers at stage 3
    (``zero`` overrides them), micro-batches of ``micro``, and ``accumulation`` of them
    (by default, as many as make 16 sequences)."""

    def budget_config(world_size):
        small = {"reduce_bucket_size": 2**14, "stage3_param_persistence_threshold": 0}
        return {
            "train_batch_size": 16,
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": accumulation or 16 // (micro * world_size),
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
            "zero_optimization": {"stage": stage} | (small if stage == 3 else {}) | zero,
        }

    return budget_config


def stage_by_rank(world_size):
    """Rank 0 asks for ZeRO-3, the others for ZeRO-1: their collectives never pair up."""
    import torch.distributed as dist

    return budget(3 if dist.get_rank() == 0 else 1, 2)(world_size)


def test_check_budget_config(capsys):
    mistakes = [
        (
            budget(3, 2, accumulation=1),
            r"deepspeed.initialize refused your config on 4 ranks: AssertionError: Check batch "
            r"related parameters. .* 16 != 2 \* 1 \* 4. Then: check the batch arithmetic",
        ),
        (
            budget(1, 2),
            r"rank 0 holds [\d,]+ bytes after the step \(ZeRO stage 1\) and a micro-batch of 2 "
            r"saves [\d,]+ for backward: [\d,]+ bytes, over the budget of 1,450,000; a smaller",
        ),
        (budget(1, 1), r"it fits, with micro-batches of 1 \(4 passes per step\), but a larger"),
    ]
    verified = "DeepSpeed trains 16 sequences per step on 4 ranks, in micro-batches of 2 x 2"
    checks(capsys, exercises.check_budget_config, LAB, "budget_config", verified, mistakes)
    with pytest.raises(AssertionError, match="did not all finish within 60 s") as info:
        exercises.check_budget_config(stage_by_rank, timeout=60)
    assert "the same config on every rank" in str(info.value)
