# nats-server from Debian's package, for `make compose-test` where the official nats image
# cannot be pulled (TANDEM_NATS_IMAGE names it; the same command line as the official one).
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends nats-server \
    && rm -rf /var/lib/apt/lists/*
ENTRYPOINT ["nats-server"]
