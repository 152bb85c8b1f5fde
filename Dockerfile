# fedcomp image: flower-superlink, flower-supernode and the flwr CLI with the app installed.
# CPU torch, no Ray (Flower's simulation extra is left out: nothing here runs the simulation
# engine), no compilers or pip caches in the final stage, non-root user `app` (uid 1000).
#
#   docker compose build                                   # torch from the PyTorch CPU index
#   pip download --no-deps torch==2.13.0 -d wheels/        # or from a local wheel folder
#   docker compose build --build-arg TORCH_WHEELS=wheels/
FROM python:3.11-slim AS build
ARG TORCH_WHEELS=""
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/fedcomp
# TORCH_WHEELS empty: only the script lands in /tmp/wheels and torch comes from the index.
COPY scripts/image_requirements.py ${TORCH_WHEELS} /tmp/wheels/
RUN set -e; wheel=$(ls /tmp/wheels/torch-2.13.0*.whl 2>/dev/null | head -n 1); \
    if [ -n "$wheel" ]; then /opt/fedcomp/bin/pip install "$wheel"; \
    else /opt/fedcomp/bin/pip install torch==2.13.0 --index-url "$TORCH_INDEX_URL"; fi
COPY pyproject.toml /tmp/
# the core and the extras a ServerApp needs (data, plots, dp); Ray is left out
RUN python3 /tmp/wheels/image_requirements.py /tmp/pyproject.toml data,plots,dp > /tmp/requirements.txt \
    && /opt/fedcomp/bin/pip install -r /tmp/requirements.txt
# Not needed at run time (~360 MB): C++ headers and test binaries of torch, the packages' own test
# suites, and uv (Flower's runtime dependency installer; installation is disabled in this image).
RUN cd /opt/fedcomp/lib/python3.11/site-packages && rm -rf torch/include torch/test \
    && find . -depth -type d -name tests -exec rm -rf {} + \
    && rm -f /opt/fedcomp/bin/uv /opt/fedcomp/bin/uvx

FROM python:3.11-slim
ENV PATH=/opt/fedcomp/bin:$PATH PYTHONUNBUFFERED=1 FLWR_HOME=/home/app/.flwr \
    FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 MPLCONFIGDIR=/tmp/matplotlib \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN useradd --create-home --uid 1000 app && mkdir -p /results /home/app/.flwr \
    && chown app:app /results /home/app/.flwr
COPY --from=build /opt/fedcomp /opt/fedcomp
COPY scripts/docker-entrypoint.sh /usr/local/bin/fedcomp-entrypoint
# the app: installed (a small layer, so code changes rebuild only this) and, in /app, the Flower
# app directory that `flwr run .` submits (the `submit` service)
WORKDIR /app
COPY pyproject.toml README.md ./
COPY fedcomp ./fedcomp
RUN pip install --no-deps . && rm -rf build
USER app
ENTRYPOINT ["fedcomp-entrypoint"]
CMD ["flower-supernode", "--help"]
