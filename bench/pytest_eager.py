"""A pytest plugin for device runs: each failure's traceback and captured output are appended to
$EAGER_REPORT the moment the test fails, so a run the device's time limit kills still says why."""

from __future__ import annotations

import os

import pytest


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not report.failed:
        return
    with open(os.environ.get("EAGER_REPORT", "eager_failures.txt"), "a") as f:
        f.write(f"==== {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext[-6000:]}\n")
        f.write(f"---- stdout\n{report.capstdout[-3000:]}\n---- stderr\n{report.capstderr[-6000:]}\n")
