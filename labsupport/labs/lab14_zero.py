"""Lab 14, ZeRO and FSDP: ZeRO stages 1-3 from scratch on real ranks, their memory and
traffic against the formulas, the same training as plain Adam, FSDP2 and DeepSpeed, and
the checkers of the formula exercises.

The training loop is in the notebook; :class:`Record` keeps its books. ZeRO is
:mod:`labsupport.parallel.zero`, the formulas :func:`labsupport.estimate.memory.
training_memory` and :mod:`labsupport.comm.traced`; FSDP2 and DeepSpeed run in
:mod:`labsupport.labs.lab14_frameworks`, the ZeRO-1 exercise in
:mod:`labsupport.labs.lab14_exercises`.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from labsupport.comm import traced
from labsupport.comm.metrics import mean_over_ranks
from labsupport.estimate.memory import training_memory
from labsupport.labs.cells import exercise
from labsupport.launch.runtime import device
from labsupport.measure.memory import saved_tensors
from labsupport.models import GPT, batch_share, random_tokens, tiny_gpt, train_one_process
from labsupport.parallel.zero import ZeRO

#: The lab's GPT: 9,522 parameters, a number 4 does not divide (ZeRO pads its buffers).
LAB_GPT = {"vocab_size": 61, "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 18}
STEPS, BATCH, LR = 3, 12, 1e-3
STAGES = (1, 2, 3)

#: Adam's step is lr·m/(√v + ε), at most about lr per element; two implementations'
#: gradients differ by float32 rounding (reduction order, the division by N), ~1e-6
#: relative, which moves a step by about as much. Over 3 steps the parameters agree
#: within these (the unit tests' tolerance), but for the attention's key bias
#: (:func:`param_mismatches`).
PARAM_TOL = {"rtol": 1e-4, "atol": 1e-6}
#: A loss of about 4.1 summed over 96 tokens in another order: ~1e-6 apart.
LOSS_TOL = 1e-5


def build(seed: int = 0) -> GPT:
    """The lab's GPT, weights drawn from ``seed``, on :func:`labsupport.device`."""
    return tiny_gpt(seed, **LAB_GPT).to(device())


def global_batch(step: int):
    """Step ``step``'s whole batch, the same in every process."""
    return random_tokens(BATCH, LAB_GPT["block_size"], LAB_GPT["vocab_size"], seed=step)


def my_share(step: int):
    """This rank's equal share of step ``step``'s batch, on its device."""
    mine = batch_share(BATCH, dist.get_rank(), dist.get_world_size())
    return tuple(t[mine].to(device()) for t in global_batch(step))


def adam_on_shares(model, steps: int = STEPS) -> tuple:
    """``steps`` steps of ``torch.optim.Adam`` on this rank's share of each batch
    (:func:`my_share`), for a model that syncs its own gradients (FSDP2's; run on every
    rank): the optimizer, and each step's loss averaged over the ranks."""
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = model(*my_share(step))[1]
        loss.backward()
        opt.step()
        losses.append(mean_over_ranks(loss))
    return opt, losses


def param_mismatches(got: dict, want: dict) -> list[str]:
    """The names of the parameters in which ``got`` and ``want`` differ beyond
    :data:`PARAM_TOL`, the attention's key bias apart, which may differ by up to ``LR``.

    That bias's gradient is zero in exact arithmetic (a softmax does not change when the
    same number is added to all of a query's scores), so in float32 it is rounding noise
    (about 1e-10) whose value depends on the order of the sums; Adam divides by the
    gradient's own size, and turns that noise into steps of about lr·|g|/(|g| + ε), a
    hundredth of lr, different in each implementation."""
    d, wrong = LAB_GPT["n_embd"], []
    for name, w in want.items():
        g, tol = got[name], torch.full_like(w, PARAM_TOL["atol"])
        if name.endswith("attn.c_attn.bias"):
            tol[d : 2 * d] = LR  # the key bias: [query | key | value]
        if ((g - w).abs() > tol + PARAM_TOL["rtol"] * w.abs()).any():
            wrong.append(name)
    return wrong


def cpu_params(model) -> dict:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def plain_adam(steps: int = STEPS) -> dict:
    """The reference: one process, the whole batch, ``torch.optim.Adam``."""
    model = build()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = train_one_process(model, opt, (global_batch(step) for step in range(steps)))
    return {"losses": losses, "params": cpu_params(model)}


class Record:
    """The bookkeeping of a ZeRO run's training loop (the loop is in the lab's notebook):
    each step's loss averaged over the ranks (:meth:`loss`), the bytes this rank holds
    after the backward pass (:meth:`held`, :meth:`~labsupport.parallel.zero.ZeRO.
    state_bytes`), and the collectives of the step (:meth:`step`, a ``with`` block that
    :mod:`labsupport.comm.traced` records; the last step's are kept). :meth:`result`
    is what :func:`memory_rows` and :func:`traffic_rows` read: the model states'
    reduce-scatters and all-gathers apart from the all-reduce of the flags that say
    which parameters got a gradient, and the whole parameters after training."""

    def __init__(self, zero: ZeRO):
        self.zero, self.losses, self.memory, self.trace = zero, [], None, None

    @contextlib.contextmanager
    def step(self):
        with traced.trace_collectives() as trace:
            yield
        self.trace = trace

    def held(self) -> None:
        self.memory = self.zero.state_bytes()

    def loss(self, loss: torch.Tensor) -> None:
        self.losses.append(mean_over_ranks(loss))

    def result(self) -> dict:
        zero, calls = self.zero, self.trace.calls
        if zero.stage == 3:  # gather the shards to compare whole parameters
            for _, unit in zero.units:
                unit.gather()
        states = traced.Trace([c for c in calls if c[0] != "all_reduce"])
        flags = traced.Trace([c for c in calls if c[0] == "all_reduce"])
        return {
            "rank": dist.get_rank(),
            "stage": zero.stage,
            "losses": self.losses,
            "memory": self.memory,
            "calls": [name for name, _, _ in calls],
            "bytes": traced.bytes_per_rank(states),
            "flag bytes": traced.bytes_per_rank(flags),
            "numel": sum(p.numel() for p in zero.model.parameters()),
            "padded": sum(u.padded for _, u in zero.units),
            "tensors": sum(len(u.params) for _, u in zero.units),
            "params": cpu_params(zero.model),
        }


def memory_rows(runs_by_world: dict) -> list[dict]:
    """Rank 0's measured bytes next to the formula, per world size and stage (fp32 Adam:
    weights 4, gradients 4, momentum 4 and variance 4 bytes per parameter)."""
    rows = []
    for world, runs in runs_by_world.items():
        for stage, r in runs[0].items():
            formula = training_memory(r["numel"], "fp32", stage, world)
            got = r["memory"]
            rows.append(
                {
                    "ranks": world,
                    "stage": stage,
                    "parameters": got["parameters"],
                    "formula p": round(formula["weights"]),
                    "gradients": got["gradients"],
                    "formula g": round(formula["gradients"]),
                    "optimizer": got["optimizer states"],
                    "formula o": round(formula["momentum"] + formula["variance"]),
                }
            )
    return rows


def traffic_rows(runs: dict, world: int) -> list[dict]:
    """Rank 0's bytes sent in a step: the reduce-scatters and all-gathers next to
    2Ψ / 2Ψ / 3Ψ x (N-1)/N x 4 bytes, and the all-reduce of one byte per parameter tensor
    (which ranks used it) next to its 2 (N-1)/N x P bytes."""
    rows = []
    for stage, r in runs[0].items():
        times = 3 if stage == 3 else 2
        rows.append(
            {
                "stage": stage,
                "collectives": ", ".join(sorted(set(r["calls"]))),
                "calls": len(r["calls"]),
                "bytes sent": round(r["bytes"]),
                "formula": round(times * r["padded"] * 4 * (world - 1) / world),
                "times Ψ": times,
                "flag bytes": round(r["flag bytes"]),
                "formula f": round(2 * r["tensors"] * (world - 1) / world),
            }
        )
    return rows


def states_and_activations(batches=(1, 8, 32), world: int = 4, config=None) -> list[dict]:
    """Per rank: the model states under each ZeRO stage (formula, fp32 Adam) and the
    activations one micro-batch saves for backward (measured), which no stage shards."""
    # attention written out: the same saved tensors on every CPU
    model = tiny_gpt(0, **(config or LAB_GPT | {"attention": "math"}))
    c, numel = model.config, sum(p.numel() for p in model.parameters())
    rows = []
    for b in batches:
        idx, targets = random_tokens(b, c.block_size, c.vocab_size, seed=0)
        with saved_tensors(exclude=model) as saved:
            loss = model(idx, targets)[1]
        del loss
        row = {"micro-batch": b, "activations": saved.nbytes}
        for stage in (0, *STAGES):
            row[f"states, stage {stage}"] = round(
                sum(training_memory(numel, "fp32", stage, world).values())
            )
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- exercises


@exercise
def check_state_bytes(fn) -> str:
    """Exercise 1: ``fn(num_params, stage, dp)``, mixed-precision model-state bytes per
    GPU under ZeRO ``stage`` (0 to 3) over ``dp`` data-parallel GPUs."""
    cases = [(7.5e9, s, 64) for s in range(4)] + [(1e9, 1, 8), (175e9, 2, 1024), (3e6, 3, 3)]
    for n, stage, dp in cases:
        want = sum(training_memory(n, "mixed", stage, dp).values())
        got = fn(n, stage, dp)
        hint = ""
        if stage and math.isclose(got, 16 * n / dp, rel_tol=1e-9) and stage < 3:
            hint = " (below stage 3 not everything is sharded: which states stay whole?)"
        elif math.isclose(got, 16 * n, rel_tol=1e-9) and stage:
            hint = " (sharding divides some of the states by dp)"
        assert math.isclose(got, want, rel_tol=1e-9), (
            f"num_params={n:g}, stage={stage}, dp={dp}: got {got:.6g} bytes, expected "
            f"{want:.6g}{hint}"
        )
    return f"{len(cases)} cases, the ZeRO paper's 7.5B example on 64 GPUs among them"


@exercise
def check_traffic(fn) -> str:
    """Exercise 2: ``fn(num_params, stage, dp, element_bytes)``, the bytes each rank sends
    in one step with ring collectives (stage 0 is DDP's all-reduce)."""
    cases = [(9522, s, 4, 4) for s in range(4)] + [(7.5e9, 3, 64, 2), (1e6, 1, 2, 2)]
    for n, stage, dp, e in cases:
        want = (3 if stage == 3 else 2) * n * e * (dp - 1) / dp
        got = fn(n, stage, dp, e)
        hint = ""
        if math.isclose(got, want * dp / (dp - 1), rel_tol=1e-9):
            hint = " (a ring sends (N-1)/N of the data, not all of it)"
        elif stage == 3 and math.isclose(got, want * 2 / 3, rel_tol=1e-9):
            hint = " (stage 3 gathers the parameters twice: for forward and for backward)"
        assert math.isclose(got, want, rel_tol=1e-9), (
            f"num_params={n:g}, stage={stage}, dp={dp}, element_bytes={e}: got {got:.6g}, "
            f"expected {want:.6g}{hint}"
        )
    return f"{len(cases)} cases, stages 0 to 3"


@exercise
def check_min_ranks(fn) -> str:
    """Exercise 3: ``fn(num_params, stage, gpu_bytes)``, the fewest data-parallel GPUs
    whose memory holds the mixed-precision states under ZeRO ``stage``, or ``None`` when
    no number of GPUs is enough."""
    cases = [
        (7.5e9, 0, 80e9, None),
        (7.5e9, 1, 80e9, 2),
        (7.5e9, 3, 80e9, 2),
        (70e9, 1, 80e9, None),
        (30e9, 2, 80e9, 21),
        (70e9, 3, 80e9, 14),
        (1e9, 0, 80e9, 1),
        (405e9, 3, 80e9, 81),
    ]
    for n, stage, memory, want in cases:
        got = fn(n, stage, memory)
        hint = ""
        if want is None and got is not None:
            hint = " (what stays whole on every GPU, whatever dp is, must fit on its own)"
        elif isinstance(got, int | float) and want and want - 1 <= got < want:
            hint = " (a whole number of GPUs that holds them: round up)"
        assert got == want, (
            f"num_params={n:g}, stage={stage}, gpu_bytes={memory:g}: got {got}, expected "
            f"{want}{hint}"
        )
    return f"{len(cases)} models and stages, from 1B to 405B parameters on 80 GB GPUs"
