# wm-refiner service image. CPU by default:
#   docker build -t wm-refiner .
# CUDA (any CUDA runtime base; torch wheels from the matching index):
#   docker build -t wm-refiner:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu22.04 \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 --build-arg INSTALL=. .
# INSTALL: what pip installs. `.[cpu]` pins the CPU build of torch; `.` takes the newest torch (>= 2.11) that
# TORCH_INDEX offers for that CUDA.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG INSTALL=".[cpu]"
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DEBIAN_FRONTEND=noninteractive

# CUDA base images ship no Python 3.11; the slim Python image already has it. Either way the project lives in
# a virtualenv so the system Python stays untouched.
RUN if ! command -v python3.11 >/dev/null 2>&1; then \
        apt-get update \
        && apt-get install -y --no-install-recommends software-properties-common \
        && add-apt-repository -y ppa:deadsnakes/ppa \
        && apt-get install -y --no-install-recommends python3.11 python3.11-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

RUN useradd --create-home --uid 1000 app && mkdir -p /cache /models /snapshots && chown app /cache /snapshots
WORKDIR /srv/wm-refiner

# Dependencies first (cached while only the code changes), then the code; the README's install command.
COPY pyproject.toml README.md ./
COPY app ./app
COPY models ./models
# The service imports the client's wire vocabulary (wm_refiner_client.spec, .formats), and the CLI the client.
COPY wm_refiner_client ./wm_refiner_client
COPY configs ./configs
RUN python -m pip install --extra-index-url "${TORCH_INDEX}" -e "${INSTALL}"

USER app
ENV WM_REFINER_HOST=0.0.0.0 \
    WM_REFINER_PORT=8000 \
    WM_REFINER_CACHE_DIR=/cache
EXPOSE 8000
# /ready: healthy once the model is loaded and warmed up. The start period covers the released refiner's start on a
# GPU (weights, warm-up, compile_step: minutes); a success ends it early, so the tiny default is healthy in seconds.
HEALTHCHECK --interval=10s --timeout=3s --start-period=900s \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/ready', timeout=2)"
# SIGTERM starts the drain (stop admitting, finish in-flight blocks, save sessions if WM_REFINER_SNAPSHOT_DIR is
# set, close streams with 1012 or 1001).
STOPSIGNAL SIGTERM
CMD ["python", "-m", "app", "serve"]
