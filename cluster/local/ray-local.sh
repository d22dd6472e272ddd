#!/usr/bin/env bash
# Start or stop a one-node Ray head on loopback, with its own temp dir and ports, so that it can live
# beside other Ray clusters on the same machine (we never run `ray stop`: it stops every cluster).
#
#   ray-local.sh start STATE_DIR [NUM_CPUS]   writes STATE_DIR/ray.env (RAY_ADDRESS, RAY_DASHBOARD_ADDRESS, ...)
#   ray-local.sh stop STATE_DIR               stops exactly the processes of that head (and its nodes), removes its
#                                             temp dir
#   ray-local.sh join STATE_DIR SLOT ADDR [NUM_CPUS]  adds a node to that head: another loopback address ADDR
#                                             (127.0.0.2, ...), port slot SLOT (1-3), its own temp dir; to try
#                                             several nodes, and elastic runs, on one machine
#   ray-local.sh lose STATE_DIR SLOT          kills that node at once (SIGKILL), as a lost machine
#
# Only this user can use the head: every port listens on 127.0.0.1 alone, and every request must carry the head's
# token (STATE_DIR/ray_auth_token, readable by this user only), since a laptop's or login node's loopback is
# shared by all of its users. Clients get both settings by sourcing STATE_DIR/ray.env.
# Ports: the block of 400 from RAY_BASE_PORT (default 26000), laid out in cluster/lib/ray-ports.sh.
# RAY_OBJECT_STORE_MEMORY (bytes), when set, sizes the head's object store (Ray's default: 30% of the memory).
set -euo pipefail
cd "$(dirname "$0")/../.."
source cluster/lib/ray-ports.sh
export PATH="$PWD/.venv/bin:$PATH"

action=${1:?usage: ray-local.sh start|stop STATE_DIR [NUM_CPUS]}
state_dir=${2:?usage: ray-local.sh start|stop STATE_DIR [NUM_CPUS]}
mkdir -p "$state_dir"
state_dir=$(cd "$state_dir" && pwd)

start() {
  local cpus=${1:-4} base=${RAY_BASE_PORT:-26000}
  # Short path: Ray's unix sockets live under the temp dir and their paths are limited to 107 bytes.
  local temp_dir
  temp_dir=$(mktemp -d /tmp/ray-XXXXXX)
  echo "$temp_dir" > "$state_dir/temp_dir"
  # Ray binds a node's ports to loopback only when it takes the node for a one-machine cluster, as on macOS: this
  # variable, read by every Ray process and client. The token: a new one per head (RAY_AUTH_TOKEN would win).
  local token="$state_dir/ray_auth_token"
  rm -f "$token"
  (umask 077; python -c 'import secrets; print(secrets.token_hex(32))' > "$token")
  unset RAY_AUTH_TOKEN
  export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$token
  # RAY_LOCAL_NODES=1: a head that nodes on other loopback addresses can join (`join`): a multi-node cluster, whose
  # services listen on the node's address; every request still needs the token.
  [ "${RAY_LOCAL_NODES:-0}" = 1 ] && export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1
  # `ray job stop` sends SIGTERM, then SIGKILL after this many seconds (Ray's default: 3); a pipeline needs longer to
  # end its MLflow runs KILLED (a sweep: every child run), read by the job supervisors the head starts.
  export RAY_JOB_STOP_WAIT_TIME_S=${RAY_JOB_STOP_WAIT_TIME_S:-60}
  # setsid: the head and every process it spawns share one new session, which `stop` ends.
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} setsid bash -c 'echo $$ > "$0"; exec "$@"' "$state_dir/sid" \
    ray start --head --disable-usage-stats \
    --node-ip-address 127.0.0.1 --dashboard-host 127.0.0.1 --temp-dir "$temp_dir" --num-cpus "$cpus" \
    ${RAY_OBJECT_STORE_MEMORY:+--object-store-memory "$RAY_OBJECT_STORE_MEMORY"} \
    $(ray_head_port_flags "$base") > "$state_dir/ray-start.log" 2>&1 \
    || { cat "$state_dir/ray-start.log" >&2; stop; exit 1; }
  cat > "$state_dir/ray.env" <<ENV
export RAY_ADDRESS=127.0.0.1:$base
export RAY_DASHBOARD_ADDRESS=http://127.0.0.1:$((base + 1))
export RAY_TEMP_DIR=$temp_dir
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=$RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER
export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN_PATH=$token
unset RAY_AUTH_TOKEN
ENV
  echo "ray head up: RAY_ADDRESS=127.0.0.1:$base dashboard http://127.0.0.1:$((base + 1)) (state: $state_dir)"
}

alive_in_session() {  # any process of session $1 that is not a zombie?
  ps -eo sid=,stat= | awk -v sid="$1" '$1 == sid && $2 !~ /^Z/ {found = 1} END {exit !found}'
}

stop() {
  [ -f "$state_dir/sid" ] || return 0
  local sid temp_dir
  sid=$(cat "$state_dir/sid")
  temp_dir=$(cat "$state_dir/temp_dir" 2>/dev/null || true)
  pkill -TERM -s "$sid" 2>/dev/null || true
  for _ in $(seq 1 15); do  # 3 s of grace; gcs_server and raylet often need SIGKILL anyway
    alive_in_session "$sid" || break
    sleep 0.2
  done
  pkill -KILL -s "$sid" 2>/dev/null || true
  [ -n "$temp_dir" ] && rm -rf "$temp_dir"
  rm -f "$state_dir/sid" "$state_dir/temp_dir" "$state_dir/ray.env" "$state_dir/ray_auth_token"
  echo "ray head stopped ($temp_dir)"
}

join() {
  local slot=${1:?usage: ray-local.sh join STATE_DIR SLOT ADDR [NUM_CPUS]} addr=${2:?usage: ray-local.sh join STATE_DIR SLOT ADDR [NUM_CPUS]}
  local cpus=${3:-1} base=${RAY_BASE_PORT:-26000} temp_dir
  [ -f "$state_dir/ray.env" ] || { echo "no head in $state_dir: ray-local.sh start it first" >&2; exit 1; }
  source "$state_dir/ray.env"
  temp_dir=$(mktemp -d /tmp/ray-XXXXXX)
  echo "$temp_dir" > "$state_dir/node$slot.temp_dir"
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} setsid bash -c 'echo $$ > "$0"; exec "$@"' "$state_dir/node$slot.sid" \
    ray start --address "$RAY_ADDRESS" --disable-usage-stats --node-ip-address "$addr" --temp-dir "$temp_dir" \
    --num-cpus "$cpus" $(ray_node_port_flags "$base" "$slot") > "$state_dir/node$slot.log" 2>&1 \
    || { cat "$state_dir/node$slot.log" >&2; lose "$slot"; exit 1; }
  echo "ray node $addr (slot $slot, $cpus CPUs) joined $RAY_ADDRESS"
}

lose() {
  local slot=$1 sid temp_dir
  [ -f "$state_dir/node$slot.sid" ] || return 0
  sid=$(cat "$state_dir/node$slot.sid")
  temp_dir=$(cat "$state_dir/node$slot.temp_dir" 2>/dev/null || true)
  pkill -KILL -s "$sid" 2>/dev/null || true
  [ -n "$temp_dir" ] && rm -rf "$temp_dir"
  rm -f "$state_dir/node$slot.sid" "$state_dir/node$slot.temp_dir"
  echo "ray node of slot $slot killed"
}

case "$action" in
  start) start "${3:-}" ;;
  stop) for sid_file in "$state_dir"/node*.sid; do [ -f "$sid_file" ] && lose "$(basename "$sid_file" .sid | tr -d node)"; done; stop ;;
  join) join "${3:-}" "${4:-}" "${5:-}" ;;
  lose) lose "${3:?usage: ray-local.sh lose STATE_DIR SLOT}" ;;
  *) echo "unknown action '$action' (start|stop|join|lose)" >&2; exit 2 ;;
esac
