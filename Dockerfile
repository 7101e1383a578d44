# agentstream services, two images from one file:
#   docker build --target services -t agentstream:services .   # gateway, streams, controller (no torch)
#   docker build --target trainer  -t agentstream:trainer  .   # trainer (torch, transformers, verl)
# Dependencies come from uv.lock, so an image has exactly the versions the tests ran with.

FROM python:3.11-slim AS base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy UV_PROJECT_ENVIRONMENT=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN pip install --no-cache-dir uv==0.13.9
WORKDIR /app

# --- build stages: resolve the locked environment first (cached while only code changes) ---------

FROM base AS build-services
COPY pyproject.toml uv.lock README.md ./
RUN uv sync --frozen --no-dev --no-install-project --extra kubernetes
COPY schemas ./schemas
COPY gateway ./gateway
COPY streams ./streams
COPY controller ./controller
COPY trainer ./trainer
COPY agentstream ./agentstream
COPY examples ./examples
RUN uv sync --frozen --no-dev --no-editable --extra kubernetes

FROM build-services AS build-trainer
RUN uv sync --frozen --no-dev --no-editable --extra kubernetes --extra train

# --- runtime stages: the environment and the examples, no build tools ------------------------

FROM python:3.11-slim AS services
ENV PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH
RUN useradd --create-home --uid 10001 agentstream
COPY --from=build-services /opt/venv /opt/venv
COPY --from=build-services /app/examples /app/examples
WORKDIR /app
USER agentstream
# each compose service names its own command: python -m gateway | streams worker | controller
CMD ["agentstream", "--help"]

FROM python:3.11-slim AS trainer
ENV PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH
RUN useradd --create-home --uid 10001 agentstream
COPY --from=build-trainer /opt/venv /opt/venv
WORKDIR /app
USER agentstream
CMD ["python", "-m", "trainer"]
