#!/usr/bin/env bash
# Tear down the topology of up.sh: stop every process left in its namespaces
# (TERM, then KILL after 5 s), then delete them, which deletes the veth pair.
# Idempotent: succeeds when there is nothing to remove.
#
#   deploy/netem/down.sh [--prefix df]
set -euo pipefail
# shellcheck source=SCRIPTDIR/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

while [[ $# -gt 0 ]]; do
  case $1 in
    --prefix) prefix=${2:?--prefix needs a value}; shift 2 ;;
    -h | --help) sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "$EXIT_USAGE" "unknown option '$1' (see --help)" ;;
  esac
done
derive_names
need_tools

# PIDs of processes in namespace $1, one per line (none: nothing)
ns_pids() { ip netns pids "$1" 2>/dev/null || true; }

for ns in "$srv_ns" "$cli_ns"; do
  ns_exists "$ns" || continue
  mapfile -t pids < <(ns_pids "$ns")
  if [[ ${#pids[@]} -gt 0 ]]; then
    note "stopping ${#pids[@]} process(es) in $ns"
    kill -TERM "${pids[@]}" 2>/dev/null || true
    for _ in $(seq 50); do
      [[ -z $(ns_pids "$ns") ]] && break
      sleep 0.1
    done
    mapfile -t pids < <(ns_pids "$ns")
    [[ ${#pids[@]} -eq 0 ]] || kill -KILL "${pids[@]}" 2>/dev/null || true
  fi
  ip netns del "$ns"
done
note "down: no namespaces '$srv_ns', '$cli_ns'"
