#!/usr/bin/env bash
# Generate one ECDSA P-384 key pair per SuperNode (OpenSSH format, what flower-supernode reads).
# Usage: scripts/generate_supernode_keys.sh [OUT_DIR] [N]
#   OUT_DIR  default ./keys;  N  number of SuperNodes, default 3
# Produces OUT_DIR/supernode-<i> (private: stays on that device, passed as
# --auth-supernode-private-key) and OUT_DIR/supernode-<i>.pub (public: registered on the SuperLink
# with `flwr supernode register OUT_DIR/supernode-<i>.pub <connection>`). Existing keys are kept.
set -euo pipefail
out=${1:-keys}
n=${2:-3}
command -v ssh-keygen >/dev/null || { echo "ssh-keygen not found (Debian/Ubuntu: apt-get install openssh-client)" >&2; exit 1; }
mkdir -p "$out"
for ((i = 0; i < n; i++)); do
  [ -f "$out/supernode-$i" ] || ssh-keygen -q -t ecdsa -b 384 -N "" -C "supernode-$i" -f "$out/supernode-$i"
done
echo "wrote $n key pairs in $out (supernode-<i>, supernode-<i>.pub)"
