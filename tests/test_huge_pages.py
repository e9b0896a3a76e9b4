"""torch's large tensors are advised into transparent huge pages in ringmaster's processes.

``import ringmaster`` and ``ringrun`` set ``THP_MEM_ALLOC_ENABLE=1`` (torch's switch)
unless the user set it; checked in real processes by finding the mapping that holds a
16 MiB tensor in ``/proc/self/smaps``: its ``VmFlags`` show ``hg`` when torch asked for
huge pages (``madvise(MADV_HUGEPAGE)``), and ``AnonHugePages`` how much the kernel gave.
"""

import pathlib
import subprocess
import sys
import textwrap

import pytest

from mpijob import job_environment, run_command

from ringmaster.common.huge_pages import TORCH_HUGE_PAGES, request_for_torch

THP_SETTING = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")

#: Prints the switch's value, whether torch advised a fresh 16 MiB tensor's memory into huge
#: pages, and how much of it lies in them.
REPORT_TENSOR_PAGES = textwrap.dedent("""
    import os
    {imports}
    tensor = torch.ones(4 << 20)
    address = tensor.data_ptr()
    huge_kib, advised = None, None
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, stop = (int(part, 16) for part in head.split("-"))
                inside = start <= address < stop
            elif inside and head == "AnonHugePages:":
                huge_kib = int(line.split()[1])
            elif inside and head == "VmFlags:":
                advised = "hg" in line.split()[1:]
    print("switch", os.environ.get("THP_MEM_ALLOC_ENABLE"), "advised", advised, "huge-kib", huge_kib,
          flush=True)
""")


def _kernel_offers_huge_pages():
    return THP_SETTING.exists() and "[never]" not in THP_SETTING.read_text()


def _environment_without_switch(**extra):
    env = job_environment(extra)
    if TORCH_HUGE_PAGES not in extra:
        env.pop(TORCH_HUGE_PAGES, None)
    return env


def _reports(output):
    """(switch, advised, huge KiB) of every ``switch ... advised ... huge-kib ...`` line in ``output``."""
    return [(words[words.index("switch") + 1], words[words.index("advised") + 1] == "True",
             int(words[words.index("huge-kib") + 1]))
            for words in (line.split() for line in output.splitlines()) if "huge-kib" in words]


def _assert_pages(reports, expected_switch, output):
    """Each report has the expected switch; torch advised huge pages exactly when it is 1."""
    assert [switch for switch, _, _ in reports] == [expected_switch] * len(reports), output
    if expected_switch == "0":
        assert all(not advised and huge_kib == 0 for _, advised, huge_kib in reports), output
    elif _kernel_offers_huge_pages():
        # Whether the kernel then finds free 2 MiB pages is up to its memory, not to ringmaster.
        assert all(advised for _, advised, _ in reports), output


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
    reports = _reports(result.stdout)
    assert len(reports) == 1, result.stdout
    _assert_pages(reports, expected_switch, result.stdout)


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
    assert len(reports) == 2, result.output
    _assert_pages(reports, expected_switch, result.output)
