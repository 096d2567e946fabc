"""import-deepspeed-forces-spawn on its reproduce release, in child processes: with the fix, the user's script chooses
any start method after ``import deepspeed``; the decoupled checkpoint engine still chooses spawn where nobody did;
``fixes.revert()`` refuses once the user has chosen (the fix's docstring says why)."""
import pytest

from tests.helpers import call_in_release

AFFECTED = "0.17.1"
FIX_ID = "import-deepspeed-forces-spawn"


def check_each_start_method_can_be_chosen_after_the_fix():
    from concurrent.futures import ThreadPoolExecutor

    from fixes.entries.import_deepspeed_forces_spawn.reproduce import run_script, user_script

    methods = ("spawn", "fork", "forkserver")
    with ThreadPoolExecutor(len(methods)) as pool:  # each in a new Python, side by side
        runs = dict(zip(methods, pool.map(run_script, [user_script(method, fixed=True) for method in methods])))
    for method, fixed in runs.items():
        assert fixed.returncode == 0 and fixed.last_line == f"start method: {method}", fixed.output[-2000:]


def check_in_this_process_the_user_chooses_and_revert_refuses():
    import multiprocessing

    import fixes
    from fixes.exceptions import PatchError

    # this check is forked from a process that imported deepspeed: the start method is already spawn
    assert multiprocessing.get_start_method(allow_none=True) == "spawn"
    [outcome] = fixes.apply(FIX_ID)
    assert outcome.action == "applied", outcome
    assert multiprocessing.get_start_method(allow_none=True) is None
    multiprocessing.set_start_method("fork")
    assert multiprocessing.get_start_method() == "fork"
    with pytest.raises(PatchError, match="replaced again"):
        fixes.revert(FIX_ID)
    assert fixes.get(FIX_ID).applied and multiprocessing.get_start_method() == "fork"


def check_decoupled_engine_still_chooses_spawn_where_nobody_did():
    import multiprocessing

    import fixes
    from deepspeed.runtime.checkpoint_engine.decoupled_checkpoint_engine import DecoupledCheckpointEngine
    from fixes import harness

    harness.setup()
    fixes.apply(FIX_ID)
    assert multiprocessing.get_start_method(allow_none=True) is None
    engine = DecoupledCheckpointEngine({}, None, False)  # no writer config: no process is started
    assert engine.ckpt_process is None
    assert multiprocessing.get_start_method(allow_none=True) == "spawn"
    # where the user chose, the engine keeps the choice
    multiprocessing.set_start_method("fork", force=True)
    DecoupledCheckpointEngine({}, None, False)
    assert multiprocessing.get_start_method() == "fork"


def test_when_applied_then_the_users_script_chooses_any_start_method():
    call_in_release(AFFECTED, check_each_start_method_can_be_chosen_after_the_fix, timeout=600)


def test_when_the_user_chose_after_apply_then_revert_refuses_and_keeps_the_choice():
    call_in_release(AFFECTED, check_in_this_process_the_user_chooses_and_revert_refuses)


def test_when_nobody_chose_then_the_decoupled_checkpoint_engine_chooses_spawn():
    call_in_release(AFFECTED, check_decoupled_engine_still_chooses_spawn_where_nobody_did)
