#!/usr/bin/env bash
# Start training on THIS node of a SLURM allocation (launch.sbatch runs it once per node with srun).
#
#   launch.sh ACCELERATE_CONFIG RECIPE.yaml [dotted.key=value ...]
#
# From SLURM's environment:
#   --machine_rank      SLURM_NODEID
#   --num_machines      SLURM_NNODES
#   --main_process_ip   the first host of SLURM_JOB_NODELIST (`scontrol show hostnames`; without
#                       scontrol, a plain expansion of lists like "gpu[01-04,07],login1")
#   --num_processes     GPUs per node x nodes; GPUs per node from GPUS_PER_NODE, else SLURM_GPUS_ON_NODE,
#                       else `nvidia-smi -L`, else 1 (one CPU process per node)
# Settings (environment): MAIN_PROCESS_PORT (default 29500), MAX_RESTARTS (>0: elastic c10d rendezvous
# with that many restarts), LAUNCHER=torchrun (torchrun itself, c10d rendezvous; the accelerate config is
# then not used: plain DDP), SLURM_HOSTS (the host list, overriding SLURM_JOB_NODELIST),
# ACCELERATE / TORCHRUN / PYTHON (the commands), DRY_RUN=1 (print the command instead of running it).
set -euo pipefail

if [ $# -lt 2 ]; then
    echo "usage: $0 ACCELERATE_CONFIG RECIPE.yaml [dotted.key=value ...]" >&2
    exit 2
fi
config=$1
shift
if [ ! -f "$config" ]; then
    echo "error: accelerate config $config: no such file" >&2
    exit 2
fi
for var in SLURM_NODEID SLURM_NNODES; do
    if [ -z "${!var:-}" ]; then
        echo "error: $var is not set: run this inside a SLURM allocation (srun), or set it" >&2
        exit 2
    fi
done
nodes=$SLURM_NNODES
rank=$SLURM_NODEID

expand_hosts() {  # SLURM's compact host list -> one name per line
    if command -v scontrol >/dev/null 2>&1; then
        scontrol show hostnames "$1"
        return
    fi
    "${PYTHON:-python3}" - "$1" <<'PY'
import re, sys
for item in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", sys.argv[1]):
    m = re.fullmatch(r"(.*)\[([^\]]*)\](.*)", item)
    if not m:
        print(item)
        continue
    head, ranges, tail = m.groups()
    for r in ranges.split(","):
        lo, _, hi = r.partition("-")
        for i in range(int(lo), int(hi or lo) + 1):
            print(f"{head}{str(i).zfill(len(lo))}{tail}")
PY
}

if [ -n "${SLURM_HOSTS:-}" ]; then
    hosts=$(echo "$SLURM_HOSTS" | tr ', ' '\n\n' | sed '/^$/d')
else
    hosts=$(expand_hosts "${SLURM_JOB_NODELIST:?SLURM_JOB_NODELIST is not set}")
fi
main_ip=${hosts%%$'\n'*}  # the first line (a pipe into head can die of SIGPIPE under pipefail)
port=${MAIN_PROCESS_PORT:-29500}

gpus=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}
if [ -z "$gpus" ] && command -v nvidia-smi >/dev/null 2>&1; then
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
gpus=${gpus:-1}
[ "$gpus" -gt 0 ] 2>/dev/null || gpus=1

if [ "${LAUNCHER:-accelerate}" = torchrun ]; then
    cmd=("${TORCHRUN:-torchrun}" --nnodes "${MIN_NODES:-$nodes}:$nodes" --nproc_per_node "$gpus"
        --rdzv_backend c10d --rdzv_endpoint "$main_ip:$port" --rdzv_id "${SLURM_JOB_ID:-llm-forge}"
        --max-restarts "${MAX_RESTARTS:-0}" -m training.train "$@")
else
    cmd=("${ACCELERATE:-accelerate}" launch --config_file "$config"
        --num_machines "$nodes" --machine_rank "$rank" --num_processes $((gpus * nodes))
        --main_process_ip "$main_ip" --main_process_port "$port")
    if [ "${MAX_RESTARTS:-0}" -gt 0 ]; then
        cmd+=(--rdzv_backend c10d --max_restarts "$MAX_RESTARTS")
    fi
    cmd+=(-m training.train "$@")
fi
echo "node $rank/$nodes on $(hostname): ${cmd[*]}" >&2
if [ -n "${DRY_RUN:-}" ]; then
    printf '%s\n' "${cmd[@]}"
    exit 0
fi
exec "${cmd[@]}"
