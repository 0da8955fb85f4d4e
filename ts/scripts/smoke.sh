#!/usr/bin/env bash
# The TypeScript participants against the conformance kit (`turnpoint conformance`,
# apps/conformance/), over the wire, on 127.0.0.1 with OS-picked ports.
#
#   scripts/smoke.sh            the TypeScript resources server (guess)
#   scripts/smoke.sh --agent    also the TypeScript agent, wired to the Python policy
#                               server (needs torch) and the TypeScript resources server
#
# Needs a built ts/ (npm run build) and the Python side set up (../dev setup); the
# `turnpoint` command is $TURNPOINT, else ../.venv/bin/turnpoint. Exits non-zero when a
# check failed or a server did not start.
set -euo pipefail
cd "$(dirname "$0")/.."
turnpoint=${TURNPOINT:-../.venv/bin/turnpoint}
agent=false
[ "${1:-}" = "--agent" ] && agent=true

work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$work/token"
export TURNPOINT_TOKEN_FILE="$work/token"
unset TURNPOINT_TOKEN

# start NAME COMMAND...: run it in the background, wait (bounded) for its serving line,
# set $address to what it printed.
start() {
  local name=$1
  shift
  "$@" >"$work/$name.out" 2>"$work/$name.err" &
  pids+=($!)
  local pid=$!
  for _ in $(seq 600); do
    if grep -q '^turnpoint: serving ' "$work/$name.out"; then
      address=$(sed -nE 's/^turnpoint: serving [^ ]+ [^ ]+ on ([^ ]+)$/\1/p' "$work/$name.out" | head -1)
      return 0
    fi
    if ! kill -0 "$pid" 2>/dev/null; then break; fi
    sleep 0.1
  done
  echo "smoke: $name did not start; its stderr says:" >&2
  cat "$work/$name.err" >&2
  return 1
}

check() {
  echo "== turnpoint conformance against the TypeScript $1 ($2)"
  "$turnpoint" conformance --target "$2" --token-file "$work/token" \
    --workload scripts/guess-workload.json --lease 0.5 "${@:3}"
}

status=0
start tools node dist/examples/guess-resources.js --instance tools --root "$work/snapshots" \
  --verifier-log "$work/verifier-tools.jsonl"
tools=$address
# Fresh processes of it on the same root, one per check that restores (a participant
# takes one restore): the first goes to the equivalence check, the second to the effects
# check, which restores the session it recorded there and re-sends the call
# (docs/spec.md sections 5.6 and 6.12).
start tools-restored node dist/examples/guess-resources.js --instance tools --root "$work/snapshots"
restored=$address
start tools-effects node dist/examples/guess-resources.js --instance tools --root "$work/snapshots"
check "resources server" "$tools" --restore-target "$restored" --restore-target "$address" || status=1

# The equivalence check (docs/spec.md section 5.6): a second, fresh resources server of
# the same instance over the same snapshot root takes the restores.
start tools-fresh node dist/examples/guess-resources.js --instance tools --root "$work/snapshots"
echo "== turnpoint conformance --equivalence against the TypeScript resources server"
"$turnpoint" conformance --target "$tools" --token-file "$work/token" --only equivalence \
  --equivalence scripts/guess-equivalence.json --restore-target "$address" \
  --snapshot-root "$work/snapshots" || status=1

if $agent; then
  start policy "$turnpoint" serve --kind model --instance policy --root "$work/snapshots"
  policy=$address
  # A fresh resources server for the agent: the one above is no longer fresh.
  start tools2 node dist/examples/guess-resources.js --instance tools2 --root "$work/snapshots"
  start agent node dist/examples/guess-agent.js --instance agent-0 --root "$work/snapshots" \
    --policy "$policy" --resources "guess=$address"
  check "agent" "$address" || status=1
fi
exit $status
