#!/bin/bash
set -euo pipefail
cd /app
tmp=$(mktemp -d /app/.unpack.XXXXXX)
tar -xzf /app/bundle.tar.gz -C "$tmp"
tar -xf "$tmp/bundle/inner.tar" -C "$tmp"
gzip -dc "$tmp/data/secret.txt.gz" > /app/secret.txt
rm -rf "$tmp"
