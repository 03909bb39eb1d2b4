# syntax=docker/dockerfile:1
# tether: one static-enough release binary on a distroless, non-root base.
#
# Build:  docker build -t tether .
# Run:    docker run --rm tether --help
#
# Build stage: the same toolchain CI uses. rustls + ring everywhere, so no
# OpenSSL and no cmake; gcc builds ring and the bundled SQLite of the embedded
# store (used only by `tether demo`/`--embedded-store`).
FROM rust:1.95-bookworm AS build
WORKDIR /src
# Dependencies first, so source edits do not rebuild them.
COPY Cargo.toml Cargo.lock ./
RUN mkdir -p src && echo 'fn main() {}' > src/main.rs && touch src/lib.rs \
    && cargo build --release --locked \
    && rm -rf src
COPY src ./src
COPY crds ./crds
COPY examples ./examples
RUN touch src/main.rs src/lib.rs && cargo build --release --locked --bin tether \
    && strip target/release/tether

# Runtime: distroless cc (glibc, CA certificates, no shell), as UID 65532.
# The Helm chart adds a read-only root filesystem and drops all capabilities;
# tether writes nothing to disk in `operator`/`worker` mode.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/tether /usr/local/bin/tether
USER 65532:65532
EXPOSE 9090
# Exec form: tether is PID 1 and receives SIGTERM directly, which drains
# sessions and releases leases (see terminationGracePeriodSeconds in the chart).
ENTRYPOINT ["/usr/local/bin/tether"]
CMD ["operator"]
