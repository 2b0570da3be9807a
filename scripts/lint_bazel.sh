#!/usr/bin/env bash
# Lint the Bazel files (BUILD.bazel, MODULE.bazel, bazel/BUILD.bazel) with buildifier: formatting
# (--mode=check) and lint warnings (--lint=warn); any finding fails. A Bazel build cannot run on
# this project's machines (README, "Bazel" says why), so CI checks the files this way instead.
# buildifier comes from the npm registry (@bazel/buildifier ships the binaries in the package) and
# is cached under ~/.cache/jax-cake-gdn/. Without npm the check is skipped with a message.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=8.2.1
DIR=${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/jax-cake-gdn/buildifier-$VERSION
BIN=$DIR/node_modules/@bazel/buildifier/buildifier-linux_amd64
case "$(uname -m)" in
  x86_64) ;;
  aarch64) BIN=${BIN%amd64}arm64 ;;
  *) echo "lint_bazel: SKIPPED: no buildifier binary for $(uname -m)" >&2; exit 0 ;;
esac
if [ ! -x "$BIN" ]; then
  if ! command -v npm >/dev/null 2>&1; then
    echo "lint_bazel: SKIPPED: npm not found (buildifier comes from the npm package @bazel/buildifier)" >&2
    exit 0
  fi
  echo "lint_bazel: installing @bazel/buildifier@$VERSION into $DIR" >&2
  mkdir -p "$DIR"
  npm install --prefix "$DIR" --no-save --no-audit --no-fund --loglevel=error \
    "@bazel/buildifier@$VERSION" >&2
fi
FILES=(BUILD.bazel MODULE.bazel bazel/BUILD.bazel)
if ! "$BIN" --mode=check --lint=warn --warnings=all "${FILES[@]}"; then
  echo "lint_bazel: FAILED (fix with: $BIN --lint=fix ${FILES[*]})" >&2
  exit 1
fi
echo "lint_bazel: OK: buildifier $VERSION --mode=check --lint=warn: ${FILES[*]}"
