"""The verdict lines of a test job: one ``FAIL`` line per failed check, then ``DONE``.

The pytest side reads them (``tests/mpijob.py``): ``FAIL <case> (rank R) <detail>`` and
``DONE <cases> cases, <failures> failures``.
"""


class Tally:
    """Counts the checks of one rank and prints a line for each one that fails."""

    def __init__(self, rank: int):
        self.rank = rank
        self.cases = 0
        self.failures = 0

    def report(self, case: str, ok: bool, detail: str = "") -> None:
        """Count the check ``case``; print it when not ``ok``, with ``detail``."""
        self.cases += 1
        if not ok:
            self.failures += 1
            print(f"FAIL {case} (rank {self.rank}) {detail}", flush=True)

    def done(self) -> None:
        """Print the ``DONE`` line."""
        print(f"DONE {self.cases} cases, {self.failures} failures", flush=True)
