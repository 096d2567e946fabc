import json

from fixes.harness import Report, compare, print_table
from fixes.record import Check, Reproduction, RunRecord, RunResult


def test_when_results_file_given_then_every_record_call_rewrites_it(tmp_path):
    path = tmp_path / "sub" / "record.json"
    report = Report("entry-x", str(path))
    report.record_environment({"deepspeed": "0.18.9"}, affected=True)
    assert json.loads(path.read_text())["affected"] is True
    report.record_reproduced("error", "boom" * 200)
    report.record_verified(compare([1.0, 2.0], [1.0, 2.5], "float32", "params"))
    record = json.loads(path.read_text())
    assert len(record["reproduced"]["detail"]) == 500
    assert record["verified"] == [{"name": "params", "dtype": "float32", "max_abs_diff": 0.5, "close": False}]
    assert report.max_abs_diff_by_dtype == {"float32": 0.5}
    assert RunRecord.from_json(record) == report.record
    assert report.record.verdict == "reproduced, fix not verified"  # the one check was not close


def test_when_record_read_back_then_the_verdict_is_computed_from_it():
    record = RunRecord("entry-x", affected=True, reproduced=Reproduction("difference", "params", 0.3),
                       verified=[Check("params", "float32", 1e-7, True)])
    assert RunRecord.from_json(json.loads(json.dumps(record.to_json()))).verdict == "reproduced → fixed"
    assert RunRecord("entry-x", affected=False).verdict == "not affected"
    assert RunRecord("entry-x", affected=True).verdict == "not reproduced"
    result = RunResult("entry-x", "0.18.9", "k", "n", "e", "failed", 1.0, error="boom", record=record)
    assert result.verdict == "notebook failed" and RunResult.from_json(result.to_json()) == result


def test_when_no_results_file_then_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Report("entry-x").record_environment({}, affected=False)
    assert list(tmp_path.iterdir()) == []


def test_when_rows_printed_then_columns_align(capsys):
    print_table([{"ZeRO": 1, "result": "trained"}, {"ZeRO": 2, "result": "RuntimeError"}])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("ZeRO  result")
    assert lines[3] == "2     RuntimeError"
