"""Launching a plan without Slurm: over SSH (`hosts` + `launch.sh`) or by hand (`commands.txt`).

Both start the same run_inter.sh as the Slurm job, once per node, with its node rank, and meet through a TCP
rendezvous on the first host or a file on a shared file system (fasop/startup.py). run_inter.sh checks on
every node that its GPU is the plan's for that node rank.

* `hosts`: one line per node of the plan in node-rank order, `HOST NODE_TYPE`; blank lines and `#` comments
  are skipped. HOST is `[USER@]NAME`: NAME of letters, digits, `.`, `_`, `:` and `-`, starting with a letter
  or digit (host names, IPv4 and IPv6 addresses), USER of letters, digits, `.`, `_` and `-`. Without
  `--hosts` the file holds placeholders (`<host-0>`) that launch.sh refuses until they are filled in. A NAME
  (in any case, with any USER) may appear once: run_inter.sh gives its node every GPU of the machine, so two
  node ranks on one machine would share its GPUs (tests on one machine use loopback aliases, 127.0.0.2, .3).
* `launch.sh`: ssh to every host, `cd` to the run directory (the same path on every host) and start
  run_inter.sh with NODE_RANK, MASTER_ADDR (the first host), MASTER_PORT, FASOP_RUN_ID and FASOP_LAUNCH_ID;
  each node's output goes to `logs/RANK-HOST.log`. When a node fails (or launch.sh is interrupted) every
  process carrying this launch's FASOP_LAUNCH_ID is signalled on every host, TERM and then KILL, which reaches
  torchrun's workers too (they run in sessions of their own); launch.sh then exits 1 (130 when interrupted).
* `commands.txt`: one command line per node, in node-rank order, to paste into a shell on that node.

Paths and names reach these files through fasop.launch.shell.quote (words), fasop.launch.shell.assignment
(environment assignments) and fasop.files.comment_line (`#` lines); the run directory of commands.txt must be
printable, as a newline would split its one-line commands.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fasop.errors import ArgumentError, InputError
from fasop.files import TOML_LIMIT_BYTES, comment_line, printable, read_text
from fasop.launch.shell import assignment, quote
from fasop.plans import Plan

LAUNCHERS = ("slurm", "ssh", "manual")
RENDEZVOUS = ("tcp", "file")
HOST = re.compile(r"([A-Za-z0-9_][A-Za-z0-9_.-]{0,63}@)?[A-Za-z0-9][A-Za-z0-9_.:-]{0,254}")
HOST_RULE = "[USER@]NAME, NAME of letters, digits, . _ : - starting with a letter or digit"
# The same rule for launch.sh, which checks the hosts file again after it has been edited.
_HOST_ERE = r"^([A-Za-z0-9_][A-Za-z0-9_.-]{0,63}@)?[A-Za-z0-9][A-Za-z0-9_.:-]{0,254}$"
STOP_GRACE_S = 15  # launch.sh: seconds between TERM and KILL when it stops the nodes
# run_inter.sh starts GPUS_PER_NODE workers on the first GPUs of its machine: a second node rank there would
# share them (and the node-type check cannot tell).
REPEATED_HOST = ("every node rank needs a machine of its own (on one machine for tests, use loopback aliases "
                 "such as 127.0.0.2 and 127.0.0.3)")


def read_hosts(path: str, placement: Sequence[str]) -> list[str]:
    """The hosts of a hosts file, checked against the plan's placement (node types in node-rank order)."""
    hosts: list[str] = []
    line_of: dict[str, int] = {}  # machine name (lower case, without USER@) -> the line that lists it
    for number, line in enumerate(read_text(path, TOML_LIMIT_BYTES).splitlines(), start=1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        where = f"{path}: line {number}"
        rank = len(hosts)
        if len(fields) != 2:
            raise InputError(where, f"expected 'HOST NODE_TYPE', got {line.strip()!r}")
        host, node_type = fields
        if not HOST.fullmatch(host):
            raise InputError(where, f"host {host!r}: expected {HOST_RULE}")
        machine = host.rsplit("@", 1)[-1].lower()
        if machine in line_of:
            raise InputError(where, f"host {host} is on line {line_of[machine]} too; {REPEATED_HOST}")
        line_of[machine] = number
        if rank >= len(placement):
            raise InputError(where, f"more hosts than the plan's {len(placement)} nodes")
        if node_type != placement[rank]:
            raise InputError(where, f"node type {node_type}, but the plan places {placement[rank]} at node rank "
                                    f"{rank} (node types in node-rank order: {' '.join(placement)})")
        hosts.append(host)
    if len(hosts) != len(placement):
        raise InputError(path, f"lists {len(hosts)} hosts, the plan has {len(placement)} nodes "
                               f"({' '.join(placement)})")
    return hosts


def hosts_text(plan: Plan, hosts: Sequence[str] | None, placement: Sequence[str] | None = None) -> str:
    """The hosts file: `hosts`, or placeholders, beside the node type of each node rank (`placement`, default:
    the plan's)."""
    placement = plan.placement if placement is None else placement
    lines = [comment_line(f"Hosts of fasop plan {plan.rank or '?'}, one per node in node-rank order: HOST NODE_TYPE."),
             comment_line(f"HOST is {HOST_RULE}, each machine once.")]
    if hosts is None:
        lines.append(comment_line("Replace every <host-N> with a host of that node type; launch.sh checks each line."))
    width = max(len(h) for h in hosts) if hosts else len(f"<host-{len(placement) - 1}>")
    for rank, node_type in enumerate(placement):
        host = hosts[rank] if hosts else f"<host-{rank}>"
        lines.append(f"{host:<{width}} {node_type}")
    return "\n".join(lines) + "\n"


def _launch_sh(plan: Plan, description: str, master_port: int, rendezvous: str) -> str:
    """launch.sh: its settings, the hosts file checked again, the command each host runs, stopping every node,
    then starting them and waiting for each."""
    sections = [_settings_lines(plan.placement, description, master_port, rendezvous), _hosts_check_lines(),
                _node_command_lines(), _stop_lines(), _start_and_wait_lines()]
    return "\n\n".join("\n".join(lines) for lines in sections) + "\n"


def _settings_lines(placement: Sequence[str], description: str, master_port: int, rendezvous: str) -> list[str]:
    return [
        "#!/usr/bin/env bash",
        description,
        "# Starts run_inter.sh on every host of the hosts file over SSH:  bash launch.sh [HOSTS_FILE]",
        "# The run directory must be at the same path on every host (a shared file system, or copied there).",
        "# Environment: SSH_OPTS (ssh options, split at spaces, e.g. \"-p 2222 -i key\"), FORWARD_ENV (names of",
        "# variables passed on to every node, e.g. \"PATH NCCL_DEBUG\"), REMOTE_DIR (the run directory on the hosts),",
        "# LOG_DIR (default logs/ here), MASTER_PORT, FASOP_RUN_ID (default: time and process id), STOP_GRACE_S.",
        "# Needs bash >= 5.1 here; Linux with bash, grep and env on the hosts.",
        "set -euo pipefail",
        "",
        'RUN_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
        'HOSTS_FILE="${1:-$RUN_DIR/hosts}"',
        'REMOTE_DIR="${REMOTE_DIR:-$RUN_DIR}"',
        'LOG_DIR="${LOG_DIR:-$RUN_DIR/logs}"',
        f"NNODES={len(placement)}",
        "NODE_TYPES=(" + " ".join(quote(n) for n in placement) + ")",
        f'MASTER_PORT="${{MASTER_PORT:-{master_port}}}"',
        f"RENDEZVOUS={quote(rendezvous)}",
        'RUN_ID="${FASOP_RUN_ID:-$(date +%Y%m%d-%H%M%S)-$$}"',
        "# Stopping signals the processes whose environment holds FASOP_LAUNCH_ID=$LAUNCH_ID: made afresh here and",
        "# set only in the nodes' commands, it marks what this launch started and nothing else. (FASOP_RUN_ID may",
        "# be set by the caller, and then launch.sh and whatever started it carry it too.)",
        'LAUNCH_ID="$RUN_ID.$$.$SRANDOM$SRANDOM"',
        f'STOP_GRACE_S="${{STOP_GRACE_S:-{STOP_GRACE_S}}}"',
        f"HOST_PATTERN={quote(_HOST_ERE)}",
        'read -ra USER_SSH_ARGS <<< "${SSH_OPTS:-}"',
        "# ssh keeps the first value of each option: the user's come first.",
        'SSH_ARGS=("${USER_SSH_ARGS[@]}" -o BatchMode=yes -o ConnectTimeout=20)',
        'read -ra FORWARD_NAMES <<< "${FORWARD_ENV:-}"',
    ]


def _hosts_check_lines() -> list[str]:
    """The settings checked, and the hosts file read and checked as read_hosts does (it may have been edited)."""
    return [
        'fail() { echo "launch.sh: $*" >&2; exit 2; }',
        "",
        '[[ "$RUN_ID" =~ ^[A-Za-z0-9_.-]+$ ]] || fail "FASOP_RUN_ID \'$RUN_ID\': expected letters, digits, _ . -"',
        '[[ "$STOP_GRACE_S" =~ ^[0-9]+$ ]] || fail "STOP_GRACE_S \'$STOP_GRACE_S\': expected whole seconds"',
        "for name in \"${FORWARD_NAMES[@]}\"; do",
        '    [[ "$name" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || fail "FORWARD_ENV: \'$name\' is not a variable name"',
        "done",
        *hosts_file_lines(),
        'MASTER_ADDR="${HOSTS[0]#*@}"',
    ]


def hosts_file_lines() -> list[str]:
    """Bash that reads HOSTS from "$HOSTS_FILE" as read_hosts does (`HOST NODE_TYPE` per line in node-rank order,
    each host once and of the node type NODE_TYPES places there, NNODES of them), HOST_PATTERN checking each name;
    it needs fail()."""
    return [
        '[[ -f "$HOSTS_FILE" ]] || fail "no hosts file $HOSTS_FILE"',
        "HOSTS=()",
        "declare -A LINE_OF  # machine name (lower case, without USER@) -> the line that lists it",
        "line_number=0",
        'while IFS= read -r line || [[ -n "$line" ]]; do',
        "    line_number=$((line_number + 1))",
        '    read -ra fields <<< "${line%%#*}"',
        "    if (( ${#fields[@]} == 0 )); then continue; fi",
        '    where="$HOSTS_FILE: line $line_number"',
        '    (( ${#fields[@]} == 2 )) || fail "$where: expected HOST NODE_TYPE"',
        '    [[ "${fields[0]}" =~ $HOST_PATTERN ]] ||',
        f'        fail "$where: host \'${{fields[0]}}\': expected {HOST_RULE} (fill in the placeholders)"',
        '    machine="${fields[0]#*@}"',
        '    machine="${machine,,}"',
        '    [[ -z "${LINE_OF[$machine]:-}" ]] ||',
        f'        fail "$where: host ${{fields[0]}} is on line ${{LINE_OF[$machine]}} too; {REPEATED_HOST}"',
        '    LINE_OF[$machine]=$line_number',
        '    (( ${#HOSTS[@]} < NNODES )) || fail "$where: more hosts than the plan\'s $NNODES nodes"',
        '    rank=${#HOSTS[@]}',
        '    [[ "${fields[1]}" == "${NODE_TYPES[rank]}" ]] || fail "$where: node type ${fields[1]}, but the plan' +
        ' places ${NODE_TYPES[rank]} at node rank $rank (node types in node-rank order: ${NODE_TYPES[*]})"',
        '    HOSTS+=("${fields[0]}")',
        'done < "$HOSTS_FILE"',
        '(( ${#HOSTS[@]} == NNODES )) || fail "$HOSTS_FILE: lists ${#HOSTS[@]} hosts, the plan has $NNODES nodes"',
    ]


def _node_command_lines() -> list[str]:
    """What each host runs, and node RANK started over ssh."""
    return [
        "quote() {  # quote TEXT: TEXT as one word for any POSIX shell (the hosts' login shells read the commands)",
        "    printf \"'%s'\" \"${1//\\'/\\'\\\\\\'\\'}\"",
        "}",
        "",
        "# Every process a node command starts carries FASOP_LAUNCH_ID (and its NODE_RANK), torchrun's workers in their",
        "# own sessions included: sh -c \"$SIGNAL_RUN\" sh SIGNAL LAUNCH_ID [NODE_RANK] signals them on one host.",
        "# shellcheck disable=SC2016  # a script for the hosts' shells, expanded there",
        "SIGNAL_RUN='for p in /proc/[0-9]*; do if grep -qzxF \"FASOP_LAUNCH_ID=$2\" \"$p/environ\" 2>/dev/null && '\\",
        "'{ [ -z \"${3:-}\" ] || grep -qzxF \"NODE_RANK=$3\" \"$p/environ\" 2>/dev/null; }; '\\",
        "'then kill -s \"$1\" \"${p#/proc/}\" 2>/dev/null; '\\",
        "'fi; done; true'",
        "",
        "node_command() {  # node_command RANK: what node RANK's host runs",
        '    local assignments=("FASOP_RUN_ID=$RUN_ID" "FASOP_LAUNCH_ID=$LAUNCH_ID" "NODE_RANK=$1" "MASTER_PORT=$MASTER_PORT"',
        '                       "FASOP_RENDEZVOUS=$RENDEZVOUS" "MASTER_ADDR=$MASTER_ADDR") name text',
        '    for name in "${FORWARD_NAMES[@]}"; do',
        '        if [[ -v "$name" ]]; then assignments+=("$name=${!name}"); fi',
        "    done",
        '    text="cd $(quote "$REMOTE_DIR") || exit 1; env"',
        '    for name in "${assignments[@]}"; do text+=" ${name%%=*}=$(quote "${name#*=}")"; done',
        "    # Workers left by a killed torchrun would hold the connection open: the host kills this node's leftovers.",
        "    # shellcheck disable=SC2016  # expanded by the host's shell",
        '    printf \'%s bash run_inter.sh; status=$?; sh -c %s sh KILL %s %s; exit "$status"\' \\',
        '        "$text" "$(quote "$SIGNAL_RUN")" "$(quote "$LAUNCH_ID")" "$1"',
        "}",
        "",
        "run_node() {  # run_node RANK: node RANK over ssh, its output into its log (exec: the job's pid is ssh's)",
        '    exec ssh "${SSH_ARGS[@]}" -- "${HOSTS[$1]}" "$(node_command "$1")" < /dev/null \\',
        '        > "$LOG_DIR/$1-${HOSTS[$1]}.log" 2>&1',
        "}",
    ]


def _stop_lines() -> list[str]:
    """Stopping every process of this run on every host."""
    return [
        "signal_nodes() {  # signal_nodes SIGNAL: SIGNAL to every process of this launch on every host",
        "    local host pids=()",
        '    for host in "${HOSTS[@]}"; do',
        '        ssh "${SSH_ARGS[@]}" -- "$host" "sh -c $(quote "$SIGNAL_RUN") sh $1 $LAUNCH_ID" < /dev/null > /dev/null 2>&1 &',
        '        pids+=("$!")',
        "    done",
        '    wait "${pids[@]}" || true',
        "}",
        "",
        "declare -A RANK_OF  # ssh pid -> node rank, while the node runs",
        "nodes_running() {",
        "    local pid",
        '    for pid in "${!RANK_OF[@]}"; do if kill -0 "$pid" 2>/dev/null; then return 0; fi; done',
        "    return 1",
        "}",
        "stop_nodes() {  # TERM to every process of this launch, KILL to what is left after STOP_GRACE_S",
        "    trap '' INT TERM HUP",
        '    echo "launch.sh: stopping every node of run $RUN_ID" >&2',
        "    signal_nodes TERM",
        "    local deadline=$((SECONDS + STOP_GRACE_S)) pid",
        "    while (( SECONDS < deadline )) && nodes_running; do sleep 1; done",
        '    for pid in "${!RANK_OF[@]}"; do kill "$pid" 2>/dev/null || true; done',
        "    wait || true",
        "    signal_nodes KILL  # also what started while the ssh connections were closing",
        "}",
    ]


def _start_and_wait_lines() -> list[str]:
    """Every node started; the first failure stops them all."""
    return [
        'mkdir -p "$LOG_DIR"',
        "trap 'stop_nodes; exit 130' INT TERM HUP",
        "for (( rank = 0; rank < NNODES; rank++ )); do",
        '    run_node "$rank" &',
        '    RANK_OF[$!]=$rank',
        "done",
        'echo "launch.sh: run $RUN_ID: $NNODES nodes started, rendezvous $RENDEZVOUS; logs in $LOG_DIR"',
        "for (( left = NNODES; left > 0; left-- )); do",
        '    finished=""',
        '    status=0',
        '    wait -n -p finished "${!RANK_OF[@]}" || status=$?',
        '    rank="${RANK_OF[$finished]}"',
        '    unset "RANK_OF[$finished]"',
        "    if (( status != 0 )); then",
        '        echo "launch.sh: node rank $rank (${HOSTS[rank]}) failed with exit status $status;' +
        ' see $LOG_DIR/$rank-${HOSTS[rank]}.log" >&2',
        "        stop_nodes",
        "        exit 1",
        "    fi",
        '    echo "launch.sh: node rank $rank (${HOSTS[rank]}) finished"',
        "done",
    ]


def _commands_txt(plan: Plan, description: str, run_dir: Path, hosts: Sequence[str] | None,
                  master_port: int, rendezvous: str) -> str:
    placement = plan.placement
    directory = printable(str(run_dir), "out_dir", "with the manual launcher, the run directory")
    lines = [description,
             comment_line("One command per node, in node-rank order: run each in a shell on a node of its type"
                          + (" (node rank 0 first)." if rendezvous != "tcp" else ".")),
             comment_line(f"{directory} must be at that path on every node (a shared file system, or copied there).")]
    master = hosts[0].split("@")[-1] if hosts else ""  # a TCP rendezvous needs --hosts (checked with the options)
    for rank, node_type in enumerate(placement):
        on = f" on {hosts[rank]}" if hosts else ""
        env = [assignment("NODE_RANK", str(rank)), assignment("MASTER_PORT", str(master_port)),
               assignment("MASTER_ADDR", master) if rendezvous == "tcp" else assignment("FASOP_RENDEZVOUS", rendezvous)]
        lines += [comment_line(f"node rank {rank}: {node_type}{on}"),
                  f"cd {quote(directory)} && {' '.join(env)} bash run_inter.sh"]
    return "\n".join(lines) + "\n"


def _rendezvous(site: Mapping[str, Any]) -> str:
    if site["rendezvous"] == "tcp":
        if site["rendezvous_file"] is not None:
            raise ArgumentError("rendezvous_file", "applies to a file rendezvous only", remedy="rendezvous")
        return "tcp"
    path = site["rendezvous_file"]
    if path is None:
        raise ArgumentError("rendezvous", "needs the path of a file on a file system every node sees", "file",
                            remedy="rendezvous_file")
    if not path.startswith("/"):
        raise ArgumentError("rendezvous_file", f"expected an absolute path, got {path!r}")
    return "file://" + printable(path, "rendezvous_file", "the path")


def launcher_inputs(site: Mapping[str, Any]) -> list[Path]:
    """Input files of the launcher options, which the outputs must not replace."""
    return [Path(site["hosts_file"])] if site.get("hosts_file") else []


def launcher_files(files: Mapping[str, str], plan: Plan, out_dir: Path, master_port: int,
                   site: Mapping[str, Any]) -> dict[str, str]:
    """The files for `site["launcher"]`: render_plan's for slurm; for ssh and manual run_inter.sh and plan.json
    with hosts and launch.sh, or commands.txt."""
    launcher = site["launcher"]
    if launcher == "slurm":
        for key in ("hosts_file", "rendezvous_file"):
            if site[key] is not None:
                raise ArgumentError(key, "applies to the ssh and manual launchers", remedy="launcher")
        if site["rendezvous"] != "tcp":
            raise ArgumentError("rendezvous", "applies to the ssh and manual launchers (a Slurm job meets at its "
                                              "first node)", "file", remedy="launcher")
        return dict(files)
    rendezvous = _rendezvous(site)
    hosts = read_hosts(site["hosts_file"], plan.placement) if site["hosts_file"] else None
    description = files["run_inter.sh"].splitlines()[1]  # "# fasop plan ...", as the scripts describe the plan
    kept = {name: files[name] for name in ("run_inter.sh", "plan.json")}
    if launcher == "ssh":
        return {**kept, "hosts": hosts_text(plan, hosts), "launch.sh": _launch_sh(plan, description, master_port, rendezvous)}
    if hosts is None and rendezvous == "tcp":
        raise ArgumentError("launcher", "a TCP rendezvous needs the first node's address: give a hosts file, or "
                                        "meet through a file", "manual", remedy="hosts_file")
    return {**kept, "commands.txt": _commands_txt(plan, description, out_dir.absolute(), hosts, master_port, rendezvous)}


def launcher_hint(site: Mapping[str, Any], out_dir: str) -> tuple[str, str]:
    """(stdout text, stderr line) that `fasop emit` prints after writing the files."""
    if site["launcher"] == "ssh":
        fill = "" if site["hosts_file"] else f"Fill in {quote(f'{out_dir}/hosts')}, then run: "
        return "", f"{fill}bash {quote(f'{out_dir}/launch.sh')}"
    if site["launcher"] == "manual":
        text = read_text(Path(out_dir) / "commands.txt", TOML_LIMIT_BYTES)
        commands = [line for line in text.splitlines() if not line.startswith("#")]
        return "\n".join(commands), f"Run each command on its node (also in {quote(f'{out_dir}/commands.txt')})"
    return "", f"Submit with: cd {quote(out_dir)} && sbatch sbatch.sh"
