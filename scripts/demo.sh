#!/usr/bin/env bash
# Sets up (idempotently) and runs the demo on its embedded default configuration.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec "${PYTHON:-python3}" -m pagedoptim demo "$@"
