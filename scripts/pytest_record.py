"""A pytest plugin for scripts/gpu_check.py: appends each test's outcome as a JSON line to $GPU_CHECK_RECORD as it
finishes, so a run killed at its time budget still tells what passed and failed.

    GPU_CHECK_RECORD=out.jsonl python -m pytest -p pytest_record ...   (scripts/ on PYTHONPATH)
"""

from __future__ import annotations

import json
import os

import pytest

_WORKER = False  # under pytest-xdist the controller receives every worker's reports: only it writes
_COLLECTED = False


def pytest_configure(config) -> None:
    global _WORKER
    _WORKER = hasattr(config, "workerinput")


def pytest_collection_finish(session) -> None:
    if not _WORKER and session.items:  # (an xdist controller collects nothing itself)
        _write({"collected": len(session.items)})


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids) -> None:
    global _COLLECTED
    if not _COLLECTED:  # every worker collects the whole suite
        _COLLECTED = True
        _write({"collected": len(ids)})


def pytest_runtest_logreport(report) -> None:
    # a test's outcome is its call's, or its setup's or teardown's where that failed or skipped it
    if _WORKER or not (report.when == "call" or report.failed or report.skipped):
        return
    outcome = "error" if report.failed and report.when != "call" else report.outcome
    row = {"test": report.nodeid, "outcome": outcome, "when": report.when, "seconds": round(report.duration, 3)}
    if report.failed:
        row["message"] = str(report.longrepr)[-2000:]  # the end holds the assertion and the line that raised
    _write(row)


def _write(row: dict) -> None:
    path = os.environ.get("GPU_CHECK_RECORD")
    if path:
        with open(path, "a") as out:
            out.write(json.dumps(row) + "\n")
