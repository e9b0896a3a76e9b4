"""Which hosts an elastic job may use: the discovery script, and the blacklist with its cooldown.

* :class:`HostDiscovery` runs ``--host-discovery-script`` (through the shell, bounded by a
  timeout) and parses one host per line, ``name`` or ``name:slots`` (blank lines and ``#``
  comments are skipped; without slots, ``--slots-per-host``). Without a script the hosts are
  the fixed ones of ``-H``/``--hostfile``/this machine.
* :class:`Blacklist`: a host whose ranks failed is left out for a cooldown that doubles with
  each failure (``--blacklist-cooldown-s`` × 2^(failures-1), at most 16 × the base), so a
  host that fails repeatedly is tried less and less often; once the cooldown is over, a host
  the script (or the fixed list) still names is used again.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

from .errors import LaunchError
from .hosts import Host

#: The longest a discovery script may run.
DISCOVERY_TIMEOUT_S = 30.0
#: A host's cooldown grows to at most this multiple of the base.
MAX_COOLDOWN_FACTOR = 16


def parse_discovery_output(text: str, slots_per_host: int, script: str) -> List[Host]:
    """The hosts in a discovery script's output, in its order, each once.

    Raises:
        LaunchError: a line that is not ``name`` or ``name:slots`` with slots >= 1.
    """
    hosts: Dict[str, Host] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, slots_text = line.partition(":")
        name = name.strip()
        if sep:
            slots_text = slots_text.strip()
            if not slots_text.isdigit() or int(slots_text) < 1:
                raise LaunchError(f"--host-discovery-script {script!r}, line {number} ({raw.strip()!r}): slots must "
                                  f"be a positive integer; print 'host' or 'host:slots', one per line")
            slots = int(slots_text)
        else:
            slots = slots_per_host
        if not name or any(c.isspace() for c in name):
            raise LaunchError(f"--host-discovery-script {script!r}, line {number} ({raw.strip()!r}) is not a host "
                              f"name; print 'host' or 'host:slots', one per line")
        hosts.setdefault(name, Host(name, slots))
    return list(hosts.values())


class HostDiscovery:
    """The hosts available now: from a script, or a fixed list.

    Args:
        script: the ``--host-discovery-script`` command (run with ``sh -c``), or ``None``.
        fixed: the hosts when there is no script.
        slots_per_host: slots of a host the script names without ``:slots``.
    """

    def __init__(self, script: Optional[str], fixed: Sequence[Host] = (), slots_per_host: int = 1,
                 timeout_s: float = DISCOVERY_TIMEOUT_S):
        self.script = script
        self.fixed = list(fixed)
        self.slots_per_host = slots_per_host
        self.timeout_s = timeout_s

    def discover(self) -> List[Host]:
        """Run the script (or return the fixed hosts).

        Raises:
            LaunchError: the script failed, timed out or printed something that is not hosts.
        """
        if self.script is None:
            return list(self.fixed)
        try:
            result = subprocess.run(["sh", "-c", self.script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    stdin=subprocess.DEVNULL, text=True, timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            raise LaunchError(f"--host-discovery-script {self.script!r} did not finish within "
                              f"{self.timeout_s:g} s") from None
        if result.returncode != 0:
            detail = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "no message"
            raise LaunchError(f"--host-discovery-script {self.script!r} exited with status {result.returncode} "
                              f"({detail})")
        return parse_discovery_output(result.stdout, self.slots_per_host, self.script)


@dataclass
class _Record:
    failures: int = 0
    until: float = 0.0
    reasons: List[str] = field(default_factory=list)


class Blacklist:
    """Hosts left out after failing, each for a cooldown that doubles with every failure.

    Args:
        cooldown_s: the first failure's cooldown.
        clock: for tests.
    """

    def __init__(self, cooldown_s: float, clock: Callable[[], float] = time.monotonic):
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._records: Dict[str, _Record] = {}

    def add(self, host: str, reason: str) -> float:
        """Record a failure of ``host``; returns its cooldown in seconds."""
        record = self._records.setdefault(host, _Record())
        record.failures += 1
        record.reasons.append(reason)
        cooldown = self.cooldown_s * min(2 ** (record.failures - 1), MAX_COOLDOWN_FACTOR)
        record.until = self._clock() + cooldown
        return cooldown

    def blocked(self, host: str) -> bool:
        """True while ``host`` is in its cooldown."""
        record = self._records.get(host)
        return record is not None and self._clock() < record.until

    def failures(self, host: str) -> int:
        record = self._records.get(host)
        return record.failures if record else 0

    def describe(self, host: str) -> str:
        """``host`` and why it is left out (for messages)."""
        record = self._records.get(host)
        if record is None:
            return host
        left = max(0.0, record.until - self._clock())
        return f"{host} ({record.reasons[-1]}; failed {record.failures}x, left out for {left:.0f} s more)"

    def usable(self, hosts: Sequence[Host]) -> List[Host]:
        """``hosts`` without those in their cooldown."""
        return [host for host in hosts if not self.blocked(host.name)]

    def blocked_names(self) -> List[str]:
        return [name for name in self._records if self.blocked(name)]
