# syntax=docker/dockerfile:1
# Rendered by `hfleet image render`; regenerate it rather than edit it.
# framework: paddle 3.3.1 (cpu)
# lock: sample.lock.json (sha256 00b27531f15632e9c7bfe1fa73139666d9e55cc83b4c1f2fedd91e9460d2da00)
# image: hfleet/paddle:00b27531f156-paddle3.3.1-cpu
# note: the lock was made on Python 3.11; this base image runs Python 3.10, so versions are capped at the locked ones rather than pinned
# not pip-installed: hybridfleet (installed from a local directory; comes with the copied project)
# not pip-installed: nvidia-nccl-cu12 (CUDA library; a cpu image needs none)
# not pip-installed: paddlepaddle (the base image provides it)
# not pip-installed: pip (the base image provides it)
# not pip-installed: torch (belongs to the other framework)
# not pip-installed: torchvision (belongs to the other framework)
FROM paddlepaddle/paddle:3.3.1
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1
WORKDIR /workspace
RUN python -m pip install \
      'grpcio<=1.85.3' \
      'numpy<=2.4.6' \
      'pyyaml<=6.0.4'
COPY . /workspace
RUN if [ -f pyproject.toml ] || [ -f setup.py ]; then python -m pip install /workspace; fi
ENV HFLEET_IMAGE_LOCK_HASH=00b27531f15632e9c7bfe1fa73139666d9e55cc83b4c1f2fedd91e9460d2da00 \
    HFLEET_IMAGE=hfleet/paddle:00b27531f156-paddle3.3.1-cpu
LABEL io.hybridfleet.lock-hash="00b27531f15632e9c7bfe1fa73139666d9e55cc83b4c1f2fedd91e9460d2da00" \
      io.hybridfleet.framework="paddle 3.3.1 cpu"
