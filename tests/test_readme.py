"""README's commands are the ones CI runs, and its quick-start example actually runs."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci_commands = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
                   if line and not line.startswith(("#", "set ", "cd ", "export "))]
    assert ci_commands == ['pip install torch==2.13.0 -e ".[test]" && bash tests/cluster/setup.sh && ruff check . '
                           '&& python -m pytest']
    assert ci_commands[0] in readme


def test_readme_quick_start_is_the_example_file():
    readme = (ROOT / "README.md").read_text()
    code = (ROOT / "examples" / "quickstart.py").read_text()
    body = code.split('"""', 2)[2].lstrip("\n")  # without the module docstring
    assert body in readme
