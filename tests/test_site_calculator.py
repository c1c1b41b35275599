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
from labsupport.estimate.compute import FITTED
from labsupport.estimate.planner import stage_params
from labsupport.estimate.published import PUBLISHED, as_published, check
from tools import site_calculator
from tools.site_calculator_html import MEMORY_START, memory_form

DEEPSEEK = web.published_inputs("DeepSeek-V3")
# What the page asks, one call each: published layouts (GPT-3; Llama 3's 128K stage with
# context parallelism; DeepSeek-V3 with expert parallelism), a custom model, the planner on
# two published runs (DeepSeek-V3's search narrowed), a refusal, and the presets.
CALLS = [
    ("memory", MEMORY_START),
    ("memory", web.published_inputs("Llama 3 405B, 128K")),
    ("memory", DEEPSEEK),
    ("memory", {"model": "custom", "layers": 24, "hidden": 2048, "heads": 16, "vocab": 50257,
                "seq_len": 4096, "gpu": "H200 SXM", "dp": 4, "tp": 2, "pp": 2, "cp": 1,
                "ep": 1, "zero": 3, "recompute": "none", "micro_batch": 2,
                "micro_batches": 4, "chunks": 2, "sequence_parallel": True}),
    ("plan", web.planner_presets()[3]),
    ("plan", web.planner_presets()[-1]),
    ("memory", MEMORY_START | {"ep": 8}),
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
    assert all("result" in a for a in here[:6]) and "error" in here[6]
    shipped = {str(tmp_path / p) for p in site_calculator.python_files()}
    assert set(page["loaded"]) <= shipped, "labsupport came from outside the page's files"


def test_the_page_would_fail_if_a_calculator_imported_torch(tmp_path):
    files = site_calculator.python_files()
    memory_py = "labsupport/estimate/memory.py"
    files[memory_py] += "\nimport torch\n"
    with pytest.raises(AssertionError, match="blocked: not in the page"):
        run_as_the_page(tmp_path, files)


@pytest.mark.parametrize("run", PUBLISHED, ids=lambda r: r["name"])
def test_memory_per_gpu_is_the_planners_memory_of_a_published_layout(run):
    shown = web.memory_per_gpu(web.published_inputs(run["name"]))
    planned = as_published(run)
    assert shown["total"] == pytest.approx(planned["memory"], rel=1e-12)
    assert shown["fits"] == planned["fits"]


def test_expert_parallelism_splits_the_routed_experts_only():
    """DeepSeek-V3 as published, ZeRO-1: the 16-bit weights are 2 bytes per parameter of the
    heaviest stage, the dense ones all there, the routed experts over ``ep``."""
    for ep in (64, 32, 1):
        shown = web.memory_per_gpu(DEEPSEEK | {"ep": ep})
        params = stage_params(web.MODELS["DeepSeek-V3"], 16, shown["stage"])
        assert params["experts"] > 10 * params["dense"]
        assert shown["parts"]["weights"] == pytest.approx(
            2 * (params["dense"] + params["experts"] / ep), rel=1e-12
        )
    assert shown["stage"] == 1  # every layer of the second stage holds experts


def test_context_parallelism_divides_the_activations_and_shards_over_dp_times_cp():
    llama = web.published_inputs("Llama 3 405B, 128K")  # cp 16 over 131,072 tokens
    shown = web.memory_per_gpu(llama)
    short = web.memory_per_gpu(llama | {"seq_len": 8192, "cp": 1, "dp": 128})
    assert shown["parts"]["activations"] == pytest.approx(short["parts"]["activations"])
    assert shown["parts"]["momentum"] == short["parts"]["momentum"]


@pytest.mark.parametrize("run", web.planner_presets(), ids=lambda r: r["name"])
def test_the_planner_ranks_each_published_mesh_as_check_does(run):
    entry = next(e for e in PUBLISHED if e["name"] == run["name"])
    page, native = web.plan_layouts(run), check(entry)
    assert page["published_rank"] == native["rank"]
    want = [r["layout"] for r in native["meshes"][: len(page["rows"])]]
    assert [r["layout"] for r in page["rows"]] == [dataclasses.asdict(w) for w in want]
    if run["model"] in web.NARROWED:  # the narrowed search keeps what tops the full one
        narrowed = web.NARROWED[run["model"]]
        for r in native["meshes"][:30]:
            assert all(getattr(r["layout"], k) in v for k, v in narrowed.items())


def test_the_page_states_the_fitted_efficiency_and_the_narrowed_search():
    text = (site_calculator.ROOT / "calculators.md").read_text()
    assert f"{100 * FITTED.gemm:.1f} %" in text
    assert "For DeepSeek-V3 the page searches only layouts without tensor parallelism" in text
    assert f"Llama 2 7B's {web.llama_ffn(4096):,}" in text  # a custom Llama's default FFN
    assert web.NARROWED == {"DeepSeek-V3": {"tp": (1,)}}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"ep": 2}, "ep must be 1: GPT-3 175B is dense"),
        ({"model": "DeepSeek-V3", "seq_len": 4096, "ep": 3}, "ep must divide the 256 experts"),
        ({"model": "DeepSeek-V3", "seq_len": 4096, "ep": 32}, "and dp·cp = 16"),
        ({"cp": 3}, "cp the sequence length"),
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


# Llama shapes with the parameter counts of Meta's released checkpoints: Llama 2 7B (its FFN
# width left to the default, Llama's rule), Llama 3 8B and Llama 2 70B (grouped-query
# attention, 8 key-value heads).
LLAMAS = [
    ({"layers": 32, "hidden": 4096, "heads": 32, "vocab": 32000}, 6_738_415_616),
    ({"layers": 32, "hidden": 4096, "heads": 32, "vocab": 128256, "ffn": 14336, "kv_heads": 8},
     8_030_261_248),
    ({"layers": 80, "hidden": 8192, "heads": 64, "vocab": 32000, "ffn": 28672, "kv_heads": 8},
     68_976_648_192),
]  # fmt: skip
LLAMA_3_405B = {"model": "custom", "family": "llama", "layers": 126, "hidden": 16384,
                "heads": 128, "vocab": 128256, "ffn": 53248, "kv_heads": 8}  # fmt: skip


@pytest.mark.parametrize(("sizes", "count"), LLAMAS, ids=["Llama 2 7B", "Llama 3 8B", "70B"])
def test_a_custom_llama_has_the_released_checkpoints_parameters(sizes, count):
    inputs = {"model": "custom", "family": "llama", "seq_len": 4096} | sizes
    assert web.model_from(inputs).params() == count


def test_a_custom_model_with_a_presets_sizes_is_the_preset():
    """Llama 3 405B's sizes as custom: the preset's parameters, and its memory on the
    128K stage as published; GPT-3's sizes (family, FFN and key-value heads left empty)."""
    llama = web.published_inputs("Llama 3 405B, 128K")
    custom = web.memory_per_gpu(llama | LLAMA_3_405B)
    assert custom["params_total"] == web.MODELS["Llama 3 405B"].params()
    assert custom["parts"] == web.memory_per_gpu(llama)["parts"]
    assert custom["custom"] == {"family": "llama", "ffn": 53248, "kv_heads": 8}
    sizes = {"model": "custom", "layers": 96, "hidden": 12288, "heads": 96, "vocab": 51200}
    gpt = web.memory_per_gpu(MEMORY_START | sizes | {"ffn": "", "kv_heads": 0})
    assert gpt["params_total"] == web.MODELS["GPT-3 175B"].params()
    assert gpt["parts"] == web.memory_per_gpu(MEMORY_START)["parts"]
    assert gpt["custom"] == {"family": "gpt", "ffn": 4 * 12288, "kv_heads": 96}


def test_the_memory_form_asks_for_every_size_a_custom_model_takes():
    form = memory_form()
    for name in web.CUSTOM + web.CUSTOM_OPTIONAL:
        assert f'name="{name}"' in form, name


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"kv_heads": 3}, "kv_heads must divide the 128 heads"),
        ({"kv_heads": 2.5}, "kv_heads must be a whole number"),
        ({"tp": 16}, "tp must divide the 8 key-value heads too"),
        ({"ffn": "wide"}, "ffn must be a whole number"),
        ({"ffn": -4096}, "ffn must be a whole number of at least 1"),
        ({"family": "mamba"}, "family must be one of gpt, llama, got 'mamba'"),
    ],
)
def test_a_bad_custom_llama_is_refused_with_what_to_do(change, message):
    inputs = web.published_inputs("Llama 3 405B, 128K") | LLAMA_3_405B | change
    answer = json.loads(web.call("memory", json.dumps(inputs)))
    assert message in answer["error"]


def test_the_planner_refuses_an_unknown_framework():
    answer = json.loads(web.call("plan", json.dumps(CALLS[4][1] | {"framework": "JAX"})))
    assert "framework must be one of" in answer["error"]


def test_the_pyodide_download_is_refused_unless_it_is_the_pinned_one(tmp_path):
    (tmp_path / f"pyodide-{site_calculator.VERSION}.tgz").write_bytes(b"not pyodide")
    with pytest.raises(SystemExit, match="sha512"):
        site_calculator.tarball(tmp_path)
    assert not (tmp_path / f"pyodide-{site_calculator.VERSION}.tgz").exists()
