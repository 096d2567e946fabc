"""fixes.harness.universal: the ZeRO-3 sub-group job, the per-sub-group state and the resume through a universal
checkpoint, on the newest release (whose conversion and loader handle several sub-groups), in child processes."""
from ci import releases
from tests.helpers import call_in_release

SHARED_STEP_FIX = "zero3-universal-resume-shared-adam-step"


def check_the_job_has_several_sub_groups_and_engine_state_covers_every_parameter():
    from fixes.harness import build_engine, make_batches, setup, universal
    from fixes.harness.resume import train_steps

    setup()
    job = universal.sub_group_job(steps=1)
    engine = build_engine(job)
    train_steps(engine, job, make_batches(job.model, job.steps), range(job.steps))
    groups = universal.sub_groups(engine)
    assert len(groups) == 3, groups
    state = universal.engine_state(engine)
    assert list(state) == [name for group in groups for name in group]
    assert all(set(values) == set(universal.STATES) for values in state.values())
    assert sum(values["fp32"].size for values in state.values()) == 212  # TinyMLP, one rank: whole parameters
    assert universal.adam_steps(engine) == [1.0, 1.0, 1.0] and not universal.shared_step(engine)


def check_resume_equivalence_sees_a_wrong_step_and_passes_once_it_is_right():
    """The newest release's loader shares one Adam step among the sub-groups (the entry SHARED_STEP_FIX): the
    comparison must catch it (step and weights), and pass with that entry's fix applied."""
    import fixes
    from fixes.harness import setup, universal

    setup()
    broken = universal.resume_equivalence(steps=3, saved_after=2)
    assert not broken["resumed vs uninterrupted: step"].close
    assert not broken["resumed vs PyTorch: step"].close
    assert not broken["resumed vs PyTorch: weights"].close
    assert all(broken[f"loaded vs saved: {key}"].close for key in universal.STATES)
    fixes.apply(SHARED_STEP_FIX)
    try:
        repaired = universal.resume_equivalence(steps=3, saved_after=2)
    finally:
        fixes.revert(SHARED_STEP_FIX)
    assert all(c.close for c in repaired.values()), [str(c) for c in repaired.values() if not c.close]


def test_when_the_sub_group_job_is_built_then_it_has_several_sub_groups_and_their_state_is_read_whole():
    call_in_release(releases.load().newest, check_the_job_has_several_sub_groups_and_engine_state_covers_every_parameter)


def test_when_a_resumed_step_count_is_wrong_then_resume_equivalence_fails_and_passes_once_fixed():
    call_in_release(releases.load().newest, check_resume_equivalence_sees_a_wrong_step_and_passes_once_it_is_right)


def check_the_command_line_reports_what_a_shell_sees():
    """A missing input folder: the module's traceback on stderr and status 1; argparse's refusal: status 2."""
    from fixes.harness import setup, universal

    setup()
    missing = universal.command_line("--input_folder", "/nonexistent/global_step1", "--output_folder", "/tmp/x")
    assert missing.returncode == 1 and "Traceback" in missing.stderr, (missing.returncode, missing.stderr[-2000:])
    refused = universal.command_line("--no-such-option")
    assert refused.returncode == 2 and "usage:" in refused.stderr, (refused.returncode, refused.stderr[-2000:])


def test_when_the_command_line_fails_then_its_status_and_stderr_are_what_a_shell_sees():
    call_in_release(releases.load().newest, check_the_command_line_reports_what_a_shell_sees)
