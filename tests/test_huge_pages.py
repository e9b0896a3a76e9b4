"""torch's large tensors live in transparent huge pages in ringmaster's processes.

``import ringmaster`` and ``ringrun`` set ``THP_MEM_ALLOC_ENABLE=1`` (torch's switch)
unless the user set it; checked in real processes by finding the mapping that holds a
16 MiB tensor in ``/proc/self/smaps`` and reading its ``AnonHugePages``.
"""

import pathlib
import subprocess
import sys
import textwrap

import pytest

from mpijob import job_environment, run_command

from ringmaster.common.huge_pages import TORCH_HUGE_PAGES, request_for_torch

THP_SETTING = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")

#: Prints the switch's value and how much of a fresh 16 MiB tensor lies in huge pages.
REPORT_TENSOR_PAGES = textwrap.dedent("""
    import os
    {imports}
    tensor = torch.ones(4 << 20)
    address = tensor.data_ptr()
    huge_kib = None
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, stop = (int(part, 16) for part in head.split("-"))
                inside = start <= address < stop
            elif inside and head == "AnonHugePages:":
                huge_kib = int(line.split()[1])
    print("switch", os.environ.get("THP_MEM_ALLOC_ENABLE"), "huge-kib", huge_kib, flush=True)
""")


def _kernel_offers_huge_pages():
    return THP_SETTING.exists() and "[never]" not in THP_SETTING.read_text()


def _environment_without_switch(**extra):
    env = job_environment(extra)
    if TORCH_HUGE_PAGES not in extra:
        env.pop(TORCH_HUGE_PAGES, None)
    return env


def _reports(output):
    """(switch, huge KiB) of every ``switch ... huge-kib ...`` line in ``output``."""
    return [(words[words.index("switch") + 1], int(words[words.index("huge-kib") + 1]))
            for words in (line.split() for line in output.splitlines()) if "huge-kib" in words]


def test_request_keeps_the_users_choice():
    env = {}
    request_for_torch(env)
    assert env == {TORCH_HUGE_PAGES: "1"}
    env = {TORCH_HUGE_PAGES: "0"}
    request_for_torch(env)
    assert env == {TORCH_HUGE_PAGES: "0"}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("user_value, expected_switch", [(None, "1"), ("0", "0")])
def test_importing_ringmaster_before_the_first_tensor(user_value, expected_switch):
    extra = {} if user_value is None else {TORCH_HUGE_PAGES: user_value}
    code = REPORT_TENSOR_PAGES.format(imports="import torch\nimport ringmaster")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50,
                            env=_environment_without_switch(**extra))
    assert result.returncode == 0, result.stderr
    [(switch, huge_kib)] = _reports(result.stdout)
    assert switch == expected_switch
    if expected_switch == "0":
        assert huge_kib == 0
    elif _kernel_offers_huge_pages():
        assert huge_kib > 0, result.stdout


@pytest.mark.timeout(90)
@pytest.mark.parametrize("user_value, expected_switch", [(None, "1"), ("0", "0")])
def test_ringrun_asks_for_huge_pages_on_every_rank(user_value, expected_switch):
    extra = {} if user_value is None else {TORCH_HUGE_PAGES: user_value}
    # The ranks do not import ringmaster: the switch can only come from ringrun.
    code = REPORT_TENSOR_PAGES.format(imports="import torch")
    result = run_command([sys.executable, "-m", "ringmaster.launch", "-np", "2", sys.executable, "-c", code],
                         80, env=_environment_without_switch(**extra))
    assert result.returncode == 0, result.output
    reports = _reports(result.stdout)
    assert [switch for switch, _ in reports] == [expected_switch] * 2, result.output
    if expected_switch == "0":
        assert all(huge_kib == 0 for _, huge_kib in reports)
    elif _kernel_offers_huge_pages():
        assert all(huge_kib > 0 for _, huge_kib in reports), result.output
