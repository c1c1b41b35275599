"""Lab 16's exercise checkers: the interval between checkpoints, the newest complete
checkpoint, and what a checkpoint must hold, checked by killing a rank and resuming.

The last one runs the lab's training loop (the notebook's) on 4 ranks with the learner's
``training_state`` written every 4 steps, kills rank 2 with SIGKILL as step 10 begins,
resumes from the learner's checkpoint of step 8 with the learner's ``restore``, and
compares the loss curve with an uninterrupted run's, bit for bit; where it differs, it
compares what the learner's restore brought back (parameters, Adam's states, each rank's
generator) with what the lab's own checkpoint restores.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile

import torch

from labsupport.estimate import reliability
from labsupport.labs import lab16_fault_tolerance as lab
from labsupport.labs.cells import exercise, expect_close, launch_answer
from labsupport.launch.errors import LaunchError
from labsupport.launch.progress import MARK
from labsupport.launch.runtime import device
from labsupport.parallel import checkpoint as ck


@exercise
def check_checkpoint_interval(fn) -> str:
    """Exercise 1: ``fn(checkpoint_s, mtbf_s)`` must give the interval that wastes least."""
    for c, m in [(40.0, 3 * 3600.0), (60.0, 11_130.0), (1.0, 3600.0), (300.0, 86_400.0)]:
        got = fn(c, m)
        assert isinstance(got, int | float) and got > 0, f"C={c} s, M={m} s: got {got!r}"
        best = reliability.young_interval(c, m)
        waste = reliability.wasted_fraction(got, c, m)
        assert abs(got - best) <= 1e-3 * best, (
            f"C={c} s, M={m:.0f} s: got {got:.1f} s, which wastes {waste:.2%} of the time; "
            f"another interval wastes {reliability.wasted_fraction(best, c, m):.2%} (write "
            "the waste C/τ + τ/(2M) and find where its derivative is zero)"
        )
    return "Young's interval for four checkpoint costs and failure rates"


@exercise
def check_newest_complete(fn) -> str:
    """Exercise 2: ``fn(root)`` must name the newest checkpoint that is complete: whose
    folder holds the checksums (:data:`~labsupport.parallel.checkpoint.MANIFEST`), which
    are written last."""
    layouts = [
        ({"step4": True, "step8": True}, "step8"),
        ({"step4": True, "step8": False}, "step4"),  # step 8 was interrupted while written
        ({"step9": True, "step10": True, "step12": False}, "step10"),  # 10 comes after 9
        ({"step4": False}, None),
        ({}, None),
    ]
    for folders, want in layouts:
        with tempfile.TemporaryDirectory() as root:
            for name, complete in folders.items():
                os.makedirs(os.path.join(root, name))
                written = [".metadata", "__0_0.distcp"] + ([ck.MANIFEST] if complete else [])
                for file in written:
                    open(os.path.join(root, name, file), "w").close()
            got = fn(root)
            got = os.path.basename(got) if got else got
        state = ", ".join(
            f"{n} ({'complete' if c else 'no ' + ck.MANIFEST})" for n, c in folders.items()
        )
        assert got == want, (
            f"checkpoints {state or 'none'}: got {got!r}, expected {want!r} (is a "
            f"checkpoint complete without {ck.MANIFEST}? is step10 newer than step9?)"
        )
    return "the newest complete checkpoint of five folders, or None"


# --------------------------------------------------------------------------- exercise 3

WORLD, KILL, RESUME_AT = 4, (2, 10), 8  # rank 2 dies as step 10 begins: step 8's is newest
SAVE_HANG = (
    "Every rank saves the checkpoint together: does your training_state() call a "
    "collective, or wait for a message, on some ranks only?"
)
RESTORE_HANG = (
    "Every rank restores its own state from what it loaded: does your restore() wait for "
    "a message, or call a collective, that not every rank sends or joins?"
)
HINTS = {
    "parameters": "save the parameters (ck.zero_parameters), and after loading rebuild the "
    "model's full parameters from the shards (ck.restore_zero)",
    "Adam": "save the optimizer's states (ck.zero_optimizer): without Adam's moments and "
    "step counts, its first update after the resume starts over",
    "generator": "save each rank's generator state (torch.get_rng_state(), and the GPU's "
    "with torch.cuda.get_rng_state()) and set it back: dropout draws its masks from it",
    "shared key": "each rank's generator state must go under a key of its own, "
    "f'rank{dist.get_rank()}': DCP takes a tensor that every rank saves under the same key "
    "as replicated, and keeps one rank's copy",
}


def fingerprint(zero) -> dict:
    """What a resume must bring back on this rank: the model's parameters, the ZeRO
    shards, Adam's states on them, and the generators."""
    found = {"the model's parameters": torch.cat([p.detach().flatten().cpu()
                                                  for p in zero.model.parameters()])}  # fmt: skip
    for i, (_, unit) in enumerate(zero.units):
        found[f"unit{i} parameters shard"] = unit.shard.detach().cpu().clone()
        states = [zero.optimizer.state.get(piece, {}) for piece in unit.pieces]
        for key in ("exp_avg", "exp_avg_sq"):
            found[f"unit{i} Adam {key}"] = torch.cat(
                [
                    s[key].detach().flatten().cpu() if key in s else torch.zeros(p.numel())
                    for s, p in zip(states, unit.pieces, strict=True)
                ]  # fmt: skip
            )
        found[f"unit{i} Adam step"] = torch.tensor([float(s.get("step", 0)) for s in states])
    found["CPU generator"] = torch.get_rng_state()
    if device().type == "cuda":
        found["CUDA generator"] = torch.cuda.get_rng_state(device())
    return found


class _WithoutProgress(io.TextIOBase):
    """This rank's output without the loop's progress reports: the checker's runs draw
    no bars, and whatever else the learner's code prints still shows."""

    def __init__(self, out):
        self.out, self.dropping = out, False

    def write(self, text: str) -> int:
        if text.startswith(MARK) or (self.dropping and text == "\n"):
            self.dropping = text != "\n"
        else:
            self.dropping = False
            self.out.write(text)
        return len(text)

    def flush(self) -> None:
        self.out.flush()


def killed_case(train, root: str, state_fn) -> None:
    """On every rank: the loop with the learner's checkpoints, rank 2 killed at step 10."""
    with contextlib.redirect_stdout(_WithoutProgress(sys.stdout)):
        train(root, kill=KILL, state=state_fn)


def resumed_case(train, root: str, state_fn, restore_fn) -> dict:
    """On every rank: the run resumed from the learner's checkpoint of step 8 under
    ``root``, with what the learner's restore brought back; then the uninterrupted run,
    which writes the lab's own checkpoint of step 8, and what that brings back."""
    restored = {}

    def recorded(state, zero):
        out = restore_fn(state, zero)
        restored.update(fingerprint(zero))
        return out

    path, reference = lab.checkpoint_path(root, RESUME_AT), os.path.join(root, "reference")
    with contextlib.redirect_stdout(_WithoutProgress(sys.stdout)):
        resumed = train(root, every=None, resume_from=path, state=state_fn, restore=recorded)
        straight = train(reference, every=RESUME_AT)
    _, zero = lab.new_run()
    state = lab.training_state(zero, 0, [])
    ck.load(state, lab.checkpoint_path(reference, RESUME_AT))
    lab.restore(state, zero)
    return {
        "start": resumed["start"],
        "losses": resumed["losses"],
        "reference": straight["losses"],
        "restored": restored,
        "want": fingerprint(zero),
    }


def _what_differs(results: list) -> str:
    """The first thing a rank's restore brought back wrong, with its hint, or a hint."""
    for rank, r in enumerate(results):
        for name, want in r["want"].items():
            got = r["restored"].get(name)
            if got is not None and torch.equal(got, want):
                continue
            kind = next(k for k in ("parameters", "Adam", "generator") if k in name)
            same = [torch.equal(other["restored"].get(name), got) for other in results]
            if kind == "generator" and got is not None and all(same):
                kind = "shared key"  # one rank's state came back, on every rank
            try:
                expect_close(got, want, f"{name} after your restore()", rank, HINTS[kind], 0, 0)
            except AssertionError as exc:
                return str(exc)
    return (
        "the parameters, Adam's states and the generators came back as they were: does "
        "the step, or the data position, go on from where the checkpoint was written?"
    )


@exercise
def check_training_state(fn, restore, train, timeout: float = 180) -> str:
    """Exercise 3: ``fn(zero, step, losses)``, the state to checkpoint (a dict DCP can
    save), and ``restore(state, zero)``, which applies a loaded state and returns the step
    to go on from and the losses so far. The lab's loop ``train`` on 4 ranks loses rank 2
    to SIGKILL at step 10, resumes from ``fn``'s checkpoint of step 8, and must give the
    loss curve of an uninterrupted run, bit for bit."""
    with tempfile.TemporaryDirectory(prefix="lab16-check-") as root:
        try:
            launch_answer(killed_case, WORLD, SAVE_HANG, timeout, args=(train, root, fn))
        except LaunchError as exc:
            if exc.root_rank != KILL[0] or exc.failures[KILL[0]].kind != "signal":
                raise  # a rank's own error: its traceback says why
        ck.verify(lab.checkpoint_path(root, RESUME_AT))
        args = (train, root, fn, restore)
        results = launch_answer(resumed_case, WORLD, RESTORE_HANG, timeout, args=args)
    r = results[0]
    start = r["start"]
    if start != RESUME_AT:
        raise AssertionError(
            f"your restore() says to go on from step {start!r}, but the checkpoint was "
            f"written after step {RESUME_AT} (rank {KILL[0]} was killed as step {KILL[1]} "
            "began): save the step in the state and return it, so that the learning rate "
            "and the position in the data go on from there"
        )
    got, want = r["losses"], r["reference"]
    if got == want:
        return (
            f"killed at step {KILL[1]}, resumed from your checkpoint of step {RESUME_AT}, "
            "the run gives the uninterrupted loss curve, bit for bit"
        )
    if len(got) != len(want) and got[-len(want) + RESUME_AT :] == want[RESUME_AT:]:
        raise AssertionError(
            f"steps {RESUME_AT} on are right, but the run resumed with {len(got) - 4} "
            f"losses before them, not {RESUME_AT}: keep the losses so far in the state, "
            "and return them from restore()"
        )
    step = lab.first_difference(got, want)
    step = min(len(got), len(want)) if step is None else step
    return_loss = f"{got[step]!r}" if step < len(got) else "missing"
    raise AssertionError(
        f"resumed from your checkpoint of step {RESUME_AT} (rank {KILL[0]} was killed as "
        f"step {KILL[1]} began), the loss of step {step} is {return_loss}, the "
        f"uninterrupted run's {want[step]!r}: {_what_differs(results)}"
    )
