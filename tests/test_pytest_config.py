"""The suite's pytest configuration: misspelt marks and unknown options are errors, and it
refuses to run where pytest-timeout is not there to enforce its time limits."""

import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parent.parent


def pytest_run(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *map(str, args)],
                          capture_output=True, text=True, timeout=120, cwd=cwd)


def test_the_suite_refuses_to_run_without_pytest_timeout():
    result = pytest_run("-p", "no:timeout", "--collect-only", "-q", "tests/test_config.py")
    assert result.returncode != 0 and "Missing required plugins: pytest-timeout" in result.stderr, result.stderr
    # Even with the requirement overridden, tests/conftest.py refuses.
    result = pytest_run("-p", "no:timeout", "-o", "required_plugins=", "--collect-only", "-q", "tests/test_config.py")
    assert result.returncode != 0 and "pytest-timeout is not active" in result.stderr, result.stderr


def module(tmp_path, source):
    """A test module in a project configured as this one (a copy of pyproject.toml beside it)."""
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    path = tmp_path / "test_m.py"
    path.write_text(textwrap.dedent(source))
    return path


def test_a_misspelt_mark_is_an_error(tmp_path):
    path = module(tmp_path, """
        import pytest

        @pytest.mark.cdua
        def test_m():
            pass
    """)
    result = pytest_run(path, cwd=tmp_path)
    assert result.returncode != 0 and "'cdua' not found in `markers`" in result.stdout + result.stderr, result.stdout
    # and so is an option pytest does not know
    config = tmp_path / "pyproject.toml"
    section = "[tool.pytest.ini_options]\n"
    config.write_text(config.read_text().replace(section, section + "timout = 9\n"))
    result = pytest_run(path, cwd=tmp_path)
    assert result.returncode != 0 and "Unknown config option: timout" in result.stderr, result.stderr


def test_a_time_limit_ends_a_test(tmp_path):
    path = module(tmp_path, """
        import time

        import pytest

        @pytest.mark.timeout(1)
        def test_m():
            time.sleep(60)
    """)
    result = pytest_run(path, cwd=tmp_path)
    assert result.returncode == 1 and "Timeout (>1.0s)" in result.stdout, result.stdout[-2000:]
