"""The elastic driver's state service: where a job's committed state outlives its ranks.

An HTTP server in a process of its own, started by ``ringrun`` for the whole elastic job
(``python -m ringmaster.launch.elastic_service``; the protocol is in
:mod:`ringmaster.common.elastic`). It is not a thread of ringrun: ringrun stays
single-threaded (see :class:`~.output.OutputRelay`), and it goes away with ringrun, as the
coordinator does (its stdin is a pipe from ringrun; it exits on end of file).
Rank 0 stores each committed snapshot here (``PUT /state``); when a generation ends, because
a rank or host was lost or because hosts were added, the next generation's rank 0 fetches
it (``GET /state``) and broadcasts it to the others. The service also answers the host-set
version (``GET /hosts``), which :meth:`State.check_host_updates` compares with the one its
generation started with, takes rank 0's request to re-form (``POST /reform``), and keeps
how each rank that shrank in place ended (``POST /exits``), which ``mpirun``'s status cannot say.

Every request must carry the job token in :data:`~ringmaster.common.elastic.TOKEN_HEADER`
(compared in constant time); others get 401 and are logged without the token.
"""

from __future__ import annotations

import hmac
import http.server
import threading
import time
from typing import List, Optional, Tuple

from ringmaster.common import elastic as protocol

_CHUNK = 1 << 20


class StateService:
    """The service of one elastic job.

    Args:
        secret: the job token.
        bind: address to listen on (the coordinator's).
        advertise: address ranks dial (if ``bind`` is a wildcard).
    """

    def __init__(self, secret: str, bind: str, advertise: Optional[str] = None):
        self._secret = secret.encode()
        self._lock = threading.Lock()
        self._snapshot: Optional[bytes] = None
        self.snapshot_time: Optional[float] = None
        self.commits = 0
        self.hosts_version = 0
        self.reform_requested = False
        self.exits: List[Tuple[int, int, int]] = []
        service = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format, *args):  # noqa: A002 - the base class's name
                pass

            def _authorized(self) -> bool:
                token = (self.headers.get(protocol.TOKEN_HEADER) or "").encode()
                if hmac.compare_digest(token, service._secret):
                    return True
                self._reply(401, b"missing or wrong job token\n")
                return False

            def _reply(self, code: int, body: bytes = b"") -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if body:
                    self.wfile.write(body)

            def do_GET(self):  # noqa: N802 - http.server's name
                if not self._authorized():
                    return
                if self.path == protocol.STATE_PATH:
                    snapshot = service.snapshot()
                    if snapshot is None:
                        self._reply(404, b"no commit yet\n")
                    else:
                        self._reply(200, snapshot)
                elif self.path == protocol.HOSTS_PATH:
                    self._reply(200, str(service.hosts_version).encode())
                elif self.path == protocol.REFORM_PATH:
                    self._reply(200, b"1" if service.reform_requested else b"0")
                elif self.path == protocol.COMMITS_PATH:
                    self._reply(200, str(service.snapshot_info()[0]).encode())
                elif self.path == protocol.EXITS_PATH:
                    with service._lock:
                        lines = "".join(f"{size} {rank} {status}\n" for size, rank, status in service.exits)
                    self._reply(200, lines.encode())
                else:
                    self._reply(404)

            def _take_exit(self) -> None:
                try:
                    length = int(self.headers.get("Content-Length", ""))
                    if not 0 < length <= 64:
                        raise ValueError(length)
                    size, rank, status = (int(field) for field in self.rfile.read(length).decode().split())
                except ValueError:
                    self.close_connection = True  # what is left of the body is not a request
                    self._reply(400, b"expected 'size rank status'\n")
                    return
                with service._lock:
                    service.exits.append((size, rank, status))
                self._reply(204)

            def do_PUT(self):  # noqa: N802
                if not self._authorized():
                    return
                if self.path != protocol.STATE_PATH:
                    self._reply(404)
                    return
                try:
                    length = int(self.headers.get("Content-Length", ""))
                except ValueError:
                    self._reply(411, b"Content-Length required\n")
                    return
                if not 0 < length <= protocol.MAX_SNAPSHOT_BYTES:
                    self._reply(413, b"snapshot size out of range\n")
                    return
                parts, left = [], length
                while left:
                    part = self.rfile.read(min(left, _CHUNK))
                    if not part:  # the sender died mid-upload: the previous commit stays
                        return
                    parts.append(part)
                    left -= len(part)
                service.store(b"".join(parts))
                self._reply(204)

            def do_POST(self):  # noqa: N802
                if not self._authorized():
                    return
                if self.path == protocol.REFORM_PATH:
                    service.reform_requested = True
                    self._reply(204)
                elif self.path == protocol.HOSTS_PATH:  # the driver: hosts were added or removed
                    service.announce_hosts_changed()
                    self._reply(200, str(service.hosts_version).encode())
                elif self.path == protocol.NEW_GENERATION_PATH:  # the driver, between generations
                    service.new_generation()
                    self._reply(204)
                elif self.path == protocol.EXITS_PATH:  # a rank that shrank in place, at exit
                    self._take_exit()
                else:
                    self._reply(404)

        self._server = http.server.ThreadingHTTPServer((bind, 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.address = f"{advertise or bind}:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="ringrun-elastic-state",
                                        daemon=True)

    def start(self) -> "StateService":
        """Serve on a background thread."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving (idempotent)."""
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()

    def store(self, snapshot: bytes) -> None:
        """Keep ``snapshot`` as the last commit."""
        with self._lock:
            self._snapshot = snapshot
            self.snapshot_time = time.monotonic()
            self.commits += 1

    def snapshot(self) -> Optional[bytes]:
        """The last committed snapshot, or ``None``."""
        with self._lock:
            return self._snapshot

    def snapshot_info(self) -> Tuple[int, int]:
        """(commits stored so far, size of the last one in bytes)."""
        with self._lock:
            return self.commits, len(self._snapshot) if self._snapshot is not None else 0

    def new_generation(self) -> None:
        """Forget the previous generation's re-form request and exits."""
        self.reform_requested = False
        with self._lock:
            self.exits = []

    def announce_hosts_changed(self) -> None:
        """Tell the ranks, at their next ``commit()``/``check_host_updates()``, to re-form."""
        self.hosts_version += 1


def main(argv=None) -> int:
    """``python -m ringmaster.launch.elastic_service --bind ADDR [--advertise ADDR] --address-file PATH``.

    The token comes from ``RINGMASTER_SECRET``. Writes ``host:port`` to the address file once
    listening, and exits when standard input reaches end of file (ringrun is gone or done).
    """
    import argparse
    import os

    from ringmaster.common.daemon import read_until_eof, refuse, write_address

    parser = argparse.ArgumentParser(prog="python -m ringmaster.launch.elastic_service")
    parser.add_argument("--bind", required=True)
    parser.add_argument("--advertise")
    parser.add_argument("--address-file", required=True)
    args = parser.parse_args(argv)
    secret = os.environ.get("RINGMASTER_SECRET", "")
    if not secret:
        return refuse("elastic state service", "RINGMASTER_SECRET is not set; the elastic state service refuses "
                                               "to run without a job token")
    service = StateService(secret, args.bind, args.advertise).start()
    write_address(args.address_file, service.address)
    try:
        read_until_eof()
    except KeyboardInterrupt:
        pass
    service.stop()
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
