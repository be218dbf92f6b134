#!/usr/bin/env bash
# Make a private CA and a SuperLink certificate for the TLS profile / real devices, and with
# --sites N a certificate for each compose site's SuperNode Runtime API (site-<i>.pem/.key, name
# supernode-<i>: its SuperExec checks it).
#   deploy/make-certs.sh [--sites N] [OUT_DIR] [EXTRA_SAN ...]
# SANs always include DNS:superlink (compose), DNS:localhost, IP:127.0.0.1; add the names or
# addresses your devices use to reach the SuperLink, e.g. IP:192.0.2.10 DNS:fl.example.org.
# Keys are 0600 and owned by whoever runs this; deploy/prepare.sh hands the ones containers
# read to their user. ca.key signs certificates: keep it off every site.
set -euo pipefail
sites=0
if [ "${1:-}" = --sites ]; then sites=$2; shift 2; fi
out="${1:-deploy/certs}"; shift || true
mkdir -p "$out"
umask 077
san="DNS:superlink,DNS:localhost,IP:127.0.0.1"
for extra in "$@"; do san="$san,$extra"; done

issue() {  # issue NAME CN SANS: NAME.key and NAME.pem signed by the CA
  openssl genrsa -out "$out/$1.key" 4096 2>/dev/null
  openssl req -new -key "$out/$1.key" -subj "/CN=$2" -out "$out/$1.csr"
  printf "subjectAltName=%s\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n" \
    "$3" > "$out/$1.ext"
  openssl x509 -req -in "$out/$1.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" \
    -CAcreateserial -days 365 -sha256 -extfile "$out/$1.ext" -out "$out/$1.pem" 2>/dev/null
  rm -f "$out/$1.csr" "$out/$1.ext"
  chmod 644 "$out/$1.pem"
}

openssl genrsa -out "$out/ca.key" 4096 2>/dev/null
openssl req -x509 -new -key "$out/ca.key" -sha256 -days 365 -subj "/CN=pflower-ca" \
  -out "$out/ca.crt"
chmod 644 "$out/ca.crt"
issue server superlink "$san"
for ((i = 0; i < sites; i++)); do
  issue "site-$i" "supernode-$i" "DNS:supernode-$i,DNS:localhost,IP:127.0.0.1"
done
echo "CA: $out/ca.crt  SuperLink: $out/server.pem $out/server.key  SANs: $san"
