# Sourced by the cluster scripts: `ray start` port flags inside one cluster's block of RAY_PORT_BLOCK ports.
# Layout from BASE: BASE..BASE+2 the head's GCS, dashboard and client server; BASE+9 an MLflow server; per
# node slot s (0..3): BASE+20+6s .. +5 the node's services and BASE+100+75s .. +74 its worker ports.
# A block per cluster lets several clusters share a machine. Slots matter only where nodes of one cluster
# share a host (the one-machine Slurm of cluster/dev); nodes on different hosts may use the same slot.
RAY_PORT_BLOCK=400

ray_node_port_flags() {  # BASE SLOT
  local base=$1 slot=${2:-0}
  local node=$((base + 20 + 6 * slot)) workers=$((base + 100 + 75 * slot))
  echo --node-manager-port "$node" --object-manager-port $((node + 1)) \
    --metrics-export-port $((node + 2)) --dashboard-agent-grpc-port $((node + 3)) \
    --dashboard-agent-listen-port $((node + 4)) --runtime-env-agent-port $((node + 5)) \
    --min-worker-port "$workers" --max-worker-port $((workers + 74))
}

ray_head_port_flags() {  # BASE: the head's services and its node ports (slot 0)
  local base=$1
  echo --port "$base" --dashboard-port $((base + 1)) --ray-client-server-port $((base + 2)) \
    $(ray_node_port_flags "$base" 0)
}
