"""Read a SLURM allocation from SLURM's environment variables.

Inside ``sbatch``/``salloc`` SLURM describes the allocation in variables such as::

    SLURM_JOB_ID=4242
    SLURM_JOB_NODELIST=node[01-04,07]     # compressed host list
    SLURM_TASKS_PER_NODE=2(x3),1,1        # tasks on each node, in node-list order
    SLURM_NTASKS=9

:func:`expand_nodelist` and :func:`expand_counts` undo the compression (the grammar of
``scontrol show hostnames``), and :func:`slurm_allocation` turns the variables into a
:class:`SlurmAllocation`: the hosts and slots ``ringrun`` runs on when it is given no
``-H``/``--hostfile``. Every error names the variable, its value and what is wrong.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence, Tuple

from .errors import LaunchError
from .hosts import Host

JOB_ID = "SLURM_JOB_ID"
NODELIST = "SLURM_JOB_NODELIST"
NTASKS = "SLURM_NTASKS"
#: Where the slots of each node come from, first found first: the tasks SLURM planned per
#: node, the ``--ntasks-per-node`` the job asked for, the CPUs SLURM gave each node.
SLOT_VARIABLES = ("SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_JOB_CPUS_PER_NODE")
STEP_NUM_TASKS = "SLURM_STEP_NUM_TASKS"
#: Inside an ``srun`` step, srun rewrites ``SLURM_NTASKS`` and ``SLURM_TASKS_PER_NODE`` to the
#: step's; these name the step's nodes and tasks per node (the job's node list stays as it was).
STEP_ID = "SLURM_STEP_ID"
STEP_NODELIST = "SLURM_STEP_NODELIST"
STEP_TASKS_PER_NODE = "SLURM_STEP_TASKS_PER_NODE"

#: The most host names a node list may expand to (guards against ``node[0-999999999]``).
MAX_NODES = 100_000

_COUNT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")
#: A run of characters that are not whitespace outside brackets (brackets kept whole).
_OUTSIDE_BRACKETS_WORD = re.compile(r"(?:[^\s\[]|\[[^\]]*\])+")


def _bad(variable: str, value: str, why: str) -> LaunchError:
    return LaunchError(f"{variable}={value!r} is not a valid SLURM value: {why}")


# ------------------------------------------------------------------ node lists

def _split_top_level(text: str, variable: str) -> List[str]:
    """Split at commas and whitespace outside brackets; check that brackets balance.

    Whitespace next to a comma is no item of its own (``a, b`` is ``a,b``); an empty item
    between commas is an error.
    """
    pieces, current, depth = [], [], 0
    for char in text:
        if char == "[":
            if depth:
                raise _bad(variable, text, "nested '[' (brackets cannot contain brackets)")
            depth = 1
        elif char == "]":
            if not depth:
                raise _bad(variable, text, "']' without a matching '['")
            depth = 0
        elif char == "," and not depth:
            pieces.append("".join(current))
            current = []
            continue
        current.append(char)
    if depth:
        raise _bad(variable, text, "'[' without a matching ']'")
    pieces.append("".join(current))
    items = []
    for piece in pieces:
        if not piece.strip():
            raise _bad(variable, text, "it has an empty entry (two commas in a row, or a comma at an end)")
        items.extend(_OUTSIDE_BRACKETS_WORD.findall(piece))
    return items


def _expand_range_list(body: str, variable: str, value: str) -> List[str]:
    """``01-04,07`` → ``['01', '02', '03', '04', '07']``; the width of each range is that of
    its lower bound, as in SLURM (``[08-10]`` → 08, 09, 10)."""
    if not body:
        raise _bad(variable, value, "empty brackets '[]'")
    numbers: List[str] = []
    for part in body.split(","):
        low, sep, high = part.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise _bad(variable, value, f"[{body}] holds {part!r}; expected a number or a range like 01-04")
        if not sep:
            numbers.append(low)
            continue
        first, last = int(low), int(high)
        if last < first:
            raise _bad(variable, value, f"range {part!r} goes down; write it as {high}-{low}")
        if last - first + 1 + len(numbers) > MAX_NODES:
            raise _bad(variable, value, f"range {part!r} has more than {MAX_NODES} numbers")
        numbers.extend(str(number).zfill(len(low)) for number in range(first, last + 1))
    return numbers


def _expand_item(item: str, variable: str, value: str) -> List[str]:
    """One node-list item: a plain name, or a name with bracket groups, expanded in order
    (the first group varies slowest: ``r[1-2]n[1-2]`` → r1n1, r1n2, r2n1, r2n2)."""
    pieces = re.split(r"\[([^\]]*)\]", item)  # text, group, text, group, ..., text
    choices: List[Sequence[str]] = []
    total = 1
    for index, piece in enumerate(pieces):
        if index % 2:
            numbers = _expand_range_list(piece, variable, value)
            total *= len(numbers)
            if total > MAX_NODES:
                raise _bad(variable, value, f"{item!r} expands to more than {MAX_NODES} names")
            choices.append(numbers)
        else:
            choices.append((piece,))
    if len(pieces) > 1 and not any(pieces[0::2]):
        raise _bad(variable, value, f"{item!r} is only brackets; expected a name such as node[01-04]")
    return ["".join(parts) for parts in itertools.product(*choices)]


def expand_nodelist(text: str, variable: str = NODELIST) -> List[str]:
    """Expand a SLURM host list as ``scontrol show hostnames`` does.

    ``node[01-04,07],gpu-a.b`` → node01 node02 node03 node04 node07 gpu-a.b. Items are
    separated by commas (or whitespace) outside brackets; a bracket group holds numbers and
    ranges (zero padding kept); a name may have several groups (``rack[1-2]-node[01-02]``)
    and text after them (``a[1-3]b``). Repeated names are kept.

    Args:
        text: the compressed list.
        variable: the variable it came from, named in errors.

    Raises:
        LaunchError: empty list or item, unbalanced or nested brackets, non-numbers in
            brackets, a range going down, or more than :data:`MAX_NODES` names.
    """
    if not text or not text.strip():
        raise _bad(variable, text, "it is empty")
    names: List[str] = []
    for item in _split_top_level(text.strip(), variable):
        names.extend(_expand_item(item, variable, text))
        if len(names) > MAX_NODES:
            raise _bad(variable, text, f"it expands to more than {MAX_NODES} names")
    return names


# ------------------------------------------------------------------ counts per node

def expand_counts(text: str, variable: str) -> List[int]:
    """Expand SLURM's per-node counts: ``2(x3),1`` → ``[2, 2, 2, 1]``.

    The syntax of ``SLURM_TASKS_PER_NODE`` and ``SLURM_JOB_CPUS_PER_NODE``: comma-separated
    ``N`` or ``N(xR)`` (N repeated R times); a plain number (``SLURM_NTASKS_PER_NODE``) is a
    list of one.

    Raises:
        LaunchError: naming ``variable`` and the malformed entry.
    """
    if not text or not text.strip():
        raise _bad(variable, text, "it is empty")
    counts: List[int] = []
    for entry in text.strip().split(","):
        match = _COUNT.match(entry.strip())
        if not match:
            raise _bad(variable, text, f"entry {entry!r} is not N or N(xR), e.g. 2(x3),1")
        repeat = int(match.group(2)) if match.group(2) is not None else 1
        if repeat < 1:
            raise _bad(variable, text, f"entry {entry!r} repeats 0 times")
        if len(counts) + repeat > MAX_NODES:
            raise _bad(variable, text, f"it expands to more than {MAX_NODES} counts")
        counts.extend([int(match.group(1))] * repeat)
    return counts


# ------------------------------------------------------------------ the allocation

@dataclass(frozen=True)
class SlurmAllocation:
    """The part of a SLURM allocation ``ringrun`` uses.

    Attributes:
        job_id: ``SLURM_JOB_ID``.
        nodes: the expanded ``SLURM_JOB_NODELIST``, in SLURM's order.
        slots: ranks each node may run, one per node.
        slots_from: ``NAME=value`` of the variable the slots came from.
        ntasks: ``SLURM_NTASKS`` (the job's ``--ntasks``, or the step's inside an ``srun``
            step), or ``None`` when unset.
        step: ``JOB.STEP`` when ringrun runs inside an ``srun`` step (``srun -n 1 ringrun``):
            then the nodes and slots are the step's, not the whole allocation's.
        nodes_from: the variable the nodes came from.
    """

    job_id: str
    nodes: Tuple[str, ...]
    slots: Tuple[int, ...]
    slots_from: str
    ntasks: Optional[int] = None
    step: Optional[str] = None
    nodes_from: str = NODELIST

    def hosts(self) -> List[Host]:
        """The allocation as ``ringrun`` hosts: nodes with no slots left out, repeats joined."""
        merged: dict = {}
        for node, slots in zip(self.nodes, self.slots):
            if slots > 0:
                merged[node] = merged.get(node, 0) + slots
        return [Host(node, slots) for node, slots in merged.items()]

    def describe(self) -> str:
        """One line naming the job and the variables behind the hosts (for messages)."""
        if self.step is not None:
            return f"SLURM step {self.step} (not the whole job {self.job_id}): {self.nodes_from} and {self.slots_from}"
        return f"SLURM job {self.job_id}: {self.nodes_from} and {self.slots_from}"

    def step_note(self) -> Optional[str]:
        """Inside an ``srun`` step, what ringrun takes from SLURM and why (else ``None``)."""
        if self.step is None:
            return None
        placed = ",".join(str(host) for host in self.hosts())
        return (f"running inside srun step {self.step}, whose variables ({self.slots_from}, "
                f"SLURM_NTASKS={self.ntasks}) describe that step, not job {self.job_id}'s whole allocation: "
                f"ringrun uses the step's hosts {placed}. To use the whole allocation, run ringrun straight "
                f"from the batch script or the salloc shell (not under srun), or give -np and -H")


def in_allocation(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` is inside a SLURM allocation (``SLURM_JOB_ID`` and
    ``SLURM_JOB_NODELIST`` both set and not empty)."""
    return bool(environ.get(JOB_ID)) and bool(environ.get(NODELIST))


def _positive(environ: Mapping[str, str], variable: str) -> Optional[int]:
    value = environ.get(variable)
    if not value:
        return None
    if not value.strip().isdigit() or int(value) < 1:
        raise _bad(variable, value, "expected a positive integer")
    return int(value)


def _slots(environ: Mapping[str, str], node_count: int, nodes_from: str = NODELIST,
           variables: Sequence[str] = SLOT_VARIABLES) -> Tuple[List[int], str]:
    """Slots per node from the first of ``variables`` that is set."""
    for variable in variables:
        value = environ.get(variable)
        if not value:
            continue
        if variable == "SLURM_NTASKS_PER_NODE":  # one number (--ntasks-per-node), every node
            if not value.strip().isdigit():
                raise _bad(variable, value, "expected a whole number, the job's --ntasks-per-node")
            counts = [int(value)] * node_count
        else:
            counts = expand_counts(value, variable)
        if len(counts) != node_count:
            raise LaunchError(
                f"{variable}={value!r} has counts for {len(counts)} node(s) but "
                f"{nodes_from}={environ[nodes_from]!r} lists {node_count}; "
                f"pass -H/--hostfile to say where the ranks run"
            )
        if not any(counts):
            raise _bad(variable, value, "no node has a slot")
        return counts, f"{variable}={value}"
    raise LaunchError(
        f"inside SLURM job {environ[JOB_ID]} but none of {', '.join(SLOT_VARIABLES)} is set, so "
        f"ringrun cannot tell how many ranks each node runs; pass -H/--hostfile"
    )


def _refuse_multi_task_step(environ: Mapping[str, str]) -> None:
    """ringrun started as one task of many of an ``srun`` step would start the whole job once
    per task: refuse."""
    tasks = environ.get(STEP_NUM_TASKS, "")
    if tasks.isdigit() and int(tasks) > 1:
        raise LaunchError(
            f"ringrun is running as one of {tasks} tasks of an srun step ({STEP_NUM_TASKS}={tasks}), "
            f"so {tasks} copies of the job would start; run ringrun once, straight from the sbatch "
            f"script or salloc shell (not under srun), or use `srun --mpi=pmix python train.py` without ringrun"
        )


def slurm_allocation(environ: Mapping[str, str]) -> Optional[SlurmAllocation]:
    """The allocation ``environ`` is inside, or ``None`` outside SLURM (see :func:`in_allocation`).

    Nodes from ``SLURM_JOB_NODELIST``; slots from ``SLURM_TASKS_PER_NODE``, else
    ``SLURM_NTASKS_PER_NODE``, else ``SLURM_JOB_CPUS_PER_NODE``; ``ntasks`` from
    ``SLURM_NTASKS``. Inside a one-task ``srun`` step (``srun -n 1 ringrun``), srun has
    rewritten those to the step's, so the step's node list and tasks per node are used,
    consistently (``SLURM_STEP_NODELIST``, ``SLURM_STEP_TASKS_PER_NODE`` where set), and
    :meth:`SlurmAllocation.step_note` says so.

    Raises:
        LaunchError: a malformed variable (naming it and its value), counts that do not match
            the nodes, no slot variable at all, or ringrun running as one of several tasks of
            an ``srun`` step.
    """
    if not in_allocation(environ):
        return None
    _refuse_multi_task_step(environ)
    step = None
    nodes_from, slot_variables = NODELIST, SLOT_VARIABLES
    if environ.get(STEP_NUM_TASKS):
        step = f"{environ[JOB_ID]}.{environ.get(STEP_ID, '?')}"
        if environ.get(STEP_NODELIST):
            nodes_from = STEP_NODELIST
        if environ.get(STEP_TASKS_PER_NODE):
            slot_variables = (STEP_TASKS_PER_NODE,)
    nodes = expand_nodelist(environ[nodes_from], nodes_from)
    slots, slots_from = _slots(environ, len(nodes), nodes_from, slot_variables)
    return SlurmAllocation(job_id=environ[JOB_ID], nodes=tuple(nodes), slots=tuple(slots),
                           slots_from=slots_from, ntasks=_positive(environ, NTASKS), step=step,
                           nodes_from=nodes_from)
