"""The launchers of a FlagScale run (fasop.launch.flagscale): FlagScale's runner (`run.py`) is started once, on
the first node, and starts every node over SSH itself from its hostfile, whose line order sets the node ranks
and whose `type=` labels place the ranks on the meshes.

* `sbatch.sh` (Slurm): one job over every node type, one heterogeneous-job component per run of nodes of one
  type in node-rank order (fasop.launch.slurm's directives); it writes the hostfile from the allocation;
* `launch.sh` (ssh): the same from the `hosts` file (`HOST NODE_TYPE` lines in node-rank order);
* `commands.txt` (manual): the one command, with a `hostfile` written here.

The runner backgrounds every node's training and returns; sbatch.sh and launch.sh then wait while any node's
training runs (FlagScale's pid files, checked over SSH) and stop them all (`action=stop`) when interrupted.
Paths reach Hydra's overrides and the scripts FlagScale writes unquoted, so the run directory must be a
SAFE_PATH, as must the FlagScale checkout (fasop.launch.options)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fasop.errors import ArgumentError
from fasop.files import comment_line
from fasop.launch.launchers import HOST, hosts_file_lines
from fasop.launch.options import SAFE_PATH, SAFE_PATH_RULE, LaunchOptions
from fasop.launch.shell import quote
from fasop.launch.slurm import _directives
from fasop.plans import placement_runs

CONFIG_NAME = "flagscale"  # the experiment config, flagscale.yaml
POLL_S = 60  # seconds between checks that a node still trains


def hostfile_line(host: str, slots: int, label: str) -> str:
    return f"{host} slots={slots} type={label}"


def runner_words(checkpoint_dir: str, action: str, overrides: Sequence[str] = ()) -> list[str]:
    """run.py's arguments as bash words with RUN_DIR set: this directory's config, then Hydra overrides of the
    paths only known where it runs (a relative checkpoint folder is in the run directory) and `overrides`."""
    checkpoint = checkpoint_dir if checkpoint_dir.startswith("/") else f"$RUN_DIR/{checkpoint_dir}"
    return ["run.py", "--config-path", '"$RUN_DIR"', "--config-name", CONFIG_NAME, f'"{action}"',
            '"experiment.exp_dir=$RUN_DIR"', '"experiment.runner.hostfile=$RUN_DIR/hostfile"',
            *(f'"train.system.checkpoint.{key}={checkpoint}"' for key in ("save", "load")),
            *(f'"{override}"' for override in overrides)]


def _settings(description: str, usage: str, nodes: Sequence[tuple[str, int, str]], opts: LaunchOptions) -> list[str]:
    """The lines every script starts with: the run directory checked, the FlagScale checkout and the nodes."""
    return [
        "#!/usr/bin/env bash",
        description,
        usage,
        "set -euo pipefail",
        "",
        'RUN_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
        'fail() { echo "$(basename "$0"): $*" >&2; exit 2; }',
        f'[[ "$RUN_DIR" =~ ^{SAFE_PATH.pattern}$ ]] || fail "run directory $RUN_DIR: expected {SAFE_PATH_RULE}"',
        f"FLAGSCALE_DIR={quote(opts.flagscale_dir)}  # relative: to the run directory",
        '[[ "$FLAGSCALE_DIR" == /* ]] || FLAGSCALE_DIR="$RUN_DIR/$FLAGSCALE_DIR"',
        '[[ -f "$FLAGSCALE_DIR/run.py" ]] || fail "no FlagScale checkout at $FLAGSCALE_DIR (its run.py)"',
        f"NNODES={len(nodes)}",
        "NODE_SLOTS=(" + " ".join(str(slots) for _, slots, _ in nodes) + ")",
        "NODE_LABELS=(" + " ".join(quote(label) for _, _, label in nodes) + ")",
        'read -ra SSH_ARGS <<< "${SSH_OPTS:-}"',
        "SSH_ARGS+=(-o BatchMode=yes -o ConnectTimeout=20)",
        "",
    ]


def _run_lines(checkpoint_dir: str, overrides: Sequence[str] = ()) -> list[str]:
    """The hostfile written from HOSTS, the runner started, then the wait while any node trains."""
    return [
        "",
        '(( ${#HOSTS[@]} == NNODES )) || fail "${#HOSTS[@]} hosts for the plan\'s $NNODES nodes"',
        "# FlagScale's hostfile: node ranks in line order, each node's GPUs and the label of its mesh.",
        "{",
        "    echo '# Written by this script: HOST slots=GPUS type=LABEL, one line per node in node-rank order.'",
        '    for (( rank = 0; rank < NNODES; rank++ )); do',
        '        echo "${HOSTS[rank]} slots=${NODE_SLOTS[rank]} type=${NODE_LABELS[rank]}"',
        "    done",
        '} > "$RUN_DIR/hostfile"',
        "",
        "flagscale() {  # flagscale ACTION: FlagScale's runner on this directory's config",
        '    (cd "$FLAGSCALE_DIR" && python ' + " ".join(runner_words(checkpoint_dir, "action=$1", overrides)) + ")",
        "}",
        "",
        "node_trains() {  # node_trains RANK: whether the training FlagScale started on node RANK still runs",
        '    local pid_file="$RUN_DIR/logs/pids/host_$1_${HOSTS[$1]}.pid"',
        "    # shellcheck disable=SC2029  # the pid file's path is expanded here, the pid on the host",
        '    ssh "${SSH_ARGS[@]}" -- "${HOSTS[$1]}" "test -f \'$pid_file\' && kill -0 \\"\\$(cat \'$pid_file\')\\"" \\',
        "        < /dev/null > /dev/null 2>&1",
        "}",
        "",
        "any_node_trains() {",
        "    local rank",
        '    for (( rank = 0; rank < NNODES; rank++ )); do if node_trains "$rank"; then return 0; fi; done',
        "    return 1",
        "}",
        "",
        "trap 'flagscale stop; exit 130' INT TERM HUP",
        "flagscale run",
        'echo "$(basename "$0"): FlagScale started $NNODES nodes; logs in $RUN_DIR/logs"',
        f"while any_node_trains; do sleep {POLL_S}; done",
        'echo "$(basename "$0"): no node trains any longer; see $RUN_DIR/logs"',
        "",
    ]


def sbatch_text(description: str, nodes: Sequence[tuple[str, int, str]], model: Any, cluster: Any,
                opts: LaunchOptions, exit_duration_min: int | None) -> str:
    """sbatch.sh: the job's directives, then the hostfile from its node lists and the runner on its first node.
    `nodes`: (node type, GPUs, label) of each node rank; `exit_duration_min`: a full run's stop before the time
    limit (Megatron-LM saves and exits then; resubmit to resume from the latest checkpoint)."""
    runs = placement_runs([node_type for node_type, _, _ in nodes])
    cpus = [opts.cpus_per_task or cluster.node_types[name].cpus_per_node for name, _ in runs]
    gpus = {name: cluster.node_types[name].gpus_per_node for name, _ in runs}  # whole nodes: Slurm's gres
    lines = _settings(description, "# Submit from this directory: sbatch sbatch.sh", nodes, opts)
    lines[3:3] = _directives(runs, model, cluster, gpus, opts, cpus, [])
    lines.append("# The allocation's hosts in node-rank order: its components in order, each of one node type.")
    lines.append("HOSTS=()")
    if len(runs) == 1:
        lines.append('mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")')
    else:
        lines += [f"for (( group = 0; group < {len(runs)}; group++ )); do",
                  '    nodelist="SLURM_JOB_NODELIST_HET_GROUP_$group"',
                  '    mapfile -t part < <(scontrol show hostnames "${!nodelist}")',
                  '    HOSTS+=("${part[@]}")',
                  "done"]
    # only this launcher has a time limit: a Hydra override adds the flag
    stop = [] if exit_duration_min is None else [f"+train.system.exit_duration_in_mins={exit_duration_min}"]
    return "\n".join(lines + _run_lines(opts.checkpoint_dir, stop))


def hosts_check_lines(node_types: Sequence[str]) -> list[str]:
    """launch.sh: HOSTS read from the hosts file (`HOST NODE_TYPE` in node-rank order), checked against the plan as
    the SSH launcher's launch.sh checks it (FlagScale's hostfile too lists each host once)."""
    return [
        "NODE_TYPES=(" + " ".join(quote(node_type) for node_type in node_types) + ")",
        'HOSTS_FILE="${1:-$RUN_DIR/hosts}"',
        f"HOST_PATTERN={quote('^' + HOST.pattern + '$')}",
        *hosts_file_lines(),
    ]


def launch_text(description: str, nodes: Sequence[tuple[str, int, str]], opts: LaunchOptions) -> str:
    """launch.sh: the hostfile from the hosts file, then the runner here (a host that reaches every node)."""
    usage = ("# Starts the run from the hosts file:  bash launch.sh [HOSTS_FILE]   (SSH_OPTS: ssh options; FlagScale "
             "reaches every host over SSH too)")
    checks = hosts_check_lines([node_type for node_type, _, _ in nodes])
    return "\n".join(_settings(description, usage, nodes, opts) + checks + _run_lines(opts.checkpoint_dir))


def commands_text(description: str, run_dir: Path, opts: LaunchOptions) -> str:
    """commands.txt: the one command, run on a host that reaches every node over SSH."""
    directory = str(run_dir)
    if not SAFE_PATH.fullmatch(directory):
        raise ArgumentError("out_dir", f"FlagScale writes the run directory into its scripts unquoted: expected "
                                       f"{SAFE_PATH_RULE}", directory)
    words = [word.replace("$RUN_DIR", directory) for word in runner_words(opts.checkpoint_dir, "action=run")]
    return "\n".join([
        description,
        comment_line("Fill in the hostfile here (HOST slots=GPUS type=LABEL, node-rank order; a host may not repeat), "
                     "then run this command on a host that reaches every node over SSH; FlagScale starts them all."),
        comment_line("The run directory must be at the same path on every node. To stop: the same with action=stop."),
        f"cd {quote(directory)} && cd {quote(opts.flagscale_dir)} && python {' '.join(words)}",
    ]) + "\n"


def hostfile_text(nodes: Sequence[tuple[str, int, str]], hosts: Sequence[str] | None) -> str:
    """The manual launcher's hostfile: the hosts given, or placeholders to fill in."""
    lines = ["# HOST slots=GPUS type=LABEL, one line per node in node-rank order (FlagScale's runner reads it)."]
    if hosts is None:
        lines.append("# Replace every <host-N> with a host of the node type in the comment above it.")
    for rank, (node_type, slots, label) in enumerate(nodes):
        lines += [comment_line(f"node rank {rank}: {node_type}"),
                  hostfile_line(hosts[rank] if hosts else f"<host-{rank}>", slots, label)]
    return "\n".join(lines) + "\n"
