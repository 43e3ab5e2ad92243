"""What run_inter.sh does on every node before torchrun: the node-type check and the rendezvous.

The same run_inter.sh serves the Slurm, SSH and manual launchers, so both steps read only its environment:

* Node-type check: the GPU name the node reports (`nvidia-smi --query-gpu=name`, or `FASOP_GPU_NAME` where
  there is no nvidia-smi, e.g. CPU test runs) must hold the plan's GPU for this node rank as whole words, in
  capitals with punctuation dropped: plan GPU `A10` matches "NVIDIA A10" but not "NVIDIA A100-SXM4-40GB",
  `RTX4090` matches "NVIDIA GeForce RTX 4090". Every GPU the node lists must match; a host list in the wrong
  order stops here instead of training slowly.
* Rendezvous (`FASOP_RENDEZVOUS`): `tcp` (default) meets at MASTER_ADDR:MASTER_PORT. `file:///PATH` (a
  path on a file system every node sees): node rank 0 writes "ADDRESS PORT" into PATH (its MASTER_ADDR, else
  its host name), the others wait for the file and read where to meet, so only node rank 0 needs to know
  its address. `FASOP_RUN_ID`, when set, is appended to PATH (`PATH.RUN_ID`) so that runs never read each
  other's file. torchrun then meets there as with `tcp` (its static rendezvous keeps the plan's node ranks;
  its own file-store rendezvous would renumber the nodes).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from fasop.launch.shell import bash_array, quote

RENDEZVOUS_TIMEOUT_S = 600  # how long nodes other than rank 0 wait for the rendezvous file


def startup_lines(node_types: Sequence[str], node_gpus: Sequence[str], gpus_per_node: int,
                  master_port: int) -> list[str]:
    """run_inter.sh's lines before torchrun: the node count, this node's rank (checked), the GPU type check
    and MASTER_ADDR/PORT; `node_types` and `node_gpus` are the plan's node type and GPU of each node rank."""
    return [*_node_rank_lines(node_types, node_gpus, gpus_per_node), "", *_gpu_check_lines(), "",
            *_rendezvous_lines(master_port)]


def _node_rank_lines(node_types: Sequence[str], node_gpus: Sequence[str], gpus_per_node: int) -> list[str]:
    return [
        f"NNODES={len(node_gpus)}",
        "NODE_TYPES=(" + " ".join(quote(n) for n in node_types) + ")",
        f"GPUS_PER_NODE={gpus_per_node}",
        'NODE_RANK="${SLURM_PROCID:-${NODE_RANK:-}}"',
        'if [[ ! "$NODE_RANK" =~ ^[0-9]+$ ]] || (( NODE_RANK >= NNODES )); then',
        '    echo "run_inter.sh: node rank \'$NODE_RANK\' is not 0 to $((NNODES - 1)); start under srun or set NODE_RANK" >&2',
        "    exit 1",
        "fi",
        "NODE_GPUS=(" + " ".join(quote(gpu) for gpu in node_gpus) + ")",
    ]


def _gpu_check_lines() -> list[str]:
    return [
        "# The node must carry the GPU type the plan gives its node rank (a host list in the wrong order stops here).",
        "gpu_matches() {  # gpu_matches PLAN_GPU REPORTED_NAME: are PLAN_GPU's letters a run of whole words of the name?",
        '    local want="${1^^}" name="${2^^}" joined i j',
        '    local -a words',
        '    want="${want//[^A-Z0-9]/}"',
        '    read -ra words <<< "${name//[^A-Z0-9]/ }"',
        '    for (( i = 0; i < ${#words[@]}; i++ )); do',
        '        joined=""',
        '        for (( j = i; j < ${#words[@]}; j++ )); do',
        '            joined+="${words[j]}"',
        '            if [[ "$joined" == "$want" ]]; then return 0; fi',
        "        done",
        "    done",
        "    return 1",
        "}",
        'PLAN_GPU="${NODE_GPUS[$NODE_RANK]}"',
        'if [[ -n "${FASOP_GPU_NAME:-}" ]]; then',
        '    GPU_NAMES="$FASOP_GPU_NAME"',
        'elif ! GPU_NAMES="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)"; then',
        '    echo "run_inter.sh: node rank $NODE_RANK on $(hostname): nvidia-smi is missing or failed, so the GPU type' +
        ' cannot be checked; set FASOP_GPU_NAME to the node\'s GPU name" >&2',
        "    exit 1",
        "fi",
        'if [[ -z "${GPU_NAMES//[[:space:]]/}" ]]; then',
        '    echo "run_inter.sh: node rank $NODE_RANK on $(hostname) reports no GPU; the plan needs $PLAN_GPU" >&2',
        "    exit 1",
        "fi",
        "while IFS= read -r GPU_NAME; do",
        '    if [[ -n "$GPU_NAME" ]] && ! gpu_matches "$PLAN_GPU" "$GPU_NAME"; then',
        '        echo "run_inter.sh: node rank $NODE_RANK on $(hostname) has GPU \'$GPU_NAME\', but the plan places a' +
        ' ${NODE_TYPES[$NODE_RANK]} node ($PLAN_GPU) at this rank; check the order of the hosts' +
        ' (node types in node-rank order: ${NODE_TYPES[*]})" >&2',
        "        exit 1",
        "    fi",
        'done <<< "$GPU_NAMES"',
    ]


def _rendezvous_lines(master_port: int) -> list[str]:
    return [
        f'MASTER_PORT="${{MASTER_PORT:-{master_port}}}"',
        'RENDEZVOUS="${FASOP_RENDEZVOUS:-tcp}"',
        'case "$RENDEZVOUS" in',
        "tcp)",
        '    MASTER_ADDR="${MASTER_ADDR:?run_inter.sh: set MASTER_ADDR to the address of node rank 0}"',
        "    ;;",
        "file:///*)",
        '    RENDEZVOUS_FILE="${RENDEZVOUS#file://}${FASOP_RUN_ID:+.$FASOP_RUN_ID}"',
        "    if (( NODE_RANK == 0 )); then",
        '        MASTER_ADDR="${MASTER_ADDR:-$(hostname)}"',
        '        printf \'%s %s\\n\' "$MASTER_ADDR" "$MASTER_PORT" > "$RENDEZVOUS_FILE.$(hostname).$$"',
        '        mv -f "$RENDEZVOUS_FILE.$(hostname).$$" "$RENDEZVOUS_FILE"  # whole or absent for the readers',
        "    else",
        f'        WAIT_S="${{FASOP_RENDEZVOUS_TIMEOUT_S:-{RENDEZVOUS_TIMEOUT_S}}}"',
        '        until [[ -s "$RENDEZVOUS_FILE" ]]; do',
        "            if (( SECONDS >= WAIT_S )); then",
        '                echo "run_inter.sh: node rank $NODE_RANK: no rendezvous file $RENDEZVOUS_FILE from node rank 0' +
        ' after $WAIT_S s" >&2',
        "                exit 1",
        "            fi",
        "            sleep 1",
        "        done",
        '        read -r MASTER_ADDR MASTER_PORT < "$RENDEZVOUS_FILE"',
        "    fi",
        "    ;;",
        "*)",
        '    echo "run_inter.sh: FASOP_RENDEZVOUS=\'$RENDEZVOUS\': expected tcp or file:///PATH" >&2',
        "    exit 1",
        "    ;;",
        "esac",
        'if [[ ! "$MASTER_PORT" =~ ^[0-9]+$ ]] || [[ ! "$MASTER_ADDR" =~ ^[A-Za-z0-9][A-Za-z0-9_.:-]*$ ]]; then',
        '    echo "run_inter.sh: rendezvous \'$MASTER_ADDR:$MASTER_PORT\' is not an address and a port" >&2',
        "    exit 1",
        "fi",
    ]


def torchrun_lines(arrays: Sequence[tuple[str, Iterable[Sequence[str]]]], *leading: str,
                   before_run: Sequence[str] = ()) -> list[str]:
    """The torchrun call after startup_lines: every node meets at MASTER_ADDR:MASTER_PORT as node rank
    NODE_RANK; the entry script gets the `leading` words, then each (name, flags) bash array in order, as
    the `before_run` lines leave them."""
    words = [*leading, *(f'"${{{name}[@]}}"' for name, _ in arrays)]
    return [
        "DISTRIBUTED_ARGS=(",
        '    --nnodes "$NNODES" --nproc_per_node "$GPUS_PER_NODE" --node_rank "$NODE_RANK"',
        '    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"',
        ")",
        *(bash_array(name, flags) for name, flags in arrays),
        *before_run,
        "",
        'exec torchrun "${DISTRIBUTED_ARGS[@]}" "$ENTRY_SCRIPT" \\',
        "    " + " ".join(words),
        "",
    ]
