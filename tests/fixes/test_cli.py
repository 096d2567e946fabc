import os
import subprocess
import sys

import pytest

from ci import releases
from fixes.cli import main, search


def _fixbook(*args, release=None):
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    if release:
        env.update(releases.environment(release))
    return subprocess.run([sys.executable, "-m", "fixes.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_when_error_line_pasted_then_search_finds_its_entry(capsys):
    assert main(["search", "must override the setup_context staticmethod"]) == 0
    assert "zero3-linear-setup-context" in capsys.readouterr().out


def test_when_whole_traceback_line_pasted_then_search_still_finds_it():
    line = ("RuntimeError: In order to use an autograd.Function with functorch transforms (vmap, grad, jvp, "
            "jacrev, ...), it must override the setup_context staticmethod. For more details, please see "
            "https://pytorch.org/docs/main/notes/extending.func.html")
    found = [match.fix_id for match in search(line)]
    assert "zero3-linear-setup-context" in found[:2]  # zero3-hooks-torch-func explains the same error
    assert set(found[:2]) == {"zero3-linear-setup-context", "zero3-hooks-torch-func"}


def test_when_nothing_matches_then_search_exits_1(capsys):
    assert main(["search", "completely unrelated words"]) == 1
    assert "no match" in capsys.readouterr().err


def test_when_show_gets_unknown_id_then_exit_2_with_known_ids(capsys):
    assert main(["show", "no-such-bug"]) == 2
    err = capsys.readouterr().err
    assert "unknown fix id 'no-such-bug'; known ids:" in err and "zero3-linear-setup-context" in err


def test_when_show_gets_known_id_then_it_prints_ranges_and_fix_call(capsys):
    assert main(["show", "zero3-linear-setup-context"]) == 0
    out = capsys.readouterr().out
    assert "fixed in:    0.19.1 (measured)" in out and 'fixes.apply("zero3-linear-setup-context")' in out


def test_when_command_missing_then_usage_error():
    with pytest.raises(SystemExit) as caught:
        main([])
    assert caught.value.code == 2


def test_when_no_deepspeed_installed_then_doctor_exits_2():
    done = _fixbook("doctor")
    assert done.returncode == 2 and "not installed" in done.stderr


def test_when_affected_release_installed_then_doctor_lists_the_bug_and_its_fix():
    done = _fixbook("doctor", release="0.18.9")
    assert done.returncode == 0, done.stderr
    [line] = [line for line in done.stdout.splitlines() if line.startswith("!  zero3-linear-setup-context")]
    assert "measured affected" in line and "probe: affected" in line
    assert line.endswith('fix: import fixes; fixes.apply("zero3-linear-setup-context")')


def test_when_measured_under_a_condition_this_install_lacks_then_doctor_trusts_the_probe():
    done = _fixbook("doctor", release="0.18.9")  # zero-grad-hook-lifetime is measured on torch < 2.1 only
    assert "zero-grad-hook-lifetime" not in done.stdout


def test_when_fixed_release_installed_then_doctor_does_not_list_the_bug():
    done = _fixbook("doctor", release=releases.load().newest)
    assert done.returncode == 0, done.stderr
    assert "zero3-linear-setup-context" not in done.stdout
    assert f"known bug(s) apply to DeepSpeed {releases.load().newest}" in done.stdout


def test_when_listing_under_affected_release_then_status_is_affected():
    done = _fixbook("list", release="0.18.9")
    assert done.returncode == 0
    assert any(line.startswith("zero3-linear-setup-context") and "AFFECTED" in line
               for line in done.stdout.splitlines())


class _Diagnosed:
    """An entry for doctor: its probe finds the bug; its drift checks pass or raise ``drift``."""

    def __init__(self, entry_id, drift=None):
        from fixes import registry

        self.info, self.id, self.drift = registry.get(entry_id).info, entry_id, drift

    def probe(self):
        from fixes import Probe

        return Probe(True, "the bug is here")

    def check_applicable(self):
        if self.drift:
            raise self.drift
        return []


def test_when_a_fix_refuses_the_installed_code_then_doctor_offers_no_call_for_it(monkeypatch, capsys):
    from fixes import DriftError, cli, registry

    drifted = _Diagnosed("zero3-linear-setup-context", DriftError("X.forward is not the code this fix was written for"))
    fine = _Diagnosed("zero12-flat-buffer-detach")
    monkeypatch.setattr(cli, "installed_deepspeed", lambda: "0.18.9")
    monkeypatch.setattr(registry, "_entries", lambda: {drifted.id: drifted, fine.id: fine})
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    [refused] = [line for line in out.splitlines() if line.startswith("!  zero3-linear-setup-context")]
    assert "no fix for this release: DriftError: X.forward is not the code" in refused
    assert "fixes.apply(" not in refused
    [offered] = [line for line in out.splitlines() if line.startswith("!  zero12-flat-buffer-detach")]
    assert offered.endswith('fix: import fixes; fixes.apply("zero12-flat-buffer-detach")')
    assert "1 can be fixed: `import fixes; fixes.apply()` (it skips the others and says why)" in out


def test_when_a_probe_raises_then_doctor_reports_it_and_goes_on(monkeypatch, capsys):
    from fixes import cli, registry

    class Exploding:
        id = "exploding"
        info = registry.get("zero3-linear-setup-context").info

        def probe(self):
            raise ValueError("cannot read this DeepSpeed")

    monkeypatch.setattr(cli, "installed_deepspeed", lambda: "0.18.9")
    monkeypatch.setattr(registry, "_entries", lambda: {"exploding": Exploding()})
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "could not check zero3-linear-setup-context: ValueError: cannot read this DeepSpeed" in out
    assert "1 could not be checked" in out


BEHAVIOUR_CHANGE = "gradient-clipping-default-1"  # an entry of kind "behaviour change" (FixInfo.kind)


def test_when_listing_then_behaviour_changes_come_apart_from_bugs():
    from fixes import registry

    done = _fixbook("list", release="0.19.3")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    [heading] = [i for i, line in enumerate(lines) if line.startswith("Behaviour changes")]
    [change] = [i for i, line in enumerate(lines) if line.startswith(BEHAVIOUR_CHANGE)]
    assert change > heading and "NEW BEHAVIOUR" in lines[change], lines[change]
    bugs = [fix.id for fix in registry.all_fixes() if not fix.info.is_behaviour_change]
    assert all(i < heading for i, line in enumerate(lines) if line.split(" ")[0] in bugs)
    assert "AFFECTED" not in lines[change]


def test_when_doctor_runs_on_a_release_with_a_behaviour_change_then_it_is_not_counted_as_a_bug():
    from fixes import registry

    done = _fixbook("doctor", release="0.19.3")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    bugs = sum(1 for fix in registry.all_fixes() if not fix.info.is_behaviour_change)
    assert any(f" of {bugs} known bug(s) apply to DeepSpeed 0.19.3" in line for line in lines), done.stdout
    assert not any(line.startswith(f"!  {BEHAVIOUR_CHANGE}") for line in lines)
    [heading] = [i for i, line in enumerate(lines) if line.startswith("behaviour changes in DeepSpeed 0.19.3")]
    [change] = [i for i, line in enumerate(lines) if line.startswith(f"~  {BEHAVIOUR_CHANGE}")]
    assert change > heading
    assert lines[change].endswith(f'to pin the old behaviour: import fixes; fixes.apply("{BEHAVIOUR_CHANGE}")')


def test_when_doctor_runs_on_a_release_without_the_change_then_no_behaviour_change_is_listed():
    done = _fixbook("doctor", release="0.19.1")
    assert done.returncode == 0, done.stderr
    assert BEHAVIOUR_CHANGE not in done.stdout and "behaviour changes in" not in done.stdout


def test_when_show_gets_a_behaviour_change_then_it_says_its_kind(capsys):
    assert main(["show", BEHAVIOUR_CHANGE]) == 0
    out = capsys.readouterr().out
    assert "kind:        behaviour change (not a bug" in out


@pytest.mark.parametrize("args", [("search", "AssertionError: no_sync context manager is incompatible with gradient partitioning logic of ZeRO stage 2"), ("list",), ("doctor",)])
def test_when_the_reader_of_its_output_goes_away_then_fixbook_ends_quietly(args):
    """`fixbook ... | head -2` where head has already gone: the first write finds no reader (made certain here by
    closing the pipe's read end before the child starts)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **releases.environment(releases.load().newest)}
    try:
        child = subprocess.run([sys.executable, "-m", "fixes.cli", *args], stdout=write_end, stderr=subprocess.PIPE,
                               text=True, env=env, timeout=300)
    finally:
        os.close(write_end)
    assert child.stderr == "", child.stderr[-2000:]
    assert child.returncode in (0, -13), child.returncode  # done, or ended by SIGPIPE as `cat` is
