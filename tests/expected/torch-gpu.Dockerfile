# syntax=docker/dockerfile:1
# Rendered by `hfleet image render`; regenerate it rather than edit it.
# framework: torch 2.13.0 (gpu, CUDA 13.0, cuDNN 9)
# lock: sample.lock.json (sha256 00b27531f15632e9c7bfe1fa73139666d9e55cc83b4c1f2fedd91e9460d2da00)
# image: hfleet/torch:00b27531f156-torch2.13.0-cuda13.0
# not pip-installed: hybridfleet (installed from a local directory; comes with the copied project)
# not pip-installed: nvidia-nccl-cu12 (CUDA library; the base image brings CUDA)
# not pip-installed: paddlepaddle (belongs to the other framework)
# not pip-installed: pip (the base image provides it)
# not pip-installed: torch (the base image provides it)
# not pip-installed: torchvision (the base image provides it)
FROM pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1
WORKDIR /workspace
RUN python -m pip install \
      grpcio==1.85.3 \
      numpy==2.4.6 \
      pyyaml==6.0.4
COPY . /workspace
RUN if [ -f pyproject.toml ] || [ -f setup.py ]; then python -m pip install /workspace; fi
ENV HFLEET_IMAGE_LOCK_HASH=00b27531f15632e9c7bfe1fa73139666d9e55cc83b4c1f2fedd91e9460d2da00 \
    HFLEET_IMAGE=hfleet/torch:00b27531f156-torch2.13.0-cuda13.0
LABEL io.hybridfleet.lock-hash="00b27531f15632e9c7bfe1fa73139666d9e55cc83b4c1f2fedd91e9460d2da00" \
      io.hybridfleet.framework="torch 2.13.0 cuda13.0"
