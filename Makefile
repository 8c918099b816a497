# gradsync: `make demo` trains a model over 4 local ranks; `make test` runs
# every test. Both install what they need into the Python they run with.

PYTHON ?= python3
NP_LIST ?= 1 2 3 4
# Adasum's fold-in paths differ for every rank count: its tests also run here.
ADASUM_NP_LIST ?= 5 6 7 8
# Partitions with fixed worker counts (the 2x3 table, DistDL's 12 workers).
PARTITION_NP_LIST ?= 6 12
TEST_TIMEOUT ?= 900
SCRIPTS_DIR := $(shell $(PYTHON) -c "import sysconfig; print(sysconfig.get_path('scripts'))" 2>/dev/null)
# mpiexec of the MPI we build with: next to $MPICC, else on PATH, else the wheel's.
MPIEXEC ?= $(or $(if $(MPICC),$(wildcard $(dir $(MPICC))mpiexec)),$(shell command -v mpiexec 2>/dev/null),$(SCRIPTS_DIR)/mpiexec)
MPICC_RESOLVED = $(or $(MPICC),$(shell command -v mpicc 2>/dev/null),$(SCRIPTS_DIR)/mpicc)
export PYTHONPATH := $(CURDIR)/pyx$(if $(PYTHONPATH),:$(PYTHONPATH))
export PYTHON

LIB := pyx/gradsync/libgradsync.so
C_TESTS := $(patsubst tests/c/%.c,tests/c/bin/%,$(wildcard tests/c/test_*.c))
C_EXAMPLES := $(patsubst tests/c/%.c,tests/c/bin/%,$(wildcard tests/c/example_*.c))
PYTEST = $(PYTHON) -m mpi4py -m pytest --with-mpi -q -p no:cacheprovider

.PHONY: all deps build test c-tests py-tests test-emulated gpu-test demo bench check-memory clean

all: build

deps:
	@sh scripts/install_deps.sh

build: deps
	$(PYTHON) setup.py -q build_ext --inplace
	@$(PYTHON) -c "import gradsync" || { echo "gradsync: the built package does not import"; exit 1; }

tests/c/bin/%: tests/c/%.c $(LIB) tests/c/gs_test.h
	@mkdir -p tests/c/bin
	$(MPICC_RESOLVED) -O2 -g -std=gnu11 -Wall -Wextra -Iinclude -Itests/c -o $@ $< \
	    -Lpyx/gradsync -lgradsync -Wl,-rpath,$(CURDIR)/pyx/gradsync -lm

c-tests: build $(C_TESTS) $(C_EXAMPLES)
	@for n in $(NP_LIST); do for t in $(C_TESTS) $(C_EXAMPLES); do \
	    echo "== $$t at $$n ranks"; \
	    timeout $(TEST_TIMEOUT) $(MPIEXEC) -n $$n $$t || exit 1; \
	done; done

py-tests: build
	@for n in $(NP_LIST); do \
	    echo "== pytest at $$n ranks"; \
	    timeout $(TEST_TIMEOUT) $(MPIEXEC) -n $$n $(PYTEST) tests/python || exit 1; \
	done
	@for n in $(ADASUM_NP_LIST); do \
	    echo "== pytest tests/python/test_adasum.py at $$n ranks"; \
	    timeout $(TEST_TIMEOUT) $(MPIEXEC) -n $$n $(PYTEST) tests/python/test_adasum.py \
	        tests/python/test_adasum_hierarchical.py || exit 1; \
	done
	@for n in $(PARTITION_NP_LIST); do \
	    echo "== pytest tests/python/test_partition.py at $$n ranks"; \
	    timeout $(TEST_TIMEOUT) $(MPIEXEC) -n $$n $(PYTEST) tests/python/test_partition.py || exit 1; \
	done
	@if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
	    for n in $(NP_LIST); do \
	        echo "== pytest tests/torch at $$n ranks"; \
	        timeout $(TEST_TIMEOUT) $(MPIEXEC) -n $$n $(PYTEST) tests/torch || exit 1; \
	    done; \
	else echo "== tests/torch skipped: torch is not importable by $(PYTHON) (pip install torch)"; fi

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
$(CPU_ONLY_LIB): $(wildcard src/*.c src/*.h include/*.h)
	@mkdir -p build/cpu-only
	$(MPICC_RESOLVED) -O1 -fPIC -std=gnu11 -Wall -Wextra -Wno-unused-parameter -Werror \
	    -fvisibility=hidden -fopenmp -DGS_BUILDING_LIBRARY -Iinclude -Isrc -shared -o $@ \
	    $(wildcard src/*.c) -Wl,-soname,libgradsync.so -Wl,--no-undefined -ldl -lpthread -lm

$(EMULATED_LIB): $(wildcard src/*.c src/*.h include/*.h) tests/emulated_cuda/cuda_emulation.c
	@mkdir -p build/emulated
	$(MPICC_RESOLVED) -O1 -g -fPIC -std=gnu11 -Wall -Wextra -Wno-unused-parameter \
	    -fvisibility=hidden -ffp-contract=off -fopenmp -DGS_BUILDING_LIBRARY -DGS_HAVE_CUDA \
	    -DGS_CUDA_ARCHS='"emulated"' -I$(CUDA_INCLUDE) -Iinclude -Isrc -shared -o $@ \
	    $(wildcard src/*.c) tests/emulated_cuda/cuda_emulation.c -Wl,-soname,libgradsync.so \
	    -Wl,--no-undefined -ldl -lpthread -lm

test-emulated: build tests/c/bin/test_device_paths $(CPU_ONLY_LIB)
	@if [ -z "$(NVCC)" ] || [ -z "$(CUDA_INCLUDE)" ]; then \
	    echo "== test-emulated: no CUDA toolkit, skipped"; exit 0; fi; \
	$(MAKE) --no-print-directory $(EMULATED_LIB) && \
	echo "== pytest test_comm.py test_dlpack.py on the CPU-only library" && \
	LD_LIBRARY_PATH=$(CURDIR)/build/cpu-only timeout $(TEST_TIMEOUT) $(MPIEXEC) -n 2 \
	    $(PYTEST) tests/python/test_comm.py tests/python/test_dlpack.py || exit 1; \
	for n in $(NP_LIST); do \
	    echo "== tests/c/bin/test_device_paths at $$n ranks (emulated CUDA)"; \
	    LD_LIBRARY_PATH=$(CURDIR)/build/emulated timeout $(TEST_TIMEOUT) $(MPIEXEC) -n $$n \
	        tests/c/bin/test_device_paths || exit 1; \
	    if [ $$n = 2 ]; then \
	    echo "== tests/c/bin/test_device_paths at 2 ranks (emulated CUDA, CUDA-aware MPI path)"; \
	    GRADSYNC_CUDA_AWARE_MPI=1 LD_LIBRARY_PATH=$(CURDIR)/build/emulated timeout $(TEST_TIMEOUT) \
	        $(MPIEXEC) -n 2 tests/c/bin/test_device_paths || exit 1; fi; \
	    echo "== pytest tests/gpu tests/python/test_dlpack.py at $$n ranks (emulated CUDA)"; \
	    LD_LIBRARY_PATH=$(CURDIR)/build/emulated timeout $(TEST_TIMEOUT) $(MPIEXEC) -n $$n \
	        $(PYTEST) tests/gpu tests/python/test_dlpack.py || exit 1; \
	done

test: c-tests py-tests test-emulated

# On a machine with a GPU: the device C test on the real runtime, the GPU
# pytest suite at 1 rank (NCCL) and at GPU_NP ranks sharing the GPU (staged
# MPI), then the figures for docs/GPU.md. Skipped cleanly without a GPU.
GPU_NP ?= 2
gpu-test: build tests/c/bin/test_device_paths
	@if ! $(PYTHON) -c "import gradsync as g, sys; sys.exit(0 if g.build_info()['cuda_devices'] else 1)"; then \
	    echo "== gpu-test: no CUDA device visible, skipped"; exit 0; fi; \
	for n in 1 $(GPU_NP); do \
	    echo "== tests/c/bin/test_device_paths at $$n ranks (CUDA)"; \
	    timeout $(TEST_TIMEOUT) $(MPIEXEC) -n $$n tests/c/bin/test_device_paths || exit 1; \
	    echo "== pytest tests/gpu at $$n ranks"; \
	    timeout $(TEST_TIMEOUT) $(MPIEXEC) -n $$n $(PYTEST) tests/gpu || exit 1; \
	done; \
	echo "== scripts/bench_gpu.py"; \
	timeout $(TEST_TIMEOUT) $(MPIEXEC) -n 1 $(PYTHON) scripts/bench_gpu.py --json gpu-bench.json

demo: build
	timeout $(TEST_TIMEOUT) $(MPIEXEC) -n 4 $(PYTHON) scripts/demo.py

bench: build
	timeout $(TEST_TIMEOUT) $(MPIEXEC) -n 2 $(PYTHON) scripts/gsbench -b 64 -e 64M -f 4 --baseline mpi4py
	timeout $(TEST_TIMEOUT) $(MPIEXEC) -n 2 $(PYTHON) scripts/gsbench --shapes resnet50 --baseline mpi4py
	timeout $(TEST_TIMEOUT) $(MPIEXEC) -n 2 $(PYTHON) scripts/gsbench --collective reduce_scatter_shards --shapes resnet50 --baseline mpi4py
	timeout $(TEST_TIMEOUT) $(MPIEXEC) -n 2 $(PYTHON) scripts/gsbench --collective accumulate -d float16 --shapes resnet50 --baseline mpi4py
	timeout $(TEST_TIMEOUT) $(PYTHON) scripts/bench_kernels.py

# The C tests under valgrind (memcheck, leaks included) at 2 ranks.
check-memory: build $(C_TESTS)
	@for t in $(C_TESTS); do echo "== valgrind $$t"; \
	    timeout $(TEST_TIMEOUT) $(MPIEXEC) -n 2 valgrind -q --error-exitcode=3 \
	        --leak-check=full --errors-for-leak-kinds=definite \
	        --suppressions=tests/c/valgrind.supp $$t || exit 1; done
	@if [ -n "$(NVCC)" ] && [ -n "$(CUDA_INCLUDE)" ]; then \
	    $(MAKE) --no-print-directory $(EMULATED_LIB) && \
	    echo "== valgrind tests/c/bin/test_device_paths (emulated CUDA)" && \
	    LD_LIBRARY_PATH=$(CURDIR)/build/emulated timeout $(TEST_TIMEOUT) $(MPIEXEC) -n 2 \
	        valgrind -q --error-exitcode=3 --leak-check=full --errors-for-leak-kinds=definite \
	        --suppressions=tests/c/valgrind.supp tests/c/bin/test_device_paths; fi

clean:
	rm -rf build tests/c/bin pyx/gradsync/*.so pyx/gradsync/_core.c pyx/*.egg-info *.egg-info
