"""Sharding changes nothing: the parts of a run are cut deterministically (balanced by recorded seconds, by count
where one is unknown), each unit is in exactly one part, and merging the parts' outputs gives the records and
files of the unsharded run, for the notebook matrix (real notebooks) and for the sweep."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import nbformat
import pytest

from ci.notebooks import claims, runner, shards
from ci import sweep
from fixes import measured
from tests.helpers import made_once


# ---- the partition -------------------------------------------------------------------------------------------

def test_when_every_duration_is_recorded_then_the_longest_go_first_each_to_the_least_loaded_part():
    seconds = {"a": 10.0, "b": 9.0, "c": 8.0, "d": 4.0, "e": 3.0, "f": 3.0, "g": 0.0}
    parts, method = shards.partition(list("abcdefg"), seconds, 3)
    assert method == shards.BY_SECONDS
    # a, b, c open the parts; d joins the lightest (8), e the next (9), f the next (10); g (0 s) ties at 12 s
    # between parts 2 and 3, each with two units: the lower part number takes it
    assert parts == [["a", "f"], ["b", "e", "g"], ["c", "d"]]
    assert [sum(seconds[u] for u in part) for part in parts] == [13.0, 12.0, 12.0]


def test_when_a_duration_is_unknown_then_the_units_are_dealt_round_robin_in_sorted_order():
    parts, method = shards.partition(["e", "a", "d", "b", "c"], {"a": 1.0, "b": None}, 2)
    assert method == shards.BY_COUNT
    assert parts == [["e", "a", "c"], ["d", "b"]]  # a, c, e and b, d: each part in the order given


@pytest.mark.parametrize("count", [1, 2, 3, 5, 9])
def test_when_units_come_in_another_order_then_every_part_holds_the_same_units_and_each_unit_is_in_one(count):
    units = [(f"entry-{i % 7}", f"0.1{i % 4}.{i}", "cpu") for i in range(23)]
    seconds = {unit: float((len(unit[0]) * 7 + int(unit[1].split(".")[-1]) * 3) % 11) for unit in units}
    parts, _ = shards.partition(units, seconds, count)
    again, _ = shards.partition(list(reversed(units)), seconds, count)
    assert [sorted(p) for p in parts] == [sorted(p) for p in again]
    assert sorted(u for p in parts for u in p) == sorted(units)
    loads = [sum(seconds[u] for u in p) for p in parts]
    assert max(loads) - min(loads) <= max(seconds.values())  # greedy longest-first: within one unit's length


@pytest.mark.parametrize("text", ["0/3", "4/3", "a/b", "3", "1/0", ""])
def test_when_a_shard_is_not_i_of_n_then_the_error_says_what_is_expected(text):
    with pytest.raises(shards.ShardError, match="I/N"):
        shards.parse(text)


def test_when_parts_miss_one_or_share_a_unit_then_the_check_names_it():
    with pytest.raises(shards.ShardError, match="parts 2/3 missing"):
        shards.check_complete({1: ["a"], 3: ["b"]}, 3, ["a", "b"], "merge")
    with pytest.raises(shards.ShardError, match='"a" is in part 1/2 and in part 2/2'):
        shards.check_complete({1: ["a"], 2: ["a", "b"]}, 2, ["a", "b"], "merge")
    with pytest.raises(shards.ShardError, match='in no part: "c"'):
        shards.check_complete({1: ["a"], 2: ["b"]}, 2, ["a", "b", "c"], "merge")


def test_when_the_runner_shards_the_matrix_then_every_run_is_in_exactly_one_part_balanced_by_its_seconds():
    matrix = runner.matrix()
    seconds = {run: 5.0 + (i * 37 % 13) for i, run in enumerate(matrix)}
    parts = [runner.shard_runs(matrix, shards.Shard(i, 4), seconds) for i in range(1, 5)]
    assert {method for _, method in parts} == {shards.BY_SECONDS}
    assert sorted(run for part, _ in parts for run in part) == sorted(matrix)
    for part, _ in parts:  # each part in the matrix's order
        assert part == [run for run in matrix if run in part]
    loads = [sum(seconds[run] for run in part) for part, _ in parts]
    assert max(loads) - min(loads) <= max(seconds.values())
    unknown = dict(seconds)
    unknown.pop(matrix[0])
    assert runner.shard_runs(matrix, shards.Shard(1, 4), unknown)[1] == shards.BY_COUNT


def test_when_runs_are_recorded_then_their_seconds_read_back_keyed_by_run(tmp_path):
    from fixes.record import RunResult

    path = tmp_path / "seconds.json"
    runner.record_seconds([RunResult("x", "0.18.9", "k", "nb", "out", "passed", 12.5),
                           RunResult("x", "0.18.9", "k", "nb", "out", "passed", 30.0, environment="colab-shape")], path)
    runner.record_seconds([RunResult("y", "0.19.8", "k", "nb", "out", "failed", 3.0)], path)
    assert runner.recorded_seconds(path) == {("x", "0.18.9", "cpu"): 12.5, ("x", "0.18.9", "colab-shape"): 30.0,
                                             ("y", "0.19.8", "cpu"): 3.0}


# ---- the notebook matrix: sharded, merged, equal to the unsharded run --------------------------------------

SMALL = ["gradient-clipping-default-1", "warmup-cosine-lr-param-groups"]  # two fast notebooks, 4 runs on cpu
SMALL_ARGS = [arg for entry in SMALL for arg in ("--entry", entry)] + ["--env", "cpu"]


def files(build: Path) -> list[str]:
    return sorted(str(path.relative_to(build)) for path in build.rglob("*") if path.is_file())


def records(build: Path) -> dict[str, object]:
    """Every record of ``build`` (and results.json) with what differs between two runs of the same notebook on
    the same machine made equal: the wall time, and the build directory in the executed copy's path."""
    def normal(data: dict) -> dict:
        return {**data, "wall_s": 0.0, "executed": str(Path(data["executed"]).relative_to(build))}

    found: dict[str, object] = {str(p.relative_to(build)): normal(json.loads(p.read_text()))
                                for p in sorted((build / "results").glob("*/*.json"))}
    found["results.json"] = [normal(data) for data in json.loads((build / "results.json").read_text())]
    return found


def notebook(path: Path, build: Path) -> list[tuple[str, str, str]]:
    """An executed notebook's cells as (type, source, outputs), every output as nbval compares it through the
    project's sanitize file (``ci.notebooks.claims.shown``: DeepSpeed's time-stamped log lines dropped), the build path
    left out."""
    patterns = claims.sanitize_patterns()
    return [(cell.cell_type, cell.source.replace(str(build), "BUILD"),
             json.dumps(claims.shown(cell, patterns) if cell.cell_type == "code" else {}).replace(str(build), "BUILD"))
            for cell in nbformat.read(path, as_version=4).cells]


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory):
    def make(build):
        assert runner.main([*SMALL_ARGS, "--build", str(build)]) == 0
        return build

    return made_once(tmp_path_factory, "unsharded", make)


@pytest.mark.notebooks
@pytest.mark.parametrize("count", [1, 2, 3])
def test_when_the_matrix_runs_in_parts_and_they_are_merged_then_records_and_files_are_the_unsharded_run_s(
        count, unsharded, tmp_path, monkeypatch, capsys):
    # the parts are balanced by the seconds the unsharded run recorded (a file of this test's own)
    monkeypatch.setattr(runner, "SECONDS", tmp_path / "seconds.json")
    runner.record_seconds(runner.recorded_runs(unsharded))
    parts = [tmp_path / f"part-{i}" for i in range(1, count + 1)]
    for i, part in enumerate(parts, 1):
        assert runner.main([*SMALL_ARGS, "--shard", f"{i}/{count}", "--build", str(part)]) == 0
    assert "parts balanced by recorded seconds" in capsys.readouterr().out
    ran = [tuple(run) for part in parts for run in json.loads((part / runner.SHARD_FILE).read_text())["runs"]]
    assert sorted(ran) == sorted(runner.matrix(SMALL, environments=["cpu"]))  # each run in one part, none twice

    merged = tmp_path / "merged"
    assert runner.main(["--merge", *map(str, parts), "--build", str(merged)]) == 0
    assert files(merged) == files(unsharded)
    assert records(merged) == records(unsharded)
    for name in files(merged):
        if name.endswith(".ipynb"):
            tag, entry = Path(name).parent.name, Path(name).name
            part = next(p for p in parts if (p / "executed" / tag / entry).exists())
            assert (merged / name).read_bytes() == (part / "executed" / tag / entry).read_bytes()
            assert notebook(merged / name, part) == notebook(unsharded / name, unsharded), name
    # what the site and the claims check read: the merged runs, their executed copies inside the merged build
    assert [runner.executed_notebook(r).is_relative_to(merged) for r in runner.recorded_runs(merged)] == [True] * 4


def test_when_merge_gets_an_incomplete_or_mixed_set_of_parts_then_it_refuses_naming_the_part(tmp_path, capsys):
    matrix = [["a", "0.19.8", "cpu"], ["b", "0.19.8", "cpu"], ["c", "0.18.9", "cpu"]]

    def part(name: str, shard: str, runs: list, whole: list = matrix) -> Path:
        directory = tmp_path / name
        directory.mkdir()
        (directory / runner.SHARD_FILE).write_text(json.dumps({"shard": shard, "matrix": whole, "runs": runs}))
        return directory

    one, two, three = part("1", "1/3", matrix[:1]), part("2", "2/3", matrix[1:2]), part("3", "3/3", matrix[2:])
    assert runner.main(["--merge", str(one), str(three), "--build", str(tmp_path / "out")]) == 2
    assert "parts 2/3 missing" in capsys.readouterr().err
    assert runner.main(["--merge", str(one), str(one), str(two), "--build", str(tmp_path / "out")]) == 2
    assert "are both part 1/3" in capsys.readouterr().err
    other = part("other", "3/3", [["c", "0.18.9", "cpu"]], matrix + [["d", "0.18.9", "cpu"]])
    assert runner.main(["--merge", str(one), str(two), str(other), "--build", str(tmp_path / "out")]) == 2
    assert "another matrix" in capsys.readouterr().err
    assert runner.main(["--merge", str(one), str(two), str(three), "--build", str(tmp_path / "out")]) == 2
    assert "has no record of a on 0.19.8" in capsys.readouterr().err
    assert runner.main(["--merge", str(tmp_path), "--build", str(tmp_path / "out")]) == 2
    assert "has no shard.json" in capsys.readouterr().err
    assert runner.main(["--shard", "4/3"]) == 2
    assert "1 <= I <= N" in capsys.readouterr().err


# ---- the sweep: sharded, merged, equal to the unsharded sweep -------------------------------------------------

ENTRIES = ["gradient-clipping-default-1", "warmup-cosine-lr-param-groups", "fp16-zero0-loss-scale"]


def fake_child(release: str, entries: list[str], timeout: float) -> tuple[dict, str]:
    """A release's child as the sweep sees it, answering at once: whether each entry shows depends on the pair."""
    answers = {}
    for entry in entries:
        shows = (len(entry) + int(release.split(".")[-1])) % 2 == 0
        answers[entry] = {"entry": entry, "probe": shows, "reproduced": shows, "evidence": f"{entry}@{release}",
                          "done": True, "seconds": float(len(entry) % 5 + 1),
                          **({"fix": "fixed", "fix_reason": "applied"} if shows else {})}
    return answers, ""


def _sweep_args(releases: list[str], out: Path) -> list[str]:
    return [*(a for e in ENTRIES for a in ("--entry", e)), *(a for r in releases for a in ("--release", r)),
            "--jobs", "1", "--out", str(out)]


def _normal(path: Path) -> dict:
    data = json.loads(path.read_text())
    for run in ("last_run", "full_run"):
        data[run] = {k: v for k, v in data[run].items() if k not in ("at", "wall_s")}
    return data


@pytest.fixture
def base(tmp_path, monkeypatch):
    """A small sweep file (every entry on 0.18.9 and 0.19.3 with recorded seconds) and a sweep that measures at
    once (the fake child above) and installs nothing."""
    monkeypatch.setattr(sweep, "run_child", fake_child)
    monkeypatch.setattr(sweep, "install_releases", lambda chosen, jobs: {})
    rows = {sweep.Pair(e, r): measured.Observation(r, "not affected", probe=False, reproduced=False, seconds=2.0)
            for e in ENTRIES for r in ("0.18.9", "0.19.3")}
    path = tmp_path / "base.json"
    measured.write(sweep.merge(measured.SweepData(releases=[], results={}), rows, ["0.18.9", "0.19.3"], {"at": "x"}),
                   path)
    return path


@pytest.mark.parametrize(("releases", "count", "balanced_by"), [
    (["0.18.9", "0.19.3", "0.19.8"], 1, "count"),  # 0.19.8 has no recorded seconds in the base file
    (["0.18.9", "0.19.3"], 2, "recorded seconds"),  # whole releases, by their rows' seconds
    (["0.18.9", "0.19.3", "0.19.8"], 3, "count"),
    (["0.19.9"], 3, "count"),  # one new release: its (release, entry) pairs are cut, so every part has work
])
def test_when_a_sweep_runs_in_parts_and_they_are_merged_then_the_file_is_the_unsharded_sweep_s(
        base, tmp_path, releases, count, balanced_by):
    whole = tmp_path / "unsharded.json"
    shutil.copy(base, whole)
    assert sweep.main(_sweep_args(releases, whole)) == 0
    parts = []
    for i in range(1, count + 1):
        parts.append(tmp_path / f"part-{i}.json")
        shutil.copy(base, parts[-1])
        assert sweep.main([*_sweep_args(releases, parts[-1]), "--shard", f"{i}/{count}"]) == 0
        shard = measured.read(parts[-1]).last_run["shard"]
        assert shard["balanced_by"] == balanced_by and shard["rows"]
    merged = tmp_path / "merged.json"
    shutil.copy(base, merged)
    assert sweep.main(["--merge", *map(str, parts), "--out", str(merged)]) == 0
    assert _normal(merged) == _normal(whole)
    assert measured.read(merged).last_run["runs"] == len(ENTRIES) * len(releases)


def test_when_sweep_parts_are_missing_twice_or_unfinished_then_the_merge_refuses(base, tmp_path, capsys):
    parts = []
    for i in (1, 2):
        parts.append(tmp_path / f"part-{i}.json")
        shutil.copy(base, parts[-1])
        assert sweep.main([*_sweep_args(["0.18.9", "0.19.3"], parts[-1]), "--shard", f"{i}/2"]) == 0
    out = tmp_path / "out.json"
    shutil.copy(base, out)
    assert sweep.main(["--merge", str(parts[0]), "--out", str(out)]) == 2
    assert "parts 2/2 missing" in capsys.readouterr().err
    assert sweep.main(["--merge", str(parts[0]), str(parts[0]), "--out", str(out)]) == 2
    assert "are both part 1/2" in capsys.readouterr().err
    assert sweep.main(["--merge", str(base), "--out", str(out)]) == 2
    assert "holds no finished part" in capsys.readouterr().err
    other = tmp_path / "other.json"
    shutil.copy(base, other)
    assert sweep.main([*_sweep_args(["0.18.9"], other), "--shard", "2/2"]) == 0
    assert sweep.main(["--merge", str(parts[0]), str(other), "--out", str(out)]) == 2
    assert "a part of another sweep" in capsys.readouterr().err
    assert out.read_text() == base.read_text()  # a refused merge writes nothing
