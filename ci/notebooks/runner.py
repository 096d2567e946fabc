"""The papermill matrix runner: every entry's notebook on each release of its matrix.

    python -m ci.notebooks.runner                          # every entry × (its reproduce release, newest)
    python -m ci.notebooks.runner --entry ID --release 0.18.9 --cell-timeout 300
    python -m ci.notebooks.runner --record                 # and keep the verdicts in fixes/data/runs.json
    python -m ci.notebooks.runner --shard 2/3 --build DIR  # part 2 of 3 of the matrix (ci.notebooks.shards), for machines side by side
    python -m ci.notebooks.runner --merge DIR1 DIR2 DIR3   # the parts' builds into build/: as if run unsharded

For each run it writes the executed notebook to ``build/executed/<release>/<entry>.ipynb`` and
one record to ``build/results/<entry>/<release>.json``; ``build/results.json`` gathers them. What the
kernel processes print outside their cells (DeepSpeed's lines at import, ipykernel's own log) goes to
``build/kernels.log``, not to the console, which shows a line per run. A failed notebook (an error, or a cell past its timeout) fails the whole run, named by notebook
and cell. Only this module knows about kernels; everything downstream reads the records.

A shard runs one part of the matrix (the parts are balanced by each run's seconds as ``--record`` keeps them
in ``ci/data/notebook_seconds.json``, by count where one is unknown) and writes ``shard.json`` beside its
records: which part, of which matrix. ``--merge`` checks that its builds are every part of one matrix, each
once, and writes the records, the executed notebooks and ``results.json`` exactly as the unsharded run writes
them (each record's executed copy pointing into the merged build).
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from fixes.files import write_atomic
from fixes.record import RunRecord, RunResult

from .. import releases as release_env
from . import shards

from .. import ROOT
NOTEBOOKS = ROOT / "notebooks"
BUILD = ROOT / "build"
SECONDS = ROOT / "ci" / "data" / "notebook_seconds.json"  # each run's wall time, kept by --record
SHARD_FILE = "shard.json"  # in a shard's build: which part of which matrix it ran
KERNEL_LOG = "kernels.log"  # in a build: what the kernel processes printed outside their cells (ci.processes.kernels.servers)


ALL_ENVIRONMENTS = "all"  # --env all: every environment's runs


def notebook_path(entry: str) -> Path:
    return NOTEBOOKS / f"{entry}.ipynb"


def matrix(entries: list[str] | None = None, releases: list[str] | None = None,
           environments: list[str] | None = None) -> list[tuple[str, str, str]]:
    """(entry, release, environment) triples: each entry on its reproduce release and on the newest
    release in the project venv (``cpu``), plus, for every environment of ``ci/environments.toml`` that
    names the entry's notebook, the entry on its reproduce release there. ``environments`` keeps only those
    (``None`` or :data:`ALL_ENVIRONMENTS` among them: every one); an unknown name is a ``ValueError``."""
    import fixes

    from ..releases import environments as env_module

    known = release_env.load()
    chosen = [fixes.get(e) for e in entries] if entries else fixes.all_fixes()
    triples = []
    for fix in chosen:
        if not notebook_path(fix.id).exists():
            raise FileNotFoundError(f"entry {fix.id} has no notebook {notebook_path(fix.id)}")
        for release in sorted({fix.info.reproduce_release, known.newest}):
            release_env.check_known(release)
            triples.append((fix.id, release, env_module.DEFAULT))
    ids = {fix.id for fix in chosen}
    for entry, env in env_module.notebook_runs():
        if entry in ids:
            triples.append((entry, fixes.get(entry).info.reproduce_release, env))
    if environments is not None:
        known_envs = {env_module.DEFAULT, *env_module.load()}
        unknown = sorted(set(environments) - known_envs - {ALL_ENVIRONMENTS})
        if unknown:
            raise ValueError(f"unknown environment(s) {', '.join(unknown)}: {', '.join(sorted(known_envs))} "
                             f"(ci/environments.toml), or {ALL_ENVIRONMENTS}")
        if ALL_ENVIRONMENTS in environments:
            environments = None
    return [t for t in triples if (releases is None or t[1] in releases) and (environments is None or t[2] in environments)]


# Which runs a test session's notebook tests use (:func:`tests_matrix`): FIXBOOK_MATRIX=main or all.
MATRIX_VARIABLE = "FIXBOOK_MATRIX"
MAIN = "main"  # FIXBOOK_MATRIX=main: the main job's runs


def tests_matrix() -> list[tuple[str, str, str]]:
    """The runs the notebook tests (``pytest -m notebooks``) use: with ``FIXBOOK_MATRIX=main`` the main job's
    (``bash ci/build.sh``: each entry on its reproduce release and the newest, in the project venv), which
    ``FIXBOOK_BUILD=build`` then reads from its build; otherwise every run of :func:`matrix` (CI's merged notebook
    matrix). Any other value is a ``ValueError``."""
    scope = os.environ.get(MATRIX_VARIABLE, ALL_ENVIRONMENTS)
    if scope == MAIN:
        from ..releases import environments as env_module

        return matrix(environments=[env_module.DEFAULT])
    if scope != ALL_ENVIRONMENTS:
        raise ValueError(f"{MATRIX_VARIABLE}={scope!r}: {MAIN} (the main job's runs) or {ALL_ENVIRONMENTS} (every run)")
    return matrix()


def ipc_kernel_manager_class() -> type:
    """A ``jupyter_client`` KernelManager whose kernel talks over Unix sockets in a directory of its own,
    not TCP ports. With TCP, the manager picks free ports and the kernel binds them later; in between,
    another process can take one (a second kernel starting, a rank's gloo connection), and the kernel
    then never answers: ``RuntimeError: Kernel didn't respond in 60 seconds`` after ``ZMQError: Address
    already in use`` (seen with two notebooks at once, main job at 3c7bde5). A private socket directory
    cannot collide. The directory goes when the kernel's resources are cleaned up."""
    import shutil
    import tempfile
    import uuid

    from jupyter_client.manager import AsyncKernelManager

    from ..processes import kernels  # nbclient's own default, made ipc

    class IPCKernelManager(AsyncKernelManager):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.client_factory = ready_client_class()
            self._socket_dir = tempfile.mkdtemp(prefix="fixbook-kernel-")
            self.transport = "ipc"
            self.ip = str(Path(self._socket_dir) / "kernel")

        async def _async_pre_start_kernel(self, **kw: Any) -> Any:
            if self.provisioner is None:  # the kernel is forked from this runner call's kernel server (ci.processes.kernels)
                self.kernel_id = self.kernel_id or kw.pop("kernel_id", str(uuid.uuid4()))
                self.provisioner = kernels.provisioner_class()(kernel_id=self.kernel_id, kernel_spec=self.kernel_spec,
                                                               parent=self)
            return await super()._async_pre_start_kernel(**kw)

        async def _async_finish_shutdown(self, waittime: float | None = None, pollinterval: float = 0.1,
                                         restart: bool = False) -> None:
            # A forked kernel that has acknowledged the shutdown request ends on its own (kernels.reap): the
            # next run need not wait for its exit (0.2 - 0.4 s, polled every 0.1 s, in every run). Else as before.
            process = getattr(self.provisioner, "process", None)
            if restart or not isinstance(process, kernels.ForkedKernel) or not self._shutdown_acknowledged():
                await super()._async_finish_shutdown(waittime=waittime, pollinterval=pollinterval, restart=restart)
                return
            kernels.reap(process, waittime if waittime is not None else self.shutdown_wait_time)

        def _shutdown_acknowledged(self, timeout_s: float = 5.0) -> bool:
            """Whether the kernel answered the shutdown request (``shutdown_reply`` on the control channel, sent
            before it stops): it then ends whether or not this manager closes its sockets."""
            import zmq

            socket = self._control_socket
            deadline = time.monotonic() + timeout_s
            while socket is not None and not socket.closed:
                left = deadline - time.monotonic()
                if left <= 0 or not socket.poll(int(left * 1000)):
                    return False
                _, reply = self.session.recv(socket, mode=zmq.NOBLOCK)
                if reply and reply.get("msg_type") == "shutdown_reply":
                    return True
            return False

        async def _async_cleanup_resources(self, restart: bool = False) -> None:
            await super()._async_cleanup_resources(restart=restart)
            if not restart:
                shutil.rmtree(self._socket_dir, ignore_errors=True)

        cleanup_resources = _async_cleanup_resources

    return IPCKernelManager


@functools.cache
def ready_client_class() -> type:
    """``jupyter_client``'s asynchronous kernel client, whose ``wait_for_ready`` does not wait for 0.2 s of silence
    on IOPub once the kernel has answered. jupyter_client's own sends ``kernel_info`` until the kernel replies on the
    shell channel and IOPub delivers a message (both sockets connected), then reads IOPub until nothing comes for
    0.2 s: the kernel_info request's status messages, which nbclient would skip anyway (it reads only the
    messages whose parent is a request it sent). Here the first two steps are the same; what IOPub already holds
    is then read without waiting: 0.2 s less per run, all of it idle (the kernel client ready in 0.23 s against
    0.47 s, ``start_new_kernel_client`` timed in the runner over six quick notebooks' runs)."""
    from queue import Empty

    from jupyter_client.asynchronous.client import AsyncKernelClient

    class ReadyClient(AsyncKernelClient):
        async def wait_for_ready(self, timeout: float | None = None) -> None:
            deadline = time.monotonic() + (float("inf") if timeout is None else timeout)
            while True:
                self.kernel_info()
                try:
                    reply = await self.shell_channel.get_msg(timeout=1)
                except Empty:
                    pass
                else:
                    if reply["msg_type"] == "kernel_info_reply":
                        try:  # IOPub connected: the request's status message has come (else ask again)
                            await self.iopub_channel.get_msg(timeout=0.2)
                        except Empty:
                            pass
                        else:
                            self._handle_kernel_info_reply(reply)
                            break
                if not await self.is_alive():
                    raise RuntimeError("Kernel died before replying to kernel_info")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"Kernel didn't respond in {timeout:.0f} seconds")
            while True:  # what IOPub holds now, without waiting for more
                try:
                    await self.iopub_channel.get_msg(timeout=0)
                except Empty:
                    break

    return ReadyClient


SAVE_EVERY_S = 10.0  # while a notebook runs, its executed copy is written at most this often (and always at its end)
ENGINE = "fixbook"  # papermill's nbclient engine, saving the executed copy every SAVE_EVERY_S: papermill_engine()
_registered: list[str] = []  # ENGINE, once this process has registered it


def papermill_engine() -> str:
    """The name of papermill's nbclient engine as the runner uses it, registered on first call: it writes the
    executed notebook when the run starts, at most every :data:`SAVE_EVERY_S` seconds while it runs, and always
    when it ends (papermill's ``notebook_complete``, called whether the notebook passed, failed or timed out).
    papermill's own engine writes it when each cell starts and again when it ends: for a 25-cell notebook 52
    writes, each re-serialising the whole notebook (0.44 s of the runner's 0.56 s of CPU per run, measured with
    cProfile on bf16-gets-fp16-optimizer). What a run records is the same: the final write holds every cell."""
    from papermill.engines import NBClientEngine, NotebookExecutionManager, papermill_engines

    if _registered:
        return ENGINE

    class Manager(NotebookExecutionManager):
        final = False

        def save(self, **kwargs: Any) -> None:
            if self.final or (self.now() - self.last_save_time).total_seconds() >= SAVE_EVERY_S:
                super().save(**kwargs)

        def notebook_start(self, **kwargs: Any) -> None:
            self.final = True  # the first write: the executed copy exists from the start
            try:
                super().notebook_start(**kwargs)
            finally:
                self.final = False

        def notebook_complete(self, **kwargs: Any) -> None:
            self.final = True
            super().notebook_complete(**kwargs)

    class Engine(NBClientEngine):
        @classmethod
        def execute_notebook(cls, nb: Any, kernel_name: str, output_path: str | None = None, progress_bar: bool = True,
                             log_output: bool = False, autosave_cell_every: int = 30, **kwargs: Any) -> Any:
            # papermill's Engine.execute_notebook, with Manager for its NotebookExecutionManager
            manager = Manager(nb, output_path=output_path, progress_bar=progress_bar, log_output=log_output,
                              autosave_cell_every=autosave_cell_every)
            manager.notebook_start()
            try:
                cls.execute_managed_notebook(manager, kernel_name, log_output=log_output, **kwargs)
            finally:
                manager.cleanup_pbar()
                manager.notebook_complete()
            return manager.nb

    papermill_engines.register(ENGINE, Engine)
    _registered.append(ENGINE)
    return ENGINE


def execute(notebook: Path, output: Path, kernel: str, parameters: dict[str, Any], cell_timeout: float,
            entry: str = "", release: str = "", cwd: Path = ROOT) -> RunResult:
    """Execute one notebook with papermill, its kernel started in ``cwd``; never raises for a notebook's own
    failure."""
    import papermill
    from papermill.exceptions import PapermillExecutionError

    output.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    status, error, cell = "passed", None, None
    try:
        papermill.execute_notebook(str(notebook), str(output), parameters=parameters, kernel_name=kernel,
                                   execution_timeout=cell_timeout, progress_bar=False, cwd=str(cwd),
                                   kernel_manager_class=ipc_kernel_manager_class(), engine_name=papermill_engine())
    except PapermillExecutionError as exc:
        status, error, cell = "failed", f"{exc.ename}: {exc.evalue}", exc.exec_count
    except Exception as exc:  # noqa: BLE001 - a timeout, a dead kernel: recorded, never hidden
        status, error = "failed", f"{type(exc).__name__}: {exc}"
        cell = _interrupted_cell(output)
    return RunResult(entry=entry or notebook.stem, release=release, kernel=kernel, notebook=str(notebook),
                     executed=str(output), status=status, wall_s=round(time.monotonic() - started, 1),
                     error=error, failed_cell=cell)


def _interrupted_cell(executed: Path) -> int | None:
    """The execution count of the cell a timeout interrupted, read from papermill's partial output
    (the kernel is interrupted, so that cell holds an error output, e.g. KeyboardInterrupt)."""
    try:
        cells = [c for c in json.loads(executed.read_text())["cells"] if c.get("cell_type") == "code"]
    except (OSError, ValueError, KeyError):
        return None
    started = [c for c in cells if c.get("execution_count") is not None]
    failed = [c for c in started if any(o.get("output_type") == "error" for o in c.get("outputs", []))]
    chosen = (failed or started)[-1:]
    return chosen[0]["execution_count"] if chosen else None


def recorded_runs(build: Path = BUILD) -> list[RunResult]:
    """Every run :func:`run_one` recorded in ``build`` (``results/<entry>/<run>.json``), in path order:
    what the site and the claims check read."""
    return [RunResult.from_json(json.loads(path.read_text())) for path in sorted((build / "results").glob("*/*.json"))]


def executed_notebook(result: RunResult) -> Path:
    """The executed notebook of ``result`` (a relative path is the checkout's)."""
    executed = Path(result.executed)
    return executed if executed.is_absolute() else ROOT / executed


def run_one(entry: str, release: str, cell_timeout: float, build: Path = BUILD, environment: str = "cpu",
            kernel: str | None = None) -> RunResult:
    """Run ``entry``'s notebook on ``release`` in ``environment``'s kernel, or in ``kernel`` where given (a
    kernel the caller wrote, e.g. :mod:`ci.tools.device`'s on a GPU machine); never raises for the notebook's failure."""
    from ..releases import environments as env_module

    tag = run_tag(release, environment)
    record_path = build / "results" / entry / f"{tag}.json"
    record_path.unlink(missing_ok=True)
    executed = build / "executed" / tag / f"{entry}.ipynb"
    try:
        kernel = kernel or env_module.kernel(environment, release)
    except env_module.EnvironmentError_ as exc:  # never a skip: the run fails, naming what is missing
        result = RunResult(entry, release, "", str(notebook_path(entry)), str(executed), "failed", 0.0, error=str(exc),
                           environment=environment)
    else:
        result = execute(notebook_path(entry), executed, kernel, {"results_file": str(record_path)}, cell_timeout,
                         entry, release)
        result.environment = environment
    if record_path.exists():
        result.record = RunRecord.from_json(json.loads(record_path.read_text()))
    record_path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(record_path, json.dumps(result.to_json(), indent=2))
    return result


def run_tag(release: str, environment: str) -> str:
    """The name of a run's record and executed folder: the release, ``-<environment>`` outside the project venv."""
    from ..releases import environments as env_module

    return release if environment == env_module.DEFAULT else f"{release}-{environment}"


def _oldest_first(release: str) -> tuple[int, ...]:
    return tuple(int(part) for part in release.split("."))


def _print_result(done: int, total: int, result: RunResult, log: Path) -> None:
    """A run's progress line; for a failed run, where its output is."""
    where = "" if result.environment == "cpu" else f" ({result.environment})"
    print(f"[{done}/{total}] {result.entry} on DeepSpeed {result.release}{where}: {result.status} in "
          f"{result.wall_s:.0f} s — {result.summary}", flush=True)
    if result.status != "passed":
        print(f"    its cells' output: {result.executed}; the kernels' own output: {log}", flush=True)


def _run_order(pairs: list[tuple[str, str, str]]) -> list[int]:
    """The indices of ``pairs`` in the order they run: kernel by kernel, the project venv's first, the oldest
    releases first. On a machine where no DeepSpeed op is built yet, an old release's run builds one (FusedAdam's
    for zero3-reload-states-wrong-order on 0.16.0: 40 s in the main job on a fresh clone, 4 s once built); this
    order starts that build first, beside the other runs, instead of last. Measured on fresh clones (papermill's
    start and end times): newest first, the notebooks spanned 259.4 s, the build's run alone for its last 36 s
    (c655f5e); oldest first, 260.5 s, the build's run taking 82 s beside the others (4998572). The build's CPU
    is the same either way; this order keeps a tail of short runs. Warm, the two orders are within 1 s (the same
    runs' times replayed two at a time). Longest first within a kernel was measured slower (the whole matrix,
    warm, --jobs 2: 501 s against 366 s; the long zero3-reload-states runs took three times their time beside
    the kernel's other runs)."""
    from ..releases import environments as env_module

    return sorted(range(len(pairs)), key=lambda i: (pairs[i][2] != env_module.DEFAULT, _oldest_first(pairs[i][1]),
                                                       pairs[i][2]))


def run_matrix(pairs: list[tuple[str, str, str]], cell_timeout: float, build: Path = BUILD, jobs: int = 1,
               kernels: dict[tuple[str, str], str] | None = None,
               on_result: Callable[[RunResult], None] | None = None) -> list[RunResult]:
    """Run every (entry, release, environment) triple; ``jobs`` > 1 runs that many notebooks at once
    (each in its own kernel and build path). Kernels are forked from one kernel server per kernel
    (``ci.processes.kernels``); runs go kernel by kernel, so a server is busy while it lives. ``kernels`` maps
    (release, environment) to a kernel name the caller wrote, instead of ``ci/environments.toml``'s.
    ``on_result`` is called with each result as it arrives (a caller that keeps each at once loses none to a
    later interruption). Results come back in the order of ``pairs``."""
    from ..processes import kernels as kernel_servers

    chosen = kernels or {}

    order = _run_order(pairs)
    results: dict[int, RunResult] = {}

    log = build / KERNEL_LOG

    def report(done: int, result: RunResult) -> None:
        _print_result(done, len(pairs), result, log)
        if on_result is not None:
            on_result(result)

    with kernel_servers.servers(log=log):
        if jobs <= 1:
            for done, index in enumerate(order, 1):
                entry, release, environment = pairs[index]
                print(f"[{done}/{len(pairs)}] {entry} on DeepSpeed {release} ({environment}) ...", flush=True)
                results[index] = run_one(entry, release, cell_timeout, build, environment,
                                         chosen.get((release, environment)))
                report(done, results[index])
        else:
            from concurrent.futures import ProcessPoolExecutor, as_completed

            from ..processes import zygote

            zygote.share()  # the workers start their kernels' servers from one zygote: torch imported once
            with ProcessPoolExecutor(max_workers=jobs) as pool:
                futures = {pool.submit(run_one, *pairs[index][:2], cell_timeout, build, pairs[index][2],
                                       chosen.get(pairs[index][1:])): index for index in order}
                for done, future in enumerate(as_completed(futures), 1):
                    results[futures[future]] = future.result()
                    report(done, results[futures[future]])
    ordered = [results[index] for index in range(len(pairs))]
    write_atomic(build / "results.json", json.dumps([r.to_json() for r in ordered], indent=2))
    return ordered


# ---- one matrix, several processes: each run is claimed by one of them --------------------------------------

CLAIMS = "claims"  # in a build that several processes fill together (run_matrix_together): who runs what


class _Claims:
    """Which process runs which run of a matrix that several processes share: ``<run>.claim`` holds the pid of
    the process that took it, ``<run>.json`` its result once recorded, ``<run>.error`` what the process raised
    instead (an error of the runner, not of the notebook). Every decision is taken under one lock."""

    def __init__(self, build: Path, pairs: list[tuple[str, str, str]]) -> None:
        self.directory = build / CLAIMS
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keys = [f"{entry}@{run_tag(release, environment)}" for entry, release, environment in pairs]

    def _path(self, index: int, suffix: str) -> Path:
        return self.directory / f"{self.keys[index]}{suffix}"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.directory / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def any_taken(self) -> bool:
        with self._locked():
            return any(self.directory.glob("*.claim"))

    def take(self, index: int) -> bool:
        """Claim run ``index`` for this process: True where nobody has, or where its claimant has ended without
        recording it (taken over)."""
        with self._locked():
            claim = self._path(index, ".claim")
            if claim.exists():
                if self._path(index, ".json").exists() or self._path(index, ".error").exists():
                    return False
                try:
                    os.kill(int(claim.read_text()), 0)
                    return False  # its claimant is running it
                except (ProcessLookupError, ValueError):
                    pass  # ended without a record: taken over
            claim.write_text(str(os.getpid()))
            return True

    def record(self, index: int, result: RunResult) -> None:
        write_atomic(self._path(index, ".json"), json.dumps(result.to_json()))

    def record_error(self, index: int, exc: BaseException) -> None:
        write_atomic(self._path(index, ".error"), f"{type(exc).__name__}: {exc}")

    def result(self, index: int) -> RunResult | None:
        """Run ``index``'s result, None while it is not recorded; raises RuntimeError with the claimant's error."""
        error = self._path(index, ".error")
        if error.exists():
            raise RuntimeError(f"the run of {self.keys[index]} failed in the process that took it: {error.read_text()}")
        done = self._path(index, ".json")
        return RunResult.from_json(json.loads(done.read_text())) if done.exists() else None

    def finished(self) -> int:
        return len(list(self.directory.glob("*.json")))


def _take_runs(pairs: list[tuple[str, str, str]], order: list[int], cell_timeout: float, build: Path) -> None:
    """Run, one after another, each run of ``order`` that this process can claim."""
    claims = _Claims(build, pairs)
    for index in order:
        if claims.take(index):
            _run_claimed(claims, pairs, index, cell_timeout, build)


def _run_claimed(claims: _Claims, pairs: list[tuple[str, str, str]], index: int, cell_timeout: float,
                 build: Path) -> None:
    entry, release, environment = pairs[index]
    try:
        result = run_one(entry, release, cell_timeout, build, environment)
    except BaseException as exc:
        claims.record_error(index, exc)
        raise
    claims.record(index, result)
    _print_result(claims.finished(), len(pairs), result, build / KERNEL_LOG)


def run_matrix_together(pairs: list[tuple[str, str, str]], cell_timeout: float, build: Path, jobs: int = 1,
                        poll_s: float = 0.5) -> list[RunResult]:
    """Run ``pairs`` into ``build`` together with every other process that calls this with the same ``build``
    and ``pairs`` (the pytest-xdist workers of one test run, which share the notebook matrix): the first process to
    reach a run claims it (``build/claims/``, under a lock) and runs it; each process runs what it claims, ``jobs``
    at once, then returns once every run is recorded, by whichever process ran it. So a process that comes late
    takes what is left, and none waits while runs are left to take. It takes them from the other end of the order
    (:func:`_run_order`), so that two processes seldom start a kernel server for the same kernel.

    A run whose claimant ended without recording it is taken over here. One whose claimant raised (an error of
    the runner: :func:`run_one` never raises for a notebook's failure) raises RuntimeError here with that error,
    without a second attempt. Results come back in the order of ``pairs``, as :func:`run_matrix`'s."""
    from ..processes import kernels as kernel_servers

    claims = _Claims(build, pairs)
    order = _run_order(pairs)
    if claims.any_taken():
        order.reverse()
    with kernel_servers.servers(log=build / KERNEL_LOG):
        if jobs <= 1:
            _take_runs(pairs, order, cell_timeout, build)
        else:
            from concurrent.futures import ProcessPoolExecutor

            with ProcessPoolExecutor(max_workers=jobs) as pool:
                for future in [pool.submit(_take_runs, pairs, order, cell_timeout, build) for _ in range(jobs)]:
                    future.result()
        results: dict[int, RunResult] = {}
        while len(results) < len(pairs):
            for index in range(len(pairs)):
                if index in results:
                    continue
                result = claims.result(index)
                if result is None and claims.take(index):  # its claimant ended without a record
                    _run_claimed(claims, pairs, index, cell_timeout, build)
                    result = claims.result(index)
                if result is not None:
                    results[index] = result
            if len(results) < len(pairs):
                time.sleep(poll_s)
    ordered = [results[index] for index in range(len(pairs))]
    write_atomic(build / "results.json", json.dumps([r.to_json() for r in ordered], indent=2))
    return ordered


# ---- shards: one part of the matrix per machine, and the parts merged back ---------------------------------

class MergeError(RuntimeError):
    """Builds that are not every part of one sharded matrix, or a part that lacks a run it was given."""


def _tag_key(tag: str) -> tuple[str, str]:
    """(release, environment) of a :func:`run_tag`."""
    from ..releases import environments as env_module

    release, _, environment = tag.partition("-")
    return release, environment or env_module.DEFAULT


def recorded_seconds(path: Path | None = None) -> dict[tuple[str, str, str], float]:
    """{(entry, release, environment): wall seconds} of each run ``--record`` kept (in ``path``, default
    :data:`SECONDS`); {} before the first."""
    path = path or SECONDS
    if not path.exists():
        return {}
    return {(entry, *_tag_key(tag)): float(seconds)
            for entry, runs in json.loads(path.read_text())["seconds"].items() for tag, seconds in runs.items()}


def record_seconds(results: list[RunResult], path: Path | None = None) -> None:
    """Keep each run's wall time in ``path`` (default :data:`SECONDS`; the latest of each run, the others kept),
    under the run history's lock: what ``--shard`` balances its parts by."""
    from fixes.files import locked
    from fixes.record import HISTORY

    path = path or SECONDS
    with locked(HISTORY):
        kept: dict[str, dict[str, float]] = {}
        for (entry, release, environment), seconds in recorded_seconds(path).items():
            kept.setdefault(entry, {})[run_tag(release, environment)] = seconds
        for result in results:
            kept.setdefault(result.entry, {})[run_tag(result.release, result.environment)] = result.wall_s
        rows = {entry: dict(sorted(runs.items())) for entry, runs in sorted(kept.items())}
        write_atomic(path, json.dumps({"seconds": rows}, indent=1) + "\n")


def shard_runs(pairs: list[tuple[str, str, str]], shard: shards.Shard,
               seconds: dict[tuple[str, str, str], float] | None = None) -> tuple[list[tuple[str, str, str]], str]:
    """The runs of ``pairs`` that part ``shard`` runs (:func:`ci.notebooks.shards.partition` by each run's recorded seconds,
    :func:`recorded_seconds` unless given), in the order of ``pairs``, and how the parts were balanced."""
    return shards.part(pairs, recorded_seconds() if seconds is None else seconds, shard)


def write_shard_file(build: Path, shard: shards.Shard, whole: list[tuple[str, str, str]],
                     mine: list[tuple[str, str, str]], method: str) -> Path:
    """``build/shard.json``: which part this build is, of which matrix, and its runs (what ``--merge`` checks)."""
    path = build / SHARD_FILE
    write_atomic(path, json.dumps({"shard": str(shard), "balanced_by": method, "matrix": [list(t) for t in whole],
                                   "runs": [list(t) for t in mine]}, indent=1) + "\n")
    return path


def merge(parts: list[Path], build: Path = BUILD) -> list[RunResult]:
    """The builds of every part of one sharded matrix (each a ``--shard`` build: ``shard.json``, ``results/``,
    ``executed/``) into ``build``, as the unsharded run writes it: each run's record (its executed copy pointing
    into ``build``), its executed notebook, ``results.json`` in the matrix's order, and the parts' ``kernels.log``
    one after the other. Raises
    :class:`MergeError` (or :class:`ci.notebooks.shards.ShardError`) naming a part missing or given twice, builds of
    different matrices or splits, or a run its part does not hold."""
    found: dict[int, tuple[Path, dict[str, Any]]] = {}
    for directory in parts:
        path = directory / SHARD_FILE
        if not path.is_file():
            raise MergeError(f"{directory} has no {SHARD_FILE}: not the build of `python -m ci.notebooks.runner --shard I/N`")
        manifest = json.loads(path.read_text())
        shard = shards.parse(manifest["shard"])
        if shard.index in found:
            raise MergeError(f"{found[shard.index][0]} and {directory} are both part {shard}")
        found[shard.index] = (directory, {**manifest, "count": shard.count})
    counts = sorted({manifest["count"] for _, manifest in found.values()})
    if len(counts) > 1:
        raise MergeError(f"the builds are parts of different splits (into {' and '.join(map(str, counts))} parts)")
    first = found[min(found)][1]["matrix"]
    for index, (directory, manifest) in sorted(found.items()):
        if manifest["matrix"] != first:
            raise MergeError(f"{directory} (part {index}/{counts[0]}) ran a part of another matrix than "
                             f"{found[min(found)][0]}: merge parts cut by the same checkout and options")
    whole = [tuple(run) for run in first]
    shards.check_complete({i: [tuple(r) for r in m["runs"]] for i, (_, m) in found.items()}, counts[0], whole,
                          "ci.notebooks.runner --merge")
    if build.resolve() in {directory.resolve() for directory in parts}:
        raise MergeError(f"--build {build} is one of the parts: merge into a directory of its own")
    owner = {tuple(run): directory for directory, manifest in found.values() for run in manifest["runs"]}
    results = []
    for entry, release, environment in whole:
        directory, tag = owner[(entry, release, environment)], run_tag(release, environment)
        source = directory / "results" / entry / f"{tag}.json"
        if not source.is_file():
            raise MergeError(f"{directory} has no record of {entry} on {tag}, a run of its part (was it interrupted?)")
        result = RunResult.from_json(json.loads(source.read_text()))
        executed = build / "executed" / tag / f"{entry}.ipynb"
        ran = directory / "executed" / tag / f"{entry}.ipynb"
        if ran.is_file():
            executed.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ran, executed)
        result.executed = str(executed)
        write_atomic(build / "results" / entry / f"{tag}.json", json.dumps(result.to_json(), indent=2))
        results.append(result)
    write_atomic(build / "results.json", json.dumps([r.to_json() for r in results], indent=2))
    logs = [(index, directory / KERNEL_LOG) for index, (directory, _) in sorted(found.items())
            if (directory / KERNEL_LOG).is_file()]
    if logs:  # the kernels' own output, part after part
        write_atomic(build / KERNEL_LOG, "".join(f"== part {index}/{counts[0]} ==\n"
                                                 + log.read_text(errors="replace") for index, log in logs))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ci.notebooks.runner", description=__doc__.splitlines()[0])
    parser.add_argument("--entry", action="append", help="entry id (repeatable; default: all)")
    parser.add_argument("--release", action="append", help="only these releases (repeatable)")
    parser.add_argument("--env", action="append", help="only these environments (repeatable; cpu is the project venv, all: every one; default: every one)")
    parser.add_argument("--cell-timeout", type=float, default=300, help="seconds per cell (default 300)")
    parser.add_argument("--build", type=Path, default=BUILD)
    parser.add_argument("--jobs", type=int, default=1, help="notebooks run at once (default 1)")
    parser.add_argument("--record", action="store_true",
                        help="also keep each run's verdict in fixes/data/runs.json (the run history the entry "
                             "cards and the GPU status are derived from) and its seconds in "
                             "ci/data/notebook_seconds.json (what --shard balances by)")
    parser.add_argument("--shard", metavar="I/N",
                        help="run only part I of N of the matrix (balanced by each run's recorded seconds); "
                             "writes shard.json into --build for --merge")
    parser.add_argument("--merge", nargs="+", type=Path, metavar="DIR",
                        help="run nothing: merge the builds of every part of a sharded run (--shard) into --build")
    args = parser.parse_args(argv)
    if args.merge:
        if args.entry or args.release or args.env or args.shard:
            print("error: --merge takes the parts' builds (and --build, --record) only: which runs they hold is "
                  "in their shard.json", file=sys.stderr)
            return 2
        try:
            results = merge(args.merge, args.build)
        except (MergeError, shards.ShardError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"merged {len(args.merge)} parts into {args.build}: {len(results)} runs")
    else:
        try:
            shard = shards.parse(args.shard) if args.shard else None
            pairs = matrix(args.entry, args.release, args.env)
        except (KeyError, ValueError, FileNotFoundError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if shard is not None:
            whole = pairs
            pairs, method = shard_runs(whole, shard)
            write_shard_file(args.build, shard, whole, pairs, method)
            print(f"shard {shard}: {len(pairs)} of the matrix's {len(whole)} runs (parts balanced by {method})",
                  flush=True)
        results = run_matrix(pairs, args.cell_timeout, args.build, args.jobs)
    if args.record:
        import datetime as dt

        from fixes.record import record_runs, summarize

        record_runs(summarize(result, dt.date.today().isoformat()) for result in results)
        record_seconds(results)
    failed = [r for r in results if r.status != "passed"]
    for result in failed:
        print(f"FAILED: {result.notebook} on {result.kernel}, cell {result.failed_cell}: {result.error}\n"
              f"        executed copy: {result.executed}", file=sys.stderr)
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
