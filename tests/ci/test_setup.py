"""ci/setup.sh: its scopes."""
import subprocess

from ci import ROOT


def test_when_setup_gets_an_unknown_scope_then_it_exits_2_naming_the_scopes_and_installs_nothing(tmp_path):
    done = subprocess.run(["bash", str(ROOT / "ci" / "setup.sh"), "everything"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "usage: bash ci/setup.sh [notebooks]" in done.stderr and "everything" in done.stderr
    assert "disk before set-up" not in done.stdout
