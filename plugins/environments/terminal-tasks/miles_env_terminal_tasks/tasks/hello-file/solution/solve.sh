#!/bin/bash
set -euo pipefail
cd /app
printf 'Hello, World!\n' > /app/hello.txt
