"""A zygote of the suite's warm pool (tests/warm_pool.py): import torch once, then fork one
child per request and turn it into the rank the request describes.

Run as ``python warm_server.py SOCKET_PATH`` with stdin a pipe from the pytest process: when that
pipe closes, the zygote kills the children it still has and ends.
"""

import fcntl
import os
import random
import runpy
import select
import selectors
import signal
import socket
import sys
import types

import warm_pool

#: What every rank imports before it does anything: torch is the one that costs (about 1.1 s of
#: CPU on the 2-core machine). Third-party modules only, none that starts a thread (a process
#: with threads must not fork; grpc starts its threads with its first channel, not on import),
#: not mpi4py.MPI (MPI_Init belongs to the rank), and nothing of ringmaster, whose modules may
#: read the job's environment when imported.
PRELOAD = ("numpy", "torch", "torch.nn", "torch.optim", "torch.autograd", "grpc", "mpi4py",
           "google.protobuf.message", "google.protobuf.descriptor_pool", "google.protobuf.internal.python_message")


def preload() -> None:
    for name in PRELOAD:
        __import__(name)
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        raise SystemExit(f"warm_server: {threads} threads after the preload; a zygote must have one")


def base_path() -> list:
    """sys.path as a fresh ``python`` would have it without PYTHONPATH and the script's folder."""
    ours = set(filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    return [entry for entry in sys.path[1:] if entry not in ours]


def refusal(request: dict) -> str:
    """Why this zygote cannot serve ``request`` ("" when it can)."""
    if request.get("netns") != warm_pool.network_namespace():
        return "another network namespace"
    theirs, ours = warm_pool.startup_fingerprint(request["env"]), warm_pool.startup_fingerprint(os.environ)
    differing = sorted(name for name in theirs.keys() | ours.keys() if theirs.get(name) != ours.get(name))
    return f"start-up variables differ: {', '.join(differing)}" if differing else ""


class Zygote:
    """The fork server: one listening socket, and the connection of each live child's client."""

    def __init__(self, path: str):
        self.default_path = base_path()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(64)
        self.wake_read, wake_write = os.pipe()
        os.set_blocking(wake_write, False)
        signal.set_wakeup_fd(wake_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.children = {}  # pid -> its client's connection
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wake_read, selectors.EVENT_READ, "reap")
        self.selector.register(sys.stdin, selectors.EVENT_READ, "parent")

    def serve(self) -> None:
        while True:
            for key, _ in self.selector.select():
                if key.data == "parent":  # the pytest process ended
                    for pid in self.children:
                        _kill(pid)
                    return
                if key.data == "reap":
                    os.read(self.wake_read, 4096)
                elif key.data == "accept":
                    self.accept()
                else:  # a client went away before its child: the child goes too, stopped or not
                    self.selector.unregister(key.fileobj)
                    _kill(key.data)
            self.reap()

    def accept(self) -> None:
        connection, _ = self.listener.accept()
        connection.settimeout(10)
        try:
            request, fds = warm_pool.receive_request(connection, max_fds=4)
        except (OSError, ValueError):
            connection.close()
            return
        reason = refusal(request) if request and len(fds) == 4 else "a malformed request"
        if reason:
            _close(fds)
            _reply(connection, {"refused": reason})
            connection.close()
            return
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self.close_in_child(connection)
            become_rank(request, fds, self.default_path)  # never returns
        _close(fds)
        self.children[pid] = connection
        self.selector.register(connection, selectors.EVENT_READ, pid)
        _reply(connection, {"pid": pid})

    def close_in_child(self, connection: socket.socket) -> None:
        """Close what the zygote holds, through the objects: a socket object left holding a
        closed number would close it again when collected, by then some MPI descriptor."""
        self.selector.close()
        for sock in (self.listener, connection, *self.children.values()):
            sock.close()
        os.close(self.wake_read)
        os.close(signal.set_wakeup_fd(-1))

    def reap(self) -> None:
        """Tell each finished child's client how it ended."""
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            connection = self.children.pop(pid, None)
            if connection is None:
                continue
            if connection in (key.fileobj for key in self.selector.get_map().values()):
                self.selector.unregister(connection)
            if os.WIFSIGNALED(status):
                _reply(connection, {"signal": os.WTERMSIG(status)})
            else:
                _reply(connection, {"code": os.waitstatus_to_exitcode(status)})
            connection.close()


def become_rank(request: dict, fds, default_path) -> None:
    """Turn this forked child into ``python ARGV`` as the client would have run it, and run it;
    ends the process (SystemExit) with the program's exit code."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()
    stdin, stdout, stderr, watch = fds
    for target, fd in ((0, stdin), (1, stdout), (2, stderr)):
        os.dup2(fd, target)
        os.close(fd)
    os.set_inheritable(watch, False)
    die_with_client(watch)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    python_path = list(filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    random.seed()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[:] = ["", *python_path, *default_path]
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[:] = [os.getcwd(), *python_path, *default_path]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[:] = [os.path.dirname(os.path.realpath(argv[0])), *python_path, *default_path]
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit:
        raise
    except BaseException as error:  # as python does: the traceback, then exit code 1
        traceback = error.__traceback__
        while traceback is not None and traceback.tb_frame.f_code.co_filename in (__file__, runpy.__file__):
            traceback = traceback.tb_next
        sys.excepthook(type(error), error.with_traceback(traceback), traceback)
        raise SystemExit(1) from None
    raise SystemExit(0)


def die_with_client(watch: int) -> None:
    """SIGIO (whose default action ends the process) when the client's end of ``watch`` closes."""
    fcntl.fcntl(watch, fcntl.F_SETOWN, os.getpid())
    fcntl.fcntl(watch, fcntl.F_SETFL, fcntl.fcntl(watch, fcntl.F_GETFL) | os.O_ASYNC)
    readable, _, _ = select.select([watch], [], [], 0)
    if readable:  # closed before O_ASYNC took effect
        os._exit(1)


def _reply(connection: socket.socket, message: dict) -> None:
    try:
        warm_pool.send_message(connection, message)
    except OSError:
        pass


def _close(fds) -> None:
    for fd in fds:
        os.close(fd)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    preload()
    Zygote(sys.argv[1]).serve()
