"""ringrun's scratch directory (the coordinator's address file, a hostfile), and what killed runs left.

A ringrun that is SIGKILLed cannot remove its directory. The name carries ringrun's pid,
so the next ringrun removes the directories of ringruns that are no longer running.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from typing import List, Optional

PREFIX = "ringrun-"
_NAME = re.compile(re.escape(PREFIX) + r"(\d+)-[^/]+$")


def make_workdir(root: Optional[str] = None) -> str:
    """A new directory for this ringrun; remove it with ``shutil.rmtree`` at the end."""
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root)


def remove_stale_workdirs(root: Optional[str] = None) -> List[str]:
    """Remove this user's ringrun directories whose ringrun is gone; return their paths."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        match = _NAME.match(name)
        path = os.path.join(root, name)
        if match is None or not os.path.isdir(path) or os.path.islink(path):
            continue
        try:
            if os.stat(path).st_uid != os.getuid() or _running(int(match.group(1))):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True
