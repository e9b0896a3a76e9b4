"""The compiled per-call path (common/compiled.py): which form runs, and the switch between them.

Each check runs in a fresh interpreter (the form is chosen at import). The fast path's own
tests (the response cache's, the schedule explorer) run against the compiled form by default
and a second time with ``RINGMASTER_COMPILED=0`` from here (the test at the end), so that CI,
which runs README's one test command, covers both forms.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from ringmaster.common import compiled

ROOT = pathlib.Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(120)

PROBE = """
import json, ringmaster
from ringmaster.common import compiled
from ringmaster.worker.frontend.build_info import compiled_built
import importlib
forms = {name: compiled.running_compiled(importlib.import_module(name)) for name in compiled.MODULES}
from ringmaster.worker.runtime import cache_protocol, response_cache
print(json.dumps({"built": compiled_built(), "forms": forms,
                  "same_phase": response_cache.Phase is cache_protocol.Phase}))
"""


def probe(**environment) -> dict:
    import json

    env = {key: value for key, value in os.environ.items() if key != compiled.ENVIRONMENT}
    env.update(environment)
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=100)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def built() -> bool:
    """Whether this checkout has the compiled form of every listed module."""
    for name in compiled.MODULES:
        folder = ROOT.joinpath(*name.split(".")[1:-1])
        if not any(path.suffix in (".so", ".pyd") for path in folder.glob(name.rpartition(".")[2] + ".*")):
            return False
    return True


def test_the_environment_switch_runs_every_listed_module_as_python():
    result = probe(RINGMASTER_COMPILED="0")
    assert result["built"] is False
    assert result["forms"] == {name: False for name in compiled.MODULES}
    assert result["same_phase"]  # the driver reads the protocol's Phase, whichever form runs


def test_the_compiled_form_runs_where_it_is_built():
    if not built():
        if os.environ.get("RINGMASTER_REQUIRE_COMPILED") == "1":
            pytest.fail("RINGMASTER_REQUIRE_COMPILED=1 but the per-call path is not compiled: "
                        "run `pip install -e .` with a C compiler present")
        pytest.skip("the per-call path is not compiled here (no C compiler at install time)")
    result = probe()
    assert result["built"] is True
    assert result["forms"] == {name: True for name in compiled.MODULES}
    assert result["same_phase"]


@pytest.mark.parametrize("value", ["0", "false", "off", "no"])
def test_the_switch_reads_the_usual_spellings_of_off(value, monkeypatch):
    monkeypatch.setenv(compiled.ENVIRONMENT, value)
    assert not compiled.wanted()


def test_every_compiled_module_keeps_its_python_source():
    """One source: each compiled module is built from its .py file, which must exist (and is
    what RINGMASTER_COMPILED=0 and a machine without a compiler run)."""
    for name in compiled.MODULES:
        source = ROOT.joinpath(*name.split(".")[1:]).with_suffix(".py")
        assert source.is_file(), f"{name}: {source} is missing"


#: The fast path's tests that run again against the Python form: the schedule explorer and the
#: cache driver (in-process, every decision of the protocol and its driver) and the real 2-rank
#: job whose carried results must equal negotiated ones bit for bit. The whole suite runs the
#: compiled form; CI runs README's one test command, so the second form runs from here.
PYTHON_FORM_TESTS = ["tests/test_cache_schedules.py", "tests/test_cache_driver.py",
                     "tests/test_cache_payload.py::test_carried_results_equal_negotiated_ones_bit_for_bit[2]"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_fast_paths_tests_pass_against_the_python_form():
    if not built():
        pytest.skip("only the Python form is installed here: the suite itself runs it")
    env = dict(os.environ, **{compiled.ENVIRONMENT: "0"})
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *PYTHON_FORM_TESTS],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=560)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout, done.stdout[-2000:]


def test_a_source_edited_after_compiling_runs_as_python(tmp_path, capsys):
    """An editable install whose .py (or .pxd) changed since it was compiled runs the edit, with a
    warning, rather than the stale extension."""
    import importlib.machinery

    source = tmp_path / "mod.py"
    extension = tmp_path / f"mod{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    declarations = tmp_path / "mod.pxd"
    for path, when in ((source, 100), (declarations, 100), (extension, 200)):
        path.write_text("")
        os.utime(path, (when, when))
    finder = compiled._PythonForm(names=("pkg.mod",), forced=False)
    assert finder.find_spec("pkg.mod", [str(tmp_path)]).origin == str(extension)
    for edited in (source, declarations):
        os.utime(edited, (300, 300))
        assert finder.find_spec("pkg.mod", [str(tmp_path)]).origin == str(source)
        assert "changed after it was compiled" in capsys.readouterr().err
        os.utime(edited, (100, 100))
    forced = compiled._PythonForm(names=("pkg.mod",))
    assert forced.find_spec("pkg.mod", [str(tmp_path)]).origin == str(source)


def _assigned_attributes(class_node) -> set:
    """Attributes its methods assign on ``self`` (``self.x = ``, ``self.x, self.y = ``, ``self.x += ``)."""
    import ast

    names = set()
    for node in ast.walk(class_node):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                isinstance(node.value, ast.Name) and node.value.id == "self":
            names.add(node.attr)
    return names


def _declared_attributes(pxd_text: str) -> dict:
    """``cdef class`` name -> the attributes its ``cdef public`` lines declare."""
    import re

    classes, current = {}, None
    for line in pxd_text.splitlines():
        match = re.match(r"cdef class (\w+)", line)
        if match:
            current = classes.setdefault(match.group(1), set())
            continue
        match = re.match(r"\s+cdef (?:public |readonly )?\w+ (.+)", line)
        if match and current is not None:
            current.update(name.strip() for name in match.group(1).split(","))
    return classes


@pytest.mark.parametrize("module", compiled.MODULES)
def test_every_attribute_a_compiled_class_sets_is_declared_in_its_pxd(module):
    """An extension type has only the fields its .pxd declares: an attribute assigned in the .py and
    missing there would be an AttributeError in the compiled form alone. Checked on the source, so
    that it fails where nothing is compiled too."""
    import ast

    source = ROOT.joinpath(*module.split(".")[1:]).with_suffix(".py")
    pxd = source.with_suffix(".pxd")
    if not pxd.exists():
        return
    declared = _declared_attributes(pxd.read_text())
    classes = {node.name: node for node in ast.parse(source.read_text()).body if isinstance(node, ast.ClassDef)}
    for name, fields in declared.items():
        assert name in classes, f"{pxd.name} declares class {name}, which {source.name} does not define"
        missing = _assigned_attributes(classes[name]) - fields
        assert not missing, (f"{source.name}: {name} assigns {sorted(missing)}, which {pxd.name} does not declare; "
                             f"add them to its `cdef public object ...` lines")
