#!/usr/bin/env bash
# Make a private CA and a SuperLink certificate for the TLS profile / real devices.
#   deploy/make-certs.sh [OUT_DIR] [EXTRA_SAN ...]
# SANs always include DNS:superlink (compose), DNS:localhost, IP:127.0.0.1; add the names or
# addresses your devices use to reach the SuperLink, e.g. IP:192.0.2.10 DNS:fl.example.org.
set -euo pipefail
out="${1:-deploy/certs}"; shift || true
mkdir -p "$out"
san="DNS:superlink,DNS:localhost,IP:127.0.0.1"
for extra in "$@"; do san="$san,$extra"; done
openssl genrsa -out "$out/ca.key" 4096 2>/dev/null
openssl req -x509 -new -key "$out/ca.key" -sha256 -days 365 -subj "/CN=pflower-ca" \
  -out "$out/ca.crt"
openssl genrsa -out "$out/server.key" 4096 2>/dev/null
openssl req -new -key "$out/server.key" -subj "/CN=superlink" -out "$out/server.csr"
printf "subjectAltName=%s\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n" \
  "$san" > "$out/server.ext"
openssl x509 -req -in "$out/server.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" \
  -CAcreateserial -days 365 -sha256 -extfile "$out/server.ext" -out "$out/server.pem" 2>/dev/null
rm -f "$out/server.csr" "$out/server.ext"
chmod 600 "$out/ca.key" "$out/server.key"
echo "CA: $out/ca.crt  SuperLink: $out/server.pem $out/server.key  SANs: $san"
