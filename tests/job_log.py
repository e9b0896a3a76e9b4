"""Where the suite's time goes, from the job log that ``RMTEST_JOB_LOG=path`` makes every test job
append to (tests/mpijob.py): the slowest jobs and the files whose jobs took longest, as Markdown.

    RMTEST_JOB_LOG=/tmp/jobs.log python -m pytest
    python tests/job_log.py /tmp/jobs.log --top 30
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from typing import Iterable, List, NamedTuple


class Job(NamedTuple):
    seconds: float
    test: str
    command: str

    @property
    def file(self) -> str:
        return self.test.split("::")[0]


def read_jobs(lines: Iterable[str]) -> List[Job]:
    jobs = []
    for line in lines:
        parts = line.rstrip("\n").split("\t", 2)
        if len(parts) == 3:
            jobs.append(Job(float(parts[0]), parts[1], parts[2]))
    return jobs


def report(jobs: List[Job], top: int) -> str:
    by_file = defaultdict(lambda: [0.0, 0])
    for job in jobs:
        by_file[job.file][0] += job.seconds
        by_file[job.file][1] += 1
    total = sum(job.seconds for job in jobs)
    lines = [f"{len(jobs)} jobs, {total:.0f} s in all.", "",
             f"The {top} slowest jobs:", "", "| s | test |", "|---:|---|"]
    lines += [f"| {job.seconds:.1f} | `{job.test}` |" for job in sorted(jobs, reverse=True)[:top]]
    lines += ["", f"The {top} files whose jobs took longest:", "", "| s | jobs | file |", "|---:|---:|---|"]
    ranked = sorted(by_file.items(), key=lambda item: -item[1][0])[:top]
    lines += [f"| {seconds:.1f} | {count} | `{name}` |" for name, (seconds, count) in ranked]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", help="the file RMTEST_JOB_LOG named")
    parser.add_argument("--top", type=int, default=30, help="rows per table (default 30)")
    args = parser.parse_args()
    with open(args.log, encoding="utf-8") as log:
        print(report(read_jobs(log), args.top))


if __name__ == "__main__":
    main()
