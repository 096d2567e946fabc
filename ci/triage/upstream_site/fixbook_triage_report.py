"""A pytest plugin for ``python -m ci.triage``: each test case's outcome is appended to ``FIXBOOK_TRIAGE_REPORT`` as
one JSON line the moment it ends, so a run killed at its timeout keeps every case that finished; each case's start is
a line too, so a case that never ended (it hung) is known. A module that fails to import is one ``error`` line under
the module's path."""
import json
import os
import signal
import threading

_watchdog = None


def _write(line):
    path = os.environ.get("FIXBOOK_TRIAGE_REPORT")
    if path:
        with open(path, "a") as handle:
            handle.write(json.dumps(line) + "\n")


def _message(report):
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (file, line, reason)
        return str(longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", ""):
        return crash.message
    text = str(longrepr or "")
    lines = [line for line in text.splitlines() if line.startswith("E ")] or text.splitlines()
    return lines[-1].removeprefix("E").strip() if lines else ""


def pytest_sessionstart(session):
    """The pytest process's own line in the record of applied fixes (see ``sitecustomize``)."""
    import sitecustomize

    if getattr(sitecustomize, "_APPLY", None):
        sitecustomize._record_process(rank="pytest")


def pytest_runtest_logstart(nodeid, location):
    global _watchdog
    _write({"node": nodeid, "outcome": "started", "message": "", "when": "start"})
    limit = float(os.environ.get("FIXBOOK_TRIAGE_HANG_S") or 0)
    if limit:  # upstream's own limit cannot end a run whose ranks hang in a collective (its pool's join waits on)
        _watchdog = threading.Timer(limit, _hung, args=(nodeid, limit))
        _watchdog.daemon = True
        _watchdog.start()


def pytest_runtest_logfinish(nodeid, location):
    if _watchdog is not None:
        _watchdog.cancel()


def _hung(nodeid, limit):
    """The case has run past the hang limit: record it as hung, then end this run and every process it started."""
    _write({"node": nodeid, "outcome": "hung", "message": f"no result within {limit:.0f} s", "when": "call"})
    os.killpg(os.getpgid(0), signal.SIGKILL)


def pytest_runtest_logreport(report):
    if report.when == "call" or report.failed or (report.when == "setup" and report.skipped):
        outcome = "passed" if report.passed else "skipped" if report.skipped else (
            "failed" if report.when == "call" else "error")
        _write({"node": report.nodeid, "outcome": outcome, "message": _message(report)[:400], "when": report.when})


def pytest_collectreport(report):
    if report.failed:
        _write({"node": report.nodeid, "outcome": "error", "message": _message(report)[:400], "when": "collect"})
