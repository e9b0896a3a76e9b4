"""The user documentation covers the code: every public name in docs/api.md (with the
signature the code has), every RINGMASTER_* variable and every ringrun flag in
docs/configuration.md. No MPI job; only the signature check imports torch."""

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
    text = re.sub(r"\s+", " ", (ROOT / "docs" / "architecture.md").read_text()
                  + (ROOT / "docs" / "benchmarks.md").read_text())
    found = re.findall(pattern, text)
    assert found, f"docs no longer say {pattern!r}: update this test with the docs"
    assert all(float(quoted.replace(",", "")) == value for quoted in found), (pattern, found, value)
