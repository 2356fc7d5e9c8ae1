# Prometheus from Debian's package, for `make compose-test` where prom/prometheus cannot be
# pulled (TANDEM_PROMETHEUS_IMAGE names it); like the official image it runs as nobody
# with its store in /prometheus.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends prometheus \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /prometheus && chown nobody:nogroup /prometheus
USER nobody
ENTRYPOINT ["prometheus"]
