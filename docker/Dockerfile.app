# syntax=docker/dockerfile:1
# SAGE Studio app image (CPU): the Prefect server, the MLflow server (+ Postgres driver), the flows and the
# Streamlit dashboard. Compose runs each as its own service from this one image. Build from the repository root:
#   docker build -f docker/Dockerfile.app -t sage-studio-app:0.1.0 .
FROM python:3.11.11-slim-bookworm

# CPU-only torch for the flows and the tiny-cpu preset (the default PyPI wheel for Linux carries CUDA libraries).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

# DL3064 is a false positive on TOKENIZERS_PARALLELISM (a name with TOKEN in it, no secret).
# hadolint ignore=DL3064
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TOKENIZERS_PARALLELISM=false \
    HF_HUB_DISABLE_TELEMETRY=1 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false \
    SAGE_HOME=/data/sage \
    SAGE_ACCELERATE_CONFIG_DIR=/app/configs/accelerate

RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /app
COPY pyproject.toml README.md prefect.yaml ./
COPY sage_core ./sage_core
COPY flows ./flows
COPY dashboards ./dashboards
COPY configs ./configs
# The package with its `app` extra (Prefect, Streamlit): the base dependencies alone are the trainer ranks'.
# `.[app]` is this package, not a PyPI name to pin (DL3013).
# hadolint ignore=DL3013
RUN pip install ".[app]" "psycopg2-binary==2.9.10" \
    && python -c "import sage_core.cli, flows, prefect, mlflow, streamlit, psycopg2, asyncpg"

RUN useradd --create-home --uid 1000 sage \
    && mkdir -p /data/sage /data/prefect /mlartifacts \
    && chown -R sage:sage /data /mlartifacts /app
USER 1000:1000

EXPOSE 8501
HEALTHCHECK --interval=30s --timeout=10s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8501/_stcore/health', timeout=5)"]

CMD ["streamlit", "run", "dashboards/app.py", "--server.address", "0.0.0.0", "--server.port", "8501", \
     "--server.headless", "true", "--client.toolbarMode", "viewer", \
     "--global.disableWidgetStateDuplicationWarning", "true"]
