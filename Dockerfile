# One image, both services: `docker run IMAGE cache_service` or `... model_service --model tiny`.
# docker-compose.yml runs the pair; docker-compose.gpu.yml adds the GPU.
# Builds with the classic builder and BuildKit alike (Docker Engine 20.10 or newer).
FROM python:3.11-slim

# Which torch build. Empty (the default): torch comes from PyPI at pyproject's exact pin,
# as `make run` installs it. A GPU image installs a CUDA torch build instead: set this to
# PyTorch's wheel index for the host driver's CUDA version (docker-compose.gpu.yml passes
# TORCH_INDEX_URL through); a CPU-only image can point it at PyTorch's CPU index to stay
# small. Either way the version is pyproject's pin, read from pyproject.toml below.
ARG TORCH_INDEX_URL=""
# pyproject's optional extras to install too, comma-separated. Empty (the CPU image): no
# triton, which runs only on CUDA and weighs about 1 GB. docker-compose.gpu.yml sets "gpu".
ARG EXTRAS=""

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PAGEDKV_HOST=0.0.0.0

WORKDIR /app

# A C compiler: the model service builds its CPU decode-attention kernel at start
# (model_service/attention/cpu_kernels.py, about a second); without one it falls back to
# the slower torch path with a warning.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

# Dependencies first, from pyproject.toml itself (never a hand-written list), so a code
# change does not reinstall torch: the core list plus that of each extra in EXTRAS.
COPY pyproject.toml README.md ./
RUN python -c 'import os, tomllib; project = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
extras = [name for name in os.environ.get("EXTRAS", "").split(",") if name]; \
print("\n".join(project["dependencies"] + [r for name in extras for r in project["optional-dependencies"][name]]))' \
        > /tmp/requirements.txt
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
        pip install --index-url "$TORCH_INDEX_URL" "$(grep -E '^torch[^a-zA-Z0-9_-]' /tmp/requirements.txt)"; \
    fi \
 && pip install -r /tmp/requirements.txt

# Then the repository itself, as `make run` installs it (`pip install .`, plus EXTRAS; the
# test extras stay out of the image). .dockerignore keeps .venv, tests and .git out.
COPY pagedkv ./pagedkv
COPY cache_service ./cache_service
COPY model_service ./model_service
RUN pip install ".${EXTRAS:+[$EXTRAS]}" && rm -rf build /tmp/requirements.txt

# Both services run as the same non-root uid: the CPU pool file in /dev/shm is mode 0600,
# so the model container can map the cache container's pool only as the same user.
RUN useradd --create-home --uid 10001 --user-group pagedkv
USER pagedkv

EXPOSE 50051 50052 9401 9402 8000
# The gRPC health of whichever service runs here (PAGEDKV_PORT is set per service; the
# cache service's port is the default). `--now` asks once and fails on NOT_SERVING, so with
# one retry the container's health follows the service's within one interval. The compose
# files set the same probe with their own start periods.
HEALTHCHECK --interval=5s --timeout=5s --start-period=120s --retries=1 \
    CMD python -m pagedkv.health_probe "127.0.0.1:${PAGEDKV_PORT:-50052}" --now --timeout 3 || exit 1

ENTRYPOINT ["python", "-m"]
CMD ["cache_service"]
