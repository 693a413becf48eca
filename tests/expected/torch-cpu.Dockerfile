# syntax=docker/dockerfile:1
# Rendered by `hfleet image render`; regenerate it rather than edit it.
# framework: torch 2.13.0 (cpu)
# lock: sample.lock.json (sha256 00b27531f15632e9c7bfe1fa73139666d9e55cc83b4c1f2fedd91e9460d2da00)
# image: hfleet/torch:00b27531f156-torch2.13.0-cpu
# torch publishes no CPU image: official Python image + CPU wheels from https://download.pytorch.org/whl/cpu
# not pip-installed: hybridfleet (installed from a local directory; comes with the copied project)
# not pip-installed: nvidia-nccl-cu12 (CUDA library; a cpu image needs none)
# not pip-installed: paddlepaddle (belongs to the other framework)
# not pip-installed: pip (the base image provides it)
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1
WORKDIR /workspace
RUN python -m pip install --index-url https://download.pytorch.org/whl/cpu \
      torch==2.13.0 \
      torchvision==0.28.0
RUN python -m pip install \
      grpcio==1.85.3 \
      numpy==2.4.6 \
      pyyaml==6.0.4
COPY . /workspace
RUN if [ -f pyproject.toml ] || [ -f setup.py ]; then python -m pip install /workspace; fi
ENV HFLEET_IMAGE_LOCK_HASH=00b27531f15632e9c7bfe1fa73139666d9e55cc83b4c1f2fedd91e9460d2da00 \
    HFLEET_IMAGE=hfleet/torch:00b27531f156-torch2.13.0-cpu
LABEL io.hybridfleet.lock-hash="00b27531f15632e9c7bfe1fa73139666d9e55cc83b4c1f2fedd91e9460d2da00" \
      io.hybridfleet.framework="torch 2.13.0 cpu"
