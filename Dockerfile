# flatrun serve in a container: built in one stage, run in a slim one as an
# unprivileged user, with the model mounted read-only (never baked in).
#
#   docker build -t flatrun .
#   docker run --rm -p 8080:8080 -v /path/to/models:/models:ro flatrun \
#       serve --model /models/model.gguf --host 0.0.0.0
#
# See docs/deploy.md (probes, Kubernetes, memory limits).

FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
COPY . .
# Portable by default: the kernels pick AVX2/AVX-512/NEON at run time.
RUN cargo build --release --locked -p flatrun-cli \
    && install -D -m 0755 target/release/flatrun /out/flatrun

FROM debian:bookworm-slim
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin flatrun \
    && mkdir /models && chown root:root /models
COPY --from=build /out/flatrun /usr/local/bin/flatrun
USER 10001:10001
VOLUME ["/models"]
EXPOSE 8080
# SIGTERM drains: in-flight requests get --shutdown-grace seconds.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/flatrun"]
CMD ["serve", "--model", "/models/model.gguf", "--host", "0.0.0.0", "--port", "8080"]
