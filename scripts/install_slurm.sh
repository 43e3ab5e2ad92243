#!/usr/bin/env bash
# Install what the launch-script tests need on a Debian 12 machine: from Debian, Slurm (slurmctld, slurmd,
# sbatch) and the shell linter; into the active Python, torch (CPU wheel) and megatron-core.
# Run as root, inside the project's virtualenv; safe to run again when everything is installed.
set -euo pipefail
[[ "${1:-}" != -h && "${1:-}" != --help ]] || { sed -n '2,/^set /s/^# \{0,1\}//p' "$0"; exit 0; }  # usage: the comment above

PYTHON="${PYTHON:-python}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"

need_apt=()
command -v slurmctld >/dev/null 2>&1 || need_apt+=(slurm-wlm)
command -v shellcheck >/dev/null 2>&1 || need_apt+=(shellcheck)
if (( ${#need_apt[@]} > 0 )); then
    if [[ "$(id -u)" != 0 ]]; then
        echo "install_slurm.sh: run as root to install ${need_apt[*]}" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${need_apt[@]}"
fi

installed() {  # installed NAME [VERSION]: is the distribution there (at that version, local tag ignored)?
    "$PYTHON" - "$@" <<'PY'
import sys
from importlib import metadata
try:
    version = metadata.version(sys.argv[1]).split("+")[0]
except metadata.PackageNotFoundError:
    sys.exit(1)
sys.exit(0 if len(sys.argv) < 3 or version == sys.argv[2] else 1)
PY
}
installed torch "$TORCH_VERSION" || "$PYTHON" -m pip install -q "torch==$TORCH_VERSION"
installed megatron-core || "$PYTHON" -m pip install -q "megatron-core>=0.13"

slurmctld -V
shellcheck --version | sed -n 2p
"$PYTHON" -m pip list 2>/dev/null | grep -E '^(torch|megatron-core) '
