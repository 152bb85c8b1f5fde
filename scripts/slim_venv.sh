#!/bin/sh
# Remove from a virtual environment what no fedcomp process needs at run time (Docker images, the arm64
# SuperNode root file system): torch's C++ headers, Python test suite and test binaries (torch_shm_manager
# stays: DataLoader workers use it), every package's own tests, and uv (Flower's runtime dependency
# installer; the images disable runtime installation). Usage: sh scripts/slim_venv.sh VENV
set -eu
venv=$1
site=$(echo "$venv"/lib/python3*/site-packages)
rm -rf "$site/torch/include" "$site/torch/test" "$venv/bin/uv" "$venv/bin/uvx"
if [ -d "$site/torch/bin" ]; then
  find "$site/torch/bin" -mindepth 1 -maxdepth 1 ! -name torch_shm_manager -exec rm -rf {} +
fi
rm -f "$site"/torch/lib/libtorchbind_test.so "$site"/torch/lib/libjitbackend_test.so "$site"/torch/lib/libbackend_with_compiler.so
find "$site" -depth -type d -name tests -exec rm -rf {} +
