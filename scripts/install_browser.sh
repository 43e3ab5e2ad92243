#!/usr/bin/env bash
# Install what the report tests need on a Debian 12 machine: from Debian, the Chromium browser, which the tests run
# headless to load a `fasop report` page. Run as root; safe to run again when it is installed.
set -euo pipefail
[[ "${1:-}" != -h && "${1:-}" != --help ]] || { sed -n '2,/^set /s/^# \{0,1\}//p' "$0"; exit 0; }  # usage: the comment above

if ! command -v chromium >/dev/null 2>&1; then
    if [[ "$(id -u)" != 0 ]]; then
        echo "install_browser.sh: run as root to install chromium" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends chromium
fi

chromium --version
