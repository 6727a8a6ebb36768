# kvevents: the aggregator (`kvevents serve`) and the engine process
# (`python -m kvevents.sim.process`) in one image.
#
#   docker build -t kvevents .
#   docker compose up        # aggregator + 4 engines + Prometheus + Grafana
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# torch first, CPU build, pinned (the same build the tests run on): its own layer, so
# code changes do not download it again, and pip never reaches for a CUDA release.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

COPY pyproject.toml README.md ./
COPY kvevents ./kvevents
COPY connector ./connector
RUN pip install ".[connector]" \
    && useradd --create-home --uid 10001 kvevents

USER kvevents

# 8000 aggregator HTTP; 5557 events (PUB), 5558 replay (ROUTER), 5560 requests (ROUTER),
# 9100 engine /metrics.
EXPOSE 8000 5557 5558 5560 9100

CMD ["kvevents", "serve", "--host", "0.0.0.0", "--port", "8000"]
