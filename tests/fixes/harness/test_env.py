"""The harness's process set-up helpers that need DeepSpeed, checked under the newest installed release in a child
process (see tests/helpers.py)."""
import json

from ci import releases
from tests.helpers import call_in_release


def check_each_distinct_deepspeed_line_is_shown_once():
    import logging

    from deepspeed.utils import logger

    from fixes import harness

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    harness.fold_repeated_warnings()
    harness.fold_repeated_warnings()  # idempotent: one filter
    for message in ("untested optimizer", "untested optimizer", "another", "untested optimizer"):
        logger.warning(message)
    assert seen == ["untested optimizer (shown once: its repeats in this run are folded)",
                    "another (shown once: its repeats in this run are folded)"], seen


def test_when_a_warning_repeats_then_it_is_shown_once_and_marked_folded():
    call_in_release(releases.load().newest, check_each_distinct_deepspeed_line_is_shown_once)


def test_when_cpu_info_is_kept_then_py_cpuinfo_runs_once_per_machine_and_every_caller_gets_its_answer(
        tmp_path, monkeypatch):
    import cpuinfo

    from fixes.harness import env

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def asked():  # stands for py-cpuinfo's answer (a new Python each call)
        calls.append(1)
        return {"arch": "X86_64", "flags": ["avx2", "avx512f"], "vendor_id_raw": "GenuineIntel"}

    monkeypatch.setattr(cpuinfo, "get_cpu_info", asked)
    env.keep_cpu_info()
    env.keep_cpu_info()  # idempotent: still one layer over py-cpuinfo's own function
    assert cpuinfo.get_cpu_info.__wrapped__ is asked
    first = cpuinfo.get_cpu_info()
    assert first == asked() and len(calls) == 2  # one through the wrapper, one direct
    path = env.cpu_info_file()
    assert path.parent == tmp_path / "fixbook" and json.loads(path.read_text()) == first
    monkeypatch.setattr(cpuinfo, "get_cpu_info", asked)  # a new process: its own wrapper, the machine's file
    env.keep_cpu_info()
    assert cpuinfo.get_cpu_info() == first and len(calls) == 2
    path.write_text("{not json")  # a damaged file is asked again and replaced
    assert cpuinfo.get_cpu_info() == first and len(calls) == 3 and json.loads(path.read_text()) == first
