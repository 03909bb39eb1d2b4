# syntax=docker/dockerfile:1
# tether: one release binary on a distroless, non-root base, for amd64 and arm64.
#
# Build (BuildKit, the default builder of current Docker):
#   docker build -t tether --build-arg REVISION="$(git rev-parse HEAD)" .
#   docker buildx build --platform linux/amd64,linux/arm64 -t REPO:TAG --push .
# Run:
#   docker run --rm tether --help
#
# The build stage always runs on the build machine's platform and
# cross-compiles when the target differs, so a multi-arch build needs no
# emulation. scripts/replay-image-build replays the build stage without Docker,
# which is why its RUN commands use paths relative to the WORKDIR only.
#
# Base images are pinned by digest. The digests below were recorded from
# public build logs (there was no registry access where this file was
# written); re-verify them when bumping. To bump, run
#   docker buildx imagetools inspect rust:1.95-bookworm
#   docker buildx imagetools inspect gcr.io/distroless/cc-debian12:nonroot
# and replace each digest after '@' with the "Digest:" line printed (the
# multi-platform index, not one platform's manifest).

# The crate's version (Cargo.toml [package] version); the replay fails when
# they differ.
ARG VERSION=0.4.0

# Build stage: the toolchain of Cargo.toml's rust-version. rustls + ring
# everywhere, so no OpenSSL and no cmake; C compiles (ring, the embedded
# store's bundled SQLite, jemalloc's configure and make) go through gcc.
FROM --platform=$BUILDPLATFORM rust:1.95-bookworm@sha256:6258907abe69656e41cd992e0b705cdcfabcbbe3db374f92ed2d47121282d4a1 AS build
ARG TARGETARCH
ARG BUILDARCH
SHELL ["/bin/bash", "-o", "errexit", "-o", "nounset", "-o", "pipefail", "-c"]
WORKDIR /src

# The Rust target for TARGETARCH, kept in a file for the build step; a cross
# gcc and the Rust target's standard library when it is not the build
# machine's architecture. Before the sources, so source edits keep this layer.
# The apt lists path is the only absolute one: it is the image's own system
# directory, touched only when cross-compiling (never in a replay).
# Cross gcc follows the base image's Debian release; pinning its exact version
# would break every Debian point release.
# hadolint ignore=DL3008
RUN case "$TARGETARCH" in \
      amd64) triple=x86_64-unknown-linux-gnu; gcc_package=gcc-x86-64-linux-gnu; libc_package=libc6-dev-amd64-cross ;; \
      arm64) triple=aarch64-unknown-linux-gnu; gcc_package=gcc-aarch64-linux-gnu; libc_package=libc6-dev-arm64-cross ;; \
      *) echo "unsupported TARGETARCH '$TARGETARCH' (amd64 or arm64)" >&2; exit 1 ;; \
    esac; \
    echo "$triple" > rust-target; \
    if [ "$TARGETARCH" != "$BUILDARCH" ]; then \
      apt-get update; \
      apt-get install -y --no-install-recommends "$gcc_package" "$libc_package"; \
      rm -rf /var/lib/apt/lists/*; \
      rustup target add "$triple"; \
    fi

# The workspace: both members' manifests must be present for cargo to load it
# (testkit is small, so all of it). crds/ and examples/ are read by the
# crate's tests (include_str!, CARGO_MANIFEST_DIR); cheap to keep alongside.
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY crds ./crds
COPY examples ./examples
COPY testkit ./testkit

# Dependencies stay compiled in the cache-mounted target directory across
# builds (and across changes to the workspace), and downloaded crates in the
# cargo registry cache. The binary is copied out of the cache mount, which is
# not part of the stage's filesystem. Stripping is done by the linker, so it
# works for the cross target too. jemalloc (the binary's allocator) is built
# for one page size: arm64 kernels run 4 KiB or 64 KiB pages, and one built
# for 64 KiB runs on both.
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    --mount=type=cache,target=/src/target,sharing=locked \
    triple="$(cat rust-target)"; \
    if [ "$TARGETARCH" = arm64 ]; then \
      export JEMALLOC_SYS_WITH_LG_PAGE=16; \
    fi; \
    if [ "$TARGETARCH" != "$BUILDARCH" ]; then \
      gcc="${triple%%-*}-linux-gnu-gcc"; \
      upper="${triple^^}"; \
      export "CARGO_TARGET_${upper//-/_}_LINKER=$gcc" "CC_${triple//-/_}=$gcc"; \
    fi; \
    CARGO_PROFILE_RELEASE_STRIP=symbols \
      cargo build --release --locked -p tether --bin tether --target "$triple"; \
    mkdir -p out; \
    cp "target/$triple/release/tether" out/tether

# Runtime: distroless cc (glibc, CA certificates, no shell), as UID 65532.
# The Helm chart adds a read-only root filesystem and drops all capabilities;
# tether writes nothing to disk in `operator`/`worker` mode.
# No HEALTHCHECK: Kubernetes ignores it (the chart probes /healthz and
# /readyz), and the image has no shell or HTTP client to run one.
# checkov:skip=CKV_DOCKER_2:Kubernetes ignores HEALTHCHECK; the chart's liveness and readiness probes call /healthz and /readyz
FROM gcr.io/distroless/cc-debian12:nonroot@sha256:9dac0a79194e45a7da0158a9c6da57b217585af0786db3845d1f0ec1a0dd182f
ARG VERSION
# The commit built from: --build-arg REVISION="$(git rev-parse HEAD)".
ARG REVISION=unknown
LABEL org.opencontainers.image.title="tether" \
      org.opencontainers.image.description="Kubernetes operator that keeps long-lived outbound WebSocket streams alive across a fleet of workers" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="https://github.com/tether-dev/tether" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /src/out/tether /usr/local/bin/tether
USER 65532:65532
EXPOSE 9090
# Exec form: tether is PID 1 and receives SIGTERM directly, which drains
# sessions and releases leases (see terminationGracePeriodSeconds in the chart).
ENTRYPOINT ["/usr/local/bin/tether"]
CMD ["operator"]
