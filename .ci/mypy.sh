#!/usr/bin/env bash
# mypy cannot follow setuptools' package-dir mapping of the editable install,
# so lay the import package out as a tree of symlinks and check that.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
tree=$(mktemp -d)
mkdir -p "$tree/kvhandoff"
ln -s "$root/pkg/__init__.py" "$tree/kvhandoff/__init__.py"
for layer in protocol topology actors cli tools; do ln -s "$root/$layer" "$tree/kvhandoff/$layer"; done
cd "$tree"
mypy --config-file "$root/pyproject.toml" -p kvhandoff.protocol -p kvhandoff.topology -p kvhandoff.tools
