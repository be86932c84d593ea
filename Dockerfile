# One image, both services: `docker run IMAGE cache_service` or `... model_service --model tiny`.
# docker-compose.yml runs the pair; docker-compose.gpu.yml adds the GPU.
FROM python:3.11-slim

# Which torch build. Empty (the default): torch comes from PyPI at pyproject's exact pin,
# as `make run` installs it. A GPU image installs a CUDA torch build instead: set this to
# PyTorch's wheel index for the host driver's CUDA version (docker-compose.gpu.yml passes
# TORCH_INDEX_URL through); a CPU-only image can point it at PyTorch's CPU index to stay
# small. Either way the version is pyproject's pin, read from pyproject.toml below.
ARG TORCH_INDEX_URL=""

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PAGEDKV_HOST=0.0.0.0

WORKDIR /app

# Dependencies first, from pyproject.toml itself (never a hand-written list), so a code
# change does not reinstall torch.
COPY pyproject.toml README.md ./
RUN python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
        > /tmp/requirements.txt
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
        pip install --index-url "$TORCH_INDEX_URL" "$(grep -E '^torch[^a-zA-Z0-9_-]' /tmp/requirements.txt)"; \
    fi \
 && pip install -r /tmp/requirements.txt

# Then the repository itself, exactly as `make run` installs it (`pip install .`; the
# test extras stay out of the image). .dockerignore keeps .venv, tests and .git out.
COPY pagedkv ./pagedkv
COPY cache_service ./cache_service
COPY model_service ./model_service
RUN pip install . && rm -rf build /tmp/requirements.txt

# Both services run as the same non-root uid: the CPU pool file in /dev/shm is mode 0600,
# so the model container can map the cache container's pool only as the same user.
RUN useradd --create-home --uid 10001 --user-group pagedkv
USER pagedkv

EXPOSE 50051 50052 9401 9402 8000
# The gRPC health of whichever service runs here (PAGEDKV_PORT is set per service; the
# cache service's port is the default). Compose files set their own, same probe.
HEALTHCHECK --interval=10s --timeout=10s --start-period=120s --retries=3 \
    CMD python -m pagedkv.health_probe "127.0.0.1:${PAGEDKV_PORT:-50052}" --timeout 5 || exit 1

ENTRYPOINT ["python", "-m"]
CMD ["cache_service"]
