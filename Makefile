# gradsync: `make demo` trains a model over 4 local ranks; `make test` runs
# every test. Both install what they need into the Python they run with.

PYTHON ?= python3
# The Python as an absolute path: a launcher may put another python3 first on
# its ranks' PATH (pyenv's shimmed mpiexec runs `pyenv exec`, which puts the
# pyenv version's bin first), and then the ranks would not run the Python make
# installed into and built for (a venv's, say).
override PYTHON := $(or $(shell $(PYTHON) -c "import sys; print(sys.executable)" 2>/dev/null),$(PYTHON))
NP_LIST ?= 1 2 3 4
# Adasum's fold-in paths differ for every rank count that is not a power of
# two: its tests also run at 7 (three ranks folded into a tree of 4; 3 ranks
# fold one into 2), and make test-extended adds 5 and 6 (8's tree is 2's and
# 4's, one level more).
ADASUM_NP_LIST ?= 7
ADASUM_EXTENDED_NP_LIST ?= 5 6
# the wire formats' error must not grow up to 8 ranks (issue 32)
WIRE_NP_LIST ?= 8
# The device suites under emulated CUDA: the C tests at NP_LIST, pytest at
# one rank and (with NCCL) at 2 ranks: each rank count costs 1-2 minutes
# here, and the host paths they share run at every count above.
EMU_PYTEST_NP_LIST ?= 1
# torch's suite through the mpiexec adapter (test_torch_upstream.py, torch's
# name gates lifted) in make test: at 4 ranks; torch's own harness runs the
# whole suite at 2, 3 and 4 (test_launch.py), `make torch-upstream` the
# adapter at every size.
UPSTREAM_ADAPTER_NP ?= 4
# Partitions with fixed worker counts (the 2x3 table, DistDL's 12 workers).
PARTITION_NP_LIST ?= 6 12
# torch's whole DistributedTest suite through torch's harness
# (tests/torch_tests/test_launch.py): make test-extended at 2, 3 and 4 ranks
# (5 minutes a size here); make test runs the same suite through the mpiexec
# adapter at UPSTREAM_ADAPTER_NP instead (test_torch_upstream.py, 1 minute).
TORCH_SUITE_SIZES ?=
TEST_TIMEOUT ?= 900
SCRIPTS_DIR := $(shell $(PYTHON) -c "import sysconfig; print(sysconfig.get_path('scripts'))" 2>/dev/null)
# mpiexec of the MPI we build with: next to $MPICC, else on PATH, else the wheel's.
MPIEXEC ?= $(or $(if $(MPICC),$(wildcard $(dir $(MPICC))mpiexec)),$(shell command -v mpiexec 2>/dev/null),$(SCRIPTS_DIR)/mpiexec)
MPICC_RESOLVED = $(or $(MPICC),$(shell command -v mpicc 2>/dev/null),$(SCRIPTS_DIR)/mpicc)
export PYTHONPATH := $(CURDIR)/pyx:$(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))
export PYTHON
# Flight records the tests provoke (deliberate mismatches, timeouts) go here
# rather than to TMPDIR/gradsync-flight-<job>: in a test run, into the run
# folder (below), removed with it (KEEP_TEST_FILES=1 keeps them for
# diagnosis); otherwise into build/. A GRADSYNC_FLIGHT_DIR already set is kept.
FLIGHT_RECORDS = $(if $(TEST_RUN_DIR),$(TEST_RUN_DIR)/flight-records,$(CURDIR)/build/flight-records)
export GRADSYNC_FLIGHT_DIR ?= $(FLIGHT_RECORDS)

LIB := pyx/gradsync/libgradsync.so

# MPICH busy-polls while a rank waits; with more ranks than cores (3-4 ranks
# on this project's two) the waiting ranks hold the cores the working ones
# need. In the test targets a waiting rank yields with a short sleep every
# 10 polls: the suites at 4 ranks run about twice as fast on two cores, at
# 2 ranks as fast as before (docs/decisions/build.md, "Oversubscribed test
# runs yield"). Timings (bench, demo) keep MPICH's defaults; other MPIs
# ignore these variables.
TEST_TARGETS := test test-extended c-tests py-tests test-emulated gpu-session-dry cluster-smoke cluster-test test-installed \
    slurm-smoke torch-upstream torch-upstream-spawn check-memory
$(TEST_TARGETS): export MPIR_CVAR_ENABLE_HEAVY_YIELD ?= 1
$(TEST_TARGETS): export MPIR_CVAR_POLLS_BEFORE_YIELD ?= 10

# The run folder (scripts/test_run.sh; docs/DEVELOPERS.md, "Temporary
# files"): when make is asked for a test target (those above, or any other
# whose name has "test" in it), it makes one folder under your TMPDIR, gives
# it to everything it runs as TMPDIR, so whatever the tests write there
# (pytest's base directories, torch's stores and torchelastic's logs, flight
# records) lands in it; the folder is removed when make exits, passed,
# failed or interrupted. `make test KEEP_TEST_FILES=1` keeps it (make says
# where). `make test` fails if the run left anything in your TMPDIR itself.
KEEP_TEST_FILES ?=
TEST_GOALS := $(filter $(TEST_TARGETS),$(MAKECMDGOALS)) \
    $(foreach g,$(MAKECMDGOALS),$(if $(findstring /,$(g)),,$(if $(findstring test,$(g)),$(g))))
ifeq ($(TEST_RUN_DIR),)
ifneq ($(strip $(TEST_GOALS)),)
TEST_RUN_DIR := $(shell KEEP_TEST_FILES=$(filter-out 0,$(KEEP_TEST_FILES)) MPIEXEC=$(MPIEXEC) \
    PYTHON=$(PYTHON) sh scripts/test_run.sh start $$PPID)
$(info == test files under $(TEST_RUN_DIR): $(if $(filter-out 0,$(KEEP_TEST_FILES)),kept (KEEP_TEST_FILES),removed when make exits (KEEP_TEST_FILES=1 keeps them)))
endif
endif
ifneq ($(TEST_RUN_DIR),)
export TEST_RUN_DIR
export TMPDIR := $(TEST_RUN_DIR)
# Bytecode cached once per run, in the run folder: a machine that sets
# PYTHONDONTWRITEBYTECODE makes every one of the run's ~130 Python processes
# recompile gradsync's modules and redo pytest's assertion rewriting of each
# test module (3-7 s of CPU apiece: minutes of make test on two cores). The
# cache goes with the folder; nothing is written beside the sources.
export PYTHONDONTWRITEBYTECODE :=
export PYTHONPYCACHEPREFIX := $(TEST_RUN_DIR)/pycache
# XLA's compiled programs cached once per run, in the run folder as well:
# the JAX tiers at 1-4 ranks and test-installed's compile the same jitted
# functions (at 2 ranks the suite takes 21 s with the cache filled, 33 s
# without); every test still lowers and runs what it asked for.
export JAX_COMPILATION_CACHE_DIR ?= $(TEST_RUN_DIR)/jax-cache
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS ?= 0
export JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES ?= 0
# hydra writes its topology file to /tmp whatever TMPDIR says (and leaves it
# when a job aborts) unless it is given one: scripts/test_run.sh copied it.
ifneq ($(wildcard $(TEST_RUN_DIR)/hwloc-topology.xml),)
export HWLOC_XMLFILE ?= $(TEST_RUN_DIR)/hwloc-topology.xml
export HWLOC_THISSYSTEM ?= 1
endif
endif

# The library's sources, named once: one folder per layer under src/
# (docs/ARCHITECTURE.md), a layer's parts in subfolders of it (transport/mpi/,
# transport/nccl/); private includes name their folder, from -Isrc.
LIB_SOURCES := $(wildcard src/*/*.c src/*/*/*.c)
LIB_DEPS := $(LIB_SOURCES) $(wildcard src/*/*.h src/*/*/*.h src/*/*.cuh src/*/*.cu include/*.h)
LIB_INCLUDES := -Iinclude -Isrc
LIB_CFLAGS := -std=gnu11 -fPIC -fvisibility=hidden -ffp-contract=off -fopenmp \
    -DGS_BUILDING_LIBRARY $(LIB_INCLUDES)
LIB_LIBS := -Wl,-soname,libgradsync.so -ldl -lpthread -lm
C_TESTS := $(patsubst tests/c/%.c,tests/c/bin/%,$(wildcard tests/c/test_*.c))
C_EXAMPLES := $(patsubst tests/c/%.c,tests/c/bin/%,$(wildcard tests/c/example_*.c))
PYTEST = $(PYTHON) -m mpi4py -m pytest --with-mpi -q -p no:cacheprovider

.PHONY: checks-and-build lint-deps emulated-libs check-install test-installed installed-wheel-start test-extended all deps build lint lint-c test gpu-session-dry check-bindings check-layers c-tests py-tests test-emulated gpu-test torch-upstream torch-upstream-spawn demo bench check-memory clean fuzz soak check-asan cluster-test cluster-smoke bench-cluster

all: build

deps:
	@sh scripts/install_deps.sh

# Objects by content (scripts/object_cache.py): the in-place build fills it,
# make test's wheel build (test-installed) reuses what it can.
OBJECT_CACHE ?= $(CURDIR)/build/object-cache
build: deps
	GRADSYNC_OBJECT_CACHE=$(OBJECT_CACHE) $(PYTHON) setup.py -q build_ext --inplace
	@$(PYTHON) -c "import gradsync" || { echo "gradsync: the built package does not import"; exit 1; }

tests/c/bin/%: tests/c/%.c $(LIB) tests/c/gs_test.h
	@mkdir -p tests/c/bin
	$(MPICC_RESOLVED) -O2 -g -std=gnu11 -Wall -Wextra $(LIB_INCLUDES) -Itests/c -o $@ $< \
	    -Lpyx/gradsync -lgradsync -Wl,-rpath,$(CURDIR)/pyx/gradsync -lm

# test_wire_kernels includes the converters' source itself (they are static)
tests/c/bin/test_wire_kernels: src/kernels/cpu_wire.c src/kernels/gs_kernels.h src/kernels/wire_format.h src/base/half.h

# The CUDA kernels' per-thread code on the host, against the host kernels
# (no GPU, no MPI).
tests/c/bin/test_cuda_pieces: tests/c/test_cuda_pieces.cc src/kernels/cuda_pieces.cuh src/base/half.h $(LIB)
	@mkdir -p tests/c/bin
	g++ -std=c++17 -O1 -g -Wall -Wextra -ffp-contract=off $(LIB_INCLUDES) -o $@ $< \
	    -Lpyx/gradsync -lgradsync -Wl,-rpath,$(CURDIR)/pyx/gradsync

# The kernels' exhaustive checks (every float32 bit pattern through the wire
# formats, every half, Adasum's kernels) split their patterns over the ranks
# and reduce across them at most a sum with zeros (test_half's public-API
# part): the whole sweep again at 3 and 4 ranks proves nothing 1 and 2 did
# not (about 12 s of make test).
RANK_LOCAL_C_TESTS := tests/c/bin/test_wire_kernels tests/c/bin/test_half tests/c/bin/test_adasum_kernels
c-tests: build $(C_TESTS) $(C_EXAMPLES) tests/c/bin/test_cuda_pieces
	tests/c/bin/test_cuda_pieces
	@for n in $(NP_LIST); do for t in $(C_TESTS) $(C_EXAMPLES); do \
	    if [ $$n -gt 2 ]; then case " $(RANK_LOCAL_C_TESTS) " in *" $$t "*) continue;; esac; fi; \
	    echo "== $$t at $$n ranks"; \
	    timeout $(TEST_TIMEOUT) $(MPIEXEC) -n $$n $$t || exit 1; \
	done; done
	@echo "== tests/c/bin/test_collectives at 4 ranks, hierarchical allreduce forced (2 groups of 2)"
	@GRADSYNC_HIERARCHICAL=1 GRADSYNC_HIERARCHY_SIZE=2 timeout $(TEST_TIMEOUT) $(MPIEXEC) -n 4 \
	    tests/c/bin/test_collectives

# test_flight.py runs in processes of its own: the doctor reads the whole
# flight record, and the suite's deliberate mismatches on the world earlier
# in the same processes would be part of it.
# Modules whose tests involve no communication (rank-independent kernels,
# subprocess checks made on rank 0) or whose collectives are the ones the
# other modules test at every size (DLPack's exchange protocol, the
# timeline file, the per-rank temporary folders): at 1 and 2 ranks only,
# since 3 and 4 ranks would repeat them on the same two cores (about 100 s
# of make test).
PROCESS_LOCAL_TESTS = test_kernels test_gpu_session test_gpu_visible test_import_check \
    test_no_shadowing test_nccl_bundle test_dlpack test_timeline test_tmp_dirs test_object_cache \
    test_stores test_shrink
py-tests: build
	@for n in $(NP_LIST); do \
	    echo "== pytest at $$n ranks"; \
	    skip=""; if [ $$n -gt 2 ]; then for t in $(PROCESS_LOCAL_TESTS); do \
	        skip="$$skip --ignore=tests/python/$$t.py"; done; fi; \
	    timeout $(TEST_TIMEOUT) $(MPIEXEC) -n $$n $(PYTEST) tests/python \
	        --ignore=tests/python/test_flight.py $$skip || exit 1; \
	    echo "== pytest tests/python/test_flight.py at $$n ranks"; \
	    timeout $(TEST_TIMEOUT) $(MPIEXEC) -n $$n $(PYTEST) tests/python/test_flight.py || exit 1; \
	done
	@for n in $(ADASUM_NP_LIST); do \
	    echo "== pytest tests/python/test_adasum.py at $$n ranks"; \
	    timeout $(TEST_TIMEOUT) $(MPIEXEC) -n $$n $(PYTEST) tests/python/test_adasum.py \
	        tests/python/test_adasum_hierarchical.py || exit 1; \
	done
	@echo "== pytest test_allreduce.py test_hierarchical.py test_wire.py at 4 ranks, hierarchical forced (2 groups of 2)"
	@GRADSYNC_HIERARCHICAL=1 GRADSYNC_HIERARCHY_SIZE=2 timeout $(TEST_TIMEOUT) $(MPIEXEC) -n 4 \
	    $(PYTEST) tests/python/test_allreduce.py tests/python/test_hierarchical.py \
	    tests/python/test_wire.py || exit 1
	@for n in $(WIRE_NP_LIST); do \
	    echo "== pytest tests/python/test_wire.py (error growth, bit equality) at $$n ranks"; \
	    timeout $(TEST_TIMEOUT) $(MPIEXEC) -n $$n $(PYTEST) tests/python/test_wire.py \
	        -k "grow or matches_reference" || exit 1; \
	done
	@for n in $(PARTITION_NP_LIST); do \
	    echo "== pytest tests/python/test_partition.py at $$n ranks"; \
	    timeout $(TEST_TIMEOUT) $(MPIEXEC) -n $$n $(PYTEST) tests/python/test_partition.py || exit 1; \
	done
	@if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
	    for n in $(NP_LIST); do \
	        echo "== pytest tests/torch_tests tests/horovod_tests at $$n ranks"; \
	        skip=""; case " $(UPSTREAM_ADAPTER_NP) " in *" $$n "*) ;; \
	            *) skip="--ignore=tests/torch_tests/test_torch_upstream.py";; esac; \
	        GS_TORCH_SUITE_SIZES="$(TORCH_SUITE_SIZES)" timeout $(TEST_TIMEOUT) $(MPIEXEC) -n $$n \
	            $(PYTEST) tests/torch_tests tests/horovod_tests $$skip || exit 1; \
	    done; \
	else echo "== tests/torch_tests tests/horovod_tests skipped: torch is not importable by $(PYTHON) (pip install torch)"; fi
	@if $(PYTHON) -c "import jax" >/dev/null 2>&1; then \
	    for n in $(NP_LIST); do \
	        echo "== pytest tests/jax_tests at $$n ranks"; \
	        timeout $(TEST_TIMEOUT) $(MPIEXEC) -n $$n $(PYTEST) tests/jax_tests || exit 1; \
	    done; \
	else echo "== tests/jax_tests skipped: jax is not importable by $(PYTHON) (pip install 'jax[cpu]')"; fi

# The device paths on a machine without a GPU: the same C sources linked with
# a host stand-in for the CUDA runtime and kernels (tests/emulated_cuda), so
# engines, staged MPI, batched packing and device Adasum run in every CI.
NVCC ?= $(or $(shell command -v nvcc 2>/dev/null),$(wildcard /usr/local/cuda/bin/nvcc))
CUDA_TOP = $(shell $(NVCC) --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$$ TOP=//p')
CUDA_INCLUDE ?= $(firstword $(wildcard $(CUDA_TOP)/targets/x86_64-linux/include $(CUDA_TOP)/include /usr/local/cuda/include))
EMULATED_LIB := build/emulated/libgradsync.so
CPU_ONLY_LIB := build/cpu-only/libgradsync.so

# The library as a machine without nvcc builds it: it must link with no
# undefined symbol (the CUDA entry points have CPU stubs).
$(CPU_ONLY_LIB): $(LIB_DEPS)
	@mkdir -p build/cpu-only
	$(MPICC_RESOLVED) -O1 $(LIB_CFLAGS) -Wall -Wextra -Wno-unused-parameter -Werror -shared -o $@ \
	    $(LIB_SOURCES) $(LIB_LIBS) -Wl,--no-undefined

# The emulated runtime (tests/emulated_cuda): streams on threads, tracked
# device memory, the launchers on the host, and an emulated NCCL.
NCCL_INCLUDE ?= $(shell $(PYTHON) -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'include'))" 2>/dev/null)
EMU_SOURCES := $(wildcard tests/emulated_cuda/*.c)
EMU_KERNELS := build/emulated/emu_kernels.o
$(EMU_KERNELS): tests/emulated_cuda/emu_kernels.cc tests/emulated_cuda/emu.h src/kernels/cuda_pieces.cuh src/device/gs_cuda.h src/base/half.h
	@mkdir -p build/emulated
	g++ -std=c++17 -O1 -g -fPIC -Wall -Wextra -fvisibility=hidden -ffp-contract=off \
	    -I$(CUDA_INCLUDE) $(LIB_INCLUDES) -c $< -o $@

$(EMULATED_LIB): $(LIB_DEPS) $(EMU_SOURCES) $(EMU_KERNELS)
	@mkdir -p build/emulated
	$(MPICC_RESOLVED) -O1 -g $(LIB_CFLAGS) -Wall -Wextra -Wno-unused-parameter -DGS_HAVE_CUDA \
	    $(if $(NCCL_INCLUDE),-DGS_HAVE_NCCL -I$(NCCL_INCLUDE)) \
	    -DGS_CUDA_ARCHS='"emulated"' -I$(CUDA_INCLUDE) -shared -o $@ \
	    $(LIB_SOURCES) $(EMU_SOURCES) $(EMU_KERNELS) $(LIB_LIBS) -Wl,--no-undefined -lstdc++

# Device tests against the emulated runtime: every path (staged MPI, the
# CUDA-aware MPI path, NCCL through the emulated NCCL), the stream
# semantics, contexts, sticky errors and NCCL faults.
EMU_ENV = LD_LIBRARY_PATH=$(CURDIR)/build/emulated
EMU_NCCL_ENV = $(EMU_ENV) GS_EMU_DISTINCT_GPUS=1 GRADSYNC_NCCL_LIBRARY=$(CURDIR)/$(EMULATED_LIB)
EMU_C_TESTS := $(addprefix tests/c/bin/,test_device_paths test_exchange_device test_device_streams \
    test_device_context test_device_sticky test_nccl_faults test_device_ring test_device_memory \
    test_device_blocking)
# The emulated-CUDA and CPU-only libraries (make test builds them in the
# background and waits for them before the GPU session's dry run, which packs
# the emulated one, and test-emulated).
emulated-libs: build
	@if [ -n "$(NVCC)" ] && [ -n "$(CUDA_INCLUDE)" ]; then \
	    $(MAKE) -j2 --no-print-directory $(EMULATED_LIB) $(CPU_ONLY_LIB); \
	else $(MAKE) --no-print-directory $(CPU_ONLY_LIB); fi

test-emulated: build $(EMU_C_TESTS)
	@if [ -z "$(NVCC)" ] || [ -z "$(CUDA_INCLUDE)" ]; then \
	    $(MAKE) --no-print-directory $(CPU_ONLY_LIB) || exit 1; \
	    echo "== test-emulated: no CUDA toolkit, skipped"; exit 0; fi; \
	$(MAKE) -j2 --no-print-directory $(EMULATED_LIB) $(CPU_ONLY_LIB) && \
	echo "== pytest test_comm.py test_dlpack.py on the CPU-only library" && \
	LD_LIBRARY_PATH=$(CURDIR)/build/cpu-only timeout $(TEST_TIMEOUT) $(MPIEXEC) -n 2 \
	    $(PYTEST) tests/python/test_comm.py tests/python/test_dlpack.py || exit 1; \
	echo "== test_device_ring at 1 rank (emulated CUDA; the kernel-table ring is per process)"; \
	$(EMU_ENV) timeout $(TEST_TIMEOUT) $(MPIEXEC) -n 1 tests/c/bin/test_device_ring || exit 1; \
	for n in $(NP_LIST); do \
	    for t in test_device_paths test_exchange_device; do \
	    echo "== $$t at $$n ranks (emulated CUDA: staged MPI, then NCCL)"; \
	    $(EMU_NCCL_ENV) timeout $(TEST_TIMEOUT) $(MPIEXEC) -n $$n tests/c/bin/$$t || exit 1; done; \
	    for t in test_device_streams test_device_context test_device_sticky test_nccl_faults \
	        test_device_memory test_device_blocking; do \
	    echo "== $$t at $$n ranks (emulated CUDA)"; \
	    $(EMU_ENV) timeout $(TEST_TIMEOUT) $(MPIEXEC) -n $$n tests/c/bin/$$t || exit 1; done; \
	    if [ $$n = 2 ]; then \
	    for t in test_device_paths test_exchange_device; do \
	    echo "== $$t at 2 ranks (emulated CUDA, CUDA-aware MPI path)"; \
	    GRADSYNC_CUDA_AWARE_MPI=1 $(EMU_ENV) timeout $(TEST_TIMEOUT) \
	        $(MPIEXEC) -n 2 tests/c/bin/$$t || exit 1; done; \
	    echo "== pytest tests/gpu at 2 ranks (emulated CUDA and NCCL)"; \
	    $(EMU_NCCL_ENV) timeout $(TEST_TIMEOUT) $(MPIEXEC) -n 2 $(PYTEST) tests/gpu || exit 1; fi; \
	    case " $(EMU_PYTEST_NP_LIST) " in *" $$n "*) \
	    echo "== pytest tests/gpu tests/python/test_dlpack.py at $$n ranks (emulated CUDA)"; \
	    $(EMU_ENV) timeout $(TEST_TIMEOUT) $(MPIEXEC) -n $$n \
	        $(PYTEST) tests/gpu tests/python/test_dlpack.py || exit 1;; esac; \
	done

test: checks-and-build installed-wheel-start bg-start-embed-test bg-start-emulated-libs \
      c-tests py-tests bg-wait-emulated-libs bg-start-gpu-session-dry test-emulated \
      cluster-smoke slurm-smoke test-installed bg-wait-embed-test bg-wait-gpu-session-dry
	@sh scripts/test_run.sh check $(TEST_RUN_DIR)

# Tiers that run beside the others in make test: the embedding test, the
# emulated-CUDA and CPU-only libraries' builds (waited for before the tiers
# that use them) and the GPU session's dry run keep about one core busy, with
# files of their own,
# and the tiers above leave a core idle for much of the run (every one-rank
# tier, the installs). bg-start-X runs `make X` niced in its own process
# group (ended by the run folder's watcher if make stops first), without
# remaking the build; bg-wait-X prints X's output and fails when X failed.
bg-start-%:
	@[ -n "$(TEST_RUN_DIR)" ] || { echo "bg-start-$*: part of make test only"; exit 1; }
	@echo "== $*: started in the background (its output follows at the end)"
	@sh scripts/test_run.sh background $(TEST_RUN_DIR) $* $(MAKE) --no-print-directory -o build $*

bg-wait-%:
	@sh scripts/test_run.sh wait $(TEST_RUN_DIR) $* $$(( 2 * $(TEST_TIMEOUT) ))

# make test's first step: the static checks beside the build. Each check is
# one process on one core, and the build leaves a core idle while nvcc
# compiles its one file; the dependencies are installed first, once, so no
# two pip runs overlap. Each target's output is printed when it finishes.
checks-and-build: deps lint-deps
	@$(MAKE) --no-print-directory -j4 --output-sync=target lint check-bindings check-layers build

# Every .pxd mirrors its public header (scripts/check_pxd.py: each function,
# constant and struct field, compiled against the header). Its rule had gone
# missing (the target was only .PHONY, so `make test` checked nothing).
check-bindings: deps
	$(PYTHON) scripts/check_pxd.py --cc $(MPICC_RESOLVED)

# src/'s layering from the compiler's call graph (scripts/check_layers.py,
# docs/ARCHITECTURE.md): every call and include goes down a layer or stays,
# no cycles, files under 500 lines and functions under 60.
check-layers: deps
	$(PYTHON) scripts/check_layers.py --quiet --cc $(MPICC_RESOLVED)

# Style: ruff (pyproject.toml) over the Python, cython-lint over the binding,
# and (lint-c) clang-format (.clang-format) over the C sources.
lint: lint-c
	$(PYTHON) -m ruff check pyx scripts tests bench
	$(PYTHON) -m cython_lint.cython_lint pyx/gradsync/*.pyx pyx/gradsync/*.pxi pyx/gradsync/*.pxd

lint-deps:
	@sh scripts/install_deps.sh lint

C_FORMATTED = $(LIB_DEPS) $(wildcard tests/c/*.c) $(wildcard pyx/gradsync/jax/*.cc)
lint-c: lint-deps
	$(SCRIPTS_DIR)/clang-format --dry-run --Werror $(C_FORMATTED)

# Simulated hosts (scripts/simcluster, docs/CLUSTER.md): network namespaces
# joined by veth links shaped with tc, one MPI job across them. Needs root
# and `ip netns`; without them both targets say why and pass.
SIMCLUSTER = $(PYTHON) scripts/simcluster --mpiexec $(MPIEXEC) --timeout $(TEST_TIMEOUT)
CLUSTER_SMOKE = tests/python/test_allreduce.py tests/python/test_adasum.py \
    tests/python/test_adasum_hierarchical.py tests/cluster/test_topology.py
CLUSTER_SUITES = $(CLUSTER_SMOKE) tests/python/test_broadcast_gather_scatter.py \
    tests/python/test_shard.py tests/python/test_async.py tests/python/test_hierarchical.py \
    tests/python/test_comm.py
CLUSTER_LAYOUTS ?= 2x2 3x1
CLUSTER_CHECK = $(SIMCLUSTER) --check || { echo "== $@: skipped (no simulated cluster here)"; exit 0; }

# Part of `make test`: 2 hosts x 2 ranks, the allreduce and Adasum suites.
# A newcomer's `pip install .`: the same tier as test-installed in a venv
# with nothing in it first (pip pulls mpich, mpi4py, numpy and ml_dtypes as
# gradsync's dependencies; torch and jax are not installed, so their suites
# say they are skipped). Not part of `make test` (pip builds the wheel again).
check-install: build
	@GS_INSTALLED_FRESH=1 MPIEXEC=$(MPIEXEC) GS_TEST_MPICC=$(MPICC_RESOLVED) \
	    TEST_TIMEOUT=$(TEST_TIMEOUT) sh scripts/test_installed.sh

# Part of `make test`: the package `pip install .` builds from a clean copy
# of the sources, installed into a fresh venv, tested from outside the
# checkout (scripts/test_installed.sh: what the install holds, console
# scripts, build info equal to this build's, then collectives, the doctor,
# torch, Horovod, JAX and embedding at 2 ranks).
test-installed: build
	@MPIEXEC=$(MPIEXEC) GS_TEST_MPICC=$(MPICC_RESOLVED) TEST_TIMEOUT=$(TEST_TIMEOUT) \
	    GS_INSTALLED_WHEEL=$(if $(filter test,$(MAKECMDGOALS)),$(INSTALLED_WHEEL)) \
	    sh scripts/test_installed.sh

# In `make test`, test-installed's `pip wheel .` (2.5 minutes of compiling
# here, seconds when it finds the in-place build's objects in OBJECT_CACHE)
# starts right after the in-place build, in the background and niced,
# in a process group of its own (the run folder's watcher ends it if make
# stops first): it takes the core that the one-process tiers leave idle, and
# test-installed waits for its wheel instead of building then.
INSTALLED_WHEEL = $(TEST_RUN_DIR)/installed-wheel
installed-wheel-start: build
	@[ -n "$(TEST_RUN_DIR)" ] || { echo "installed-wheel-start: part of make test only"; exit 1; }
	@mkdir -p $(INSTALLED_WHEEL) && echo "== test-installed: pip wheel . started in the background"
	@GRADSYNC_OBJECT_CACHE=$(OBJECT_CACHE) setsid nice -n 10 sh scripts/test_installed.sh wheel $(INSTALLED_WHEEL) \
	    </dev/null >$(INSTALLED_WHEEL)/log 2>&1 & echo $$! > $(TEST_RUN_DIR)/.run/installed-wheel.pgid

cluster-smoke: build
	@$(CLUSTER_CHECK); echo "== cluster 2 hosts x 2 ranks: allreduce and Adasum suites"; \
	$(SIMCLUSTER) --hosts 2 --ranks-per-host 2 -- $(PYTEST) $(CLUSTER_SMOKE) || exit 1; \
	echo "== cluster 2 hosts x 2 ranks: a link taken down, and the doctor's verdict"; \
	timeout $(TEST_TIMEOUT) $(PYTHON) -m pytest -q -p no:cacheprovider \
	    tests/cluster/test_cluster_faults.py -k "link_down and 2x2-default" || exit 1; \
	echo "== cluster 2 hosts x 2 ranks: a host lost, the other trains on (gradsync.elastic)"; \
	timeout $(TEST_TIMEOUT) $(PYTHON) -m pytest -q -p no:cacheprovider \
	    tests/cluster/test_cluster_elastic.py

# srun on a one-node Slurm of this machine (scripts/slurmlocal: root, and
# Debian's slurm-wlm and munge, which only `make slurm-install` installs:
# no test target installs a system package): srun --mpi=pmi2, srun without
# PMI joined through MASTER_ADDR, and the error without either
# (tests/cluster/test_slurm.py). Skipped, saying why, where it cannot run.
slurm-smoke: build
	@if ! why=$$($(PYTHON) scripts/slurmlocal --check 2>&1); then \
	    echo "== slurm-smoke: skipped ($${why#slurmlocal: })"; exit 0; fi; \
	echo "== srun on a one-node Slurm: --mpi=pmi2, without PMI, the torch backend"; \
	timeout $(TEST_TIMEOUT) $(PYTHON) -m pytest -q -p no:cacheprovider tests/cluster/test_slurm.py

# Installs what `make slurm-smoke` needs, when asked (root on Debian or
# Ubuntu): slurm-wlm and munge, with apt-get.
.PHONY: slurm-install
slurm-install:
	@[ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 || \
	    { echo "make slurm-install: needs root and apt-get (Debian, Ubuntu)"; exit 1; }
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge || \
	    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
	        --no-install-recommends slurm-wlm munge; }

# The acceptance suites across hosts at each layout (the torch optimizer's too
# when torch imports), the allreduce suite with the hierarchical path forced,
# hosts of unequal sizes, then network faults (tests/cluster/test_cluster_faults.py).
cluster-test: build
	@$(SIMCLUSTER) --cleanup >/dev/null 2>&1; $(CLUSTER_CHECK); \
	for l in $(CLUSTER_LAYOUTS); do h=$${l%x*}; r=$${l#*x}; \
	    echo "== cluster $$h hosts x $$r ranks: pytest suites"; \
	    $(SIMCLUSTER) --hosts $$h --ranks-per-host $$r -- $(PYTEST) $(CLUSTER_SUITES) || exit 1; \
	    if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
	    echo "== cluster $$h hosts x $$r ranks: tests/torch_tests/test_optimizer.py"; \
	    $(SIMCLUSTER) --hosts $$h --ranks-per-host $$r -- $(PYTEST) tests/torch_tests/test_optimizer.py \
	        || exit 1; fi; \
	done; \
	echo "== cluster 2 hosts x 2 ranks, GRADSYNC_HIERARCHICAL=1: allreduce suites"; \
	GRADSYNC_HIERARCHICAL=1 $(SIMCLUSTER) --hosts 2 --ranks-per-host 2 -- $(PYTEST) \
	    tests/python/test_allreduce.py tests/python/test_async.py || exit 1; \
	echo "== cluster 2 hosts of 2 and 1 ranks: topology and hierarchical suites"; \
	$(SIMCLUSTER) --hosts 2 --ranks-per-host 2,1 -- $(PYTEST) tests/cluster/test_topology.py \
	    tests/python/test_hierarchical.py tests/python/test_adasum_hierarchical.py || exit 1; \
	echo "== cluster network faults"; \
	timeout $(TEST_TIMEOUT) $(PYTHON) -m pytest -q -p no:cacheprovider tests/cluster/test_cluster_faults.py tests/cluster/test_cluster_elastic.py

# Allreduce across 2 simulated hosts x 2 ranks at 10 and 1 Gbit/s: time and
# bytes per host link, gradsync flat / hierarchical / default against mpi4py
# (bench.cluster; docs/PERFORMANCE.md "Across hosts").
CLUSTER_RATES ?= 10gbit 1gbit
bench-cluster: build
	@$(CLUSTER_CHECK); for rate in $(CLUSTER_RATES); do \
	    $(SIMCLUSTER) --hosts 2 --ranks-per-host 2 --rate $$rate -- \
	        $(PYTHON) -m bench.cluster --repeats 7 --json cluster-$$rate.json || exit 1; done

# On a machine with a GPU: the device C tests on the real runtime, then
# under compute-sanitizer (memcheck, racecheck), the GPU pytest suite at 1
# rank (NCCL) and at GPU_NP ranks sharing the GPU (staged MPI), then the
# figures for docs/GPU.md. Without a GPU it says so and passes, but a
# machine whose nvidia-smi lists GPUs that gradsync cannot see (a driver
# older than the CUDA runtime, say) fails, with gradsync's reason.
GPU_NP ?= 2
SANITIZER ?= $(or $(shell command -v compute-sanitizer 2>/dev/null),$(wildcard $(CUDA_TOP)/bin/compute-sanitizer))
gpu-test: build tests/c/bin/test_device_paths tests/c/bin/test_device_streams
	@$(PYTHON) scripts/gpu_visible.py || exit 1; \
	if ! $(PYTHON) -c "import gradsync as g, sys; sys.exit(0 if g.build_info()['cuda_devices'] else 1)"; then \
	    echo "== gpu-test: no CUDA device visible, skipped"; exit 0; fi; \
	for n in 1 $(GPU_NP); do \
	    echo "== tests/c/bin/test_device_paths at $$n ranks (CUDA)"; \
	    timeout $(TEST_TIMEOUT) $(MPIEXEC) -n $$n tests/c/bin/test_device_paths || exit 1; \
	    echo "== pytest tests/gpu at $$n ranks"; \
	    timeout $(TEST_TIMEOUT) $(MPIEXEC) -n $$n $(PYTEST) tests/gpu || exit 1; \
	done; \
	if [ -n "$(SANITIZER)" ]; then for tool in memcheck racecheck; do \
	    echo "== compute-sanitizer --tool $$tool tests/c/bin/test_device_paths (1 rank)"; \
	    GRADSYNC_NCCL=0 timeout $(TEST_TIMEOUT) $(MPIEXEC) -n 1 $(SANITIZER) --tool $$tool \
	        --error-exitcode 3 tests/c/bin/test_device_paths || exit 1; done; fi; \
	echo "== bench.gpu"; \
	timeout $(TEST_TIMEOUT) $(MPIEXEC) -n 1 $(PYTHON) -m bench.gpu --json gpu-bench.json

# The GPU session script (scripts/gpu_session.sh, docs/GPU.md) dry-run here
# so it cannot rot between the rare sessions with a GPU: its prepare step
# builds a bundle against the emulated CUDA runtime in a copy of the tree,
# and the session runs every step there (tiny budgets, bench --dry-run).
GPU_DRY := build/gpu-dry
gpu-session-dry: build $(EMULATED_LIB)
	@echo "== scripts/gpu_session.sh dry run (emulated CUDA runtime)"
	@GS_PREP_DRY=1 GS_PREP_DIR=$(CURDIR)/$(GPU_DRY) GS_PREP_OUT=$(CURDIR)/$(GPU_DRY)/bundle \
	    bash scripts/gpu_prepare.sh > $(GPU_DRY).log 2>&1 || { cat $(GPU_DRY).log; exit 1; }
	@GS_NCCL_ARCH=0 GS_EMU_NCCL_VERSION=23007 GS_NCCL_OUT=$(CURDIR)/$(GPU_DRY)/nccl \
	    bash scripts/build_nccl.sh --pack $(EMULATED_LIB) > $(GPU_DRY)-nccl.log 2>&1 || \
	    { cat $(GPU_DRY)-nccl.log; exit 1; }
	@cd $(GPU_DRY)/tree && GS_SESSION_DRY=1 GS_BUNDLE=$(CURDIR)/$(GPU_DRY)/bundle \
	    GS_NCCL_BUNDLE=$(CURDIR)/$(GPU_DRY)/nccl \
	    OUT=$(CURDIR)/$(GPU_DRY)/out timeout $(TEST_TIMEOUT) bash scripts/gpu_session.sh all \
	    wire_np1 wire_np2 wire_nccl wire_memcheck wire_bench nccl2 > /dev/null 2>&1; \
	grep -q "the carried NCCL unpacked" $(CURDIR)/$(GPU_DRY)/out/session.log || \
	    { echo "gpu-session-dry: the carried NCCL was not unpacked"; exit 1; }; \
	$(PYTHON) scripts/gpu_summary.py build/gpu-session --expect-pass \
	    build,visible,c_np1,c_np2,pytest_np1,memcheck,initcheck,nccl_shared,probes,wire_np1,wire_np2,wire_nccl,wire_memcheck,nccl_c2,nccl_pytest2$(if $(shell $(PYTHON) -c "import torch" 2>/dev/null && echo y),$(comma)bench$(comma)wire_bench$(comma)nccl_latency$(comma)nccl_allreduce)

comma := ,

# torch's DistributedTest suite on gloo and on gradsync by one harness, at 2-4
# ranks: build/torch-upstream/<backend>-<ranks>.txt list every test's outcome
# (docs/TORCH_BACKEND.md's tables); the counts are printed side by side.
UPSTREAM_NP_LIST ?= 2 3 4
torch-upstream: build
	@mkdir -p build/torch-upstream
	@for n in $(UPSTREAM_NP_LIST); do for b in gloo gradsync; do \
	    rm -f build/torch-upstream/$$b-$$n.txt; \
	    GS_TORCH_UPSTREAM_BACKEND=$$b GS_TORCH_UPSTREAM_REPORT=$(CURDIR)/build/torch-upstream/$$b-$$n.txt \
	        timeout $(TEST_TIMEOUT) $(MPIEXEC) -n $$n $(PYTEST) tests/torch_tests/test_torch_upstream.py \
	        >/dev/null 2>&1; \
	    echo "$$n ranks, $$b: $$(cut -d' ' -f1 build/torch-upstream/$$b-$$n.txt | sort | uniq -c | tr -s ' \n' ' ')"; \
	done; done

# torch's own suite through torch's own harness (TestDistBackend: each test
# starts its ranks, MPI singletons that gradsync joins through file://),
# gradsync and gloo, at each size of UPSTREAM_NP_LIST: every test's outcome
# in build/torch-upstream/spawn-<backend>-<ranks>.txt, the two compared test
# by test (launch/compare.py: fails on a gradsync failure, or a test gloo
# passes that gradsync skips for a reason naming no backend).
# The ranks fork from a server that imported torch's test module once
# (UPSTREAM_SPAWN_START=spawn: torch's own start method, each rank importing
# it afresh, about 7 s a test here instead of 0.2-0.5); UPSTREAM_SPAWN_K
# picks tests (unittest -k patterns, OR-ed; empty: all 285).
UPSTREAM_SPAWN_START ?= forkserver
UPSTREAM_SPAWN_K ?=
torch-upstream-spawn: build
	@mkdir -p build/torch-upstream
	@for n in $(UPSTREAM_NP_LIST); do for b in gloo gradsync; do \
	    r=build/torch-upstream/spawn-$$b-$$n.txt; rm -f $$r; \
	    BACKEND=$$b WORLD_SIZE=$$n GS_SPAWN_START_METHOD=$(UPSTREAM_SPAWN_START) \
	        GS_SPAWN_REPORT=$(CURDIR)/$$r timeout $(TEST_TIMEOUT) $(PYTHON) \
	        tests/torch_tests/launch/dist_suite.py $(UPSTREAM_SPAWN_K) \
	        >build/torch-upstream/spawn-$$b-$$n.log 2>&1; \
	done; \
	echo "== $$n ranks"; $(PYTHON) tests/torch_tests/launch/compare.py \
	    build/torch-upstream/spawn-gloo-$$n.txt build/torch-upstream/spawn-gradsync-$$n.txt \
	    || exit 1; \
	done

# make demo DEMO_ARGS="--backend torch-ddp": DDP on the gradsync torch backend
DEMO_ARGS ?=
demo: build
	timeout $(TEST_TIMEOUT) $(MPIEXEC) -n 4 $(PYTHON) scripts/demo.py $(DEMO_ARGS)

bench: build
	timeout $(TEST_TIMEOUT) $(MPIEXEC) -n 2 $(PYTHON) scripts/gsbench -b 64 -e 64M -f 4 --baseline mpi4py
	timeout $(TEST_TIMEOUT) $(MPIEXEC) -n 2 $(PYTHON) scripts/gsbench --shapes resnet50 --baseline mpi4py
	timeout $(TEST_TIMEOUT) $(MPIEXEC) -n 2 $(PYTHON) scripts/gsbench --collective reduce_scatter_shards --shapes resnet50 --baseline mpi4py
	timeout $(TEST_TIMEOUT) $(MPIEXEC) -n 2 $(PYTHON) scripts/gsbench --collective accumulate -d float16 --shapes resnet50 --baseline mpi4py
	timeout $(TEST_TIMEOUT) $(PYTHON) -m bench.kernels

# The C tests under valgrind (memcheck, leaks included) at 2 ranks.
check-memory: build $(C_TESTS)
	@echo "== pytest tests/leaks at 2 ranks (bytes kept per call, every call kind: issue 34)"
	@timeout $(TEST_TIMEOUT) $(MPIEXEC) -n 2 $(PYTEST) tests/leaks || exit 1
	@for t in $(C_TESTS); do echo "== valgrind $$t"; \
	    timeout $(TEST_TIMEOUT) $(MPIEXEC) -n 2 valgrind -q --error-exitcode=3 \
	        --leak-check=full --errors-for-leak-kinds=definite \
	        --suppressions=tests/c/valgrind.supp $$t || exit 1; done
	@if [ -n "$(NVCC)" ] && [ -n "$(CUDA_INCLUDE)" ]; then \
	    $(MAKE) --no-print-directory $(EMULATED_LIB) && \
	    for t in $(DEVICE_C_TESTS); do echo "== valgrind $$t (emulated CUDA)" && \
	    LD_LIBRARY_PATH=$(CURDIR)/build/emulated timeout $(TEST_TIMEOUT) $(MPIEXEC) -n 2 \
	        valgrind -q --error-exitcode=3 --leak-check=full --errors-for-leak-kinds=definite \
	        --suppressions=tests/c/valgrind.supp $$t || exit 1; done; fi

# Fuzzing the C API's argument checks (tests/fuzz/fuzz_args.c; findings in
# docs/RELIABILITY.md): libFuzzer with ASan and UBSan for FUZZ_SECONDS in one
# process (a 1-rank communicator), seeded from tests/fuzz/corpus, new inputs
# kept in build/fuzz/corpus, a crashing input left as build/fuzz/crash-*.
# clang comes from Debian when missing. Without libFuzzer the same harness is
# built with gcc's ASan and UBSan and fed FUZZ_RUNS pseudo-random inputs.
# FUZZ_KNOWN=avoid steps around the known findings listed in RELIABILITY.md.
FUZZ_SECONDS ?= 60
FUZZ_RUNS ?= 200000
FUZZ_KNOWN ?=
FUZZ_MPI = $(wordlist 2,1000,$(shell $(MPICC_RESOLVED) -show))
FUZZ_CFLAGS = -g -O1 -std=gnu11 -ffp-contract=off -Wno-unknown-pragmas \
    -Wno-implicit-function-declaration '-D__builtin_cpu_supports(f)=gs_fuzz_cpu_supports(f)' \
    -DGS_BUILDING_LIBRARY $(LIB_INCLUDES) $(if $(FUZZ_KNOWN),-DGS_FUZZ_AVOID_KNOWN)
FUZZ_ENV = LSAN_OPTIONS=suppressions=$(CURDIR)/tests/fuzz/lsan.supp \
    UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1$(if $(FUZZ_KNOWN),:suppressions=$(CURDIR)/tests/fuzz/known_ubsan.supp)

fuzz: deps
	@command -v clang >/dev/null 2>&1 || { echo "== fuzz: installing clang (Debian)"; \
	    apt-get install -y -q clang >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null && apt-get install -y -q clang >/dev/null; }; } || true
	@mkdir -p build/fuzz/corpus
	@if printf 'int LLVMFuzzerTestOneInput(const char *d, long n) { return 0; }\n' | \
	    clang -x c - -fsanitize=fuzzer -o build/fuzz/probe >/dev/null 2>&1; then \
	  echo "== fuzz: libFuzzer + ASan + UBSan for $(FUZZ_SECONDS) s"; \
	  clang $(FUZZ_CFLAGS) -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
	      -fsanitize-recover=pointer-overflow -o build/fuzz/fuzz_args tests/fuzz/fuzz_args.c \
	      $(LIB_SOURCES) $(FUZZ_MPI) -ldl -lpthread -lm || exit 1; \
	  $(FUZZ_ENV) timeout $$(( $(FUZZ_SECONDS) + 600 )) build/fuzz/fuzz_args \
	      -max_total_time=$(FUZZ_SECONDS) -timeout=30 -rss_limit_mb=4096 -print_final_stats=1 \
	      -artifact_prefix=build/fuzz/ build/fuzz/corpus tests/fuzz/corpus; \
	else \
	  echo "== fuzz: no libFuzzer: $(FUZZ_RUNS) pseudo-random inputs under gcc's ASan + UBSan"; \
	  gcc $(FUZZ_CFLAGS) -DGS_FUZZ_STANDALONE -fsanitize=address,undefined \
	      -fno-sanitize-recover=all -fsanitize-recover=pointer-overflow \
	      -o build/fuzz/fuzz_args_standalone tests/fuzz/fuzz_args.c $(LIB_SOURCES) \
	      $(FUZZ_MPI) -ldl -lpthread -lm || exit 1; \
	  $(FUZZ_ENV) GS_FUZZ_RUNS=$(FUZZ_RUNS) timeout 3600 build/fuzz/fuzz_args_standalone \
	      tests/fuzz/corpus/*; \
	fi

# Load and memory soak (scripts/soak.py; not part of `make test`): SOAK_NP
# ranks, SOAK_SECONDS of mixed operations at random sizes, plus 100k small
# fused allreduces and 1k ResNet-50 lists (SOAK_ARGS to change them), every
# result checked, resident memory after warm-up and at the end.
SOAK_SECONDS ?= 600
SOAK_NP ?= 4
SOAK_ARGS ?=
soak: build
	timeout $$(( $(SOAK_SECONDS) + 3600 )) $(MPIEXEC) -n $(SOAK_NP) $(PYTHON) scripts/soak.py \
	    --seconds $(SOAK_SECONDS) $(SOAK_ARGS)

# The library and the C tests built with gcc's AddressSanitizer (LeakSanitizer
# included) and UBSan, run at 2 ranks (the tests' own misaligned sub-buffers
# are exempt from the alignment check; the library is not); then a short soak in Python with that
# library and libasan preloaded (leaks reported only when a stack passes
# through gradsync: CPython and MPI keep memory until exit by design).
ASAN_FLAGS = -g -O1 -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all
ASAN_ENV = ASAN_OPTIONS=detect_leaks=1 LSAN_OPTIONS=suppressions=$(CURDIR)/tests/fuzz/lsan.supp \
    UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:suppressions=$(CURDIR)/tests/fuzz/known_ubsan.supp
check-asan: build
	@mkdir -p build/asan/bin
	$(MPICC_RESOLVED) $(ASAN_FLAGS) -fsanitize-recover=pointer-overflow $(LIB_CFLAGS) \
	    -shared -o build/asan/libgradsync.so $(LIB_SOURCES) $(LIB_LIBS)
	@for t in $(C_TESTS) $(C_EXAMPLES); do b=build/asan/bin/$$(basename $$t); \
	    $(MPICC_RESOLVED) $(ASAN_FLAGS) -fno-sanitize=alignment -std=gnu11 $(LIB_INCLUDES) -Itests/c \
	        -o $$b tests/c/$$(basename $$t).c \
	        -Lbuild/asan -lgradsync -Wl,-rpath,$(CURDIR)/build/asan -lm || exit 1; \
	    echo "== ASan $$b at 2 ranks"; \
	    $(ASAN_ENV) timeout $(TEST_TIMEOUT) $(MPIEXEC) -n 2 $$b >/dev/null || exit 1; done
	@echo "== ASan: scripts/soak.py at 2 ranks (30 s, 20k small allreduces, 20 ResNet-50 lists)"
	@rm -f build/asan/py.*
	timeout $(TEST_TIMEOUT) $(MPIEXEC) -n 2 \
	    -genv LD_PRELOAD $$($(MPICC_RESOLVED) -print-file-name=libasan.so) \
	    -genv LD_LIBRARY_PATH $(CURDIR)/build/asan \
	    -genv ASAN_OPTIONS detect_leaks=1:log_path=$(CURDIR)/build/asan/py \
	    -genv LSAN_OPTIONS exitcode=0:suppressions=$(CURDIR)/tests/fuzz/lsan.supp \
	    -genv UBSAN_OPTIONS halt_on_error=1:print_stacktrace=1:suppressions=$(CURDIR)/tests/fuzz/known_ubsan.supp \
	    $$($(PYTHON) -c 'import sys; print(sys.executable)') scripts/soak.py --seconds 30 \
	    --small 20000 --resnet 20 --max-log2 18 --rss-bound-mb 1000000
	$(PYTHON) scripts/asan_report.py build/asan/py.*

# ---- make install: gradsync for C and C++ programs (docs/GUIDE.md, "Embedding gradsync")
# Into PREFIX (staged under DESTDIR when set): include/*.h, the library
# lib/libgradsync.so.MAJOR.MINOR.PATCH with SONAME libgradsync.so.MAJOR and
# the links libgradsync.so.MAJOR and libgradsync.so, lib/pkgconfig/gradsync.pc
# and the CMake package lib/cmake/gradsync (target gradsync::gradsync). The
# library is the in-place build's objects relinked there with that SONAME
# (scripts/install/gs_install.py); the in-place and wheel libraries keep
# SONAME libgradsync.so (docs/decisions/build.md, "Installing for C and C++").
PREFIX ?= /usr/local
# The version, read from include/gs_export.h only ("." matches the "#" that
# make would take for a comment).
gs_version_part = $(shell sed -n 's/^.define GS_VERSION_$(1)  *\([0-9][0-9]*\) *$$/\1/p' include/gs_export.h)
GS_VERSION_MAJOR := $(call gs_version_part,MAJOR)
GS_VERSION_MINOR := $(call gs_version_part,MINOR)
GS_VERSION_PATCH := $(call gs_version_part,PATCH)
GS_VERSION := $(GS_VERSION_MAJOR).$(GS_VERSION_MINOR).$(GS_VERSION_PATCH)
INSTALL_ROOT = $(DESTDIR)$(abspath $(PREFIX))
INSTALL_CMAKE = $(INSTALL_ROOT)/lib/cmake/gradsync

.PHONY: install uninstall embed-test
install: build
	@[ -n "$(GS_VERSION_MAJOR)" ] && [ -n "$(GS_VERSION_MINOR)" ] && [ -n "$(GS_VERSION_PATCH)" ] || \
	    { echo "make install: include/gs_export.h has no GS_VERSION_MAJOR/MINOR/PATCH"; exit 1; }
	install -d $(INSTALL_ROOT)/include $(INSTALL_ROOT)/lib
	install -m 644 include/*.h $(INSTALL_ROOT)/include/
	$(PYTHON) scripts/install/gs_install.py link -o $(INSTALL_ROOT)/lib/libgradsync.so.$(GS_VERSION) \
	    --soname libgradsync.so.$(GS_VERSION_MAJOR)
	ln -sfn libgradsync.so.$(GS_VERSION) $(INSTALL_ROOT)/lib/libgradsync.so.$(GS_VERSION_MAJOR)
	ln -sfn libgradsync.so.$(GS_VERSION_MAJOR) $(INSTALL_ROOT)/lib/libgradsync.so
	$(PYTHON) scripts/install/gs_install.py configure --prefix $(abspath $(PREFIX)) \
	    --version $(GS_VERSION) --destroot $(INSTALL_ROOT)

uninstall:
	rm -f $(addprefix $(INSTALL_ROOT)/include/,$(notdir $(wildcard include/*.h))) \
	    $(INSTALL_ROOT)/lib/libgradsync.so $(INSTALL_ROOT)/lib/libgradsync.so.$(GS_VERSION_MAJOR) \
	    $(INSTALL_ROOT)/lib/libgradsync.so.$(GS_VERSION) $(INSTALL_ROOT)/lib/pkgconfig/gradsync.pc \
	    $(INSTALL_CMAKE)/gradsyncConfig.cmake $(INSTALL_CMAKE)/gradsyncConfigVersion.cmake
	@rmdir $(INSTALL_CMAKE) 2>/dev/null || true

# Part of `make test`: a C program built with pkg-config and one built with
# CMake against `make install PREFIX=build/embed-prefix`, and a Cython
# extension cimporting gradsync's .pxd files built against the in-place
# package, each run at 2 ranks (tests/embed). The prefix is removed after,
# also on failure.
EMBED_PREFIX := $(CURDIR)/build/embed-prefix
embed-test: build
	@rm -rf $(EMBED_PREFIX); \
	$(MAKE) --no-print-directory install PREFIX=$(EMBED_PREFIX) DESTDIR= >$(EMBED_PREFIX).log 2>&1 || \
	    { cat $(EMBED_PREFIX).log; rm -rf $(EMBED_PREFIX) $(EMBED_PREFIX).log; exit 1; }; \
	rm -f $(EMBED_PREFIX).log; echo "== pytest tests/embed (installed into $(EMBED_PREFIX))"; \
	GS_EMBED_PREFIX=$(EMBED_PREFIX) MPIEXEC=$(MPIEXEC) MPICC=$(MPICC_RESOLVED) \
	    timeout $(TEST_TIMEOUT) $(MPIEXEC) -n 1 $(PYTEST) tests/embed; \
	rc=$$?; rm -rf $(EMBED_PREFIX); exit $$rc

clean:
	rm -rf build tests/c/bin pyx/gradsync/*.so pyx/gradsync/jax/*.so pyx/gradsync/jax/.gradsync-build pyx/gradsync/_core.c pyx/*.egg-info *.egg-info

# Frameworks on the gradsync backend (issue 46 item 3; docs/TORCH_BACKEND.md
# "Frameworks"): installs the tested versions into $(PYTHON) (torch pinned so
# pip keeps the installed one) and runs each recipe at 2 ranks against gloo.
FRAMEWORK_PINS = lightning==2.6.6 transformers==5.24.0 accelerate==1.15.0 deepspeed==0.19.8
.PHONY: framework-test
# The slow tiers make test leaves out, so that it stays near 20 minutes on
# two cores (README): torch's suite through its harness, the tests marked
# `extended` (whole jobs that another tier of make test covers), the
# framework recipes (installs Lightning, transformers, accelerate,
# DeepSpeed), and the installed tier in a venv with nothing in it.
test-extended: build
	@echo "== torch's suite through its harness at 2, 3 and 4 ranks"
	@GS_TORCH_SUITE_SIZES="2 3 4" timeout $$(( 3 * $(TEST_TIMEOUT) )) $(MPIEXEC) -n 1 $(PYTEST) \
	    tests/torch_tests/test_launch.py -k suite_through_its_harness
	@echo "== the tests marked extended (tests/conftest.py), at 1 rank"
	@GS_EXTENDED_TESTS=1 timeout $(TEST_TIMEOUT) $(MPIEXEC) -n 1 $(PYTEST) -m extended \
	    tests/python tests/torch_tests tests/horovod_tests tests/jax_tests
	@for n in $(ADASUM_EXTENDED_NP_LIST); do \
	    echo "== pytest tests/python/test_adasum.py at $$n ranks"; \
	    timeout $(TEST_TIMEOUT) $(MPIEXEC) -n $$n $(PYTEST) tests/python/test_adasum.py \
	        tests/python/test_adasum_hierarchical.py || exit 1; \
	done
	@$(MAKE) --no-print-directory framework-test check-install

framework-test:
	DS_BUILD_OPS=0 $(PYTHON) -m pip install -q $(FRAMEWORK_PINS) \
	    "torch==$$($(PYTHON) -c 'import torch; print(torch.__version__.split("+")[0])')"
	PYTHONPATH=pyx timeout 2400 $(PYTHON) -m pytest -q -p no:cacheprovider tests/framework_tests \
	    tests/torch_tests/test_init_helper.py
