# fedcomp app image: Flower SuperLink / SuperNode / CLI with the app's dependencies installed.
# CPU build of torch (the PyPI default on x86_64 Linux is a multi-GB CUDA build).
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
RUN useradd --create-home --uid 1000 app
WORKDIR /app
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY fedcomp ./fedcomp
RUN pip install . && mkdir -p /results /home/app/.flwr && chown -R app:app /app /results /home/app
USER app
ENV FLWR_HOME=/home/app/.flwr
