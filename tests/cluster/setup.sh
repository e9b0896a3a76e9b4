#!/usr/bin/env bash
# Set-up for the multi-host tests (tests/cluster/netns_cluster.py, run by tests/test_cluster.py):
# install what a network-namespace test cluster needs and this machine lacks, with apt:
# openssh-server (an sshd in each namespace host), openssh-client (ssh, ssh-keygen) and
# iproute2 (ip, tc).
#
# Safe to run anywhere, and again: when everything is there it only says so; when it cannot
# install (not root, no apt-get, no mirror reachable) it says why and exits 0, and the cluster
# tests then skip with the reason. Nothing is started: openssh-server's postinst would start
# an sshd in this machine's own network namespace, so a policy-rc.d that forbids starting
# services is put in place for the install (and removed again if this script created it).
#
# With RINGMASTER_REQUIRE_CLUSTER=1 (as CI sets it, in .ci/run) a cluster is required: a
# failed install exits 1, and so does a machine on which, everything installed, no cluster
# can be built (`netns_cluster.py check`); the cluster tests then fail instead of skipping.
set -uo pipefail

say() { echo "tests/cluster/setup.sh: $*" >&2; }
have() { command -v "$1" >/dev/null 2>&1; }
required() { [ "${RINGMASTER_REQUIRE_CLUSTER:-}" = 1 ]; }
# give_up REASON: the cluster tests cannot run here; an error where a cluster is required.
give_up() {
    if required; then
        say "$1; RINGMASTER_REQUIRE_CLUSTER=1: failing"
        exit 1
    fi
    say "$1 (the cluster tests will skip)"
    exit 0
}
# Where a cluster is required, check that one can be built here, now that all is installed.
check_required() {
    required || return 0
    local here python
    here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
    python=$(command -v python || command -v python3)
    "$python" "$here/netns_cluster.py" check || give_up "no network-namespace cluster can be built here"
}

packages=()
[ -x /usr/sbin/sshd ] || packages+=(openssh-server)
{ have ssh && have ssh-keygen; } || packages+=(openssh-client)
{ have ip && have tc; } || packages+=(iproute2)

if [ "${#packages[@]}" = 0 ]; then
    say "nothing to install ($(/usr/sbin/sshd -V 2>&1 | head -n1); ip and tc present)"
    check_required
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    give_up "not root; not installing ${packages[*]}"
fi
if ! have apt-get; then
    give_up "no apt-get; install ${packages[*]} by hand to run the cluster tests"
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
    give_up "apt-get update failed; not installing ${packages[*]}"
fi
if ! timeout 300 "${apt[@]}" install -y --no-install-recommends "${packages[@]}" >/dev/null; then
    give_up "apt-get install ${packages[*]} failed"
fi
say "installed ${packages[*]} ($(/usr/sbin/sshd -V 2>&1 | head -n1))"
check_required
