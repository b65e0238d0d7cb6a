# The operator image: the moult-operator binary (no libtorch: the crate never depends on it) on
# distroless, as non-root. Build from the repository root:
#   docker build -f operator/images/operator.Dockerfile -t ghcr.io/moult-dev/moult-operator:0.1.0 .
FROM rust:1.95.0-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p moult-operator --bin moult-operator

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/moult-operator /usr/local/bin/moult-operator
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/moult-operator"]
