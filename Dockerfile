# nmt-serve images, torch-free: `--target cpu` (python slim + onnxruntime, the int8 model dir) or
# `--target gpu` (CUDA runtime + cuDNN + onnxruntime-gpu, the fp32 model dir): one precision per
# image. Both run as a non-root user and answer the container healthcheck through grpc.health.v1
# (nmt-health, part of the image). The CPU image installs the wheels in deploy/wheelhouse/ without an
# index when scripts/stack.sh has filled it (CPython 3.11, x86_64), else from pip's index.
# nmt-serve itself goes in as a wheel built in its own stage: no sources, build/ or egg-info in the images.
# OCI labels from build arguments (scripts/stack.sh passes them): VERSION (pyproject.toml's), REVISION (the
# git commit, "-dirty" when the tree had changes; also nmt_build_info's commit), SOURCE (the repository URL).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
# onnxruntime-gpu's CUDA major must be the image's: its CUDA provider links libcublas.so.12 up to 1.26 and
# libcublas.so.13 from 1.27 (read from the wheels' libonnxruntime_providers_cuda.so); with the wrong one it fails
# to load and the server runs on the CPU. A CUDA 13 image takes "onnxruntime-gpu>=1.27".
ARG ONNXRUNTIME_GPU="onnxruntime-gpu>=1.20,<1.27"
ARG VERSION=""
ARG REVISION=""
ARG SOURCE=""

# The sources, and the wheels when a wheelhouse was filled (the training checkpoint stays out of the images).
FROM scratch AS source
WORKDIR /src
COPY pyproject.toml README.md ./
COPY model/ model/
COPY export/ export/
COPY importers/ importers/
COPY runtime/ runtime/
COPY bench/ bench/
COPY server/ server/
COPY client/ client/
COPY protos/ protos/
COPY deploy/wheelhouse/ /wheelhouse/

# nmt-serve's wheel, built from the sources (setuptools from the wheelhouse when there is one).
FROM ${PYTHON_IMAGE} AS wheel
# The sources' digest (scripts/stack.sh): buildah does not rebuild a RUN whose bind-mounted stage changed, it does when a
# build argument before it did.
ARG SOURCE_DIGEST
ENV PIP_NO_CACHE_DIR=1
RUN --mount=type=bind,from=source,source=/src,target=/src,rw \
    --mount=type=bind,from=source,source=/wheelhouse,target=/tmp/wheelhouse \
    if ls /tmp/wheelhouse/*.whl >/dev/null 2>&1; then export PIP_NO_INDEX=1 PIP_FIND_LINKS=/tmp/wheelhouse; fi \
    && pip wheel --no-deps --wheel-dir /dist /src
# The wheel alone, in a stage of its own for the installs to mount (buildah mounts a scratch stage's files reliably).
FROM scratch AS dist
COPY --from=wheel /dist/ /dist/

# The model dirs, readable by the image's user whatever their modes in the build context.
FROM ${PYTHON_IMAGE} AS models
COPY artifacts/de-en-small/onnx-int8/ /models/de-en-small/onnx-int8/
COPY artifacts/de-en-small/onnx-fp32/ /models/de-en-small/onnx-fp32/
RUN chmod -R a+rX /models

FROM ${PYTHON_IMAGE} AS cpu
ARG VERSION
ARG REVISION
ARG SOURCE
ARG SOURCE_DIGEST
LABEL org.opencontainers.image.title="nmt-serve" \
      org.opencontainers.image.description="German->English translation over gRPC and HTTP/JSON on ONNX Runtime, CPU, int8" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}"
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
# The wheels are mounted for this step only, so that no layer keeps them.
RUN --mount=type=bind,from=dist,source=/dist,target=/tmp/dist \
    --mount=type=bind,from=source,source=/wheelhouse,target=/tmp/wheelhouse \
    if ls /tmp/wheelhouse/*.whl >/dev/null 2>&1; then export PIP_NO_INDEX=1 PIP_FIND_LINKS=/tmp/wheelhouse; fi \
    && pip install "$(ls /tmp/dist/nmt_serve-*.whl)[serve-cpu]"
RUN useradd --system --uid 10001 --no-create-home nmt
COPY --from=models /models/de-en-small/onnx-int8/ /models/de-en-small/onnx-int8/
USER nmt
ENV NMT_MODEL_DIR=/models/de-en-small/onnx-int8 NMT_HOST=0.0.0.0 NMT_METRICS_HOST=0.0.0.0 NMT_HTTP_HOST=0.0.0.0 \
    NMT_BUILD_COMMIT=${REVISION}
# gRPC, the HTTP/JSON API (NMT_HTTP_PORT, default 8000), metrics.
EXPOSE 50051 8000 9300
HEALTHCHECK --interval=5s --timeout=4s --start-period=60s --retries=3 CMD ["nmt-health", "--target", "127.0.0.1:50051"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["nmt-serve"]

FROM ${CUDA_IMAGE} AS gpu
ARG VERSION
ARG REVISION
ARG SOURCE
ARG SOURCE_DIGEST
LABEL org.opencontainers.image.title="nmt-serve" \
      org.opencontainers.image.description="German->English translation over gRPC and HTTP/JSON on ONNX Runtime, CUDA, fp32" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}"
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 DEBIAN_FRONTEND=noninteractive
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
ARG ONNXRUNTIME_GPU
RUN --mount=type=bind,from=dist,source=/dist,target=/tmp/dist pip install "$(ls /tmp/dist/nmt_serve-*.whl)[serve]" "${ONNXRUNTIME_GPU}"
RUN useradd --system --uid 10001 --no-create-home nmt
# fp32 on the GPU (int8 dynamic quantization is a CPU format).
COPY --from=models /models/de-en-small/onnx-fp32/ /models/de-en-small/onnx-fp32/
USER nmt
ENV NMT_MODEL_DIR=/models/de-en-small/onnx-fp32 NMT_HOST=0.0.0.0 NMT_METRICS_HOST=0.0.0.0 NMT_HTTP_HOST=0.0.0.0 \
    NMT_BUILD_COMMIT=${REVISION}
EXPOSE 50051 8000 9300
HEALTHCHECK --interval=5s --timeout=4s --start-period=120s --retries=3 CMD ["nmt-health", "--target", "127.0.0.1:50051"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["nmt-serve"]
