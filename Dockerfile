# syntax=docker/dockerfile:1
# The Fleet image: one image for the commander and the workers (`fleet commander`,
# `fleet worker --tier T`, and every other `fleet` command).
#
#   docker build -t fleet:0.1.0 .
#   docker run --rm -e REDIS_URL=redis://fleet-worker:PASSWORD@HOST:6379/0 fleet:0.1.0 worker --tier chat
#
# Python 3.11, the interpreter the test suite runs on (scripts/test); pinned by tag (a digest
# would pin it harder: add `@sha256:…` once you have pulled it and can read it).
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

# --- build: the project and its `k8s` and `rq` extras as wheels, from this repository --------
# (`rq`: the relay, the RQ workers of rq tiers and `fleet jobs`)
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src
# .dockerignore lets in only what the package is built from (pyproject.toml, README.md, LICENSE
# and the package directories, with stores/lua/*.lua and commander/monitor/static/*)
COPY . .
# every dependency ships a manylinux wheel for CPython 3.11, so no compiler is needed here
RUN pip wheel --wheel-dir /wheels ".[k8s,rq]"

# --- runtime: the wheels installed, nothing else -------------------------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="fleet" \
      org.opencontainers.image.description="Stateless chat-turn workers on Redis, with an autoscaling commander" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# The commander's /healthz, /metrics and monitor bind loopback by default: a deployment that
# publishes them sets FLEET_COMMANDER_METRICS_HOST=0.0.0.0 with the tokens
# (FLEET_COMMANDER_OPERATOR_TOKEN, FLEET_COMMANDER_METRICS_TOKEN: compose/docker-compose.yml and
# the Kubernetes manifests do); the commander refuses 0.0.0.0 without a token
# (docs/operations/security.md)
# tini as PID 1: it forwards SIGTERM at any moment (a Python PID 1 ignores one that comes while
# it still imports, before its handlers exist: a pod deleted then would wait out its grace
# period) and reaps the workers the commander's process runtime forks
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini=0.19.0-1 \
 && rm -rf /var/lib/apt/lists/*
# a numeric, unprivileged user: Kubernetes' runAsNonRoot can only verify a numeric USER
RUN groupadd --system --gid 10001 fleet \
 && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/fleet --create-home \
            --shell /usr/sbin/nologin fleet
# the wheels are mounted from the build stage for this one step, so they never land in a layer.
# DL3013 (pin versions) does not apply: --no-index installs exactly the wheels built above.
# hadolint ignore=DL3013
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels "fleet[k8s,rq]"
USER 10001:10001
# `fleet commander` with the process runtime keeps its worker logs under .fleet/logs here
WORKDIR /var/lib/fleet
# 9464: the commander's /healthz, /metrics and monitor; 8081: a worker's /livez and /readyz
# (FLEET_WORKER_HEALTH_PORT). No HEALTHCHECK: the image runs either process, each with its own
# endpoint; compose/docker-compose.yml and the Kubernetes manifests set the checks per service.
EXPOSE 9464 8081
ENTRYPOINT ["tini", "--", "fleet"]
CMD ["commander"]
