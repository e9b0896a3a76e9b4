"""Builds the compiled per-call path (Cython) beside the Python package described in pyproject.toml.

The modules compiled are listed in common/compiled.py; each is compiled from its own ``.py``
file, which stays the one source. Without a C compiler the build warns and installs the
Python form only (set RINGMASTER_REQUIRE_COMPILED=1 to make that an error instead).
"""

import importlib.util
import os
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
NO_COMPILER = ("ringmaster: no working C compiler, so the per-call path is installed in its Python form "
               "only (rm.compiled_built() is False). Install one (Debian/Ubuntu: apt-get install "
               "gcc python3-dev; RHEL: dnf install gcc python3-devel; macOS: xcode-select --install) and "
               "reinstall. RINGMASTER_REQUIRE_COMPILED=1 makes this an error.")


def _compiled_list():
    spec = importlib.util.spec_from_file_location("_ringmaster_compiled", os.path.join(HERE, "common", "compiled.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MODULES


def _source(module: str) -> str:
    """The .py file of ``ringmaster.x.y`` (package-dir: ringmaster.worker is worker/, and so on)."""
    parts = module.split(".")[1:]
    return os.path.join(*parts) + ".py"


class OptionalBuildExt(build_ext):
    """build_ext that falls back to the Python form when no C compiler works."""

    _warned = False

    def run(self):
        try:
            super().run()
        except Exception as error:  # noqa: BLE001 - distutils raises several kinds
            self._give_up(error)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as error:  # noqa: BLE001
            self._give_up(error)

    def _give_up(self, error):
        if os.environ.get("RINGMASTER_REQUIRE_COMPILED") == "1":
            raise SystemExit(f"{NO_COMPILER}\n({type(error).__name__}: {error})")
        if not OptionalBuildExt._warned:
            OptionalBuildExt._warned = True
            sys.stderr.write(f"WARNING: {NO_COMPILER}\n({type(error).__name__}: {error})\n")


def _pxd_tree() -> str:
    """A tree where Cython finds each module's .pxd under its import name (ringmaster/worker/...):
    the package-dir mapping of pyproject.toml, as links. The .pxd beside a .py gives the static
    types of its compiled form."""
    root = os.path.join(HERE, "build", "cython-include")
    package = os.path.join(root, "ringmaster")
    os.makedirs(package, exist_ok=True)
    open(os.path.join(package, "__init__.pxd"), "a").close()
    for name in ("worker", "ops", "common"):
        link = os.path.join(package, name)
        if not os.path.islink(link):
            os.symlink(os.path.join(HERE, name), link)
    return root


def _extensions():
    try:
        from Cython.Build import cythonize
    except ImportError:  # pyproject.toml's build requirements bring Cython; a --no-build-isolation build may not
        sys.stderr.write("WARNING: ringmaster: Cython is not installed: the per-call path runs in its Python form "
                         "(pip install cython, then reinstall).\n")
        return []
    from setuptools import Extension

    modules = _compiled_list()
    extensions = [Extension(module, [_source(module)]) for module in modules]
    return cythonize(extensions, language_level=3, quiet=True, include_path=[_pxd_tree()],
                     # Annotations are documentation here, never C types: both forms accept the same values.
                     compiler_directives={"annotation_typing": False, "binding": True,
                                          "embedsignature": False})


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
