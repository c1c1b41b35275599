"""Lab 15's mechanism exercise: a DeepSpeed config for a memory budget, which the checker
hands to ``deepspeed.initialize`` on 4 real ranks (its CPU accelerator, over gloo) and
runs for one optimizer step, its micro-batches and their gradient accumulation included.

What a rank holds is measured as section 4 of the lab measures it, on section 4's GPT
(:func:`~labsupport.labs.lab15_frameworks.live_tensor_bytes` after the step, less what was
alive before the model was built, the batch included: model states and DeepSpeed's
buffers, the same bytes as section 4's table at the same stage), plus what one
micro-batch saves for its backward pass (:func:`labsupport.measure.memory.saved_tensors`,
which no ZeRO stage shards: lab 14). That is measured as lab 14 measures it, on the same
GPT with its attention written out (``attention="math"``), so that what it saves is the
same on every CPU.
"""

from __future__ import annotations

import contextlib
import io
import warnings

import torch.distributed as dist

from labsupport.labs.cells import exercise, launch_answer
from labsupport.labs.lab15_frameworks import BATCH, SEQ, _batch, live_tensor_bytes
from labsupport.measure.memory import saved_tensors
from labsupport.models import tiny_gpt
from labsupport.parallel.deepspeed_setup import use_deepspeed_accelerator

WORLD = 4
#: Bytes each rank may hold. Measured on 4 ranks after one step: ZeRO-1 holds 829,704
#: bytes, ZeRO-3 with the lab's small bucket 658,189 (section 4's table), and one sequence
#: saves about 0.35 MB for backward (353,796; 699,140 for 2): a micro-batch of 2 fits under
#: ZeRO-3 only (1,357,329 bytes; ZeRO-1's 1,528,844), one of 4 under none, and DeepSpeed's
#: default 2 GB bucket under nothing.
BUDGET = 1_450_000
#: The largest micro-batch that fits :data:`BUDGET` at some stage (the exercise asks for it:
#: fewer, larger micro-batches keep the hardware busier).
BEST_MICRO = 2
#: The GPT whose saved activations are measured: section 4's, its attention written out.
MODEL = {"block_size": SEQ, "attention": "math"}


def budget_case(fn) -> dict:
    """``deepspeed.initialize`` with the config ``fn(world_size)`` returns, then one
    optimizer step of the lab's batch (this rank's share of it, in micro-batches): what
    DeepSpeed made of the config, or its refusal, and the bytes this rank holds."""
    config = fn(dist.get_world_size())
    if not isinstance(config, dict):
        return {"config": repr(config)}
    use_deepspeed_accelerator()
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        import deepspeed
    warnings.filterwarnings("ignore", category=FutureWarning)
    idx, targets = _batch(0)  # before the count starts: section 4 holds no batch after a step
    before = live_tensor_bytes()
    model = tiny_gpt(0, block_size=SEQ)  # section 4's GPT
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            engine, *_ = deepspeed.initialize(
                model=model, model_parameters=model.parameters(), config=config
            )
    except Exception as exc:  # noqa: BLE001 - DeepSpeed's own refusal, reported as such
        return {"config": config, "refused": f"{type(exc).__name__}: {exc}".strip()}
    found = {
        "config": config,
        "stage": engine.zero_optimization_stage(),
        "micro": engine.train_micro_batch_size_per_gpu(),
        "accumulation": engine.gradient_accumulation_steps(),
        "train_batch_size": engine.train_batch_size(),
    }
    micro, steps = found["micro"], found["accumulation"]
    if micro * steps * dist.get_world_size() != BATCH:
        return found  # another global batch: nothing to run this step on
    for i in range(steps):
        loss = engine(idx[i * micro : (i + 1) * micro], targets[i * micro : (i + 1) * micro])[1]
        engine.backward(loss)
        engine.step()  # the optimizer steps at the last micro-batch only
    found["optimizer steps"] = engine.global_steps
    del loss
    found["held"] = live_tensor_bytes() - before
    plain = tiny_gpt(0, **MODEL)
    with saved_tensors(exclude=plain) as saved:
        plain(idx[:micro], targets[:micro])
    found["activations"] = saved.nbytes
    engine.destroy()
    return found


def _refusal(message: str) -> str:
    if "batch" in message.lower():
        return (
            "check the batch arithmetic: train_batch_size = train_micro_batch_size_per_gpu "
            f"x gradient_accumulation_steps x {WORLD} data-parallel ranks"
        )
    return "the lab's section 3 reads a config DeepSpeed accepts, key by key"


@exercise
def check_budget_config(fn, timeout: float = 300) -> str:
    """Exercise 4: ``fn(world_size)`` returns a DeepSpeed config that trains the lab's
    batch of 16 sequences on 4 ranks within :data:`BUDGET` bytes per rank, with the
    largest micro-batch that fits."""
    hint = (
        "deepspeed.initialize and a step take well under a minute here, unless the ranks "
        "disagree: does budget_config return the same config on every rank, and return?"
    )
    results = launch_answer(budget_case, WORLD, hint, timeout, args=(fn,))
    r = results[0]
    if not isinstance(r["config"], dict):
        raise AssertionError(f"budget_config returned {r['config']}: return a dict, the config")
    if "refused" in r:
        raise AssertionError(
            f"deepspeed.initialize refused your config on {WORLD} ranks: "
            f"{r['refused'].splitlines()[0]}. Then: {_refusal(r['refused'])}"
        )
    if r["train_batch_size"] != BATCH:
        raise AssertionError(
            f"DeepSpeed accepts it, but it trains {r['train_batch_size']} sequences per step "
            f"({r['micro']} x {r['accumulation']} x {WORLD}): the lab's batch is {BATCH}"
        )
    for rank, found in enumerate(results):
        total = found["held"] + found["activations"]
        if total > BUDGET:
            alone = found["held"] > BUDGET
            what = (
                "the states and buffers alone are over it: which stage holds least between "
                "steps, and are its buffers sized for this model (section 3)?"
                if alone
                else "a smaller micro-batch saves fewer activations, or another stage fewer states"
            )
            raise AssertionError(
                f"rank {rank} holds {found['held']:,} bytes after the step (ZeRO stage "
                f"{found['stage']}) and a micro-batch of {found['micro']} saves "
                f"{found['activations']:,} for backward: {total:,} bytes, over the budget "
                f"of {BUDGET:,}; {what}"
            )
    if r["micro"] < BEST_MICRO:
        raise AssertionError(
            f"it fits, with micro-batches of {r['micro']} ({r['accumulation']} passes per "
            "step), but a larger micro-batch fits the budget too at another stage: which "
            "stage holds least between steps?"
        )
    return (
        f"DeepSpeed trains {BATCH} sequences per step on {WORLD} ranks, in micro-batches of "
        f"{r['micro']} x {r['accumulation']} accumulated, within {BUDGET:,} bytes per rank"
    )
