"""The chapters' figures, drawn from code: ``python -m labsupport.figures chapters/figures``.

Each function returns a matplotlib figure; :func:`main` saves them all as PNG with no
timestamp in the file, so that regenerating a figure changes nothing unless its code
did (a test checks that the committed files match).
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib.pyplot as plt

from labsupport import plotting
from labsupport.launching import global_rank


def ranks_on_two_nodes():
    """Chapter 6: 2 nodes x 4 GPUs; global rank = node_rank x 4 + local_rank."""
    infos = [
        {"rank": global_rank(node, local, 4), "local_rank": local, "node_rank": node}
        for node in range(2)
        for local in range(4)
    ]
    ax = plotting.draw_ranks(infos, title="world_size = 8: two nodes, four processes each")
    return ax.figure


FIGURES = {"06-ranks.png": ranks_on_two_nodes}


def save(fig, path: Path) -> None:
    fig.savefig(path, metadata={"Software": None}, bbox_inches="tight")
    plt.close(fig)


def main(outdir: str) -> None:
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    for name, make in FIGURES.items():
        save(make(), out / name)
        print(f"wrote {out / name}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "chapters/figures")
