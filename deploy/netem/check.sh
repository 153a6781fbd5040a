#!/usr/bin/env bash
# Does this kernel have sch_netem? Exit 0 if yes; 3 (with a pointer to the
# userspace latency proxy) if not; 4 without root or iproute2.
#
#   deploy/netem/check.sh
set -euo pipefail
# shellcheck source=SCRIPTDIR/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

case ${1-} in
  -h | --help) sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  "") ;;
  *) die "$EXIT_USAGE" "check.sh takes no arguments" ;;
esac
need_tools
if probe_netem; then
  echo "netem: available (tc qdisc ... netem works on this kernel)"
else
  echo "netem: $NO_NETEM_HINT" >&2
  exit "$EXIT_NO_NETEM"
fi
