# The init image of agent pods: one file, /moult, that an init container copies into a shared
# volume so that the user's agent image (any distribution) can run `moult agents`.
# It is the agent-side `moult`: static (musl) and without libtorch (`--no-default-features`: the
# roles that only move data; see docs/operator.md, "Images"). Build from the repository root:
#   docker build -f operator/images/init.Dockerfile -t ghcr.io/moult-dev/moult-init:0.1.0 .
FROM rust:1.95.0-bookworm AS build
RUN rustup target add x86_64-unknown-linux-musl && apt-get update && apt-get install -y musl-tools
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p moult-runtime --no-default-features --target x86_64-unknown-linux-musl

FROM busybox:1.37.0-musl
COPY --from=build /src/target/x86_64-unknown-linux-musl/release/moult /moult
USER 65532:65532
# The init container runs `cp /moult /opt/moult/bin/moult`.
