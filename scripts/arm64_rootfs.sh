#!/usr/bin/env bash
# An arm64 (aarch64) Debian 12 root file system with fedcomp's core (flwr without Ray, numpy, torch from
# the aarch64 wheels on PyPI), run on an amd64 machine under qemu-user emulation: what a Raspberry Pi 4/5
# or a Jetson's CPU runs, for tests and for trying a SuperNode without the device. Needs root and
# Debian's mirror + PyPI; nothing else is downloaded.
#
#   scripts/arm64_rootfs.sh setup [ROOT]        qemu-user-static + binfmt_misc, debootstrap --arch=arm64,
#                                               the core's aarch64 wheels into ROOT/opt/fedcomp (idempotent:
#                                               a ready ROOT is reused; ~5-10 min from nothing on 2 cores)
#   scripts/arm64_rootfs.sh exec ROOT CMD...    run CMD inside ROOT (arm64, emulated; exec'd, so signals reach
#                                               it) with /proc and /sys mounted, PATH=/opt/fedcomp/bin:..., the host's
#                                               network (127.0.0.1 is the host's)
#   scripts/arm64_rootfs.sh umount ROOT         unmount ROOT/proc and ROOT/sys (after the last exec)
#
# ROOT defaults to $FEDCOMP_ARM64_ROOT or build/arm64-root in the repository (ignored by git). On a real arm64 device none of this is
# needed: `pip install -c constraints.txt .` there (README, "Edge devices").
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cmd=${1:-setup}; shift || true
ROOT=${1:-${FEDCOMP_ARM64_ROOT:-$here/build/arm64-root}}; if [ $# -gt 0 ]; then shift; fi
SUITE=bookworm MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SITE=opt/fedcomp/lib/python3.11/site-packages
# PyPI's aarch64 wheel of torch 2.13.0 is a CUDA 13 build that requires several GB of NVIDIA libraries on
# aarch64; 2.7.1's (and, by their metadata, 2.8-2.10's) declare CUDA requirements for x86_64 only: CPU
# builds. 2.7.1 is inside the core's range (torch>=2.4,<2.14), so the arm64 run also tests an older torch
# than CI's 2.13.0. On a device: torch's CPU index or a vendor build.
TORCH=${FEDCOMP_ARM64_TORCH:-2.7.1}

# Only /proc and /sys (read-only) are mounted (debootstrap made the device nodes in ROOT/dev; /dev is never bind-mounted, so
# removing ROOT can never reach the host's devices).
mounts() {
  mountpoint -q "$ROOT/proc" || mount -t proc proc "$ROOT/proc"
  mountpoint -q "$ROOT/sys" || mount -t sysfs -o ro sysfs "$ROOT/sys"   # torch's cpuinfo reads the CPU lists
}
umounts() {
  for m in sys proc; do if mountpoint -q "$ROOT/$m"; then umount -l "$ROOT/$m"; fi; done
}

emulation() {
  if ! [ -x /usr/bin/qemu-aarch64-static ] || ! command -v update-binfmts >/dev/null || ! command -v debootstrap >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      qemu-user-static binfmt-support debootstrap >/dev/null
  fi
  mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
  [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64
  # the F flag (kernel keeps the interpreter open) lets it run inside a chroot without copying qemu in
  grep -q '^flags: .*F' /proc/sys/fs/binfmt_misc/qemu-aarch64 || { echo "qemu-aarch64 binfmt lacks the F flag" >&2; exit 1; }
}

setup() {
  emulation
  if ! [ -x "$ROOT/usr/bin/python3.11" ]; then
    umounts
    rm -rf "$ROOT"
    debootstrap --arch=arm64 --variant=minbase --include=python3,python3-venv,ca-certificates \
      "$SUITE" "$ROOT" "$MIRROR" >"${ROOT%/}.debootstrap.log" 2>&1 \
      || { tail -20 "${ROOT%/}.debootstrap.log" >&2; exit 1; }
    rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/*
  fi
  if ! [ -f "$ROOT/opt/fedcomp/.core-installed" ]; then
    chroot "$ROOT" /usr/bin/python3.11 -m venv --without-pip /opt/fedcomp
    # The host's pip resolves and unpacks the aarch64 wheels at native speed (emulated pip is slow);
    # what it resolves is fedcomp's core: pyproject's [project].dependencies with torch==$TORCH.
    # pip evaluates environment markers for the host, so torch's x86_64-only CUDA requirements would be
    # pulled in: torch goes in without dependencies, then its requirements as they hold on aarch64.
    pipt() {
      python3 -m pip install -q --disable-pip-version-check --no-cache-dir --only-binary=:all: \
        --platform manylinux_2_28_aarch64 --platform manylinux_2_17_aarch64 --platform manylinux2014_aarch64 \
        --platform linux_aarch64 --python-version 3.11 --implementation cp --abi cp311 \
        --target "$ROOT/$SITE" --upgrade "$@"
    }
    rm -rf "$ROOT/$SITE"; mkdir -p "$ROOT/$SITE"
    python3 "$here/scripts/image_requirements.py" "$here/pyproject.toml" > "$ROOT/tmp/requirements.txt"
    pipt --no-deps "torch==$TORCH"
    python3 - "$ROOT/$SITE" >> "$ROOT/tmp/requirements.txt" <<'PY'
import glob, sys
from packaging.requirements import Requirement
env = {"platform_machine": "aarch64", "platform_system": "Linux", "sys_platform": "linux",
       "python_version": "3.11", "python_full_version": "3.11.2", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
meta = glob.glob(sys.argv[1] + "/torch-*.dist-info/METADATA")[0]
for line in open(meta):
    if line.startswith("Requires-Dist:"):
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is None or req.marker.evaluate(env):
            req.marker = None
            print(req)
PY
    grep -v '^torch' "$ROOT/tmp/requirements.txt" > "$ROOT/tmp/requirements-rest.txt"
    pipt -r "$ROOT/tmp/requirements-rest.txt"
    # console scripts point at the host's Python: point them at the venv's and put them on its PATH
    for f in "$ROOT/$SITE"/bin/*; do
      [ -f "$f" ] || continue
      sed -i '1s|^#!.*python.*$|#!/opt/fedcomp/bin/python|' "$f"
      mv "$f" "$ROOT/opt/fedcomp/bin/"
    done
    rmdir "$ROOT/$SITE/bin" 2>/dev/null || true
    sh "$here/scripts/slim_venv.sh" "$ROOT/opt/fedcomp"
    touch "$ROOT/opt/fedcomp/.core-installed"
  fi
  # Emulation is 10-20x slower than the device: a SuperNode gives the ClientApp process it launches 30 s
  # (Flower's HEARTBEAT_DEFAULT_INTERVAL, the task token's first lifetime) to start and report, and an
  # emulated `flwr-clientapp` needs longer just to import Flower. In this root file system only,
  # flower-supernode raises that grace to $FEDCOMP_TASK_GRACE seconds (default 600); nothing else changes.
  cat > "$ROOT/opt/fedcomp/bin/flower-supernode" <<'PY'
#!/opt/fedcomp/bin/python
import os
import sys

import flwr.supercore.corestate.in_memory_corestate as corestate

corestate.HEARTBEAT_DEFAULT_INTERVAL = int(os.environ.get("FEDCOMP_TASK_GRACE", "600"))
from flwr.supernode.cli import flower_supernode  # noqa: E402

sys.exit(flower_supernode())
PY
  chmod 0755 "$ROOT/opt/fedcomp/bin/flower-supernode"
  # fedcomp itself (pure Python) from this checkout, replaced on every setup
  rm -rf "$ROOT/$SITE/fedcomp"
  cp -r "$here/fedcomp" "$ROOT/$SITE/fedcomp"
  find "$ROOT/$SITE/fedcomp" -name __pycache__ -prune -exec rm -rf {} +
  echo "arm64 root file system ready: $ROOT ($(du -sm "$ROOT" | cut -f1) MB; venv $(du -sm "$ROOT/opt/fedcomp" | cut -f1) MB)"
}

case "$cmd" in
  setup) setup ;;
  exec)
    emulation; mounts
    exec chroot "$ROOT" /usr/bin/env -i PATH=/opt/fedcomp/bin:/usr/bin:/bin HOME=/root LANG=C.UTF-8 \
      PYTHONUNBUFFERED=1 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 ${FEDCOMP_ARM64_ENV:-} "$@" ;;
  umount) umounts ;;
  *) echo "usage: $0 setup|exec|umount [ROOT] [CMD...]" >&2; exit 2 ;;
esac
