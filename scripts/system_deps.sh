#!/usr/bin/env bash
# System packages the test bed needs: iptables, for NAT between network namespaces (testbed/netns.py). Without root
# or apt-get the install is skipped with a message; the NAT tests then skip themselves and say why.
set -uo pipefail
if command -v iptables >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "system_deps: iptables is missing and cannot be installed here (needs root and apt-get): NAT tests skip." >&2
    exit 0
fi
if ! apt-get install -y -q iptables >/dev/null 2>&1; then
    apt-get update -q >/dev/null 2>&1 && apt-get install -y -q iptables >/dev/null 2>&1 \
        || echo "system_deps: apt-get could not install iptables: NAT tests skip." >&2
fi
