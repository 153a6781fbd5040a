# shellcheck shell=bash disable=SC2034  # the names set here are used by the scripts that source it
# Sourced by the scripts in deploy/netem/: names, option parsing, the netem probe.
#
# The topology for a prefix P (default "df"):
#
#   namespace P-srv                          namespace P-cli
#   veth-srv 10.77.0.1/24  <--- veth --->    veth-cli 10.77.0.2/24
#   (data service, Cassandra, file server)   (the client, the bench)
#
# Shaping applies to the egress of both veth ends, so every direction is delayed:
# RTT = 2 x delay.

DF_NETEM_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
readonly DF_NETEM_DIR

# Exit statuses shared by the scripts.
readonly EXIT_USAGE=2        # bad arguments
readonly EXIT_NO_NETEM=3     # the kernel has no sch_netem: use `dataferry latency-proxy`
readonly EXIT_NO_PRIVILEGE=4 # not root, or `ip`/`tc` missing

prefix='df'
subnet=10.77.0

die() {
  local code=$1
  shift
  echo "netem: error: $*" >&2
  exit "$code"
}

note() { echo "netem: $*" >&2; }

# Names derived from $prefix and $subnet; call after parsing options.
derive_names() {
  [[ $prefix =~ ^[a-zA-Z0-9][a-zA-Z0-9_.-]{0,30}$ ]] || die "$EXIT_USAGE" "--prefix must be a short name ([a-zA-Z0-9_.-]), got '$prefix'"
  [[ $subnet =~ ^[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$ ]] || die "$EXIT_USAGE" "--subnet is three octets such as 10.77.0, got '$subnet'"
  srv_ns="$prefix-srv"
  cli_ns="$prefix-cli"
  srv_dev=veth-srv
  cli_dev=veth-cli
  srv_ip="$subnet.1"
  cli_ip="$subnet.2"
}

need_tools() {
  local tool
  for tool in ip tc; do
    command -v "$tool" >/dev/null 2>&1 || die "$EXIT_NO_PRIVILEGE" "'$tool' not found: install iproute2"
  done
  [[ $EUID -eq 0 ]] || die "$EXIT_NO_PRIVILEGE" "network namespaces and qdiscs need root (run with sudo)"
}

ns_exists() { ip netns list 2>/dev/null | awk '{print $1}' | grep -qxF -- "$1"; }

readonly NO_NETEM_HINT="this kernel has no sch_netem, so tc cannot add delay, jitter or loss.
Use the userspace link emulator instead (delay, jitter and rate, no loss):
    dataferry latency-proxy --listen 127.0.0.1:9043 --upstream HOST:PORT --delay 50ms [--jitter 5ms] [--rate 1gbit]
or run the bench through it: dataferry bench --link proxy
(a rate alone works without netem: --rate uses tbf; dataferry bench --link veth
puts a tbf rate on this topology and the proxy's delay on top)"

# Probe for sch_netem on a throwaway veth pair in a throwaway network namespace
# (unshare -n: the namespace and the pair vanish when the probe exits).
# Returns 0 when netem works, 3 when the kernel lacks it; dies on anything else.
probe_netem() {
  local out
  if out=$(unshare --net -- sh -c 'ip link add p0 type veth peer name p1 && tc qdisc add dev p0 root netem delay 1ms' 2>&1); then
    return 0
  fi
  case $out in
    *"Specified qdisc kind is unknown"* | *"No such file or directory"*) return "$EXIT_NO_NETEM" ;;
    *"Operation not permitted"*) die "$EXIT_NO_PRIVILEGE" "cannot probe for netem without root: $out" ;;
    *) die 1 "the netem probe failed in an unexpected way: $out" ;;
  esac
}

# Shaping options: --delay, --jitter, --loss, --rate. parse_shape_option "$@"
# consumes one option (and its value) and sets $shift_by, or returns 1.
delay=0ms
jitter=0ms
loss=0%
rate=
parse_shape_option() {
  case ${1-} in
    --delay | --jitter | --loss | --rate)
      [[ $# -ge 2 ]] || die "$EXIT_USAGE" "$1 needs a value"
      case $1 in
        --delay) duration_us "$2" >/dev/null && delay=$2 ;;
        --jitter) duration_us "$2" >/dev/null && jitter=$2 ;;
        --loss) loss_percent "$2" >/dev/null && loss=$2 ;;
        --rate) rate_bytes "$2" >/dev/null && rate=$2 ;;
      esac
      shift_by=2
      ;;
    *) return 1 ;;
  esac
}

# "25ms" -> 25000 (microseconds); "0", "0ms", "1.5ms", "2s", "500us" are accepted.
duration_us() {
  local text=$1
  [[ $text =~ ^([0-9]+(\.[0-9]+)?)(us|ms|s)?$ ]] || die "$EXIT_USAGE" "not a duration: '$text' (use e.g. 25ms)"
  local unit=${BASH_REMATCH[3]:-ms}
  awk -v v="${BASH_REMATCH[1]}" -v u="$unit" 'BEGIN { m = (u == "s") ? 1e6 : (u == "ms") ? 1e3 : 1; printf "%d", v * m }'
}

# "0.1%" or "0.1" -> "0.1"
loss_percent() {
  local text=${1%\%}
  [[ $text =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "$EXIT_USAGE" "not a loss percentage: '$1' (use e.g. 0.1%)"
  awk -v v="$text" 'BEGIN { if (v > 100) exit 1 }' || die "$EXIT_USAGE" "loss above 100%: '$1'"
  echo "$text"
}

# "1gbit" -> bytes per second (tc's bit units: bit, kbit, mbit, gbit)
rate_bytes() {
  local text=${1,,}
  [[ $text =~ ^([0-9]+(\.[0-9]+)?)(bit|kbit|mbit|gbit)$ ]] || die "$EXIT_USAGE" "not a rate: '$1' (use e.g. 100mbit or 1gbit)"
  awk -v v="${BASH_REMATCH[1]}" -v u="${BASH_REMATCH[3]}" \
    'BEGIN { m = (u == "gbit") ? 1e9 : (u == "mbit") ? 1e6 : (u == "kbit") ? 1e3 : 1; printf "%d", v * m / 8 }'
}
