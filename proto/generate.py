"""Generate the Python stubs of ``ringmaster.proto`` (run: ``python -m ringmaster.proto.generate``).

grpcio-tools writes ``import ringmaster_pb2`` into the gRPC stub; we rewrite it to a
relative import so the stubs live inside the ``ringmaster.proto`` package.
"""

from __future__ import annotations

import pathlib
import sys
import tempfile

PROTO_DIR = pathlib.Path(__file__).resolve().parent
PROTO_FILE = "ringmaster.proto"
GENERATED = ("ringmaster_pb2.py", "ringmaster_pb2_grpc.py")


def generate_sources() -> dict:
    """Run protoc on ``ringmaster.proto``; return {file name: source text}."""
    from grpc_tools import protoc  # test/dev dependency only

    with tempfile.TemporaryDirectory() as out:
        status = protoc.main([
            "grpc_tools.protoc", f"-I{PROTO_DIR}", f"--python_out={out}",
            f"--grpc_python_out={out}", str(PROTO_DIR / PROTO_FILE),
        ])
        if status != 0:
            raise RuntimeError(f"protoc failed on {PROTO_DIR / PROTO_FILE} (exit {status})")
        sources = {name: (pathlib.Path(out) / name).read_text() for name in GENERATED}
    sources["ringmaster_pb2_grpc.py"] = sources["ringmaster_pb2_grpc.py"].replace(
        "import ringmaster_pb2 as ringmaster__pb2", "from . import ringmaster_pb2 as ringmaster__pb2")
    return sources


def main() -> int:
    for name, text in generate_sources().items():
        (PROTO_DIR / name).write_text(text)
        print(f"wrote {PROTO_DIR / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
