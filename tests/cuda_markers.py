"""Which tests need CUDA but are not marked ``cuda`` (read from their source, not run).

CI has no GPU, and the device check (``bench/gpu/device_check.sh``) runs ``pytest -m cuda``:
a test that needs a GPU but lacks the mark runs nowhere. Skipping it on CPU hides that, and
so does building its parameters only where a GPU is present
(``["cpu"] + (["cuda"] if torch.cuda.is_available() else [])``).

A *use* of CUDA, in a test module or a job script it runs, is:

- a device string ``"cuda"`` or ``"cuda:N"`` (a tensor's device, a parameter, a job's argument);
- a ``.cuda(...)`` call;
- ``torch.cuda.X`` other than the probes ``is_available`` and ``device_count`` (asking is
  not needing);
- an import of ``cupy``.

Not a use: a comparison with ``"cuda"`` (``device == "cuda"``), and everything in the body
of an ``if`` that makes one (the value compared arrives as a parameter or an argument, whose
own literal is a use); anything inside ``pytest.param(..., marks=pytest.mark.cuda)``; a line
carrying the comment ``# cuda-marker: not a device (<why>)`` (a device *name* a test only
compares or sends, a refusal checked where no GPU is).

A test (``test_*`` function or method) *needs CUDA* when its decorators, its body, or what it
names from its module (helpers, constants, job scripts read from ``tests/jobs``), followed
transitively, contain a use. It is *marked* by ``@pytest.mark.cuda``, a ``cuda`` mark on its
class, or the module's ``pytestmark``. :func:`unmarked` lists those that need CUDA and are
not marked.
"""

from __future__ import annotations

import ast
import pathlib
import re
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Set

PRAGMA = "# cuda-marker: not a device"
PROBES = {"is_available", "device_count"}
_DEVICE_STRING = re.compile(r"^cuda(:\d+)?$")


@dataclass(frozen=True)
class Use:
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def is_cuda_mark(node: ast.AST) -> bool:
    """``pytest.mark.cuda`` (or ``mark.cuda``) anywhere in ``node``."""
    return any(isinstance(n, ast.Attribute) and n.attr == "cuda" and isinstance(n.value, ast.Attribute)
               and n.value.attr == "mark" for n in ast.walk(node))


def _is_device_string(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and bool(_DEVICE_STRING.match(node.value))


def _compares_with_cuda(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Compare) and any(_is_device_string(c) for c in [n.left, *n.comparators])
               for n in ast.walk(node))


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


class _Scan(ast.NodeVisitor):
    """The uses of CUDA in a subtree, and the module-level names it refers to."""

    def __init__(self, path: str, lines: List[str]):
        self.path, self.lines = path, lines
        self.uses: List[Use] = []
        self.names: Set[str] = set()

    def _use(self, node: ast.AST, what: str) -> None:
        line = getattr(node, "lineno", 0)
        if 0 < line <= len(self.lines) and PRAGMA in self.lines[line - 1]:
            return
        self.uses.append(Use(self.path, line, what))

    def visit_Name(self, node: ast.Name) -> None:
        self.names.add(node.id)

    def visit_Constant(self, node: ast.Constant) -> None:
        if _is_device_string(node):
            self._use(node, f"device string {node.value!r}")

    def visit_Compare(self, node: ast.Compare) -> None:
        for part in [node.left, *node.comparators]:
            if not _is_device_string(part):
                self.visit(part)

    def _visit_guarded(self, node) -> None:
        self.visit(node.test)
        if not _compares_with_cuda(node.test):
            self.visit_all(node.body if isinstance(node.body, list) else [node.body])
        self.visit_all(node.orelse if isinstance(node.orelse, list) else [node.orelse])

    visit_If = _visit_guarded
    visit_IfExp = _visit_guarded

    def visit_Attribute(self, node: ast.Attribute) -> None:
        dotted = _dotted(node)
        if dotted.startswith("torch.cuda.") and dotted.split(".")[2] not in PROBES:
            self._use(node, dotted)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "param" and any(
                k.arg == "marks" and is_cuda_mark(k.value) for k in node.keywords):
            return  # pytest.param(..., marks=pytest.mark.cuda): marked where it is made
        if isinstance(func, ast.Attribute) and func.attr == "cuda":
            self._use(node, ".cuda()")
            self.visit(func.value)
            self.visit_all(node.args)
            self.visit_all(k.value for k in node.keywords)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        if any(alias.name.split(".")[0] == "cupy" for alias in node.names):
            self._use(node, "import cupy")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if (node.module or "").split(".")[0] == "cupy":
            self._use(node, "from cupy import")

    def visit_all(self, nodes: Iterable[Optional[ast.AST]]) -> None:
        for node in nodes:
            if node is not None:
                self.visit(node)


def scan(nodes: Iterable[ast.AST], path: str, lines: List[str]) -> _Scan:
    scanner = _Scan(path, lines)
    scanner.visit_all(nodes)
    return scanner


def job_uses(path: pathlib.Path) -> List[Use]:
    """A job script's uses of CUDA outside its top-level ``if`` statements: what it needs
    whatever its arguments (which decide its branches; a test's argument ``"cuda"`` is a use
    of its own). Its functions count: a job runs what it defines."""
    source = path.read_text()
    body = [node for node in ast.parse(source).body if not isinstance(node, ast.If)]
    return scan(body, str(path), source.splitlines()).uses


@dataclass
class Test:
    name: str
    line: int
    marked: bool
    uses: List[Use]


def tests_of(path: pathlib.Path, jobs_dir: Optional[pathlib.Path] = None) -> List[Test]:
    """Every test of the module at ``path``, with its uses of CUDA (followed through the
    module-level names it refers to) and whether it is marked."""
    source = path.read_text()
    return tests_of_source(source, str(path), jobs_dir or path.parent / "jobs")


def tests_of_source(source: str, path: str, jobs_dir: pathlib.Path) -> List[Test]:
    tree = ast.parse(source)
    lines = source.splitlines()
    module_marked = False
    definitions: Dict[str, _Scan] = {}  # module-level name -> what defining it uses and names
    tests = []  # (name, line, marked, scan)

    def job_scan(node: ast.AST, scanned: _Scan) -> None:
        for n in ast.walk(node):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.endswith(".py"):
                job = jobs_dir / n.value
                if job.is_file():
                    scanned.uses += job_uses(job)

    def function(node, class_marked: bool) -> None:
        marked = class_marked or any(is_cuda_mark(d) for d in node.decorator_list)
        scanned = scan([*node.decorator_list, *node.args.defaults, *node.body], path, lines)
        if node.name.startswith("test"):
            tests.append((node.name, node.lineno, marked, scanned))
        definitions[node.name] = scanned

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function(node, False)
        elif isinstance(node, ast.ClassDef):
            class_marked = any(is_cuda_mark(d) for d in node.decorator_list)
            for statement in node.body:
                if isinstance(statement, ast.Assign) and any(
                        isinstance(t, ast.Name) and t.id == "pytestmark" for t in statement.targets):
                    class_marked = class_marked or is_cuda_mark(statement.value)
            for statement in node.body:
                if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    function(statement, class_marked)
            definitions[node.name] = scan(node.body, path, lines)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
            if "pytestmark" in names:
                module_marked = module_marked or is_cuda_mark(node.value)
                continue
            scanned = scan([node.value] if node.value is not None else [], path, lines)
            if node.value is not None:
                job_scan(node.value, scanned)
            for name in names:
                definitions[name] = scanned

    def closure(scanned: _Scan) -> List[Use]:
        uses, seen, todo = list(scanned.uses), set(), list(scanned.names)
        while todo:
            name = todo.pop()
            if name in seen or name not in definitions:
                continue
            seen.add(name)
            uses += definitions[name].uses
            todo += definitions[name].names
        return sorted(set(uses), key=lambda u: u.line)

    return [Test(name, line, module_marked or marked, closure(scanned)) for name, line, marked, scanned in tests]


def unmarked(tests_dir: pathlib.Path) -> List[str]:
    """``path:line test: uses`` for each test under ``tests_dir`` that needs CUDA unmarked."""
    found = []
    for path in sorted(tests_dir.rglob("test_*.py")):
        for test in tests_of(path, tests_dir / "jobs"):
            if test.uses and not test.marked:
                found.append(f"{path.relative_to(tests_dir)}:{test.line} {test.name}: "
                             + "; ".join(str(u) for u in test.uses[:3]))
    return found
