"""The source tree keeps its layout (docs/architecture.md, "Where the code lives"): which
folder may import which, no import cycles, every worker module in one of its three rooms,
and no torch or MPI in the processes that must not load them.

Every ``.py`` file of ringmaster's source folders (as pyproject.toml maps them) is parsed
with ``ast``; every ``import x`` and ``from x import y`` counts, at module level, inside
functions and under ``if TYPE_CHECKING:``, with relative imports resolved. A failure names
the file, the line and the rule it breaks. No MPI job, and torch is never imported here.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

API = "ringmaster"                                # ringmaster/__init__.py: loads ringmaster.worker lazily
WORKER = "ringmaster.worker"                      # worker/__init__.py: the public API, re-exported
FRONTEND = "ringmaster.worker.frontend"
RUNTIME = "ringmaster.worker.runtime"
COMPRESSION = "ringmaster.worker.compression"
ROOMS = (FRONTEND, RUNTIME, COMPRESSION)
OPS = "ringmaster.ops"
LAUNCH = "ringmaster.launch"
COORDINATOR = "ringmaster.coordinator"
#: Loaded by ringrun and by the coordinator daemon (a child of rank 0 under plain mpirun,
#: where initializing MPI would hang): never torch, never MPI.
NO_TORCH = (COORDINATOR, LAUNCH, "ringmaster.common", "ringmaster.proto")
HEAVY = ("torch", "mpi4py")
#: Public modules of an optional extra, next to ringmaster/__init__.py, each re-exporting one
#: frontend module (``import ringmaster.lightning``); nothing imports them, and only they may
#: import that module from outside worker/.
EXTRA_ENTRIES = {"ringmaster.lightning": f"{FRONTEND}.lightning"}


# ------------------------------------------------------------------ the import graph
@dataclasses.dataclass(frozen=True)
class Import:
    module: str        # the importing module
    path: str          # its file, relative to the repository root
    line: int
    target: str        # a ringmaster module, or the top-level name of another package
    deferred: bool     # inside a function: runs when called, not when imported
    type_only: bool    # under ``if TYPE_CHECKING:``: never runs

    @property
    def eager(self) -> bool:
        return not (self.deferred or self.type_only)

    def where(self) -> str:
        kind = " (inside a function)" if self.deferred else " (under TYPE_CHECKING)" if self.type_only else ""
        return f"{self.path}:{self.line}: {self.module} imports {self.target}{kind}"


def _package_dirs() -> dict:
    """{package: folder} and the listed packages, from pyproject.toml's [tool.setuptools]."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    try:
        import tomllib
    except ModuleNotFoundError:  # Python < 3.11: the two tables are simple enough to read
        table = re.search(r"\[tool\.setuptools\.package-dir\]\n(.*?)(?:\n\[|\Z)", text, re.S).group(1)
        dirs = dict(re.findall(r'^"([\w.]+)"\s*=\s*"([^"]+)"', table, re.M))
        listed = re.findall(r'"([\w.]+)"', re.search(r"\bpackages\s*=\s*\[(.*?)\]", text, re.S).group(1))
        return dirs, listed
    setuptools = tomllib.loads(text)["tool"]["setuptools"]
    return setuptools["package-dir"], setuptools["packages"]


def _modules() -> dict:
    """{module name: (path, is a package)} for every .py file of the mapped folders."""
    dirs, _ = _package_dirs()
    modules = {}
    for package, folder in dirs.items():
        base = ROOT / folder
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if any(part in ("__pycache__",) for part in parts):
                continue
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            modules[".".join([package, *parts])] = (path.relative_to(ROOT).as_posix(), is_package)
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports_of(module: str, path: str, is_package: bool, modules: dict) -> list:
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"), filename=path)
    found = []

    def target_of(name: str) -> str:
        return name if name.split(".")[0] == "ringmaster" else name.split(".")[0]

    def visit(node, deferred: bool, type_only: bool):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(module, path, node.lineno, target_of(alias.name), deferred, type_only))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                base = package[:len(package) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                name = submodule if submodule in modules else source
                found.append(Import(module, path, node.lineno, target_of(name), deferred, type_only))
        for child in ast.iter_child_nodes(node):
            in_function = deferred or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                visit(child, in_function, type_only or child in node.body)
            else:
                visit(child, in_function, type_only)

    visit(tree, False, False)
    return found


MODULES = _modules()
IMPORTS = [imp for name, (path, is_package) in MODULES.items() for imp in _imports_of(name, path, is_package, MODULES)]


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _broken(rule: str, imports) -> list:
    return [f"{imp.where()}\n    breaks: {rule}" for imp in imports]


def _report(problems: list) -> str:
    return "\n" + "\n".join(problems)


def test_the_source_tree_is_found():
    assert {FRONTEND, RUNTIME, COMPRESSION, OPS, LAUNCH, COORDINATOR, API, WORKER} <= set(MODULES)
    assert any(imp.module == f"{RUNTIME}.lifecycle" and imp.target == f"{RUNTIME}.executor" for imp in IMPORTS)
    assert any(imp.deferred and imp.module == API and imp.target == WORKER for imp in IMPORTS)


# ------------------------------------------------------------------ the rules
def test_every_worker_module_lives_in_a_room():
    strays = [f"{MODULES[name][0]}: {name} is not in worker/runtime/, worker/frontend/ or worker/compression/\n"
              f"    breaks: every module of worker/ lives in one of its rooms (worker/__init__.py only re-exports)"
              for name in MODULES if _within(name, WORKER) and name != WORKER
              and not any(_within(name, room) for room in ROOMS)]
    assert not strays, _report(strays)


def test_every_package_is_installed():
    """pyproject.toml lists every package folder, so that ``pip install .`` ships it too."""
    _, listed = _package_dirs()
    missing = [f"{path}: package {name} is not in pyproject.toml's [tool.setuptools] packages"
               for name, (path, is_package) in MODULES.items() if is_package and name not in listed]
    assert not missing, _report(missing)


def test_only_the_public_api_imports_the_frontend():
    rule = ("imports run frontend -> runtime -> ops: only the frontend itself and ringmaster.worker "
            "(the public API) import ringmaster.worker.frontend")
    bad = [imp for imp in IMPORTS if _within(imp.target, FRONTEND)
           and not _within(imp.module, FRONTEND) and imp.module != WORKER
           and EXTRA_ENTRIES.get(imp.module) != imp.target]
    assert not bad, _report(_broken(rule, bad))


def test_an_extras_entry_module_is_imported_by_no_one():
    """``ringmaster.lightning`` is the user's to import: a module of the tree that imported it would load
    an optional package (and the whole worker) where the base install must not need it."""
    assert all(name in MODULES for name in EXTRA_ENTRIES), sorted(EXTRA_ENTRIES)
    rule = "an optional extra's entry module (ringmaster.lightning) is imported by users only, never inside the tree"
    bad = [imp for imp in IMPORTS if imp.target in EXTRA_ENTRIES]
    assert not bad, _report(_broken(rule, bad))


def test_compression_imports_neither_runtime_nor_frontend():
    rule = "compression is used by the frontend and the runtime's executor, and imports neither"
    bad = [imp for imp in IMPORTS if _within(imp.module, COMPRESSION)
           and (_within(imp.target, RUNTIME) or _within(imp.target, FRONTEND))]
    assert not bad, _report(_broken(rule, bad))


def test_nothing_inside_imports_the_public_api():
    """``ringmaster`` and ``ringmaster.worker`` re-export the frontend: a module of the tree that
    imports them depends on the frontend (and, below it, makes an import cycle)."""
    rule = ("only ringmaster/__init__.py loads ringmaster.worker; inside the tree, import the module that "
            "defines a name, not the package that re-exports it")
    bad = [imp for imp in IMPORTS if imp.target in (API, WORKER) and imp.module != API]
    assert not bad, _report(_broken(rule, bad))


def test_ops_imports_no_worker_launch_or_coordinator():
    rule = "ops/ is plain functions over a communicator and arrays: it imports no worker/, launch/ or coordinator/"
    bad = [imp for imp in IMPORTS if _within(imp.module, OPS)
           and (imp.target == API or any(_within(imp.target, package) for package in (WORKER, LAUNCH, COORDINATOR)))]
    assert not bad, _report(_broken(rule, bad))


def test_the_worker_imports_no_coordinator():
    rule = ("a rank shares the protocol with the coordinator through proto/ (auth, the op specs, the dtype "
            "table) and common/; it imports nothing of coordinator/, the daemon's")
    bad = [imp for imp in IMPORTS if _within(imp.module, WORKER) and _within(imp.target, COORDINATOR)]
    assert not bad, _report(_broken(rule, bad))


def test_only_the_launcher_imports_launch():
    rule = "launch/ is ringrun's: no rank (nor the coordinator) imports it; share code through common/"
    bad = [imp for imp in IMPORTS if _within(imp.target, LAUNCH) and not _within(imp.module, LAUNCH)]
    assert not bad, _report(_broken(rule, bad))


def test_coordinator_and_launcher_import_no_torch_mpi_or_worker():
    rule = ("the coordinator daemon and ringrun (and common/, proto/, which they share) never import torch or "
            "mpi4py, nor worker/ or ops/ (MPI initialized in the coordinator, a child of rank 0, hangs)")
    bad = [imp for imp in IMPORTS if any(_within(imp.module, package) for package in NO_TORCH)
           and (imp.target in HEAVY or _within(imp.target, WORKER) or _within(imp.target, OPS))]
    # ringmaster/__init__.py runs in all of them: only its lazy __getattr__ may load the worker.
    bad += [imp for imp in IMPORTS if imp.module == API and imp.eager
            and (imp.target in HEAVY or _within(imp.target, WORKER) or _within(imp.target, OPS))]
    assert not bad, _report(_broken(rule, bad))


def _eager_closure(start: str) -> dict:
    """{module reached: the import that reached it} over imports that run at import time,
    counting the packages Python imports on the way (``a.b.c`` runs ``a`` and ``a.b``)."""
    eager = {}
    for imp in IMPORTS:
        if imp.eager:
            eager.setdefault(imp.module, []).append(imp)
    reached, todo = {start: None}, [start]
    while todo:
        name = todo.pop()
        parts = name.split(".")
        parents = [".".join(parts[:i]) for i in range(1, len(parts))]
        for parent in parents:
            if parent in MODULES and parent not in reached:
                reached[parent] = reached[name]
                todo.append(parent)
        for imp in eager.get(name, []):
            if imp.target not in reached:
                reached[imp.target] = imp
                if imp.target in MODULES:
                    todo.append(imp.target)
    return reached


def _chain(reached: dict, name: str) -> list:
    chain = []
    while reached.get(name) is not None:
        chain.append(reached[name].where())
        name = reached[name].module
    return chain[::-1]


def test_nothing_the_coordinator_or_ringrun_loads_imports_torch_or_mpi():
    problems = []
    for name in MODULES:
        if not any(_within(name, package) for package in NO_TORCH):
            continue
        reached = _eager_closure(name)
        for heavy in HEAVY:
            if heavy in reached:
                problems.append(f"importing {name} imports {heavy}:\n    " + "\n    ".join(_chain(reached, heavy))
                                + "\n    breaks: the coordinator daemon and ringrun never import torch or mpi4py")
    assert not problems, _report(problems)


@pytest.mark.parametrize("command", [
    ["-m", "ringmaster.coordinator", "--help"],
    ["-m", "ringmaster.launch", "--help"],
    ["-c", "import ringmaster.coordinator.server, ringmaster.launch.cli"],
])
def test_coordinator_and_ringrun_start_without_torch_or_mpi(command, tmp_path):
    """The same, as Python sees it: every module a fresh interpreter imports (``-X importtime``)."""
    result = subprocess.run([sys.executable, "-X", "importtime", *command], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:")}
    assert "ringmaster" in imported, result.stderr[-3000:]
    heavy = sorted(name for name in imported if name.split(".")[0] in HEAVY)
    assert not heavy, (f"python {' '.join(command)} imported {heavy[:5]}: the coordinator daemon and ringrun "
                       f"must never import torch or mpi4py")


# ------------------------------------------------------------------ cycles
def _cycles() -> list:
    """Strongly connected groups of modules (more than one module, or one importing itself)."""
    edges = {}
    for imp in IMPORTS:
        if imp.target in MODULES and imp.target != imp.module:
            edges.setdefault(imp.module, {}).setdefault(imp.target, imp)
    index, low, on_stack, stack, groups = {}, {}, set(), [], []
    counter = 0
    for root in MODULES:  # Tarjan, iteratively
        if root in index:
            continue
        work = [(root, iter(edges.get(root, {})))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges.get(child, {}))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return [(group, [edges[a][b].where() for a in group for b in group if b in edges.get(a, {})])
            for group in groups]


def _cycle_report(cycles) -> str:
    return _report([f"these modules import each other: {', '.join(group)}\n    " + "\n    ".join(lines)
                    + "\n    breaks: no import cycles (move what both need into a module below both)"
                    for group, lines in cycles])


def test_no_import_cycles():
    cycles = _cycles()
    assert not cycles, _cycle_report(cycles)


#: docs/architecture.md: "Keep modules under ~600 lines, split by job".
MAX_MODULE_LINES = 600


def test_no_module_is_over_600_lines():
    """Every ``.py`` file outside tests/ (source, bench/, examples/) has at most MAX_MODULE_LINES lines."""
    files = [path for path in ROOT.rglob("*.py") if not any(part == "tests" or part.startswith(".")
                                                              for part in path.relative_to(ROOT).parts)]
    assert any(path.name == "executor.py" for path in files)
    long = [f"{path.relative_to(ROOT)}: {count} lines\n    breaks: a module has one job and at most "
            f"{MAX_MODULE_LINES} lines; split it by job"
            for path in sorted(files) for count in [len(path.read_text(encoding="utf-8").splitlines())]
            if count > MAX_MODULE_LINES]
    assert not long, _report(long)
