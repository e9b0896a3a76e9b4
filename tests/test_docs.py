"""The user documentation covers the code: every public name in docs/api.md (with the
signature the code has), every RINGMASTER_* variable and every ringrun flag in
docs/configuration.md; and every measured figure in README and the measurement pages names
the date it was measured at. No MPI job; only the signature check imports torch."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "api.md"
CONFIGURATION = ROOT / "docs" / "configuration.md"
CONFIG_SOURCE = ROOT / "common" / "config.py"

#: A documented callable: `rm.name(...)`, `rm.parallel.name(...)`, `ProcessSet.name(...)`,
#: `optimizer.name(...)`, `HybridParallel.name(...)`, ...
SIGNATURE = re.compile(r"^(rm\.parallel|rm\.elastic|rm|ProcessSet|optimizer|Compressor|HybridParallel|State|"
                       r"ElasticSampler|ZeroOptimizer)\.(\w+)\((.*)\)$")


def _public_names() -> list:
    import ringmaster  # its __all__ is plain data: nothing heavy is imported

    return list(ringmaster.__all__)


def _heading_spans(path: pathlib.Path) -> list:
    """The `code` spans of the Markdown headings of ``path``."""
    spans = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            spans.extend(re.findall(r"`([^`]+)`", line))
    return spans


def _documented_public_names() -> set:
    names = set()
    for span in _heading_spans(API):
        match = re.match(r"^rm\.(\w+)", span)
        if match:
            names.add(match.group(1))
    return names


def test_every_public_name_has_an_entry_in_api_md():
    public = _public_names()
    documented = _documented_public_names()
    missing = [name for name in public if name not in documented]
    assert not missing, (f"names in ringmaster.__all__ without a heading `rm.NAME...` in docs/api.md: "
                         f"{missing}")
    stale = sorted(documented - set(public))
    assert not stale, f"docs/api.md documents names that are not in ringmaster.__all__: {stale}"


def _config_variables() -> set:
    from ringmaster.common import config  # standard library only

    parsed = set(config.ENVIRONMENT)
    mentioned = set(re.findall(r"\bRINGMASTER_[A-Z0-9_]*[A-Z0-9]\b", CONFIG_SOURCE.read_text(encoding="utf-8")))
    return parsed | mentioned


def test_every_config_variable_is_in_configuration_md():
    variables = _config_variables()
    assert "RINGMASTER_FUSION_THRESHOLD" in variables  # the parser of this test still works
    text = CONFIGURATION.read_text(encoding="utf-8")
    documented = set(re.findall(r"`(RINGMASTER_[A-Z0-9_]+)`", text))
    missing = sorted(variables - documented)
    assert not missing, f"RINGMASTER_* variables of common/config.py missing from docs/configuration.md: {missing}"
    unknown = sorted(documented - variables)
    assert not unknown, f"docs/configuration.md documents variables common/config.py does not read: {unknown}"


def test_every_ringrun_flag_is_in_configuration_md():
    from ringmaster.launch.cli import build_parser  # standard library only

    text = CONFIGURATION.read_text(encoding="utf-8")
    flags = [flag for action in build_parser()._actions for flag in action.option_strings
             if flag not in ("-h", "--help")]
    assert "--fusion-threshold-mb" in flags
    missing = [flag for flag in flags if not re.search(rf"`{re.escape(flag)}[ `=]", text)]
    assert not missing, f"ringrun flags missing from docs/configuration.md: {missing}"


# ------------------------------------------------------------------ signatures
def _documented_parameters(text: str):
    """[(name, kind, default expression or None)] of a signature written as in the docs."""
    arguments = ast.parse(f"def documented({text}): pass").body[0].args
    result = []
    positional = arguments.posonlyargs + arguments.args
    defaults = [None] * (len(positional) - len(arguments.defaults)) + list(arguments.defaults)
    kinds = ([inspect.Parameter.POSITIONAL_ONLY] * len(arguments.posonlyargs)
             + [inspect.Parameter.POSITIONAL_OR_KEYWORD] * len(arguments.args))
    for arg, kind, default in zip(positional, kinds, defaults):
        result.append((arg.arg, kind, default))
    if arguments.vararg:
        result.append((arguments.vararg.arg, inspect.Parameter.VAR_POSITIONAL, None))
    for arg, default in zip(arguments.kwonlyargs, arguments.kw_defaults):
        result.append((arg.arg, inspect.Parameter.KEYWORD_ONLY, default))
    if arguments.kwarg:
        result.append((arguments.kwarg.arg, inspect.Parameter.VAR_KEYWORD, None))
    return result


def _resolve(prefix: str, name: str, rm):
    owners = {
        "rm": rm,
        "ProcessSet": rm.ProcessSet,
        "Compressor": rm.Compressor,
        "rm.parallel": rm.parallel,
        "HybridParallel": rm.parallel.HybridParallel,
        "rm.elastic": rm.elastic,
        "State": rm.elastic.State,
        "ElasticSampler": rm.elastic.ElasticSampler,
        "ZeroOptimizer": rm.ZeroOptimizer,
        # the methods DistributedOptimizer adds to the optimizer it returns
        "optimizer": importlib.import_module("ringmaster.worker.frontend.optimizer")._DistributedOptimizer,
    }
    return getattr(owners[prefix], name)


def _signature_problems(span: str, rm, namespace: dict) -> list:
    prefix, name, text = SIGNATURE.match(span).groups()
    try:
        target = _resolve(prefix, name, rm)
    except AttributeError:
        return [f"`{span}`: {prefix}.{name} does not exist"]
    actual = list(inspect.signature(target).parameters.values())
    methods = ("ProcessSet", "optimizer", "HybridParallel", "State", "ElasticSampler", "ZeroOptimizer")
    if prefix in methods and actual and actual[0].name == "self":
        actual = actual[1:]
    try:
        documented = _documented_parameters(text)
    except SyntaxError as error:
        return [f"`{span}`: not a valid parameter list ({error})"]
    if [(p.name, p.kind) for p in actual] != [(n, k) for n, k, _ in documented]:
        return [f"`{span}`: the code's signature is {name}{inspect.signature(target)}"]
    problems = []
    for parameter, (_, _, default) in zip(actual, documented):
        if default is None:
            if parameter.default is not inspect.Parameter.empty:
                problems.append(f"`{span}`: {parameter.name} has the default {parameter.default!r}")
            continue
        if parameter.default is inspect.Parameter.empty:
            problems.append(f"`{span}`: {parameter.name} has no default")
            continue
        try:
            expected = eval(compile(ast.Expression(default), "<api.md>", "eval"), dict(namespace))  # noqa: S307
        except Exception as error:  # noqa: BLE001 - report any unevaluable default
            problems.append(f"`{span}`: default of {parameter.name} cannot be evaluated ({error})")
            continue
        if not (parameter.default is expected or parameter.default == expected):
            problems.append(f"`{span}`: {parameter.name} defaults to {parameter.default!r} in the code, "
                            f"{ast.unparse(default)} in the docs")
    return problems


def test_documented_signatures_match_the_code():
    pytest.importorskip("torch")
    import ringmaster as rm

    namespace = {name: getattr(rm, name) for name in rm.__all__}
    spans = [span for span in _heading_spans(API) if SIGNATURE.match(span)]
    problems = [problem for span in spans for problem in _signature_problems(span, rm, namespace)]
    assert not problems, "signatures in docs/api.md that differ from the code:\n" + "\n".join(problems)

    # every public function and constructible class is documented with its signature
    with_signature = {SIGNATURE.match(span).group(2) for span in spans if span.startswith("rm.")}
    need_signature = [name for name in rm.__all__
                      if inspect.isfunction(getattr(rm, name))
                      or (isinstance(getattr(rm, name), type) and not issubclass(getattr(rm, name), BaseException)
                          and getattr(rm, name).__init__ is not object.__init__)]
    missing = [name for name in need_signature if name not in with_signature]
    assert not missing, f"public callables documented without their signature in docs/api.md: {missing}"


def _quoted_constants():
    """(statement in docs/architecture.md, the value the code uses): a tuned constant that
    changes must change its description too."""
    from ringmaster.common import keepalive
    from ringmaster.coordinator import health
    from ringmaster.worker.runtime import cache_protocol, response_cache
    import test_cache_schedules  # tests/ is on the path of every test module

    return [
        (r"idle for ([\d.]+) s the cycles stop", cache_protocol.DORMANT_AFTER_S),
        (r"waiting after ([\d.]+) s is withdrawn", cache_protocol.WITHDRAW_AFTER_S),
        (r"after (\d+) heartbeat timeouts", health.LIVE_SILENCE_FACTOR),
        (r"waits up to (\d+) heartbeat timeouts", health.LIVE_SILENCE_FACTOR),
        (r"gets a (\d+)-minute ping timeout", keepalive.LOCAL_PING_TIMEOUT_MS / 60_000),
        (r"under ([\d,]+) seeded random schedules", 7 * test_cache_schedules.QUICK_SCHEDULES),
        (r"cycles every (\d+) ms while the cache", response_cache.IDLE_CYCLE_S * 1000),
    ]


@pytest.mark.parametrize("pattern,value", _quoted_constants())
def test_constants_quoted_in_the_architecture_match_the_code(pattern, value):
    text = re.sub(r"\s+", " ", "".join((ROOT / "docs" / page).read_text()
                                       for page in ("architecture.md", "benchmarks.md", "benchmarks-history.md")))
    found = re.findall(pattern, text)
    assert found, f"docs no longer say {pattern!r}: update this test with the docs"
    assert all(float(quoted.replace(",", "")) == value for quoted in found), (pattern, found, value)


# ------------------------------------------------------------------ dated figures
#: Pages whose figures are measurements; each figure names the date it was measured at.
MEASURED_PAGES = ("README.md", "docs/benchmarks.md", "docs/benchmarks-history.md", "docs/scaling.md",
                  "docs/decisions.md", "docs/elastic.md", "bench/gpu/README.md")

#: A measured figure: a time (ms, µs, us, seconds with decimals, "33 min 52 s"), a rate, a
#: share (%), or a ratio: a number followed by × (but not the count of "100 × 16 KiB").
FIGURE = re.compile(r"\d(?:[\d,]*\d)?(?:\.\d+)?\s?(?:ms|µs|us|GB/s|MB/s|TB/s|Gbit/s|%)(?![\w/])"
                    r"|\d(?:\.\d+)?\s?×(?!\s?\d)"
                    r"|\d\.\d+\s?s\b"
                    r"|\d+ min \d+ s\b")
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")


def _blocks(text: str) -> list:
    """The page's headings, paragraphs and tables as lists of (line number, line), outside
    code blocks; a paragraph ends at a blank line or a heading."""
    blocks, current, fenced = [], [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and line.strip() and not line.startswith("#") and (
                not current or current[-1][1].startswith("|") == line.startswith("|")):
            current.append((number, line))
            continue
        if current:
            blocks.append(current)
            current = []
        if not fenced and line.startswith("#"):
            blocks.append([(number, line)])
        elif not fenced and line.strip() and not line.lstrip().startswith("```"):
            current = [(number, line)]  # a table right after its caption, or the reverse
    if current:
        blocks.append(current)
    return blocks


def _undated_figure_lines(text: str) -> list:
    """[(line number, line)] of the figure lines that name no date. A figure line is dated
    when its paragraph or table names a date (a table together with the paragraph right
    before it, which introduces it), or the heading or first paragraph of a section
    (## or deeper) that holds it."""
    undated = []
    sections = []  # [level, dated, lead still to come] of the headings above
    previous = None
    for block in _blocks(text):
        first = block[0][1]
        if first.startswith("#"):
            level = len(first) - len(first.lstrip("#"))
            sections = [section for section in sections if section[0] < level]
            sections.append([level, level >= 2 and bool(DATE.search(first)), level >= 2])
            previous = None
            continue
        words = "\n".join(line for _, line in block)
        is_table = first.startswith("|")
        for section in sections:
            if section[2]:
                section[2] = False
                section[1] = section[1] or (not is_table and bool(DATE.search(words)))
        dated = bool(DATE.search(words)) or any(section[1] for section in sections)
        if is_table and previous is not None and not previous[0][1].startswith("|"):
            dated = dated or bool(DATE.search("\n".join(line for _, line in previous)))
        if not dated:
            undated.extend((number, line) for number, line in block if FIGURE.search(line))
        previous = block
    return undated


def test_the_figure_rule_finds_undated_figures():
    page = ("# Page\n\n## Speed\n\nA step took 1.5 ms, 0.8 × MPI's.\n\n100 × 16 KiB tensors.\n\n"
            "## Latency (2026-11-28 at 348283d)\n\n| size | ms |\n|---|---|\n| 4 B | 0.27 ms |\n\n"
            "### Since\n\nMeasured 2026-11-28.\n\nIt took 2 ms.\n\n## Tables\n\nAt 348283d, 2026-11-28:\n\n"
            "| size | ms |\n|---|---|\n| 4 B | 0.27 ms |\n\n```\n0.3 ms\n```\n")
    assert _undated_figure_lines(page) == [(5, "A step took 1.5 ms, 0.8 × MPI's.")]


@pytest.mark.parametrize("page", MEASURED_PAGES)
def test_every_figure_names_the_date_it_was_measured_at(page):
    undated = _undated_figure_lines((ROOT / page).read_text(encoding="utf-8"))
    assert not undated, (
        f"figures in {page} that name no date: write the date (YYYY-MM-DD) and the commit they were "
        f"measured at in their paragraph or table, or in their section's heading or first paragraph:\n"
        + "\n".join(f"  {page}:{number}: {line.strip()}" for number, line in undated))
