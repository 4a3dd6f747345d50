#!/usr/bin/env bash
# N wm-refiner replicas and HAProxy in front of them, on loopback, for development and tests.
#
#   deploy/local-cluster.sh --replicas 3 --port 8080 --state-dir /tmp/cluster [--model DIR] [--api-key KEY]
#                           [--vae DIR] [--checkpoint-every-blocks N]
#
# Real processes and the real router: each replica is `python -m app serve` on its own port with its own
# replica_id, all sharing STATE_DIR/snapshots (sessions move between them through it); HAProxy
# (deploy/haproxy.cfg.template) listens on PORT. Once every replica is ready and the router answers, it writes
# STATE_DIR/cluster.json ({"router_port", "replicas": [{"replica_id", "port", "pid"}], "router_pid"}) and waits.
# SIGTERM or Ctrl-C drains every replica (their sessions are saved to the shared folder) and stops the router.
# Logs: STATE_DIR/<replica_id>.log, STATE_DIR/haproxy.log. Needs haproxy (apt-get install haproxy).
set -euo pipefail

replicas=3 port=8080 state_dir="" model="" api_key="" vae="" checkpoint_every=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --replicas) replicas="$2"; shift 2 ;;
        --port) port="$2"; shift 2 ;;
        --state-dir) state_dir="$2"; shift 2 ;;
        --model) model="$2"; shift 2 ;;
        --api-key) api_key="$2"; shift 2 ;;
        --vae) vae="$2"; shift 2 ;;
        --checkpoint-every-blocks) checkpoint_every="$2"; shift 2 ;;
        -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
        *) echo "local-cluster.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
[[ -n "$state_dir" ]] || { echo "local-cluster.sh: --state-dir DIR is required" >&2; exit 2; }
[[ "$replicas" =~ ^[1-9][0-9]*$ ]] || { echo "local-cluster.sh: --replicas must be a positive integer" >&2; exit 2; }
command -v haproxy >/dev/null || { echo "local-cluster.sh: haproxy not found (apt-get install haproxy)" >&2; exit 1; }

root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python}"
mkdir -p "$state_dir/snapshots" "$state_dir/cache"
state_dir="$(cd "$state_dir" && pwd)"

free_port() { "$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

pids=() ports=() ids=() router_pid=""
stop() {
    local status="${1:-0}"
    trap - TERM INT ERR
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    [[ -n "$router_pid" ]] && { kill -TERM "$router_pid" 2>/dev/null || true; wait "$router_pid" 2>/dev/null || true; }
    rm -f "$state_dir/cluster.json"
    exit "$status"
}
trap 'stop 0' TERM INT
trap 'echo "local-cluster.sh: failed (line $LINENO)" >&2; stop 1' ERR

# Every replica knows the others, for GET /v1/sessions to list the whole deployment.
for ((i = 0; i < replicas; i++)); do ports+=("$(free_port)"); done
peers=""
for p in "${ports[@]}"; do peers+="${peers:+,}http://127.0.0.1:$p"; done
for ((i = 0; i < replicas; i++)); do
    replica_port="${ports[$i]}" replica_id="replica-$i"
    (
        cd "$root"
        export WM_REFINER_PORT="$replica_port" WM_REFINER_HOST=127.0.0.1 WM_REFINER_REPLICA_ID="$replica_id"
        export WM_REFINER_SNAPSHOT_DIR="$state_dir/snapshots" WM_REFINER_CACHE_DIR="$state_dir/cache"
        export WM_REFINER_PEERS="$peers"
        # The router (on loopback) sets X-Forwarded-For (option forwardfor): believed from it alone.
        export WM_REFINER_FORWARDED_ALLOW_IPS=127.0.0.1
        [[ -n "$model" ]] && export WM_REFINER_MODEL="$model"
        [[ -n "$api_key" ]] && export WM_REFINER_API_KEY="$api_key"
        [[ -n "$vae" ]] && export WM_REFINER_VAE="$vae"
        [[ -n "$checkpoint_every" ]] && export WM_REFINER_CHECKPOINT_EVERY_BLOCKS="$checkpoint_every"
        exec "$python" -m app serve
    ) >"$state_dir/$replica_id.log" 2>&1 &
    pids+=("$!") ids+=("$replica_id")
    # The first replica builds the embedded tiny refiner; the others wait for it rather than race.
    if [[ $i -eq 0 && -z "$model" ]]; then
        until [[ -f "$state_dir/cache/tiny/config.json" ]]; do
            kill -0 "${pids[0]}" 2>/dev/null || { echo "replica-0 died: see $state_dir/replica-0.log" >&2; stop 1; }
            sleep 0.2
        done
    fi
done

servers=""
for ((i = 0; i < replicas; i++)); do
    servers+="    server ${ids[$i]} 127.0.0.1:${ports[$i]} check"$'\n'
done
template="$(cat "$root/deploy/haproxy.cfg.template")"
config="${template//@ROUTER_BIND@/127.0.0.1:$port}"
config="${config//@SERVERS@/$servers}"
config="${config//@STATS_SOCKET@/$state_dir/haproxy.sock}"
printf '%s\n' "$config" >"$state_dir/haproxy.cfg"
haproxy -c -q -f "$state_dir/haproxy.cfg"
haproxy -db -f "$state_dir/haproxy.cfg" >"$state_dir/haproxy.log" 2>&1 &
router_pid="$!"

ready() { "$python" - "$1" <<'PY'
import sys, httpx
try:
    sys.exit(0 if httpx.get(f"http://127.0.0.1:{sys.argv[1]}/ready", timeout=2).status_code == 200 else 1)
except httpx.HTTPError:
    sys.exit(1)
PY
}
deadline=$((SECONDS + 600))
for ((i = 0; i < replicas; i++)); do
    until ready "${ports[$i]}"; do
        kill -0 "${pids[$i]}" 2>/dev/null || { echo "${ids[$i]} died: see $state_dir/${ids[$i]}.log" >&2; stop 1; }
        (( SECONDS < deadline )) || { echo "${ids[$i]} not ready in time" >&2; stop 1; }
        sleep 0.2
    done
done
# Ready once the router answers and has every replica UP (its checks need a few passes): a session created
# before that would be placed on the ring of the replicas up at the time.
all_up() { "$python" - "$state_dir/haproxy.sock" "$replicas" <<'PY'
import csv, socket, sys
try:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(sys.argv[1])
        sock.sendall(b"show stat\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
except OSError:
    sys.exit(1)
rows = csv.DictReader(data.decode().lstrip("# ").splitlines())
up = [r for r in rows if r["pxname"] == "replicas" and r["svname"] not in ("BACKEND", "FRONTEND") and r["status"] == "UP"]
sys.exit(0 if len(up) == int(sys.argv[2]) else 1)
PY
}
until ready "$port" && all_up; do
    kill -0 "$router_pid" 2>/dev/null || { echo "haproxy died: see $state_dir/haproxy.log" >&2; stop 1; }
    (( SECONDS < deadline )) || { echo "the router did not answer in time" >&2; stop 1; }
    sleep 0.2
done

"$python" - "$state_dir/cluster.json" "$port" "$router_pid" "${ids[*]}" "${ports[*]}" "${pids[*]}" <<'PY'
import json, os, sys
path, port, router_pid, ids, ports, pids = sys.argv[1:]
replicas = [{"replica_id": r, "port": int(p), "pid": int(q)} for r, p, q in zip(ids.split(), ports.split(), pids.split())]
tmp = path + ".tmp"
with open(tmp, "w") as out:
    json.dump({"router_port": int(port), "router_pid": int(router_pid), "replicas": replicas}, out, indent=2)
os.replace(tmp, path)
PY
echo "cluster ready: http://127.0.0.1:$port ($replicas replicas; $state_dir/cluster.json)"
# Wait for a signal (or a replica or the router exiting on its own, which is left for the operator to see).
while true; do sleep 1 & wait $!; done
