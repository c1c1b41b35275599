"""The website's calculators: the Python the page runs, without torch or numpy, gives the
labs' answers; the adapter (labsupport.estimate.web) says what is wrong with bad input;
the Pyodide download is refused unless it is the pinned one.

The page itself, in Chromium, is tested by tests/browser/test_site.py.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from labsupport.estimate import web
from labsupport.estimate.memory import training_memory
from labsupport.estimate.planner import evaluate, memory, stage_params
from labsupport.estimate.published import CLUSTERS, MODELS, PUBLISHED, check
from tools import site_calculator

# What the page asks, one call each: the published GPT-3 layout, context parallelism, a
# custom model, the planner on a published run, and a refusal.
CALLS = [
    ("memory", {"model": "GPT-3 175B", "seq_len": 2048, "gpu": "A100 SXM 80GB", "dp": 16,
                "tp": 8, "pp": 12, "cp": 1, "ep": 1, "zero": 0, "recompute": "full",
                "micro_batch": 1, "micro_batches": 96, "chunks": 8, "sequence_parallel": False}),
    ("memory", {"model": "Llama 3 405B", "seq_len": 8192, "gpu": "H100 SXM", "dp": 64,
                "tp": 8, "pp": 16, "cp": 2, "ep": 1, "zero": 2, "recompute": "selective",
                "micro_batch": 1, "micro_batches": 16, "chunks": 1, "sequence_parallel": True}),
    ("memory", {"model": "custom", "layers": 24, "hidden": 2048, "heads": 16, "vocab": 50257,
                "seq_len": 4096, "gpu": "H200 SXM", "dp": 4, "tp": 2, "pp": 2, "cp": 1,
                "ep": 1, "zero": 3, "recompute": "none", "micro_batch": 2,
                "micro_batches": 4, "chunks": 2, "sequence_parallel": True}),
    ("plan", {"model": "Llama 3 405B", "cluster": "Meta RoCE, 16,384 H100", "global_batch": 2048}),
    ("memory", {"model": "GPT-3 175B", "seq_len": 2048, "gpu": "A100 SXM 80GB", "dp": 1,
                "tp": 1, "pp": 1, "cp": 1, "ep": 8, "zero": 0, "recompute": "full",
                "micro_batch": 1, "micro_batches": 1, "chunks": 1, "sequence_parallel": False}),
    ("presets", {}),
]  # fmt: skip

# Run by a fresh Python whose path starts with the page's files: torch and numpy cannot be
# imported, and labsupport must come from those files, not from the repository.
IN_THE_PAGE = """
import importlib.abc, json, sys
class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "numpy"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: not in the page)")
sys.meta_path.insert(0, Blocked())
sys.path.insert(0, sys.argv[1])
from labsupport.estimate import web
answers = [json.loads(web.call(name, json.dumps(args))) for name, args in json.loads(sys.argv[2])]
loaded = sorted(m.__file__ for m in list(sys.modules.values())
                if m.__name__.startswith("labsupport"))
print(json.dumps({"answers": answers, "loaded": loaded}))
"""


def run_as_the_page(tmp_path, files: dict[str, str]) -> dict:
    for path, source in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(source)
    out = subprocess.run(
        [sys.executable, "-I", "-c", IN_THE_PAGE, str(tmp_path), json.dumps(CALLS)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_the_pages_python_imports_without_torch_or_numpy_and_answers_as_the_labs(tmp_path):
    page = run_as_the_page(tmp_path, site_calculator.python_files())
    here = [json.loads(web.call(name, json.dumps(args))) for name, args in CALLS]
    assert page["answers"] == here
    assert "result" in here[3] and "error" in here[4]
    shipped = {str(tmp_path / p) for p in site_calculator.python_files()}
    assert set(page["loaded"]) <= shipped, "labsupport came from outside the page's files"


def test_the_page_would_fail_if_a_calculator_imported_torch(tmp_path):
    files = site_calculator.python_files()
    memory_py = "labsupport/estimate/memory.py"
    files[memory_py] += "\nimport torch\n"
    with pytest.raises(AssertionError, match="blocked: not in the page"):
        run_as_the_page(tmp_path, files)


@pytest.mark.parametrize("run", PUBLISHED, ids=lambda r: r["model"])
def test_memory_per_gpu_is_the_planners_memory_of_a_published_layout(run):
    """As published, the settings the source leaves open as the planner chooses them."""
    model, lay = MODELS[run["model"]], check(run)["published"]["layout"]
    inputs = {"model": run["model"], "seq_len": model.seq_len, "gpu": CLUSTERS[run["cluster"]].gpu,
              "dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "cp": 1, "ep": 1, "zero": lay.zero,
              "recompute": lay.recompute, "micro_batch": lay.micro_batch,
              "micro_batches": run["global_batch"] // (lay.dp * lay.micro_batch),
              "chunks": lay.chunks,
              "sequence_parallel": lay.sequence_parallel}  # fmt: skip
    shown = web.memory_per_gpu(inputs)
    planned = evaluate(model, CLUSTERS[run["cluster"]], lay, run["global_batch"])
    assert shown["total"] == pytest.approx(planned["memory"], rel=1e-12)
    states = training_memory(stage_params(model, lay.pp) / lay.tp, "mixed", lay.zero, lay.dp)
    assert {k: shown["parts"][k] for k in states} == states


def test_context_parallelism_splits_the_tokens_and_shards_over_dp_times_cp():
    inputs = dict(CALLS[1][1])
    shown = web.memory_per_gpu(inputs)
    model = dataclasses.replace(MODELS["Llama 3 405B"], seq_len=4096)  # 8,192 over cp = 2
    lay = web.Layout(128, 8, 16, 2, 1, 1, "selective", True)
    assert shown["parts"]["activations"] == memory(model, lay, 128 * 16)["activations"]
    without = web.memory_per_gpu(inputs | {"cp": 1, "dp": 128})
    assert shown["parts"]["activations"] == pytest.approx(without["parts"]["activations"] / 2)
    assert shown["parts"]["momentum"] == without["parts"]["momentum"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"ep": 2}, "ep must be 1"),
        ({"cp": 2, "recompute": "none"}, "keeps no score matrix"),
        ({"tp": 5}, "tp must divide the heads"),
        ({"pp": 200}, "pp must be at most the 96 layers"),
        ({"pp": 1, "chunks": 2}, "interleaving (chunks > 1) needs pp > 1"),
        ({"dp": 0}, "dp must be a whole number of at least 1"),
        ({"dp": 1.5}, "dp must be a whole number"),
        ({"model": "GPT-5"}, "model must be custom or one of"),
        ({"gpu": "TPU"}, "gpu must be one of"),
    ],
)
def test_bad_input_is_refused_with_what_to_do(change, message):
    answer = json.loads(web.call("memory", json.dumps(CALLS[0][1] | change)))
    assert message in answer["error"]


def test_the_pyodide_download_is_refused_unless_it_is_the_pinned_one(tmp_path):
    (tmp_path / f"pyodide-{site_calculator.VERSION}.tgz").write_bytes(b"not pyodide")
    with pytest.raises(SystemExit, match="sha512"):
        site_calculator.tarball(tmp_path)
    assert not (tmp_path / f"pyodide-{site_calculator.VERSION}.tgz").exists()
