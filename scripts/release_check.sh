#!/usr/bin/env bash
# Before a release: everything CI runs, plus the `release` tier (the full products of the long
# matrices, e.g. the client conformance matrix's 11 architectures x 5 recipes x 4 clients, where CI
# runs a cover that reaches every architecture, recipe, client, refusal and client limit once).
# About 20 minutes more than CI on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/run
bash .ci/llama-cpp-python
export QC_REQUIRE_LLAMA_CPP=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
source .ci/client-venvs "$tmp"
pytest -m release
