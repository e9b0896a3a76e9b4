#!/bin/sh
# Open MPI's remote shell agent without ssh: run a command in a worker pod through the
# Kubernetes API (`kubectl exec`), as the MPI Operator's v1 did. Open MPI calls it the way it
# calls ssh:  kubexec.sh [ssh options] HOST COMMAND...
# ringrun passes ssh options (-o ConnectTimeout<TAB>N; -p, -i with --ssh-port/--ssh-identity-file):
# they mean nothing here and are skipped. HOST is the hostfile's name, POD.SERVICE.NAMESPACE.svc
# in the MPI Operator's hostfile: the pod is its first label, the namespace its third (a bare
# POD: kubectl's own namespace, the launcher's). The command waits until the pod is Ready.
# Needs: kubectl in the launcher's image, and a service account allowed to create pods/exec
# (docs/kubernetes.md, mpijob-kubexec.yaml).
set -eu
while [ $# -gt 0 ]; do
    case "$1" in
        -o|-p|-i|-l|-F) shift 2 ;;
        -*) shift ;;
        *) break ;;
    esac
done
host=$1
shift
pod=${host%%.*}
namespace=$(echo "$host" | cut -s -d. -f3)
where=${namespace:+--namespace=$namespace}
kubectl wait $where --for=condition=Ready "pod/$pod" --timeout="${KUBEXEC_WAIT:-300s}" >/dev/null
exec kubectl exec $where "$pod" -- /bin/sh -c "$*"
