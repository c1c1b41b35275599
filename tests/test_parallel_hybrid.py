"""The mesh of 3D parallelism, and a GPT trained data x tensor x pipeline parallel with
ZeRO-1 on the data axis, against one process."""

from __future__ import annotations

import pytest

from labsupport import LaunchError, launch
from labsupport.parallel.hybrid import train_3d, train_single
from labsupport.parallel.parallel_state import Mesh

CONFIG = {"vocab_size": 64, "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 16}


def test_the_groups_of_megatrons_initialize_model_parallel_example():
    """megatron/core/parallel_state.py: 16 GPUs, tensor-parallel 2, pipeline-parallel 4."""
    mesh = Mesh(dp=2, tp=2, pp=4)
    assert mesh.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13],
                                 [14, 15]]  # fmt: skip
    assert mesh.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert mesh.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14],
                                 [13, 15]]  # fmt: skip
    assert mesh.embedding_groups() == [[0, 12], [1, 13], [2, 14], [3, 15]]


@pytest.mark.parametrize("order", ["tp-dp-pp", "dp-tp-pp", "pp-tp-dp"])
def test_coordinates_and_ranks_are_inverse_and_every_group_is_a_partition(order):
    mesh = Mesh(dp=3, tp=2, pp=2, order=order)
    for rank in range(mesh.world_size):
        assert mesh.rank_of(**mesh.coords(rank)) == rank
    for axis in ("tp", "dp", "pp"):
        flat = sorted(r for g in mesh.groups(axis) for r in g)
        assert flat == list(range(12))
        assert all(len(g) == mesh.size(axis) for g in mesh.groups(axis))


def test_two_orders_put_the_tensor_parallel_group_on_different_ranks():
    assert Mesh(dp=2, tp=2, pp=1, order="tp-dp-pp").groups("tp") == [[0, 1], [2, 3]]
    assert Mesh(dp=2, tp=2, pp=1, order="dp-tp-pp").groups("tp") == [[0, 2], [1, 3]]


def test_a_bad_mesh_is_a_clear_error():
    with pytest.raises(ValueError, match="name tp, dp and pp once"):
        Mesh(2, 2, 2, order="tp-dp")
    with pytest.raises(LaunchError, match="world has 4"):
        launch(lambda: Mesh(2, 2, 2).process_groups(), 4, timeout=60)


@pytest.mark.parametrize(("dp", "tp", "pp"), [(2, 2, 2), (1, 2, 2), (2, 1, 2)])
def test_3d_training_gives_the_loss_curve_of_one_process(dp, tp, pp):
    want = train_single(CONFIG, steps=3, batch=8, lr=1e-2)
    results = launch(train_3d, dp * tp * pp, args=(CONFIG, dp, tp, pp, 2, 3, 8, 1e-2),
                     timeout=300)  # fmt: skip
    last = [r for r in results if r["losses"]]
    assert len(last) == dp * tp  # the last pipeline stage of every (dp, tp) coordinate
    for r in last:
        # float32 losses ~4 after three Adam steps that differ by rounding: ~1e-6 apart
        assert r["losses"] == pytest.approx(want, abs=1e-5)
    for r in results:
        assert r["rank"] in r["groups"]["tp"] and r["rank"] in r["groups"]["pp"]
