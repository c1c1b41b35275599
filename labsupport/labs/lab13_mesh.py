"""Lab 13's mechanism exercise: the process groups of a 3D mesh, from its sizes and an
order, checked on real ranks against PyTorch's ``init_device_mesh`` and offline against
:class:`~labsupport.parallel.parallel_state.Mesh` on larger meshes.

The learner's ``mesh_groups(dp, tp, pp, order)`` returns the ranks of every tp, dp and pp
group. On 6 ranks, every rank calls it and creates a process group from each list it
returns, every rank the same groups in the same order (as Megatron-LM's
``initialize_model_parallel`` and :meth:`Mesh.process_groups` do): a group a rank
creates that another does not is a hang, reported as a timeout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from labsupport.labs.cells import exercise, launch_answer
from labsupport.labs.lab13_hybrid import torch_groups
from labsupport.launch.runtime import device
from labsupport.parallel.parallel_state import AXES, Mesh

#: The meshes run on 6 ranks: (dp, tp, pp, order).
ON_RANKS = [(3, 2, 1, "tp-dp-pp"), (1, 2, 3, "tp-dp-pp"), (2, 1, 3, "tp-pp-dp"),
            (3, 2, 1, "dp-tp-pp")]  # fmt: skip
#: The meshes checked offline, too many ranks for a laptop.
OFFLINE = [(2, 2, 2, "tp-dp-pp"), (2, 4, 2, "tp-dp-pp"), (2, 4, 2, "tp-pp-dp"),
           (2, 2, 4, "tp-dp-pp"), (8, 4, 12, "tp-dp-pp"), (4, 2, 2, "dp-tp-pp")]  # fmt: skip
WORLD = 6
HANG = (
    "Every rank calls mesh_groups() and then dist.new_group() for every list it returns: "
    "new_group is collective over the whole world, so every rank must create every group, "
    "in the same order. Does your function return something that depends on the rank "
    "(only the rank's own groups, say)?"
)


def _lists(given, world: int) -> tuple[dict | None, str | None]:
    """``given`` as ``{axis: [[rank, ...], ...]}``, or what is wrong with its form."""
    if not isinstance(given, dict) or sorted(given) != sorted(AXES):
        keys = sorted(given) if isinstance(given, dict) else type(given).__name__
        return None, f"return a dict with the keys 'tp', 'dp' and 'pp'; got {keys}"
    found = {}
    for axis in AXES:
        try:
            groups = [[int(r) for r in group] for group in given[axis]]
        except (TypeError, ValueError):
            return None, f"{axis}: give a list of groups, each a list of ranks"
        for group in groups:
            if len(set(group)) != len(group) or not all(0 <= r < world for r in group):
                return None, f"{axis} group {group}: ranks 0 to {world - 1}, each once"
        found[axis] = groups
    return found, None


def mesh_case(fn) -> list[dict]:
    """On every rank, for each mesh of :data:`ON_RANKS`: the learner's lists, the process
    groups created from them (the ranks an all-gather over this rank's group of each axis
    returns) and ``init_device_mesh``'s groups of this rank."""
    me, found = dist.get_rank(), []
    for dp, tp, pp, order in ON_RANKS:
        lists, problem = _lists(fn(dp, tp, pp, order), dp * tp * pp)
        entry = {"lists": lists, "problem": problem, "torch": torch_groups(dp, tp, pp, order)}
        found.append(entry)
        if problem:
            continue
        mine = {}
        for axis in AXES:
            for ranks in lists[axis]:
                group = dist.new_group(ranks)  # every rank, every group, the same order
                if me in ranks:
                    mine[axis] = group
        entry["members"] = {}
        if len(mine) < len(AXES) or any(
            sorted(r for g in lists[a] for r in g) != list(range(dp * tp * pp)) for a in AXES
        ):
            continue  # not every rank in one group of each axis: the lists' verdict says so
        for axis, group in mine.items():
            gathered = [torch.zeros(1, device=device()) for _ in range(dist.get_world_size(group))]
            dist.all_gather(gathered, torch.tensor([float(me)], device=device()), group=group)
            entry["members"][axis] = [int(t.item()) for t in gathered]
    return found


def _mesh_problem(lists: dict, dp: int, tp: int, pp: int, order: str) -> str | None:
    """What is wrong with the learner's groups of one mesh, against :class:`Mesh`."""
    mesh, where = Mesh(dp, tp, pp, order), f"dp={dp}, tp={tp}, pp={pp}, order {order!r}"
    for axis in AXES:
        want, got = mesh.groups(axis), lists[axis]
        size = mesh.size(axis)
        wrong_size = [g for g in got if len(g) != size]
        if wrong_size:
            return (
                f"{where}: your {axis} group {wrong_size[0]} has {len(wrong_size[0])} ranks; a "
                f"{axis} group has {axis}={size} ranks, one for each {axis} coordinate"
            )
        if sorted(got) == want:
            continue
        if sorted(sorted(g) for g in got) == want:
            return (
                f"{where}: your {axis} groups hold the right ranks, but list a group's ranks "
                f"in the order of their {axis} coordinate: {want}"
            )
        wrong = [r for g in got for r in g if mesh.group_of(axis, r) not in got]
        if not wrong:
            missing = [g for g in want if g not in got]
            return (
                f"{where}: your {axis} groups are {got}, expected {want}: every rank is in "
                f"exactly one {axis} group" + (f"; {missing[0]} is missing" if missing else "")
            )
        rank = wrong[0]
        mine = next(g for g in got if rank in g)
        hint = (
            f"{order.split('-')[0]} varies fastest: its groups are consecutive ranks"
            if axis == order.split("-")[0]
            else f"the first axis of the order varies fastest, the last ({order.split('-')[-1]})"
            " slowest"
        )
        if len(got) != len(want):
            hint = f"{len(want)} groups of {size}: one per coordinate of the other two axes"
        return (
            f"{where}: your {axis} group of rank {rank} is {mine}, expected "
            f"{mesh.group_of(axis, rank)} ({hint})"
        )
    return None


@exercise
def check_mesh_groups(fn, timeout: float = 120) -> str:
    """``fn(dp, tp, pp, order)``: the ranks of every tp, dp and pp group of the mesh, the
    order naming the axes fastest-varying first. Run on 6 ranks, where the process groups
    made from it must be ``init_device_mesh``'s, then offline on larger meshes."""
    results = launch_answer(mesh_case, WORLD, HANG, timeout, args=(fn,))
    for (dp, tp, pp, order), entry in zip(ON_RANKS, results[0], strict=True):
        if entry["problem"]:
            raise AssertionError(f"dp={dp}, tp={tp}, pp={pp}, order {order!r}: {entry['problem']}")
        problem = _mesh_problem(entry["lists"], dp, tp, pp, order)
        if problem:
            shape = tuple(reversed(order.split("-")))
            raise AssertionError(
                f"on {WORLD} ranks, {problem}; init_device_mesh(mesh_dim_names={shape}) "
                "makes Mesh's groups"
            )
    for rank, found in enumerate(results):
        for (dp, tp, pp, order), entry in zip(ON_RANKS, found, strict=True):
            for axis in AXES:
                got, want = entry.get("members", {}).get(axis), entry["torch"][axis]
                assert got == want, (
                    f"dp={dp}, tp={tp}, pp={pp}, order {order!r}: rank {rank}'s {axis} "
                    f"process group holds {got}, init_device_mesh's {want}"
                )
    for dp, tp, pp, order in OFFLINE:
        lists, problem = _lists(fn(dp, tp, pp, order), dp * tp * pp)
        problem = problem or _mesh_problem(lists, dp, tp, pp, order)
        if problem:
            raise AssertionError(f"right on {WORLD} ranks, but offline, {problem}")
    return (
        f"on {WORLD} ranks your groups are init_device_mesh's for {len(ON_RANKS)} meshes, and "
        f"Mesh's for {len(OFFLINE)} larger ones (BLOOM's 8 x 4 x 12 among them)"
    )
