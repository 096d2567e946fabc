"""Running a check function under one DeepSpeed release, in a child process.

The pytest process itself never imports DeepSpeed: each release lives in its own directory and
only one can be imported per process. A check is a module-level function of a test file (named
``check_*`` so pytest does not collect it); it passes by returning and fails by raising.
"""
from __future__ import annotations

import textwrap

import pytest

from ci import releases


def call_in_release(release: str, test_file: str, function: str, timeout: float = 300) -> str:
    code = textwrap.dedent(f"""
        import runpy
        runpy.run_path({test_file!r})[{function!r}]()
    """)
    if not releases.is_installed(release):
        pytest.fail(f"DeepSpeed {release} is not installed: run `bash ci/setup.sh`")
    done = releases.run_python(release, ["-c", code], timeout=timeout, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"{function} under DeepSpeed {release} failed (exit {done.returncode}):\n"
                    f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}", pytrace=False)
    return done.stdout
