"""Opt-in memory report: the pytest process's resident memory after every test, and its peak.

`LORAPLEX_TEST_RSS=path/to/report.tsv pytest ...` appends one line per test (node id, RSS and peak RSS in MiB
after its teardown, live threads, child processes, seconds in setup + call + teardown) and prints the largest
steps up and the peak at the end.
Read from /proc, so Linux only; without the variable nothing is registered.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

ENV_VAR = "LORAPLEX_TEST_RSS"
NUM_LARGEST = 15


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def _num_children() -> int:
    children = Path(f"/proc/self/task/{os.getpid()}/children")
    return len(children.read_text().split()) if children.exists() else 0


class RssReport:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[tuple[str, float, float]] = []
        self.last_rss = _status_mib("VmRSS")
        self.seconds: dict[str, float] = {}
        self.file = path.open("a")  # several pytest processes (make test's groups) may share one report
        self.file.write("nodeid\trss_mib\tpeak_mib\tthreads\tchildren\tseconds\n")
        self.file.write(f"<start pid {os.getpid()}>\t{self.last_rss:.0f}\t{_status_mib('VmHWM'):.0f}"
                        f"\t{threading.active_count()}\t0\t0\n")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        rss, peak = _status_mib("VmRSS"), _status_mib("VmHWM")
        self.rows.append((nodeid, rss - self.last_rss, rss))
        self.last_rss = rss
        self.file.write(f"{nodeid}\t{rss:.0f}\t{peak:.0f}\t{threading.active_count()}\t{_num_children()}"
                        f"\t{self.seconds.pop(nodeid, 0.0):.2f}\n")
        self.file.flush()

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        # the session's fixtures are torn down by now (sessionfinish ran before the summary)
        rss, peak = _status_mib("VmRSS"), _status_mib("VmHWM")
        self.file.write(f"<end>\t{rss:.0f}\t{peak:.0f}\t{threading.active_count()}\t{_num_children()}\t0\n")
        self.file.close()
        terminalreporter.section("resident memory of the pytest process")
        for nodeid, step, after in sorted(self.rows, key=lambda row: -row[1])[:NUM_LARGEST]:
            terminalreporter.write_line(f"{step:+8.0f} MiB -> {after:6.0f} MiB  {nodeid}")
        terminalreporter.write_line(f"peak RSS {peak:.0f} MiB, at the end {rss:.0f} MiB (per test: {self.path})")


def register(config: pytest.Config) -> None:
    """Called from the root conftest: registers the report when the variable names a file."""
    target = os.environ.get(ENV_VAR)
    if target:
        config.pluginmanager.register(RssReport(Path(target)), "loraplex-rss-report")
