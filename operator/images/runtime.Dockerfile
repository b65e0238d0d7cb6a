# The runtime image: the `moult` binary with libtorch and CUDA, for engines (built-in backend),
# trainer and coordinator pods. tch links against the libtorch inside the PyPI torch wheel
# (tch 0.26 <-> torch 2.13.0, docs/architecture.md#testing-against-real-things); the Linux wheel brings CUDA through the nvidia-* wheels.
# Build from the repository root:
#   docker build -f operator/images/runtime.Dockerfile -t ghcr.io/moult-dev/moult:0.1.0 .
FROM python:3.12.12-slim-bookworm AS torch
RUN python -m venv /opt/venv && /opt/venv/bin/pip install --no-cache-dir torch==2.13.0

FROM rust:1.95.0-bookworm AS build
COPY --from=torch /opt/venv /opt/venv
COPY --from=torch /usr/local /usr/local
ENV LIBTORCH_USE_PYTORCH=1 PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p moult-runtime

FROM python:3.12.12-slim-bookworm
COPY --from=torch /opt/venv /opt/venv
COPY --from=build /src/target/release/moult /usr/local/bin/moult
ENV PATH=/opt/venv/bin:$PATH \
    LD_LIBRARY_PATH=/opt/venv/lib/python3.12/site-packages/torch/lib \
    HOME=/tmp
RUN useradd --uid 1000 --create-home moult
USER 1000:1000
ENTRYPOINT ["/usr/local/bin/moult"]
