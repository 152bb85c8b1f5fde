#!/usr/bin/env bash
# Generate a self-signed CA and a SuperLink server certificate for TLS (openssl).
# Usage: scripts/generate_certs.sh [OUT_DIR] [SERVER_NAMES]
#   OUT_DIR       default ./certs
#   SERVER_NAMES  comma-separated DNS names/IPs in the certificate (default: superlink,localhost,127.0.0.1)
# Produces ca.crt/ca.key (keep ca.key secret) and server.crt/server.key for flower-superlink.
set -euo pipefail
out=${1:-certs}
names=${2:-superlink,localhost,127.0.0.1}
mkdir -p "$out"
san=""
IFS=',' read -ra parts <<< "$names"
for n in "${parts[@]}"; do
  if [[ $n =~ ^[0-9.]+$ ]]; then san+="IP:$n,"; else san+="DNS:$n,"; fi
done
san=${san%,}
openssl req -x509 -newkey rsa:4096 -sha256 -days 365 -nodes -subj "/CN=fedcomp-ca" \
  -keyout "$out/ca.key" -out "$out/ca.crt" 2>/dev/null
openssl req -newkey rsa:4096 -sha256 -nodes -subj "/CN=${parts[0]}" \
  -keyout "$out/server.key" -out "$out/server.csr" 2>/dev/null
openssl x509 -req -in "$out/server.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" -CAcreateserial \
  -days 365 -sha256 -extfile <(printf "subjectAltName=%s" "$san") -out "$out/server.crt" 2>/dev/null
rm -f "$out/server.csr"
chmod 600 "$out"/*.key
echo "wrote $out/ca.crt $out/server.crt $out/server.key (SAN: $san)"
