"""Launching ranks: results come back, errors and hangs become clear exceptions. Each check runs
under the newest installed DeepSpeed, in a child process (see tests/helpers.py)."""
from ci import releases
from tests.helpers import call_in_release


def check_two_ranks_train_like_plain_pytorch_data_parallel():
    from fixes import harness

    job = harness.Job(zero_stage=2, micro_steps=2)
    ranks = harness.launch(harness.run_job, 2, job, timeout=180)
    reference = harness.train_reference(job, world_size=2)
    harness.assert_close(ranks[0].params, reference.params, "float32", "rank 0 vs reference")
    harness.assert_close(ranks[1].params, ranks[0].params, "float32", "rank 1 vs rank 0")


def check_when_fewer_gpus_than_ranks_then_the_ranks_run_on_cpu_and_say_so():
    """A one-GPU machine (Colab) simulated: the launcher sees CUDA with one device."""
    import contextlib
    import io
    import os

    import torch

    from fixes import harness

    torch.cuda.is_available, torch.cuda.device_count = (lambda: True), (lambda: 1)
    assert harness.env.rank_placement(1) == ("cuda", "")
    assert harness.env.RANK_DEVICES == set()  # nothing launched yet in this process
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        seen = harness.launch(os.getenv, 2, "CUDA_VISIBLE_DEVICES", timeout=120)
    assert seen == ["", ""], seen
    assert "2 ranks but 1 GPU(s) here: the 2 ranks run on CPU (gloo)" in printed.getvalue()
    assert harness.env.RANK_DEVICES == {"cpu"}  # what the notebook's run record says of its ranks
    assert harness.launch(os.getenv, 2, "DS_ACCELERATOR", timeout=120) == ["cpu", "cpu"]
    assert harness.launch(os.getppid, 2, timeout=120) == [os.getpid()] * 2  # spawned here: CUDA is in play


def check_when_every_rank_runs_on_cpu_here_then_ranks_fork_from_one_server_and_see_this_environment():
    import os
    import sys

    from fixes import harness

    launching = sys.modules["fixes.harness.launch"]
    assert launching.start_method("cpu", "") == "forkserver"
    assert launching.start_method("cpu", "2 ranks but 1 GPU(s) here") == "spawn"
    assert launching.start_method("cuda", "") == "spawn"
    parents = harness.launch(os.getppid, 2, timeout=120)
    assert os.getpid() not in parents and len(set(parents)) == 1, parents  # both forked by the one server
    os.environ["FIXBOOK_LAUNCH_CHECK"] = "set after the server started"
    assert harness.launch(os.getenv, 2, "FIXBOOK_LAUNCH_CHECK", timeout=120) == ["set after the server started"] * 2
    assert harness.launch(os.getppid, 1, timeout=120) == parents[:1]  # the same server, started once


def check_a_hanging_rank_becomes_a_timeout_error():
    import time

    from fixes import harness
    from fixes.exceptions import RankTimeoutError

    started = time.monotonic()
    try:
        harness.launch(time.sleep, 2, 600, timeout=5)  # the ranks never finish: any limit shows it
    except RankTimeoutError as exc:
        assert "did not finish within 5 s" in str(exc), exc
        assert time.monotonic() - started < 60
    else:
        raise AssertionError("a sleeping rank was not reported as a hang")


def check_a_raising_rank_reports_its_exception():
    import math

    from fixes import harness
    from fixes.exceptions import RankFailedError

    try:
        harness.launch(math.sqrt, 1, -1.0, timeout=120)
    except RankFailedError as exc:
        assert exc.exc_type == "ValueError" and "math domain error" in exc.message, exc
    else:
        raise AssertionError("the rank's ValueError was lost")


def check_a_crashing_rank_reports_its_signal():
    import os

    from fixes import harness
    from fixes.exceptions import RankFailedError

    try:
        harness.launch(os.abort, 1, timeout=120)
    except RankFailedError as exc:
        assert exc.exc_type == "ProcessDied" and "SIGABRT" in exc.message, exc
    else:
        raise AssertionError("a rank that died was not reported")


def check_a_function_from_main_is_refused():
    from fixes import harness
    from fixes.exceptions import HarnessError

    def local():
        return 1

    local.__module__ = "__main__"
    try:
        harness.launch(local, 1)
    except HarnessError as exc:
        assert "importable module" in str(exc)
    else:
        raise AssertionError("a __main__ function was accepted")


def _held_port():
    """A listening socket on a free port: a bind of that port now fails with EADDRINUSE."""
    import socket

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    return held, held.getsockname()[1]


def check_when_another_launchs_store_has_the_port_free_port_gives_then_no_rank_meets_it():
    """Two launches side by side, made deterministic: ``free_port`` gives this launch the port on which another
    launch's store is served (as it can between another launch's choice of a port and its bind). A rank of this
    launch that met there would add its keys to that store, and in a real run exchange tensors with the other
    launch's ranks."""
    import datetime
    import os
    import socket
    import sys

    from torch.distributed import TCPStore

    from fixes import harness
    from fixes.harness import env

    launching = sys.modules["fixes.harness.launch"]
    other = TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    keys = other.num_keys()
    # Set on the launching module too, though it no longer imports ``free_port``: a launcher that picked its ranks'
    # port with it again would be handed the other store's port, and the assertions below would fail.
    launching.free_port = env.free_port = lambda: other.port
    seen = harness.launch(os.getenv, 2, "MASTER_PORT", timeout=120)
    assert other.num_keys() == keys, f"a rank met at the other launch's store: {other.num_keys() - keys} new keys"
    assert seen[0] == seen[1] != str(other.port), seen
    with launching.rendezvous() as meeting:  # the launch's own port is held while its ranks run
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", meeting.port))
            except OSError:
                pass
            else:
                raise AssertionError(f"port {meeting.port} could be bound during the launch")


def check_when_setup_picked_a_port_that_is_taken_then_it_takes_another_but_never_replaces_a_users():
    import os

    from fixes.harness import env

    held, taken = _held_port()
    os.environ.pop("MASTER_PORT", None)
    ports = iter([taken])
    real = env.free_port
    env.free_port = lambda: next(ports, None) or real()
    env.setup()
    assert os.environ["MASTER_PORT"] != str(taken)
    import torch

    torch.distributed.destroy_process_group()
    os.environ["MASTER_PORT"] = str(taken)  # the user's own: a taken port is their error, shown as it is
    try:
        env.setup()
    except RuntimeError as exc:
        assert env.port_taken(exc), exc
    else:
        raise AssertionError("a taken MASTER_PORT the user set was replaced silently")
    finally:
        held.close()


def test_when_another_launchs_store_has_the_port_free_port_gives_then_no_rank_meets_it():
    call_in_release(releases.load().newest, check_when_another_launchs_store_has_the_port_free_port_gives_then_no_rank_meets_it)


def test_when_setup_picked_a_port_that_is_taken_then_it_takes_another_but_never_replaces_a_users():
    call_in_release(releases.load().newest,
                    check_when_setup_picked_a_port_that_is_taken_then_it_takes_another_but_never_replaces_a_users)


def test_when_two_ranks_train_then_they_match_plain_data_parallel():
    call_in_release(releases.load().newest, check_two_ranks_train_like_plain_pytorch_data_parallel)


def test_when_a_rank_hangs_then_launch_raises_timeout_error_in_time():
    call_in_release(releases.load().newest, check_a_hanging_rank_becomes_a_timeout_error)


def test_when_a_rank_raises_then_launch_reports_its_exception():
    call_in_release(releases.load().newest, check_a_raising_rank_reports_its_exception)


def test_when_a_rank_dies_then_launch_reports_the_signal():
    call_in_release(releases.load().newest, check_a_crashing_rank_reports_its_signal)


def test_when_function_lives_in_main_then_launch_refuses_it():
    call_in_release(releases.load().newest, check_a_function_from_main_is_refused)


def test_when_fewer_gpus_than_ranks_then_the_ranks_run_on_cpu_and_say_so():
    call_in_release(releases.load().newest, check_when_fewer_gpus_than_ranks_then_the_ranks_run_on_cpu_and_say_so)


def test_when_every_rank_runs_on_cpu_here_then_ranks_fork_from_one_server_and_see_this_environment():
    call_in_release(releases.load().newest,
                    check_when_every_rank_runs_on_cpu_here_then_ranks_fork_from_one_server_and_see_this_environment)


def check_when_ranks_print_then_their_lines_reach_the_launchers_stdout_with_their_rank():
    import contextlib
    import io
    import os

    from fixes import harness

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # in a notebook, sys.stdout is the cell's output
        harness.launch(print, 2, "hello from a rank", timeout=120)
        harness.launch(os.write, 2, 2, b"written straight to file descriptor 2\n", timeout=120)
    text = printed.getvalue()
    for rank in (0, 1):
        assert f"[rank{rank}] hello from a rank" in text, text
        assert f"[rank{rank}] written straight to file descriptor 2" in text, text


def test_when_ranks_print_then_the_launching_cell_shows_their_lines_not_the_servers_terminal():
    call_in_release(releases.load().newest, check_when_ranks_print_then_their_lines_reach_the_launchers_stdout_with_their_rank)
