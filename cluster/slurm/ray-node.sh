#!/usr/bin/env bash
# One Ray node inside a Slurm job step (started by ray-cluster.sbatch with srun, one task per node):
#   ray-node.sh head     the head (GCS, dashboard) on this node
#   ray-node.sh worker   a worker that joins the head at RAY_SLURM_HEAD_ADDR
# Runs `ray start --block` in the foreground so the step lives as long as Ray does; when the step is
# signalled (teardown, scancel) it stops this node's Ray processes and removes its temp dir.
# Needs (exported by ray-cluster.sbatch): RAY_SLURM_REPO, RAY_SLURM_BASE_PORT, RAY_SLURM_HEAD_ADDR,
# RAY_AUTH_MODE/RAY_AUTH_TOKEN_PATH; optional RAY_SLURM_KEEP_TEMP=1, RAY_SLURM_EXTRA_ARGS.
set -euo pipefail
role=${1:?usage: ray-node.sh head|worker}
repo=${RAY_SLURM_REPO:?}
base=${RAY_SLURM_BASE_PORT:?}
source "$repo/cluster/lib/ray-ports.sh"
export PATH="$repo/.venv/bin:$PATH"

node=${SLURMD_NODENAME:?not inside a Slurm step}
# NodeAddr, not `hostname`: the address Slurm itself uses for this node (the right interface on clusters
# with several, and distinct for nodes that share a host name).
addr=$(scontrol show node "$node" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
# This node's port slot: its place in the job's node list (cluster/lib/ray-ports.sh).
mapfile -t job_nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
for i in "${!job_nodes[@]}"; do [ "${job_nodes[$i]}" = "$node" ] && slot=$((i % 4)); done
cpus=${SLURM_CPUS_ON_NODE:-1}
gpus=${SLURM_GPUS_ON_NODE:-0}
# Per job and node, short (Ray's unix socket paths must stay under 107 bytes), on node-local disk.
temp_dir="/tmp/ray-slurm-${SLURM_JOB_ID}-${node}"
rm -rf "$temp_dir"  # left over by a killed earlier attempt of the same (requeued) job

args=(--block --disable-usage-stats --node-ip-address "$addr" --temp-dir "$temp_dir"
      --num-cpus "$cpus" --num-gpus "$gpus" ${RAY_SLURM_EXTRA_ARGS:-})
if [ "$role" = head ]; then
  args=(--head --dashboard-host "$addr" $(ray_head_port_flags "$base") "${args[@]}")
else
  args=(--address "${RAY_SLURM_HEAD_ADDR:?}:$base" $(ray_node_port_flags "$base" "${slot:?}") "${args[@]}")
fi

cleanup() {  # quick: Slurm sends SIGKILL KillWait seconds after the TERM
  trap - TERM INT EXIT
  # `|| true`: under set -e a failing kill (`ray start` already ended by itself) would end the cleanup here.
  [ -n "${ray_pid:-}" ] && { kill -TERM "$ray_pid" 2>/dev/null || true; }
  # This node's Ray processes (gcs_server, raylet, workers, agents) all name the temp dir in their arguments.
  pkill -TERM -f -- "$temp_dir" 2>/dev/null || true
  for _ in $(seq 10); do pgrep -f -- "$temp_dir" >/dev/null || break; sleep 0.2; done
  pkill -KILL -f -- "$temp_dir" 2>/dev/null || true
  [ "${RAY_SLURM_KEEP_TEMP:-0}" = 1 ] || rm -rf "$temp_dir"
  echo "ray-node: $role on $node ($addr) stopped"
}
trap cleanup TERM INT EXIT

echo "ray-node: $role on $node ($addr), $cpus CPUs, $gpus GPUs, ports $base.., temp $temp_dir"
# `ray job stop` sends SIGTERM, then SIGKILL after this many seconds (Ray's default: 3); a pipeline needs longer to
# end its MLflow runs KILLED (a sweep: every child run), read by the job supervisors the head starts.
export RAY_JOB_STOP_WAIT_TIME_S=${RAY_JOB_STOP_WAIT_TIME_S:-60}
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} ray start "${args[@]}" &
ray_pid=$!
wait "$ray_pid"
