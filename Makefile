# hpctrain: the two commands of the README, and what they stand on.
#
#   make demo    train the digits example on 2 ranks; prints the run directory
#   make test    run the whole test suite (unit, real mpirun, real Slurm, end-to-end)
#   make test-quick   unit tests and one smoke test per layer under mpirun -n 2 (about 2 minutes)
#   make coverage     the whole suite with line coverage of every process, ranks included
#   make setup   build the stack into .venv (idempotent; both targets above call it)
#   make bench   benchmarks (communication, training step, checkpoint I/O)
#   make bench-ettr   training under random rank kills: ETTR against uninterrupted runs before, between and after (~40 minutes)
#   make install PREFIX=/opt/hpctrain/<version> [MODULEFILES=DIR]
#                one installation for every user of a cluster, with a modulefile
#                (scripts/install.sh; MODULEFILES defaults to $(PREFIX)/modulefiles)

VENV ?= .venv
PY := $(VENV)/bin/python
NP ?= 2
# Open MPI refuses root and more ranks than cores unless told; these are for this
# project's own runs (tests, demo), never set by the library.
MPIRUN ?= mpirun --oversubscribe $(if $(filter 0,$(shell id -u)),--allow-run-as-root,)
PYTEST_ARGS ?=

.PHONY: setup install demo test test-quick coverage bench bench-ettr doctor clean

setup:
	@bash scripts/setup.sh

install:
	@PREFIX="$(PREFIX)" $(if $(MODULEFILES),MODULEFILES="$(MODULEFILES)") bash scripts/install.sh

doctor: setup
	@$(VENV)/bin/hpctrain doctor

demo: setup
	@bash scripts/demo.sh

test: setup
	@bash scripts/test.sh $(PYTEST_ARGS)

# The inner loop (docs/testing.md): what needs no cluster and no long run, in one process.
test-quick: setup
	@OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q -m "smoke or not (mpi or slurm or multinode or gpu or slow)" $(PYTEST_ARGS)

coverage: setup
	@bash scripts/coverage.sh -n 2 --dist loadgroup $(PYTEST_ARGS)

bench: setup
	@bash scripts/bench.sh

bench-ettr: setup
	@OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) benchmarks/ettr.py $(ETTR_ARGS)

clean:
	rm -rf runs bench-results .pytest_cache coverage
