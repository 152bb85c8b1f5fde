# fedcomp images, two targets from one file:
#  * default (last stage, what docker compose builds): flower-superlink, flower-supernode and the flwr CLI
#    with the app and the extras a ServerApp needs (data, plots, dp);
#  * `supernode` (--target supernode): the lean SuperNode for devices (amd64, arm64): fedcomp's core only,
#    CPU torch, flwr without Ray, no matplotlib/sklearn/pandas/pyarrow; it trains on a partition file
#    (node config data-file=..., written by `python -m fedcomp.task.datafiles`).
# No compilers or pip caches in the final stages, non-root user `app` (uid 1000).
#
#   docker compose build                                   # torch from the PyTorch CPU index
#   pip download --no-deps torch==2.13.0 -d wheels/        # or from a local wheel folder
#   docker compose build --build-arg TORCH_WHEELS=wheels/
#   docker build --target supernode -t fedcomp-supernode --build-arg TORCH_WHEELS=wheels/ .
FROM python:3.11-slim AS core-build
ARG TORCH_WHEELS=""
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/fedcomp
# TORCH_WHEELS empty: only the script lands in /tmp/wheels and torch comes from the index.
COPY scripts/image_requirements.py ${TORCH_WHEELS} /tmp/wheels/
RUN set -e; wheel=$(ls /tmp/wheels/torch-2.13.0*.whl 2>/dev/null | head -n 1); \
    if [ -n "$wheel" ]; then /opt/fedcomp/bin/pip install "$wheel"; \
    else /opt/fedcomp/bin/pip install torch==2.13.0 --index-url "$TORCH_INDEX_URL"; fi
COPY pyproject.toml constraints.txt /tmp/
RUN python3 /tmp/wheels/image_requirements.py /tmp/pyproject.toml > /tmp/requirements.txt \
    && /opt/fedcomp/bin/pip install -c /tmp/constraints.txt -r /tmp/requirements.txt
# Not needed at run time: C++ headers, test suites and test binaries of torch (~200 MB; torch_shm_manager
# stays), the packages' own tests, and uv (Flower's runtime dependency installer; installation is
# disabled in these images).
COPY scripts/slim_venv.sh /tmp/
RUN sh /tmp/slim_venv.sh /opt/fedcomp

# the lean SuperNode: core only, without pip and setuptools (nothing is installed at run time), and the
# shared libraries' symbol tables stripped (`strip --strip-unneeded`, what Debian does to its packages;
# a library that no longer loads afterwards keeps its symbols: scripts/strip_libs.py): -131 MB, of it
# libtorch_cpu.so 89 MB. binutils lives in this build stage only. The .pyc files stay: without them every
# ClientApp process (one per message) compiles what it imports, since user app cannot write them (docs/how-to/docker-compose.md).
FROM core-build AS supernode-venv
COPY scripts/strip_libs.py /tmp/
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends binutils >/dev/null \
    && /opt/fedcomp/bin/python /tmp/strip_libs.py /opt/fedcomp \
    && { /opt/fedcomp/bin/pip uninstall -q -y pip setuptools wheel 2>/dev/null || true; } \
    && rm -f /opt/fedcomp/bin/pip*

FROM python:3.11-slim AS supernode
ENV PATH=/opt/fedcomp/bin:$PATH PYTHONUNBUFFERED=1 FLWR_HOME=/home/app/.flwr \
    FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
RUN useradd --create-home --uid 1000 app && mkdir -p /home/app/.flwr /data && chown app:app /home/app/.flwr
COPY --from=supernode-venv /opt/fedcomp /opt/fedcomp
# the library the ClientApp runs (and python -m fedcomp.task.datafiles, ...); the FAB that the SuperLink
# sends carries only the app's entry points (fedcomp_app/), which import it. A small layer: code changes
# rebuild only this.
COPY fedcomp /opt/fedcomp/lib/python3.11/site-packages/fedcomp
WORKDIR /home/app
USER app
ENTRYPOINT ["flower-supernode"]
CMD ["--help"]

# the extras a ServerApp needs, on top of the core (after the supernode stages: the legacy builder builds
# every stage before --target, so `--target supernode` never installs these)
FROM core-build AS full-build
RUN python3 /tmp/wheels/image_requirements.py /tmp/pyproject.toml data,plots,dp > /tmp/requirements-full.txt \
    && /opt/fedcomp/bin/pip install -c /tmp/constraints.txt -r /tmp/requirements-full.txt \
    && sh /tmp/slim_venv.sh /opt/fedcomp

# the default image (SuperLink, SuperNodes, flwr CLI): core + data, plots, dp
FROM python:3.11-slim
ENV PATH=/opt/fedcomp/bin:$PATH PYTHONUNBUFFERED=1 FLWR_HOME=/home/app/.flwr \
    FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 MPLCONFIGDIR=/tmp/matplotlib \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN useradd --create-home --uid 1000 app && mkdir -p /results /home/app/.flwr \
    && chown app:app /results /home/app/.flwr
COPY --from=full-build /opt/fedcomp /opt/fedcomp
COPY scripts/docker-entrypoint.sh /usr/local/bin/fedcomp-entrypoint
# the app: installed (a small layer, so code changes rebuild only this) and, in /app, the Flower
# app directory that `flwr run .` submits (the `submit` service)
WORKDIR /app
COPY pyproject.toml README.md LICENSE ./
COPY fedcomp ./fedcomp
COPY fedcomp_app ./fedcomp_app
RUN pip install --no-deps . && rm -rf build
USER app
ENTRYPOINT ["fedcomp-entrypoint"]
CMD ["flower-supernode", "--help"]
