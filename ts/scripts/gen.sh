#!/bin/sh
# Generate src/gen from ../proto (and proto/third_party) with buf and protoc-gen-es.
#   scripts/gen.sh           regenerate
#   scripts/gen.sh --check   fail if regenerating would change a byte of src/gen
# buf is $BUF, else ../.venv/bin/buf (installed by ../dev setup), else buf on PATH.
# Without buf the check says so and fails under CI (CI=true), else it is skipped loudly.
set -eu
cd "$(dirname "$0")/.."
buf=${BUF:-}
if [ -z "$buf" ]; then
  if [ -x ../.venv/bin/buf ]; then buf=../.venv/bin/buf; else buf=$(command -v buf || true); fi
fi
if [ -z "$buf" ]; then
  echo "gen: buf not found (set BUF, or run ../dev setup)" >&2
  if [ "${1:-}" = "--check" ] && [ "${CI:-}" != "true" ]; then
    echo "gen: SKIPPED the check that src/gen matches the proto" >&2
    exit 0
  fi
  exit 1
fi
if [ "${1:-}" != "--check" ]; then
  exec "$buf" generate
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -R src/gen "$work/committed"
"$buf" generate
if diff -r "$work/committed" src/gen >/dev/null; then
  echo "gen: src/gen matches the proto"
else
  diff -r "$work/committed" src/gen | head -20 >&2
  rm -rf src/gen && cp -R "$work/committed" src/gen
  echo "gen: src/gen is stale: run npm run gen and commit the result" >&2
  exit 1
fi
