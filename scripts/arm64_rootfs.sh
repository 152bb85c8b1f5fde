#!/usr/bin/env bash
# An arm64 (aarch64) root file system with Debian 12's Python 3.11 and fedcomp's core (flwr without Ray,
# numpy, torch from PyPI's aarch64 wheels), run on an amd64 machine under qemu-user emulation: what a
# Raspberry Pi 4/5 or a Jetson's CPU runs, for tests and for trying a SuperNode without the device.
# Needs root and Debian's mirror + PyPI; nothing else is downloaded.
#
#   scripts/arm64_rootfs.sh setup [ROOT]        qemu-user-static + binfmt_misc, then ROOT built WITHOUT
#                                               emulation: Debian's arm64 packages of python3.11 unpacked,
#                                               the core's aarch64 wheels installed by this machine's pip,
#                                               everything byte-compiled here (idempotent: a ready ROOT is
#                                               reused; ~2-3 min from nothing on 2 cores)
#   scripts/arm64_rootfs.sh exec ROOT CMD...    run CMD inside ROOT (arm64, emulated; exec'd, so signals reach
#                                               it) with /proc and /sys mounted, PATH=/opt/fedcomp/bin:..., the host's
#                                               network (127.0.0.1 is the host's)
#   scripts/arm64_rootfs.sh umount ROOT         unmount ROOT/proc and ROOT/sys (after the last exec)
#
# ROOT defaults to $FEDCOMP_ARM64_ROOT or build/arm64-root in the repository (ignored by git). On a real
# arm64 device none of this is needed: `pip install -c constraints.txt .` there (docs/how-to/edge-devices.md).
#
# Why no debootstrap: its second stage runs every package's maintainer scripts under emulation (~15 min
# on 2 cores). A ClientApp needs none of them: only the files of python3.11 and the C libraries it loads,
# which `dpkg-deb` unpacks natively. The packages are resolved by apt with a private state folder
# (ROOT.apt, removed afterwards) for the arm64 architecture: this machine's apt configuration, its
# dpkg architectures and its package lists are not touched.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cmd=${1:-setup}; shift || true
ROOT=${1:-${FEDCOMP_ARM64_ROOT:-$here/build/arm64-root}}; if [ $# -gt 0 ]; then shift; fi
# setup starts with `rm -rf ROOT`: an empty ROOT or the host's / is refused before anything runs
[ -n "$ROOT" ] || { echo "arm64_rootfs: refusing an empty ROOT" >&2; exit 2; }
ROOT=$(realpath -m -- "$ROOT")
[ "$ROOT" != "/" ] || { echo "arm64_rootfs: refusing ROOT '/'" >&2; exit 2; }
SUITE=bookworm MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
KEYRING=${DEBIAN_KEYRING:-/usr/share/keyrings/debian-archive-keyring.gpg}
SITE=opt/fedcomp/lib/python3.11/site-packages
# python3.11 and what its extension modules and the wheels' shared objects load (libc6, zlib, libffi,
# libssl, libstdc++, ... come in as their dependencies)
PACKAGES="python3.11-minimal libpython3.11-stdlib libstdc++6"
# PyPI's aarch64 wheel of torch 2.13.0 is a CUDA 13 build that requires several GB of NVIDIA libraries on
# aarch64; 2.7.1's (and, by their metadata, 2.8-2.10's) declare CUDA requirements for x86_64 only: CPU
# builds. 2.7.1 is inside the core's range (torch>=2.4,<3), so the arm64 run also tests an older torch
# than CI's 2.13.0. On a device: torch's CPU index or a vendor build.
TORCH=${FEDCOMP_ARM64_TORCH:-2.7.1}

# Only /proc and /sys (read-only) are mounted; /dev holds four device nodes made by mknod (null, zero,
# random, urandom) and is never bind-mounted, so removing ROOT can never reach the host's devices.
mounts() {
  mountpoint -q "$ROOT/proc" || mount -t proc proc "$ROOT/proc"
  mountpoint -q "$ROOT/sys" || mount -t sysfs -o ro sysfs "$ROOT/sys"   # torch's cpuinfo reads the CPU lists
}
umounts() {
  for m in sys proc; do if mountpoint -q "$ROOT/$m"; then umount -l "$ROOT/$m"; fi; done
}

emulation() {
  if ! [ -x /usr/bin/qemu-aarch64-static ] || ! command -v update-binfmts >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends qemu-user-static binfmt-support >/dev/null 2>&1 || {
      apt-get update -qq && apt-get install -y -qq --no-install-recommends qemu-user-static binfmt-support >/dev/null; }
  fi
  mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
  [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64
  # the F flag (kernel keeps the interpreter open) lets it run inside a chroot without copying qemu in
  grep -q '^flags: .*F' /proc/sys/fs/binfmt_misc/qemu-aarch64 || { echo "qemu-aarch64 binfmt lacks the F flag" >&2; exit 1; }
}

stamp() { echo "arm64_rootfs: $1 $(( $(date +%s) - t0 )) s (load $(cut -d' ' -f1 /proc/loadavg))"; t0=$(date +%s); }

# Debian's arm64 python3.11 unpacked into ROOT (merged /usr like a bookworm system), no maintainer scripts.
debian_files() {
  local apt="$ROOT.apt"
  rm -rf "$ROOT" "$apt"
  mkdir -p "$apt"/lists/partial "$apt"/archives/partial "$apt"/parts "$ROOT"/usr/bin "$ROOT"/usr/lib "$ROOT"/usr/sbin
  : > "$apt/status"
  echo "deb [arch=arm64 signed-by=$KEYRING] $MIRROR $SUITE main" > "$apt/sources.list"
  local o=(-o APT::Architecture=arm64 -o APT::Architectures=arm64 -o Dir::State="$apt" -o Dir::State::status="$apt/status"
           -o Dir::Cache="$apt" -o Dir::Etc::SourceList="$apt/sources.list" -o Dir::Etc::SourceParts="$apt/parts"
           -o Dir::Etc::Preferences="$apt/none" -o Dir::Etc::PreferencesParts="$apt/parts" -o Debug::NoLocking=1)
  apt-get "${o[@]}" -qq update
  apt-get "${o[@]}" -qq -y --download-only --no-install-recommends install $PACKAGES >/dev/null
  stamp "Debian packages downloaded ($(ls "$apt"/archives/*.deb | wc -l) .debs, $(du -sm "$apt/archives" | cut -f1) MB):"
  for l in bin lib sbin; do ln -s "usr/$l" "$ROOT/$l"; done
  for deb in "$apt"/archives/*.deb; do
    dpkg-deb --fsys-tarfile "$deb" | tar -x --keep-directory-symlink -C "$ROOT"
  done
  rm -rf "$apt"
  ln -sf python3.11 "$ROOT/usr/bin/python3"
  mkdir -p "$ROOT"/proc "$ROOT"/sys "$ROOT"/dev "$ROOT"/tmp "$ROOT"/root "$ROOT"/data
  chmod 1777 "$ROOT/tmp"
  mknod -m 666 "$ROOT/dev/null" c 1 3; mknod -m 666 "$ROOT/dev/zero" c 1 5
  mknod -m 666 "$ROOT/dev/random" c 1 8; mknod -m 666 "$ROOT/dev/urandom" c 1 9
  echo "root:x:0:0:root:/root:/bin/sh" > "$ROOT/etc/passwd"
  echo "root:x:0:" > "$ROOT/etc/group"
  printf '127.0.0.1\tlocalhost\n::1\tlocalhost\n' > "$ROOT/etc/hosts"
  compile "$ROOT/usr/lib/python3.11"
  touch "$ROOT/.debian-files"
  stamp "Debian packages unpacked and byte-compiled:"
}

# This machine's Python writes the .pyc files the emulated one would otherwise write on first import (under
# emulation, compiling torch's and flwr's modules costs minutes). A .pyc is the same on every CPU; it is
# only valid for the same Python minor version, so nothing is compiled unless this one is 3.11 as well.
host311() { python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; }
compile() { if host311; then python3 -m compileall -q -j 0 "$@" >/dev/null || true; fi; }

# fedcomp's core from PyPI's aarch64 wheels into a virtual environment at ROOT/opt/fedcomp, by this machine's pip
core() {
  rm -rf "$ROOT/opt/fedcomp"
  mkdir -p "$ROOT/$SITE" "$ROOT/opt/fedcomp/bin"
  # a virtual environment is a pyvenv.cfg and a python link (what `python3 -m venv --without-pip` makes)
  printf 'home = /usr/bin\ninclude-system-site-packages = false\nversion = 3.11.2\n' > "$ROOT/opt/fedcomp/pyvenv.cfg"
  ln -s /usr/bin/python3.11 "$ROOT/opt/fedcomp/bin/python"
  ln -s python "$ROOT/opt/fedcomp/bin/python3"
  # The host's pip resolves and unpacks the aarch64 wheels at native speed (emulated pip is slow); it
  # byte-compiles them too when it is a Python 3.11. What it resolves is fedcomp's core:
  # pyproject's [project].dependencies with torch==$TORCH. pip evaluates environment markers for the host,
  # so torch's x86_64-only CUDA requirements would be pulled in: torch goes in without dependencies, then
  # its requirements as they hold on aarch64.
  local compile_opt=--no-compile; if host311; then compile_opt=--compile; fi
  pipt() {
    python3 -m pip install -q --disable-pip-version-check --no-warn-conflicts --no-cache-dir --only-binary=:all: $compile_opt \
      --platform manylinux_2_28_aarch64 --platform manylinux_2_17_aarch64 --platform manylinux2014_aarch64 \
      --platform linux_aarch64 --python-version 3.11 --implementation cp --abi cp311 \
      --target "$ROOT/$SITE" --upgrade "$@"
  }
  python3 "$here/scripts/image_requirements.py" "$here/pyproject.toml" > "$ROOT/tmp/requirements.txt"
  pipt --no-deps "torch==$TORCH"
  stamp "torch $TORCH (aarch64 wheel) installed:"
  python3 - "$ROOT/$SITE" >> "$ROOT/tmp/requirements.txt" <<'PY'
import glob, sys
try:  # pip's own copy: the venv's packaging may be being installed at the same time (.ci/run)
    from pip._vendor.packaging.requirements import Requirement
except ImportError:
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
  stamp "flwr, numpy and torch's requirements (aarch64 wheels) installed:"
}

setup() {
  t0=$(date +%s)
  # one setup at a time per ROOT (.ci/run may start one in the background while it installs; the test's own waits)
  mkdir -p "$(dirname "$ROOT")"
  exec 9>"$ROOT.lock"
  flock -n 9 || { flock 9; stamp "waited for another setup of $ROOT:"; }
  emulation
  stamp "qemu-user + binfmt_misc ready:"
  if ! [ -f "$ROOT/.debian-files" ]; then
    umounts
    debian_files
  fi
  [ -f "$ROOT/opt/fedcomp/.core-installed" ] || core
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
  compile "$ROOT/$SITE/fedcomp"
  stamp "fedcomp copied:"
  echo "arm64 root file system ready: $ROOT ($(du -sm "$ROOT" | cut -f1) MB; venv $(du -sm "$ROOT/opt/fedcomp" | cut -f1) MB)"
}

case "$cmd" in
  setup) setup ;;
  exec)
    emulation; mounts
    # the host's env and chroot start CMD (an aarch64 program, run through qemu by binfmt_misc) in ROOT
    exec env -i PATH=/opt/fedcomp/bin:/usr/bin:/bin HOME=/root LANG=C.UTF-8 PYTHONUNBUFFERED=1 \
      FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 ${FEDCOMP_ARM64_ENV:-} "$(command -v chroot || echo /usr/sbin/chroot)" "$ROOT" "$@" ;;
  umount) umounts ;;
  *) echo "usage: $0 setup|exec|umount [ROOT] [CMD...]" >&2; exit 2 ;;
esac
