#!/bin/bash
set -euo pipefail
cd /app
sed -i -e 's|^DATABASE_URL=.*|DATABASE_URL=postgres://db:5432/prod|' -e '/^SECRET_TOKEN=/d' /app/app.env
echo 'LOG_LEVEL=debug' >> /app/app.env
