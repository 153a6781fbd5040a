#!/usr/bin/env bash
# Shape both ends of the veth pair made by up.sh. Each end delays its egress, so
# RTT = 2 x delay; loss applies to each direction; rate caps each direction.
#
#   deploy/netem/shape.sh [--prefix df] [--delay 25ms] [--jitter 2ms] [--loss 0.1%] [--rate 1gbit]
#
# Delay, jitter or loss need sch_netem (exit 3 with a pointer to the latency
# proxy when the kernel lacks it). A rate alone uses tbf, which works without
# netem. No options: back to the default qdisc (no shaping).
set -euo pipefail
# shellcheck source=SCRIPTDIR/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

while [[ $# -gt 0 ]]; do
  if parse_shape_option "$@"; then
    shift "$shift_by"
    continue
  fi
  case $1 in
    --prefix) prefix=${2:?--prefix needs a value}; shift 2 ;;
    -h | --help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "$EXIT_USAGE" "unknown option '$1' (see --help)" ;;
  esac
done
derive_names
need_tools
if ! ns_exists "$srv_ns" || ! ns_exists "$cli_ns"; then
  die 1 "no topology '$prefix': run up.sh --prefix $prefix first"
fi

delay_us=$(duration_us "$delay")
jitter_us=$(duration_us "$jitter")
loss_pct=$(loss_percent "$loss")
[[ -z $rate ]] || rate_Bps=$(rate_bytes "$rate")

if ((delay_us > 0 || jitter_us > 0)) || [[ $loss_pct != 0 && $loss_pct != 0.0 ]]; then
  if ! probe_netem; then
    echo "netem: $NO_NETEM_HINT" >&2
    exit "$EXIT_NO_NETEM"
  fi
  # limit: packets held, enough for the bandwidth-delay product of a fast veth
  qdisc=(netem limit 1000000 delay "${delay_us}us")
  ((jitter_us > 0)) && qdisc+=("${jitter_us}us")
  [[ $loss_pct == 0 || $loss_pct == 0.0 ]] || qdisc+=(loss random "${loss_pct}%")
  [[ -z $rate ]] || qdisc+=(rate "$rate")
elif [[ -n $rate ]]; then
  # burst: 10 ms at the rate, and at least two 64 KiB GSO packets
  burst=$((rate_Bps / 100 > 131072 ? rate_Bps / 100 : 131072))
  qdisc=(tbf rate "$rate" burst "$burst" latency 100ms)
else
  qdisc=()
fi

for end in "$srv_ns:$srv_dev" "$cli_ns:$cli_dev"; do
  ns=${end%%:*}
  dev=${end#*:}
  tc -n "$ns" qdisc del dev "$dev" root 2>/dev/null || true
  if [[ ${#qdisc[@]} -gt 0 ]]; then
    tc -n "$ns" qdisc add dev "$dev" root "${qdisc[@]}"
  fi
done
if [[ ${#qdisc[@]} -gt 0 ]]; then
  note "$prefix: ${qdisc[*]} on both ends"
else
  note "$prefix: no shaping"
fi
