"""Lab 16, fault tolerance: the notebook's training loop, with a rank killed by SIGKILL and
the run resumed exactly, each part of the checkpoint needed, partial and damaged
checkpoints refused clearly and passed over (a block zeroed in place, which DCP alone
loads), an asynchronous checkpoint that holds the state it started from and its
checksums, a checkpoint of 4 ranks loaded on 2, and the exercises' checkers against the
notebook's worked solutions and wrong answers, one of which hangs the ranks. (The
checkpoint module itself is in tests/test_parallel_checkpoint.py, the failure arithmetic
in tests/test_estimate_reliability.py.)"""

from __future__ import annotations

import ast
import functools
import math
import os
import shutil
from pathlib import Path

import nbformat
import pytest
import torch
import torch.distributed as dist
from notebook_solutions import LABS, solution, stub

from labsupport import LaunchError, launch
from labsupport.labs import lab16_checks, lab16_torchrun
from labsupport.labs import lab16_fault_tolerance as lab
from labsupport.parallel import checkpoint as ck

LAB = "16-fault-tolerance.ipynb"


def notebook_function(lab: str, name: str):
    """The function ``name`` that a code cell of the notebook ``lab`` defines, with the
    notebook's imports (its first cell's import statements)."""
    cells = [
        c.source for c in nbformat.read(LABS / lab, as_version=4).cells if c.cell_type == "code"
    ]
    imports = [n for n in ast.parse(cells[0]).body if isinstance(n, ast.Import | ast.ImportFrom)]
    source = next(c for c in cells if c.startswith(f"def {name}("))
    namespace = {"__name__": "notebook"}  # not importable: cloudpickle sends it by value
    exec(compile(ast.Module(imports, []), lab, "exec"), namespace)
    exec(compile(source, f"<{lab}: {name}>", "exec"), namespace)
    return namespace[name]


#: The training loop, as the notebook writes it.
train = notebook_function(LAB, "train")
#: A short run: 6 steps on 2 ranks, a checkpoint every 2.
SHORT = {"steps": 6, "every": 2}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted short run, and the same run with rank 1 killed at step 5."""
    root = tmp_path_factory.mktemp("lab16")
    straight = launch(train, 2, args=(str(root / "straight"),), kwargs=SHORT, timeout=300)
    with pytest.raises(LaunchError) as killed:
        kill = {**SHORT, "kill": (1, 5)}
        launch(train, 2, args=(str(root / "killed"),), kwargs=kill, timeout=300)
    return {"root": root, "straight": straight[0], "error": killed.value}


def test_a_killed_rank_is_the_root_cause_and_the_resume_is_exact(runs):
    error = runs["error"]
    assert error.root_rank == 1 and error.failures[1].kind == "signal"
    assert "SIGKILL" in error.failures[1].summary
    assert error.failures[0].knock_on
    path = lab.latest_checkpoint(str(runs["root"] / "killed"))
    assert os.path.basename(path) == "step00004"  # steps 4 and 5 were done, and lost
    resumed = launch(
        train, 2, args=(str(runs["root"] / "killed"),), kwargs={**SHORT, "resume_from": path}
    )[0]
    assert resumed["start"] == 4
    assert resumed["losses"] == runs["straight"]["losses"]  # bit for bit


def test_leaving_one_part_out_changes_the_curve_where_it_is_first_used(runs):
    path = str(runs["root"] / "straight" / "step00004")
    first = {}
    for part in lab.PARTS:
        restore = functools.partial(lab.restore, leave_out=(part,))
        options = {**SHORT, "resume_from": path, "restore": restore, "every": None}
        run = launch(train, 2, args=(str(runs["root"] / "none"),), kwargs=options)[0]
        first[part] = lab.first_difference(run["losses"], runs["straight"]["losses"])
    assert first == {"optimizer states": 5, "RNG states": 4, "step": 4}
    assert not os.path.exists(runs["root"] / "none")  # every=None: no checkpoint written


def test_training_shows_its_progress_on_every_rank(tmp_path, capsys):
    """A bar per rank while it trains; the finished bars stay in the record (printed, in a
    terminal, as each rank finishes)."""
    launch(train, 2, args=(str(tmp_path),), kwargs={"steps": 2, "every": None})
    out = capsys.readouterr().out.splitlines()
    for rank in range(2):
        assert f"[rank {rank}] train |{'#' * 24}| 2/2" in out


def test_first_difference():
    assert lab.first_difference([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]) is None
    assert lab.first_difference([1.0, 2.5, 3.0], [1.0, 2.0, 3.0]) == 1
    assert lab.first_difference([1.0, 2.0, 9.0, 9.0], [1.0, 2.0]) is None


def test_latest_checkpoint_passes_over_partial_damaged_and_foreign_folders(runs, tmp_path, capsys):
    assert lab.latest_checkpoint(str(tmp_path / "nothing")) is None
    for step in (2, 4, 6):
        shutil.copytree(runs["root"] / "straight" / f"step{step:05d}", tmp_path / f"step{step:05d}")
    shutil.copytree(tmp_path / "step00006", tmp_path / "step00008.tmp")  # not a step folder
    lab.zero_block(str(tmp_path / "step00006" / "__1_0.distcp"))  # damaged in place
    (tmp_path / "step00004" / ck.MANIFEST).unlink()  # as if interrupted while written
    assert lab.latest_checkpoint(str(tmp_path)) == str(tmp_path / "step00002")
    out = capsys.readouterr().out  # each message wrapped to the page's width
    assert max(len(line) for line in out.splitlines()) <= 79
    said = [" ".join(("passed over:" + m).split()) for m in out.split("passed over:")[1:]]
    assert said[0].startswith("passed over: the checkpoint at step00006 is damaged: __1_0.distcp")
    assert said[1].startswith("passed over: the checkpoint at step00004 is incomplete")
    assert len(said) == 2
    shutil.rmtree(tmp_path / "step00002")
    assert lab.latest_checkpoint(str(tmp_path)) is None


def test_partial_and_damaged_checkpoints_are_refused_clearly(runs, tmp_path):
    good = runs["root"] / "straight" / "step00004"
    partial, corrupt, zeroed = tmp_path / "partial", tmp_path / "corrupt", tmp_path / "zeroed"
    for copy in (partial, corrupt, zeroed):
        shutil.copytree(good, copy)
    (partial / ck.MANIFEST).unlink()
    for data in Path(corrupt).glob("*.distcp"):
        data.write_bytes(b"not a checkpoint")
    lab.zero_block(str(zeroed / "__1_0.distcp"))
    for path, message in [
        (partial, "incomplete"),
        (corrupt, "__0_0.distcp has changed since it was saved"),
        (zeroed, "__1_0.distcp has changed since it was saved"),
    ]:
        with pytest.raises(LaunchError, match=message):
            launch(train, 2, args=(str(tmp_path),), kwargs={**SHORT, "resume_from": str(path)})
    # what the checksums catch: DCP alone loads the zeroed block without a word
    intact = launch(lab.gathered_state, 2, args=(str(good),))[0]
    alone = launch(lab.gathered_state, 2, args=(str(zeroed),), kwargs={"verified": False})[0]
    differ = {k: int((alone[k] != intact[k]).sum()) for k in intact}
    assert differ["unit0.exp_avg"] >= 1000 and sum(differ.values()) == differ["unit0.exp_avg"]
    changed = alone["unit0.exp_avg"] != intact["unit0.exp_avg"]
    assert (alone["unit0.exp_avg"][changed] == 0).sum() >= 1000  # Adam's first moment: 0


def test_an_async_checkpoint_holds_the_state_it_started_from(tmp_path):
    results = launch(lab.async_checkpoint, 2, args=(str(tmp_path),), kwargs={"steps": 2})
    for r in results:
        assert r["training_went_on"] and r["held_the_state"]
        assert r["async_written_s"] >= r["async_returned_s"] > 0
    ck.verify(str(tmp_path / "async"))  # hashed in the background, after the writes


def test_a_checkpoint_of_4_ranks_loads_on_2_and_resumes(tmp_path):
    root = str(tmp_path / "four")
    launch(train, 4, args=(root,), kwargs={"steps": 2, "every": 2}, timeout=300)
    path = lab.latest_checkpoint(root)
    on4 = launch(lab.gathered_state, 4, args=(path,), timeout=300)[0]
    on2 = launch(lab.gathered_state, 2, args=(path,), timeout=300)[0]
    assert on4.keys() == on2.keys()
    assert all(torch.equal(on4[k], on2[k]) for k in on4)
    assert any(on4[k].abs().sum() > 0 for k in on4 if "exp_avg" in k)  # Adam's states came
    options = {"steps": 3, "every": None, "resume_from": path}
    resumed = launch(train, 2, args=(root,), kwargs=options, timeout=300)[0]
    assert resumed["start"] == 2 and len(resumed["losses"]) == 3


# --------------------------------------------------------------------------- torchrun


def test_torchrun_lines_lose_their_times_pids_and_paths():
    line = (
        "E1203 03:16:14.792000 7353 .venv/lib/python3.11/site-packages/torch/distributed/"
        "elastic/multiprocessing/api.py:1002] failed (exitcode: -9) local_rank: 2 "
        "(pid: 7358) of binary: /home/learner/course/.venv/bin/python"
    )
    assert lab16_torchrun._message(line) == "failed (exitcode: -9) local_rank: 2"
    info = "I1203 03:16:16.131000 7353 x/api.py:553]   restart_count=1"
    assert lab16_torchrun._message(info) == "restart_count=1"


# --------------------------------------------------------------------------- exercises


@pytest.mark.parametrize(
    ("check", "name"),
    [
        (lab16_checks.check_checkpoint_interval, "checkpoint_interval"),
        (lab16_checks.check_newest_complete, "newest_complete"),
    ],
)
def test_checkers_accept_the_solutions_and_say_not_attempted_to_the_stub(check, name, capsys):
    assert check(solution(LAB, name))
    assert "Correct" in capsys.readouterr().out
    assert not check(stub(name))
    assert "Not attempted yet" in capsys.readouterr().out


def test_interval_checker_rejects_a_missing_factor_and_the_mtbf_itself():
    with pytest.raises(AssertionError, match="derivative"):
        lab16_checks.check_checkpoint_interval(lambda c, m: math.sqrt(c * m))
    with pytest.raises(AssertionError, match="wastes"):
        lab16_checks.check_checkpoint_interval(lambda c, m: m)
    with pytest.raises(AssertionError, match="got"):
        lab16_checks.check_checkpoint_interval(lambda c, m: None)


def test_newest_checker_rejects_ignoring_checksums_and_comparing_names_as_text():
    def newest_holding(file):
        def newest(root):
            names = [n for n in os.listdir(root) if os.path.exists(os.path.join(root, n, file))]
            return os.path.join(root, max(names, key=lambda n: int(n[4:]))) if names else None

        return newest

    def newest_by_text(root):
        names = [n for n in os.listdir(root) if os.path.exists(os.path.join(root, n, ck.MANIFEST))]
        return os.path.join(root, max(names)) if names else None

    for file in ("__0_0.distcp", ".metadata"):  # DCP writes .metadata before the checksums
        with pytest.raises(AssertionError, match=f"complete without {ck.MANIFEST}"):
            lab16_checks.check_newest_complete(newest_holding(file))
    assert lab16_checks.check_newest_complete(newest_holding(ck.MANIFEST))
    with pytest.raises(AssertionError, match="step10"):
        lab16_checks.check_newest_complete(newest_by_text)


def without(key, state_fn):
    """``state_fn`` with ``key`` left out of the state."""

    def leaves_out(zero, step, losses):
        state = state_fn(zero, step, losses)
        del state[key]
        return state

    return leaves_out


def one_generator_for_all(zero, step, losses):
    """Saves the generator under one key for every rank: DCP keeps one rank's copy."""
    return {**without("rng", solution(LAB, "training_state"))(zero, step, losses),
            "rng": torch.get_rng_state()}  # fmt: skip


def restores_the_shared_generator(state, zero):
    ck.restore_zero(zero)
    torch.set_rng_state(state["rng"])
    return state["step"], list(state["losses"])


def restores_without_generators(state, zero):
    ck.restore_zero(zero)
    return state["step"], list(state["losses"])


def restores_without_step(state, zero):
    ck.restore_zero(zero)
    torch.set_rng_state(state["rng"][f"rank{dist.get_rank()}"]["cpu"])
    return state.get("step", 0), list(state["losses"])


def waits_for_rank_0(state, zero):
    """Every rank but 0 waits for rank 0 to send the step, which rank 0 never does."""
    step = torch.tensor([state["step"]])
    if dist.get_rank() != 0:
        dist.recv(step, src=0)
    return restore(state, zero)


restore = solution(LAB, "restore")


def test_check_training_state(capsys):
    state = solution(LAB, "training_state")
    check = functools.partial(lab16_checks.check_training_state, train=train)
    assert check(state, restore)
    assert capsys.readouterr().out.startswith(
        "Correct: killed at step 10, resumed from your checkpoint of step 8, the run gives "
        "the uninterrupted loss curve, bit for bit"
    )
    resumed = r"resumed from your checkpoint of step 8 \(rank 2 was killed as step 10 began\), "
    mistakes = [
        (
            (without("optimizer", state), restore),
            resumed + r"the loss of step 9 is [\d.]+, the uninterrupted run's [\d.]+: rank 0: "
            r"unit0 Adam exp_avg after your restore\(\) differs at \[0\] .*expected "
            r"[-\d.e]+, got 0 \(save the optimizer's states",
        ),
        (
            (one_generator_for_all, restores_the_shared_generator),
            resumed + r"the loss of step 8 is [\d.]+, the uninterrupted run's [\d.]+: rank \d: "
            r"CPU generator after your restore\(\) differs at .*a key of its own",
        ),
        (
            (without("rng", state), restores_without_generators),
            resumed + r"the loss of step 8 .*: rank 0: CPU generator after your restore\(\) "
            r"differs at .*save each rank's generator state",
        ),
        (
            (without("step", state), restores_without_step),
            r"your restore\(\) says to go on from step 0, but the checkpoint was written "
            r"after step 8",
        ),
    ]
    for (state_fn, restore_fn), message in mistakes:
        with pytest.raises(AssertionError, match=message):
            check(state_fn, restore_fn)
    with pytest.raises(AssertionError, match="did not all finish within 40 s") as info:
        check(state, waits_for_rank_0, timeout=40)
    assert "does your restore() wait for a message" in str(info.value)
    capsys.readouterr()
    assert not check(stub("training_state"), stub("restore"))
    assert capsys.readouterr().out.startswith("Not attempted yet: write training_state")
