# kvevents images, one Dockerfile, two targets:
#
#   docker build --target aggregator -t kvevents-aggregator .   # `kvevents serve`: no torch
#   docker build --target engine     -t kvevents-engine .       # simulated engines + loadgen
#   docker compose up --build                                   # both, with Prometheus + Grafana
#
# A plain `docker build .` builds the aggregator (the last stage). For a cluster, tag it
# with the package's version (kvevents/__init__.py, the one place it is written; the
# Kubernetes manifests' kustomize `images:` carries the same) and push it:
#
#   VERSION=$(sed -n 's/^__version__ = "\(.*\)"/\1/p' kvevents/__init__.py)
#   docker build --target aggregator -t REGISTRY/kvevents-aggregator:$VERSION .
#   docker push REGISTRY/kvevents-aggregator:$VERSION

FROM python:3.11-slim AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
RUN useradd --create-home --uid 10001 kvevents

# The wheel is built once, in a stage of its own: a compiler needed to build it never
# reaches the images that run it.
FROM base AS wheel
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc g++ \
    && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md LICENSE ./
COPY kvevents ./kvevents
COPY connector ./connector
RUN pip wheel --no-deps --wheel-dir /wheels .

# Engines (`python -m kvevents.sim.process`) and the load generator (`kvevents
# loadgen`): the connector and demo extras. torch first, the CPU build pinned (the one
# the tests run on), in its own layer so code changes do not download it again.
FROM base AS engine
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY --from=wheel /wheels /wheels
RUN pip install "$(echo /wheels/kvevents-*.whl)[demo]" && rm -rf /wheels
USER kvevents
# 5557 events (PUB), 5558 replay (ROUTER), 5560 requests (ROUTER), 9100 /metrics.
EXPOSE 5557 5558 5560 9100
CMD ["python", "-m", "kvevents.sim.process", "--name", "engine-0"]

# The aggregator: the base install, the k8s extra (lightkube, for
# --discover-k8s-selector, deploy/kubernetes) and the text extra (tokenizers and jinja2,
# for --tokenizer: the gateway turns prompts and chats into token ids itself); no torch.
FROM base AS aggregator
COPY --from=wheel /wheels /wheels
RUN pip install "$(echo /wheels/kvevents-*.whl)[k8s,text]" && rm -rf /wheels
USER kvevents
# 8090: HTTP API, /metrics and the live page.
EXPOSE 8090
CMD ["kvevents", "serve", "--host", "0.0.0.0", "--port", "8090"]
