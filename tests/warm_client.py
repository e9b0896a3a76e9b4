"""What a launcher starts in place of ``python`` when the suite's warm pool is on
(tests/warm_pool.py): ask a zygote for a forked rank, pass it this process's signals, and end as
it ended. Where no zygote can serve the request, become the real Python instead.

Run as ``python -S warm_client.py PYTHON_ARGS...``: it imports only the standard library.
"""

import os
import signal
import socket
import sys

import warm_pool

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2,
                     signal.SIGQUIT, signal.SIGALRM, signal.SIGCONT)


def become_python(arguments):
    """``exec`` the real interpreter on ``arguments``, with the site-packages this client skipped."""
    os.execv(sys.executable, [sys.executable, *arguments])


def supported(arguments) -> bool:
    """``-c CODE``, ``-m MODULE`` or ``SCRIPT``, each followed by the program's own arguments."""
    if not arguments:
        return False
    if arguments[0] in ("-c", "-m"):
        return len(arguments) >= 2
    return not arguments[0].startswith("-")


def local_rank() -> int:
    for name in ("OMPI_COMM_WORLD_LOCAL_RANK", "PMIX_RANK", "SLURM_LOCALID"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def main(arguments) -> None:
    directory = os.environ.get(warm_pool.POOL_DIR)
    if not directory or not supported(arguments):
        become_python(arguments)
    servers = int(os.environ.get(warm_pool.POOL_SIZE, "1"))
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(os.path.join(directory, f"zygote-{local_rank() % servers}.sock"))
    except OSError as error:
        not_served(f"no zygote: {error}", arguments)
        become_python(arguments)
    ours, childs = socket.socketpair()
    request = {"argv": arguments, "cwd": os.getcwd(), "env": dict(os.environ),
               "netns": warm_pool.network_namespace()}
    warm_pool.send_message(connection, request, [0, 1, 2, childs.fileno()])
    childs.close()
    replies = warm_pool.MessageReader(connection)
    reply = replies.next()
    if not reply or "pid" not in reply:
        not_served((reply or {}).get("refused", "no answer"), arguments)
        connection.close()
        become_python(arguments)
    pid = reply["pid"]
    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, lambda signum, _frame: _forward(pid, signum))
    status = replies.next()
    if status is None:  # the zygote is gone: so must its child be
        _forward(pid, signal.SIGKILL)
        sys.stderr.write(f"warm_client: the zygote serving pid {pid} ended before it\n")
        os._exit(1)
    end_as(status)


def not_served(reason: str, arguments) -> None:
    """Say why no zygote served this rank: on stderr with RMTEST_WARM_POOL_DEBUG, and in the job
    log's companion file (``<RMTEST_JOB_LOG>.unserved``) where the suite keeps a job log."""
    if os.environ.get(warm_pool.DEBUG):
        sys.stderr.write(f"warm_client: not served: {reason}\n")
    log = os.environ.get("RMTEST_JOB_LOG")
    if log:
        with open(log + ".unserved", "a", encoding="utf-8") as unserved:
            unserved.write(f"{reason}\t{' '.join(' '.join(arguments[:2]).split())[:120]}\n")


def _forward(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def end_as(status: dict) -> None:
    """Exit with the child's code, or die of the child's signal."""
    signum = status.get("signal")
    if signum:
        if signum != signal.SIGKILL:
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
        os.kill(os.getpid(), signum)
        os._exit(128 + signum)
    os._exit(status.get("code", 1))


if __name__ == "__main__":
    main(sys.argv[1:])
