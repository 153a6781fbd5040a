#!/usr/bin/env bash
# One experiment on an emulated link: build the topology, shape it, run a server
# in P-srv, run a client command in P-cli, and tear everything down afterwards
# (on success, failure or Ctrl-C). Exits with the client's status.
#
#   deploy/netem/lab.sh [--prefix df] [--subnet 10.77.0] [--delay 25ms] [--jitter 2ms] [--loss 0.1%] [--rate 1gbit] \
#       [--server 'COMMAND' --ready PORT [--ready-timeout 60]] -- CLIENT COMMAND...
#
# Both commands see SRV_IP and CLI_IP in their environment; the server command
# is a bash string (quote it), e.g.
#   deploy/netem/lab.sh --delay 50ms --server 'dataferry serve --store sqlite:data.db --host $SRV_IP --port 8470' \
#       --ready 8470 -- curl -s http://10.77.0.1:8470/readyz
set -euo pipefail
# shellcheck source=SCRIPTDIR/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

up_args=()
server=
ready=
ready_timeout=60
while [[ $# -gt 0 ]]; do
  if parse_shape_option "$@"; then
    up_args+=("$1" "$2")
    shift 2
    continue
  fi
  case $1 in
    --prefix) prefix=${2:?--prefix needs a value}; shift 2 ;;
    --subnet) subnet=${2:?--subnet needs a value}; shift 2 ;;
    --server) server=${2:?--server needs a command}; shift 2 ;;
    --ready) ready=${2:?--ready needs a port}; shift 2 ;;
    --ready-timeout) ready_timeout=${2:?--ready-timeout needs seconds}; shift 2 ;;
    -h | --help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --) shift; break ;;
    *) die "$EXIT_USAGE" "unknown option '$1' (the client command goes after --; see --help)" ;;
  esac
done
[[ $# -gt 0 ]] || die "$EXIT_USAGE" "no client command: put it after --"
[[ -z $ready || $ready =~ ^[0-9]+$ ]] || die "$EXIT_USAGE" "--ready is a port number, got '$ready'"
[[ $ready_timeout =~ ^[0-9]+$ ]] || die "$EXIT_USAGE" "--ready-timeout is whole seconds, got '$ready_timeout'"
derive_names
need_tools
export SRV_IP=$srv_ip CLI_IP=$cli_ip

server_pid=
# shellcheck disable=SC2317  # invoked by the EXIT trap
teardown() {
  local status=$?
  trap - EXIT INT TERM
  if [[ -n $server_pid ]]; then
    # the group, and the process itself in case it has not reached setsid yet
    kill -TERM -- "-$server_pid" "$server_pid" 2>/dev/null || true
  fi
  # down.sh also stops whatever is still running in the namespaces
  "$DF_NETEM_DIR/down.sh" --prefix "$prefix" || status=1
  if [[ -n $server_pid ]]; then
    for _ in $(seq 50); do
      kill -0 "$server_pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -KILL -- "-$server_pid" "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
  fi
  exit "$status"
}
trap teardown EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

"$DF_NETEM_DIR/up.sh" --prefix "$prefix" --subnet "$subnet" "${up_args[@]}"

if [[ -n $server ]]; then
  # setsid: the server gets its own process group, so teardown reaches its children
  ip netns exec "$srv_ns" setsid bash -c "$server" &
  server_pid=$!
  if [[ -n $ready ]]; then
    for ((i = 0; ; i++)); do
      kill -0 "$server_pid" 2>/dev/null || die 1 "the server exited before $srv_ip:$ready answered"
      if ip netns exec "$cli_ns" bash -c "exec 3<>/dev/tcp/$srv_ip/$ready" 2>/dev/null; then
        break
      fi
      ((i < ready_timeout * 5)) || die 1 "nothing answered on $srv_ip:$ready within ${ready_timeout}s"
      sleep 0.2
    done
    note "server ready on $srv_ip:$ready"
  fi
fi

set +e
ip netns exec "$cli_ns" "$@"
status=$?
set -e
exit "$status"
