# make help: list targets. Every target creates .venv (pinned requirements.txt) first if needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat requirements.txt pyproject.toml | sha1sum | cut -c1-12)
ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help venv train test test-full test-gpu apex bench-gpu bench-decode chaos lint format bench bench-overhead bench-straggler bench-dgc bench-dgc-accuracy bench-localsgd bench-gossip bench-diloco bench-network bench-nodes bench-faults bench-soak bench-tta bench-membership bench-peers peers clean

help: ## list targets
	@grep -hE '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  make %-16s %s\n", $$1, $$2}'

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	PYTHONWARNINGS=ignore $(PY) -m pip install --quiet --no-deps --no-build-isolation --editable .
	rm -f $(VENV)/.installed-* && touch $@

venv: $(STAMP) ## create .venv with the pinned dependencies

PEERS_STAMP := $(VENV)/.peers-$(shell sha1sum requirements-peers.txt | cut -c1-12)
$(PEERS_STAMP): $(STAMP) requirements-peers.txt
	$(PY) -m pip install --quiet -r requirements-peers.txt
	rm -f $(VENV)/.peers-* && touch $@

peers: $(PEERS_STAMP) ## install the peers extra (torchft) into .venv: what bench-peers compares with

train: $(STAMP) ## train ResNet-50 on digits with 2 processes (W&B offline); extra overrides: ARGS="..."
	$(PY) train.py $(ARGS)

test: $(STAMP) ## run the test suite (CPU, gloo; what CI runs, ~15 min on 2 cores, 12-19 by the load)
	$(PY) -m pytest -q -m "not full" --durations=30 $(ARGS)

test-full: $(STAMP) ## the test suite plus the slow tests marked full (each names its cover in make test)
	$(PY) -m pytest -q $(ARGS)

test-gpu: $(STAMP) ## on a GPU machine: the CUDA tests, and the fault tests on NCCL (one GPU per node; skips what needs more)
	RELAXSYNC_TEST_GPU=1 $(PY) -m pytest -q -m "" tests/test_gpu.py tests/test_device.py tests/test_faults.py $(ARGS)

APEX_SRC ?=
apex: $(STAMP) ## install NVIDIA apex 25.04 (Python-only, for amp=apex) from a source dir or tarball: APEX_SRC=path
	@test -n "$(APEX_SRC)" || { echo "make apex: set APEX_SRC to NVIDIA apex 25.04's source (a directory or a .tar.gz)"; exit 2; }
	$(PY) scripts/install_apex.py "$(APEX_SRC)"

SEED ?= 0
N ?=
ONLY ?=
JOBS ?= 1
STORE ?=
chaos: $(STAMP) ## (~80 min) every sync option x phase x kill/hang of any of 3-4 torchrun nodes (store on etcd); SEED= N= ONLY= JOBS= STORE=
	$(PY) -m tests._chaos --seed $(SEED) $(if $(N),--n $(N)) $(if $(ONLY),--only $(ONLY)) --jobs $(JOBS) $(if $(STORE),--store $(STORE))

lint: $(STAMP) ## ruff check + format check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP) ## ruff format + autofix
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: bench-decode bench-overhead bench-straggler bench-dgc bench-dgc-accuracy bench-localsgd bench-gossip bench-diloco bench-network bench-nodes bench-faults bench-soak bench-tta bench-membership bench-peers ## run every benchmark (results: docs/benchmarks/)

bench-gpu: $(STAMP) ## on a GPU: train.py vs a plain torch loop (img/s), the loader's rate, NCCL recoveries (--smoke: CPU)
	$(PY) -m bench.gpu $(ARGS)

bench-decode: $(STAMP) ## image files into batches: our CPU decode vs a plain torchvision DataLoader (per core); on a GPU, nvJPEG's path
	$(PY) -m bench.decode $(ARGS)

bench-overhead: $(STAMP) ## our allreduce loop vs a plain torch DDP loop (samples/s ratio)
	$(PY) -m bench.overhead $(ARGS)

bench-straggler: $(STAMP) ## allreduce vs relaxed sync with one rank slowed 3x, and a healthy 2-process run
	$(PY) -m bench.straggler $(ARGS)

bench-dgc: $(STAMP) ## DGC on ResNet-50: bytes per step vs allreduce, compression time vs forward+backward
	$(PY) -m bench.dgc $(ARGS)

bench-dgc-accuracy: $(STAMP) ## DGC (with warm-up) vs allreduce top-1 on digits, ResNet-18, 2 processes
	$(PY) -m bench.dgc_accuracy $(ARGS)

bench-localsgd: $(STAMP) ## local SGD k = 1..16 and adaptive: samples/s, bytes/step, top-1 side by side
	$(PY) -m bench.localsgd $(ARGS)

bench-gossip: $(STAMP) ## allreduce vs SGP vs crossover (coarse, fine, hierarchical), 4 processes
	$(PY) -m bench.gossip $(ARGS)

bench-diloco: $(STAMP) ## DiLoCo (H sweep) and streaming DiLoCo vs allreduce and local SGD top-1, 2 and 4 processes
	$(PY) -m bench.diloco $(ARGS)

bench-network: $(STAMP) ## every algorithm on emulated slow links, multi-node torchrun (root; ~25 min)
	$(PY) -m bench.network $(ARGS)

bench-nodes: $(STAMP) ## (root) nodes of 2 processes: bytes on each node's link, sync.scope=node vs process vs 1 per node
	$(PY) -m bench.nodes $(ARGS)

bench-faults: $(STAMP) ## (root) a dead node, a hung one, SIGTERM, a node joining, vs torchrun's restart: recovery s, lost steps
	$(PY) -m bench.faults $(ARGS)

bench-soak: $(STAMP) ## (~70 min) failures that keep coming (kill, hang, a join in each one's place) until 1000 are survived
	$(PY) -m bench.soak $(ARGS)

bench-tta: $(STAMP) ## (root) time to a target top-1 per sync option on slow and uneven emulated clusters (~34 min)
	$(PY) -m bench.tta $(ARGS)

bench-membership: $(STAMP) ## the failure agreement simulated at 64, 256, 1024 ranks on one store: agreement s, store calls/s
	$(PY) -m bench.membership $(ARGS)

bench-peers: $(PEERS_STAMP) ## (root) ours beside torchft and torch's own averagers, same job, emulated links
	$(PY) -m bench.peers $(ARGS)

clean: ## remove run outputs (keeps .venv)
	rm -rf outputs multirun .pytest_cache
