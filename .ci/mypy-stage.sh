#!/usr/bin/env bash
# Lays out the installed package tree (strata/, with coordinator/, worker/ and protos/ as its
# subpackages, as pyproject.toml's package-dir maps them) as symlinks under build/typecheck, so
# that mypy sees the same module names Python imports: strata.coordinator.core, ...
set -euo pipefail
cd "$(dirname "$0")/.."
stage=build/typecheck/strata
rm -rf build/typecheck && mkdir -p "$stage"
for f in strata/*; do ln -s "../../../$f" "$stage/$(basename "$f")"; done
for d in coordinator worker protos; do ln -s "../../../$d" "$stage/$d"; done
echo build/typecheck
