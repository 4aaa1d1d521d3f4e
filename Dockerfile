# fluidserve: the OpenAI-compatible server on NVIDIA GPUs.
#
#   docker build -t fluidserve .
#   docker run --gpus all -p 8000:8000 -v ~/.cache/huggingface:/root/.cache/huggingface fluidserve --model <id>
#
# Tensor parallelism over several GPUs (Ray + NCCL) also wants shared memory:
# add --shm-size=16g (or --ipc=host) and --executor ray --tensor-parallel-size N.
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# Triton compiles its launcher stubs at run time, hence gcc and the Python
# headers next to the interpreter. Versions float with the distribution's
# security updates rather than being pinned.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

WORKDIR /opt/fluidserve

# Dependencies first, from pyproject.toml alone, so that editing the source
# does not re-download torch: install against empty package folders, then
# the real source without dependencies.
COPY pyproject.toml ./
RUN mkdir -p serve kernels scheduler kvcache engine/models engine/executor \
    && touch README.md \
    && pip install . \
    && pip uninstall -y fluidserve \
    && rm -rf build ./*.egg-info
COPY . .
RUN pip install --no-deps . && rm -rf build ./*.egg-info

# A non-root user (uid 1000, the usual owner of the host's Hugging Face
# cache). The documented mount point /root/.cache/huggingface is kept: /root
# is opened for traversal and the cache folder is the user's, so the same
# `docker run -v` line works for root-owned and user-owned setups alike.
RUN (userdel --remove ubuntu 2>/dev/null || true) \
    && useradd --create-home --uid 1000 --shell /usr/sbin/nologin fluidserve \
    && mkdir -p /root/.cache/huggingface \
    && chmod 0755 /root \
    && chown -R fluidserve:fluidserve /root/.cache
ENV HF_HOME=/root/.cache/huggingface \
    FLUIDSERVE_HOST=0.0.0.0
USER 1000:1000
WORKDIR /home/fluidserve

EXPOSE 8000

# /health is 503 as soon as generation is dead (engine loop or a worker);
# a dead engine loop also ends the process (status 1): run with --restart.
# The start period covers downloading and loading a large model.
HEALTHCHECK --interval=10s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

ENTRYPOINT ["fluidserve", "serve"]
