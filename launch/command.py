"""Checks on the user's command that catch mistakes before anything is started."""

from __future__ import annotations

import os
import re
import shutil
from typing import List, Optional, Sequence

from .errors import LaunchError

_PYTHON = re.compile(r"^python(\d+(\.\d+)*)?$")
_PYTHON_FLAGS_WITH_VALUE = set("WX")  # -W arg, -X opt
_PYTHON_LONG_WITH_VALUE = {"--check-hash-based-pycs"}
_PYTHON_NO_SCRIPT = {"-h", "-?", "--help", "-V", "--version", "--help-env", "--help-xoptions", "--help-all"}


def normalize_command(command: Sequence[str]) -> List[str]:
    """The user's command without a leading ``--`` separator.

    Raises:
        LaunchError: there is no command.
    """
    command = list(command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise LaunchError(
            "no command given; usage: ringrun -np N [options] COMMAND [ARGS...], "
            "e.g. ringrun -np 2 python train.py"
        )
    return command


def python_script(command: Sequence[str]) -> Optional[str]:
    """The script a ``python``/``pythonN[.M]`` command runs, or ``None`` (not Python, or
    ``-c``/``-m``/stdin/no script)."""
    if not command or not _PYTHON.match(os.path.basename(command[0])):
        return None
    index = 1
    while index < len(command):
        arg = command[index]
        if arg in _PYTHON_NO_SCRIPT or arg == "-":
            return None
        if arg == "--":
            return command[index + 1] if index + 1 < len(command) else None
        if arg.startswith("--"):
            index += 2 if arg in _PYTHON_LONG_WITH_VALUE else 1
            continue
        if not arg.startswith("-"):
            return arg
        cluster = arg[1:]
        for position, flag in enumerate(cluster):
            if flag in "cm":
                return None
            if flag in _PYTHON_FLAGS_WITH_VALUE:
                if position == len(cluster) - 1:
                    index += 1  # the value is the next argument
                break
        index += 1
    return None


def check_command(command: Sequence[str], local_only: bool, cwd: Optional[str] = None) -> None:
    """Refuse a command that cannot work.

    - ``python X.py ...``: ``X.py`` must exist here (ranks share this working directory
      on one host, or the same path on every host);
    - for a job on this machine only: the program must be on PATH.

    Raises:
        LaunchError: naming the missing script or program.
    """
    cwd = cwd or os.getcwd()
    script = python_script(command)
    if script is not None and not os.path.exists(os.path.join(cwd, script)):
        raise LaunchError(f"script {script!r} does not exist (looked in {cwd})")
    if local_only and shutil.which(command[0]) is None:
        raise LaunchError(f"program {command[0]!r} was not found on PATH (or is not executable)")
