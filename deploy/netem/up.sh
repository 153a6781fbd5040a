#!/usr/bin/env bash
# Build the two-namespace topology: P-srv (veth-srv, 10.77.0.1/24) <-> P-cli
# (veth-cli, 10.77.0.2/24), then shape it (options as for shape.sh).
#
#   deploy/netem/up.sh [--prefix df] [--subnet 10.77.0] [--delay 25ms] [--jitter 2ms] [--loss 0.1%] [--rate 1gbit]
#
# Nothing is made outside the two namespaces. On any failure what was made is
# torn down again; down.sh --prefix P removes it all later.
set -euo pipefail
# shellcheck source=SCRIPTDIR/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

shape=()
while [[ $# -gt 0 ]]; do
  if parse_shape_option "$@"; then
    shape+=("$1" "$2")
    shift 2
    continue
  fi
  case $1 in
    --prefix) prefix=${2:?--prefix needs a value}; shift 2 ;;
    --subnet) subnet=${2:?--subnet needs a value}; shift 2 ;;
    -h | --help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "$EXIT_USAGE" "unknown option '$1' (see --help)" ;;
  esac
done
derive_names
need_tools
for ns in "$srv_ns" "$cli_ns"; do
  ! ns_exists "$ns" || die 1 "namespace '$ns' exists already: run down.sh --prefix $prefix first"
done

cleanup_on_failure() {
  local status=$?
  if ((status != 0)); then
    "$DF_NETEM_DIR/down.sh" --prefix "$prefix" >/dev/null 2>&1 || true
  fi
  exit "$status"
}
trap cleanup_on_failure EXIT

ip netns add "$srv_ns"
ip netns add "$cli_ns"
ip -n "$srv_ns" link add "$srv_dev" type veth peer name "$cli_dev" netns "$cli_ns"
ip -n "$srv_ns" addr add "$srv_ip/24" dev "$srv_dev"
ip -n "$cli_ns" addr add "$cli_ip/24" dev "$cli_dev"
for ns in "$srv_ns" "$cli_ns"; do
  ip -n "$ns" link set lo up
done
ip -n "$srv_ns" link set "$srv_dev" up
ip -n "$cli_ns" link set "$cli_dev" up
"$DF_NETEM_DIR/shape.sh" --prefix "$prefix" "${shape[@]}"
note "up: $srv_ns ($srv_dev $srv_ip) <-> $cli_ns ($cli_dev $cli_ip)"
