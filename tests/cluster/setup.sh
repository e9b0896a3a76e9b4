#!/usr/bin/env bash
# CI set-up for the network-namespace test cluster (tests/cluster/netns_cluster.py):
# install Debian's openssh-server so each namespace host can run its own sshd.
#
# Best effort: when it cannot install (not root, no apt-get, no mirror reachable) it says
# why and exits 0, and the cluster tests then skip with the reason. Nothing is started:
# the package's postinst would start an sshd in this machine's own network namespace, so a
# policy-rc.d that forbids starting services is put in place for the install (and removed
# again if this script created it).
set -uo pipefail

say() { echo "tests/cluster/setup.sh: $*" >&2; }

if [ -x /usr/sbin/sshd ]; then
    say "sshd already installed ($(/usr/sbin/sshd -V 2>&1 | head -n1))"
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    say "not root; skipping the openssh-server install (the cluster tests will skip)"
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    say "no apt-get; install an OpenSSH server (sshd) by hand to run the cluster tests"
    exit 0
fi

policy=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && created_policy=1
fi
cleanup() { if [ "$created_policy" = 1 ]; then rm -f "$policy"; fi; }
trap cleanup EXIT

# APT::Sandbox::User=root: apt's download methods run as _apt, which cannot write a /tmp
# that is not world-writable (as on the CI machines: mode 750), and then fail with
# "Couldn't create temporary file /tmp/apt.conf.XXXX for passing config to apt-key".
apt=(apt-get -o APT::Sandbox::User=root -o Dpkg::Use-Pty=0 -q)
export DEBIAN_FRONTEND=noninteractive
if ! timeout 120 "${apt[@]}" update >/dev/null; then
    say "apt-get update failed; the cluster tests will skip"
    exit 0
fi
if ! timeout 300 "${apt[@]}" install -y --no-install-recommends openssh-server >/dev/null; then
    say "apt-get install openssh-server failed; the cluster tests will skip"
    exit 0
fi
say "installed $(/usr/sbin/sshd -V 2>&1 | head -n1)"
