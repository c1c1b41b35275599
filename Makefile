# Distributed Training, Hands-On: build the course, run its tests.
#   make book     build the website into _build/html (creates .venv on first use)
#   make test     the whole suite: lint, unit tests, strict nbval on every lab (with
#                 another CPU's vector kernels), the strict book build, the website
#                 and the labs in JupyterLab, in headless Chromium
#   make lab      JupyterLab on the labs
#   make execute  re-execute the labs in place, storing their outputs
#   make figures  regenerate the chapters' figures from labsupport
#   make bench    benchmarks, printed as tables with ratios and floors, and written to
#                 _build/bench.json
#   make gpu-check  the CUDA/NCCL path, on a machine with a GPU

PYTHON ?= python3
# Where torch comes from. Empty: PyPI (a CUDA build on Linux, several GB). On a machine
# without GPUs, TORCH_INDEX=https://download.pytorch.org/whl/cpu gets the CPU build of
# the same version (about 200 MB); the lock pins everything else either way.
TORCH_INDEX ?=
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LABS := $(wildcard labs/*.ipynb)
MATHJAX := _build/_vendor/mathjax

.PHONY: book calculator test test-home lint unit nbval nbval-portable browser lab execute figures bench stress lock clean \
	gpu-check

$(STAMP): requirements.lock pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11) and "the course needs Python 3.11: run make PYTHON=python3.11")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip==25.3
	$(if $(TORCH_INDEX),$(PY) -m pip install --quiet --index-url $(TORCH_INDEX) torch==2.13.0)
	$(PY) -m pip install --quiet -r requirements.lock
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

$(MATHJAX): $(STAMP)
	mkdir -p $(dir $@)
	rm -rf $@ && cp -r "$$($(PY) -c 'import mathjax, os; print(os.path.dirname(mathjax.__file__))')/static/mathjax/es5" $@

# The calculators page: Pyodide (downloaded once, checked against its pinned sha512) and
# labsupport's calculators, as files the page loads from a folder or a server.
calculator: $(STAMP)
	$(PY) -m tools.site_calculator

book: $(STAMP) $(MATHJAX) calculator
	$(VENV)/bin/jupyter-book build . --warningiserror --nitpick --keep-going

# What the tests create stays under _build/test, nothing in folders other programs on
# the machine share: the temporary folder (multiprocessing's, torch.compile's), Jupyter's
# runtime folder, IPython's history, matplotlib's cache and DeepSpeed's extension builds
# (a build killed mid-way leaves a lock that would make the next one wait forever).
TEST_HOME := $(CURDIR)/_build/test
TEST_DIRS := tmp jupyter ipython matplotlib torch_extensions
unit nbval nbval-portable browser: export TMPDIR := $(TEST_HOME)/tmp
unit nbval nbval-portable browser: export JUPYTER_RUNTIME_DIR := $(TEST_HOME)/jupyter
unit nbval nbval-portable browser: export IPYTHONDIR := $(TEST_HOME)/ipython
unit nbval nbval-portable browser: export MPLCONFIGDIR := $(TEST_HOME)/matplotlib
unit nbval nbval-portable browser: export TORCH_EXTENSIONS_DIR := $(TEST_HOME)/torch_extensions

test-home:
	mkdir -p $(addprefix $(TEST_HOME)/,$(TEST_DIRS))
	find $(TEST_HOME)/torch_extensions -name lock -delete

lint: $(STAMP)
	$(VENV)/bin/ruff check labsupport tests bench tools labs
	$(VENV)/bin/ruff format --check labsupport tests bench tools labs

# Two workers, a test file each at a time: the exercises' checkers spend much of their
# tests waiting (for a rank that must time out, for a launch), which the other file fills.
unit: test-home $(STAMP)
	$(PY) -m pytest tests --ignore=tests/browser -q -n 2 --dist loadfile

# $(call nbval_run,PREFIX): nbval on every lab, the command prefixed (environment, load).
nbval_run = cd labs && $(1) ../$(PY) -m pytest --nbval $(notdir $(LABS)) \
	--nbval-sanitize-with ../tests/nbval_sanitize.cfg -p no:cacheprovider -q

# The stored outputs come from `make execute`, on this machine's fastest vector kernels;
# they must hold on learners' machines too. So nbval runs every lab once, with the
# kernels of a CPU without AVX2 unless ATEN_CPU_CAPABILITY names others: one run checks
# both that each lab reproduces its outputs and that they do not depend on the CPU.
# (torch.compile's cache does not key on the capability: each gets its own.)
NBVAL_CPU = ATEN_CPU_CAPABILITY=$${ATEN_CPU_CAPABILITY:-default} \
	TORCHINDUCTOR_CACHE_DIR=$(TEST_HOME)/inductor-$${ATEN_CPU_CAPABILITY:-default}
nbval: test-home $(STAMP)
	$(call nbval_run,$(NBVAL_CPU))

# A further check, not part of `make test`: the kernels of a CPU with AVX2 but without
# AVX-512 (most laptops), four threads per rank and two busy processes beside the labs.
nbval-portable: test-home $(STAMP)
	$(call nbval_run,ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
		LABSUPPORT_THREADS=4 TORCHINDUCTOR_CACHE_DIR=$(TEST_HOME)/inductor-avx2 \
		../$(PY) ../tools/busy.py 2 --)

browser: test-home book
	$(PY) -m pytest tests/browser -q

test: lint unit nbval book browser

# JupyterLab on the repository, opening the labs: a lab's links to its chapter work. It
# listens on 127.0.0.1 only and asks for its token (printed in the link it opens): a
# kernel runs any code it is sent, so nothing on the network may reach it. Its kernels
# talk to it over Unix sockets in its runtime folder (IPC), which only this user can
# open, rather than over TCP ports. It neither asks to fetch Jupyter's news nor checks
# for updates: the settings' defaults say no (a learner may still turn them on), and the
# server has no news feed and no update check to call.
LAB_CONFIG := _build/jupyterlab-config
lab: $(STAMP)
	mkdir -p $(LAB_CONFIG)/labconfig
	echo '{"@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": false}}' \
		> $(LAB_CONFIG)/labconfig/default_setting_overrides.json
	JUPYTER_CONFIG_PATH="$(CURDIR)/$(LAB_CONFIG)$${JUPYTER_CONFIG_PATH:+:$$JUPYTER_CONFIG_PATH}" \
	$(VENV)/bin/jupyter lab --ServerApp.ip=127.0.0.1 --ServerApp.root_dir=. \
		--LabApp.default_url=/lab/tree/labs --KernelManager.transport=ipc \
		--LabApp.news_url=None --LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate \
		$$([ "$$(id -u)" = 0 ] && echo --allow-root)

execute: $(STAMP)
	$(PY) -m tools.execute $(LABS)

figures: $(STAMP)
	$(PY) -m tools.figures chapters/figures

# Every bench in a process of its own (bench/__main__.py), then their figures and the
# machine's in one JSON file, to compare two runs; under 10 minutes on 2 cores.
bench: $(STAMP)
	$(PY) -m bench

# The CUDA path on a machine with a GPU: every strategy on one rank over NCCL, the
# single-device labs' GPU numbers, and tests/test_gpu.py where there are two GPUs or more.
gpu-check: $(STAMP)
	$(PY) -m tools.gpu_check

# 1,000 launches of a function that does nothing, two busy processes beside them.
stress: $(STAMP)
	$(PY) -m tools.busy 2 -- $(PY) -m bench.stress 1000

lock:
	rm -rf _build/lock-venv && $(PYTHON) -m venv _build/lock-venv
	_build/lock-venv/bin/pip install --quiet pip==25.3
	$(if $(TORCH_INDEX),_build/lock-venv/bin/pip install --quiet --index-url $(TORCH_INDEX) torch==2.13.0)
	_build/lock-venv/bin/pip install --quiet -r requirements.in
	{ head -2 requirements.lock; _build/lock-venv/bin/pip freeze | sed 's/+cpu$$//'; } > requirements.lock.new
	mv requirements.lock.new requirements.lock

clean:
	rm -rf _build
