# syntax=docker/dockerfile:1.7
# One Tollgate engine replica on NVIDIA GPUs.
#
#   docker build -f infra/docker/backend-cuda.Dockerfile -t tollgate-backend-cuda .
#   docker run --gpus all -e TOLLGATE_BACKEND_SECRET=... -p 9000:9000 tollgate-backend-cuda
#
# Base: NVIDIA's CUDA runtime image (no compiler, no CUDA toolkit). torch's CUDA wheels
# bring their own CUDA libraries; the base supplies the driver-compatible runtime and the
# container toolkit's hooks. The built-in model ships in the wheel; point TOLLGATE_MODEL
# at a mounted checkpoint folder for a real one.

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# --- build: python, the wheel and its dependencies in a virtual environment ---------------
FROM ${CUDA_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
RUN python3 -m venv /opt/tollgate
COPY pyproject.toml README.md ./
COPY gateway gateway
COPY backend backend
COPY tenants tenants
COPY migrations migrations
COPY web web
# PyPI's torch for Linux x86_64 is the CUDA build. pip and setuptools leave afterwards.
RUN /opt/tollgate/bin/pip wheel --no-deps --wheel-dir /wheels . \
 && /opt/tollgate/bin/pip install /wheels/tollgate-*.whl \
 && /opt/tollgate/bin/pip uninstall -y pip setuptools wheel \
 && find /opt/tollgate -name '__pycache__' -prune -exec rm -rf {} +

# --- runtime: the CUDA runtime, python, the environment; an unprivileged user -------------
FROM ${CUDA_IMAGE} AS backend
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 tollgate \
 && useradd --system --uid 10001 --gid tollgate --home-dir /var/lib/tollgate \
        --create-home --shell /usr/sbin/nologin tollgate
COPY --from=build /opt/tollgate /opt/tollgate
ENV PATH=/opt/tollgate/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    TOLLGATE_DATA_DIR=/var/lib/tollgate \
    TOLLGATE_LOG_FORMAT=json \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
WORKDIR /var/lib/tollgate
USER 10001:10001
EXPOSE 9000
# Model loading onto the GPU takes a while: a long start period before failures count.
HEALTHCHECK --interval=10s --timeout=3s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9000/healthz', timeout=2)"]
ENTRYPOINT ["tollgate"]
CMD ["backend", "serve", "--host", "0.0.0.0", "--port", "9000"]
