"""Lab 17's exercises: the online-softmax merge, checked inside ring attention on real
ranks, and the zig-zag assignment of chunks to ranks, checked by running the ring with it.

The learner's function only ever runs on the ranks, under a timeout: an answer that
never returns (a loop that does not end, a collective that not every rank calls) is
reported as such rather than hanging the notebook.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labsupport.labs.cells import exercise, launch_answer
from labsupport.labs.lab17_context_parallel import against_sdpa, qkv
from labsupport.parallel import context_parallel as cp
from labsupport.parallel.blockwise_attention import attention_block, count_work

WORLD = 4
#: Queries scaled up so that scores, and log-sum-exps, reach the hundreds: exp() of them
#: overflows float32 (beyond 88.7), as real models' scores can. float32 rounds a score of
#: 300 by about 2e-5, which exp() turns into a relative error of 2e-5 in the
#: probabilities: measured, 2e-3 at most on gradients of size 78 (correct merge), where
#: an overflowing merge gives inf or nan.
LARGE, LARGE_TOL = 60.0, {"rtol": 1e-3, "atol": 1e-2}


# --------------------------------------------------------------------------- the merge


def merge_case(fn) -> dict:
    """The learner's ``fn(out, lse, block_out, block_lse)`` on two blocks of keys, then
    inside the ring against SDPA: causal zig-zag, causal contiguous (where the ranks merge
    0 to ``cp - 1`` times), without a mask, and with scores in the hundreds."""
    q, k, v, _ = qkv(12, heads=2, kv_heads=2)
    scale = q.size(-1) ** -0.5
    (o1, l1), (o2, l2) = (
        attention_block(q, k[..., s, :], v[..., s, :], scale) for s in (slice(0, 5), slice(5, 12))
    )
    want = F.scaled_dot_product_attention(q, k, v)
    want_lse = ((q @ k.transpose(-2, -1)) * scale).logsumexp(-1)
    got = fn(o1.clone(), l1.clone(), o2.clone(), l2.clone())
    found = {"pair": isinstance(got, tuple | list) and len(got) == 2}
    if found["pair"]:
        out, lse = (torch.as_tensor(t) for t in got)
        found["shapes"] = out.shape == want.shape and lse.shape == want_lse.shape
    if not found.get("shapes"):
        return found
    close = lambda a, b: bool(torch.allclose(a, b, rtol=1e-5, atol=1e-5))  # noqa: E731
    found |= {
        "out": close(out, want),
        "lse": close(lse, want_lse),
        "average": close(out, (o1 + o2) / 2),
        "lse is the max": close(lse, torch.maximum(l1, l2)),
    }
    if not (found["out"] and found["lse"]):
        return found  # wrong on two blocks: say so, without running the ring
    ring = lambda *t, **kw: cp.ring_attention(*t, merge=fn, **kw)  # noqa: E731
    found["ring, causal zig-zag"] = against_sdpa(ring, 32, True, "zigzag")
    found["ring, causal contiguous"] = against_sdpa(ring, 24, True, "contiguous")
    found["ring, no mask"] = against_sdpa(ring, 24, False, "zigzag")
    found["ring, large scores"] = against_sdpa(ring, 24, True, "zigzag", LARGE, LARGE_TOL)
    return found


@exercise
def check_merge(fn, timeout: float = 60) -> str:
    """Exercise 1: ``fn(out, lse, block_out, block_lse)`` merges two attention results
    over disjoint keys into ``(out, lse)`` over both; run by the ring on 4 ranks."""
    hint = (
        "A merge runs on one rank's own tensors and needs no message: the ring moves the "
        "keys and values. Does yours call a collective (all_reduce, barrier) that the "
        "other ranks, which merge a different number of times, never join?"
    )
    results = launch_answer(merge_case, WORLD, hint, timeout, args=(fn,))
    r = results[0]
    if not r["pair"]:
        raise AssertionError("return a pair (out, lse): the merged output and its log-sum-exp")
    if not r["shapes"]:
        raise AssertionError("out must keep block_out's shape and lse block_lse's")
    if not r["out"]:
        if r["average"]:
            hint = "a plain average gives each block the same weight; weight each by its share "
            hint += "of the softmax's denominator over both blocks, exp(lse_i - new_lse)"
        else:
            hint = "weight each output by exp(its lse - the merged lse)"
        raise AssertionError(
            f"on two blocks, the merged output is not the softmax over both: {hint}"
        )
    if not r["lse"]:
        hint = " (the larger of the two is only the max)" if r["lse is the max"] else ""
        raise AssertionError(
            "the output is right but the merged lse is not: it is log(exp(lse) + "
            f"exp(block_lse)){hint}; the next merge and the backward pass use it"
        )
    cases = ("ring, causal zig-zag", "ring, causal contiguous", "ring, no mask")
    for rank, found in enumerate(results):
        for case in (*cases, "ring, large scores"):
            wrong = [name for name, same in found[case].items() if not same]
            if not wrong:
                continue
            if case == "ring, large scores" and all(
                all(f[c].values()) for f in results for c in cases
            ):
                raise AssertionError(
                    f"right while the scores are small, but with scores in the hundreds rank "
                    f"{rank}'s {', '.join(wrong)} differ from SDPA's: exp() of a log-sum-exp "
                    "above 88.7 overflows float32. Combine them without exponentiating "
                    "them whole: torch.logaddexp, or subtract the larger one first"
                )
            raise AssertionError(
                f"right on two blocks, but inside the ring ({case}) rank {rank}'s "
                f"{', '.join(wrong)} differ from SDPA's"
            )
    return "inside ring attention on 4 ranks, your merge gives SDPA's output and gradients"


# --------------------------------------------------------------------------- zig-zag


def zigzag_case(fn) -> dict:
    """The learner's ``fn(rank, cp)`` for every rank at cp = 2, 3, 4 and 8; at cp = 4
    (this launch), ring attention run with the layout it gives, against SDPA, and the
    score blocks each rank computed."""
    answers = {n: [tuple(int(c) for c in fn(r, n)) for r in range(n)] for n in (2, 3, 4, 8)}
    found = {"answers": answers}
    try:
        layout = cp.Layout(tuple(answers[dist.get_world_size()]))
    except ValueError:
        return found
    with count_work() as work:
        found["equal"] = against_sdpa(cp.ring_attention, 32, True, layout)
    found["blocks"] = work.scores("forward") // (32 // 8) ** 2
    return found


def _problem(answers: list, n: int) -> str | None:
    """What is wrong with an assignment of chunks to ``n`` ranks, or ``None``."""
    for r, mine in enumerate(answers):
        if len(mine) != 2:
            return f"with cp={n}, rank {r} gets {list(mine)}: each rank gets 2 of the 2·cp chunks"
    held = [c for mine in answers for c in mine]
    missing = sorted(set(range(2 * n)) - set(held))
    twice = sorted({c for c in held if held.count(c) > 1})
    if missing or twice or len(held) != 2 * n:
        where = {c: [r for r, mine in enumerate(answers) if c in mine] for c in twice}
        return (
            f"with cp={n} the {2 * n} chunks (0 to {2 * n - 1}) must go to exactly one rank "
            f"each: you give {answers}; chunks held by no rank: {missing}; by several: {where}"
        )
    return None


@exercise
def check_zigzag(fn, timeout: float = 60) -> str:
    """Exercise 2: ``fn(rank, cp)`` returns the two chunks (of ``2·cp``) rank ``rank``
    holds, so that a causal mask gives every rank the same work."""
    hint = "Did zigzag_chunks return? A loop that never ends keeps every rank waiting."
    results = launch_answer(zigzag_case, WORLD, hint, timeout, args=(fn,))
    r = results[0]
    for n, answers in r["answers"].items():
        problem = _problem(answers, n)
        if problem:
            raise AssertionError(problem)
    blocks = [found["blocks"] for found in results]
    if not all(all(found["equal"].values()) for found in results):  # any valid layout works
        raise AssertionError("ring attention with your layout differs from SDPA's")
    if len(set(blocks)) > 1:
        raise AssertionError(
            f"every chunk is held once, but the work is uneven: score blocks per rank "
            f"{blocks} at cp=4 (the slowest does {max(blocks) / (sum(blocks) / 4):.2f}x the "
            "mean). Under a causal mask late chunks cost more than early ones: pair an early "
            "chunk with a late one"
        )
    return f"every rank holds 2 chunks and computes the same work ({blocks[0]} blocks at cp=4)"
