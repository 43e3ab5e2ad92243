#!/usr/bin/env bash
# Install what the SSH launch tests need on a Debian 12 machine: the OpenSSH server and client. The tests
# start their own sshd on loopback addresses with keys made for them; the system's ssh service is not
# started here (a policy-rc.d denies it while the package installs, unless the machine has one already).
# Run as root; safe to run again when everything is installed.
set -euo pipefail
[[ "${1:-}" != -h && "${1:-}" != --help ]] || { sed -n '2,/^set /s/^# \{0,1\}//p' "$0"; exit 0; }  # usage: the comment above

if command -v sshd >/dev/null 2>&1 || [[ -x /usr/sbin/sshd ]]; then
    /usr/sbin/sshd -V 2>&1 | head -n 1 || true
    exit 0
fi
if [[ "$(id -u)" != 0 ]]; then
    echo "install_sshd.sh: run as root to install openssh-server" >&2
    exit 1
fi
policy=/usr/sbin/policy-rc.d
made_policy=""
if [[ ! -e "$policy" ]]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy"
    chmod 755 "$policy"
    made_policy=1
fi
remove_policy() { if [[ -n "$made_policy" ]]; then rm -f "$policy"; fi; }
trap remove_policy EXIT
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends openssh-server openssh-client
/usr/sbin/sshd -V 2>&1 | head -n 1 || true
