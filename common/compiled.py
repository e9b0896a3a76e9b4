"""Which modules of the per-call path are compiled, and which form of them runs.

The per-call path (submitting, the response cache's cycle, completing handles, the copies
and the waits of a cycle) is compiled with Cython from the very ``.py`` files listed in
:data:`MODULES`: one source, two forms. ``pip install`` builds the extensions (setup.py,
which reads this list); the compiled form of a module sits beside its ``.py`` file and
Python's import system prefers it. So nothing can drift apart: the state machine of the
cache (``cache_protocol.Phase`` and its moves), the messages and the checks are the same
lines in both forms, and the tests that import a module test the form that runs.

``RINGMASTER_COMPILED=0`` in the environment, before ``import ringmaster``, runs the
``.py`` files instead (:func:`install`); so does a ``.py`` (or ``.pxd``) edited after it was
compiled, with a warning, so that an edit always runs. ``RINGMASTER_PYTHON_MODULES=a,b`` runs
only the named ones as Python (for comparing the forms part by part). Without a C compiler at
install time the build warns and the ``.py`` files run.

This module imports nothing of ringmaster: setup.py reads it before the package exists.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

#: The modules compiled, as imported.
MODULES = (
    "ringmaster.worker.runtime.cache_protocol",
    "ringmaster.worker.runtime.entries",
    "ringmaster.worker.runtime.handles",
    "ringmaster.worker.runtime.response_cache",
)

#: Set to 0 to run the ``.py`` files of :data:`MODULES` although their compiled form is built.
ENVIRONMENT = "RINGMASTER_COMPILED"


def wanted() -> bool:
    """False when the environment asks for the Python form (``RINGMASTER_COMPILED=0``)."""
    return os.environ.get(ENVIRONMENT, "1").strip().lower() not in ("0", "false", "no", "off")


class _PythonForm(importlib.abc.MetaPathFinder):
    """Finds the ``.py`` file of a compiled module where the import system would take the extension:
    for every listed module when ``forced`` (``RINGMASTER_COMPILED=0``), otherwise only for one whose
    ``.py`` or ``.pxd`` changed after it was compiled (an editable install whose source was edited:
    the edit runs, with a warning, until ``pip install -e .`` compiles it again)."""

    def __init__(self, names=MODULES, forced: bool = True):
        self.names = names
        self.forced = forced

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.names:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.origin is None or spec.origin.endswith(".py"):
            return spec
        source = os.path.join(os.path.dirname(spec.origin), fullname.rpartition(".")[2] + ".py")
        if not os.path.exists(source):
            return spec
        if not self.forced:
            if not _stale(spec.origin, source):
                return spec
            sys.stderr.write(f"ringmaster: {source} (or its .pxd) changed after it was compiled: running it as "
                             f"Python; `pip install -e .` compiles it again\n")
        return importlib.util.spec_from_file_location(fullname, source)


def _stale(extension: str, source: str) -> bool:
    built = os.path.getmtime(extension)
    declarations = source[:-3] + ".pxd"
    return os.path.getmtime(source) > built or (os.path.exists(declarations) and os.path.getmtime(declarations) > built)


def install() -> None:
    """Choose the form of each listed module before any is imported (called by ``import ringmaster``)."""
    if any(isinstance(finder, _PythonForm) for finder in sys.meta_path):
        return
    if not wanted():
        sys.meta_path.insert(0, _PythonForm())
    elif os.environ.get("RINGMASTER_PYTHON_MODULES"):  # a comma-separated list: these run as Python (bisecting)
        names = {name.strip() for name in os.environ["RINGMASTER_PYTHON_MODULES"].split(",")}
        sys.meta_path.insert(0, _PythonForm(tuple(m for m in MODULES if m.rpartition(".")[2] in names)))
    else:
        sys.meta_path.insert(0, _PythonForm(forced=False))


def running_compiled(module) -> bool:
    """Whether ``module`` (an imported module of :data:`MODULES`) is its compiled form."""
    return not (getattr(module, "__file__", None) or "").endswith(".py")
