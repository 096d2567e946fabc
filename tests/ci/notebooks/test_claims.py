"""The claim cells (nbval's ``nbval-check-output``), the shared sanitize file, and the committed references."""
import re

import nbformat
import pytest

import fixes
from ci.notebooks import claims, runner
from ci import site


def _executed(tmp_path, text: str, tagged: bool = True):
    claim = nbformat.v4.new_code_cell("print(verdict)", id="claim01", metadata={"tags": [claims.TAG]} if tagged else {})
    claim.outputs = [nbformat.v4.new_output("stream", name="stdout", text=text),
                     nbformat.v4.new_output("stream", name="stderr", text="UserWarning: machine-specific\n")]
    setup = nbformat.v4.new_code_cell("import x", id="setup01")
    setup.outputs = [nbformat.v4.new_output("stream", name="stdout", text="whatever\n")]
    path = tmp_path / "executed.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[setup, claim]), path)
    return path


def test_when_a_claim_in_the_reference_is_changed_then_the_check_fails_naming_the_cell_and_both_texts(tmp_path):
    executed = _executed(tmp_path, "Reproduced: KeyError: 0 at engine.step()\nmax abs diff 1.234e-02\n")
    reference = claims.claims(executed)
    assert claims.compare("e", "0.18.2-cpu", claims.claims(executed), reference) == []
    changed = {cell: {**found, "shown": {"stdout": [["Reproduced: KeyError: 1 at engine.step()\n", "max abs diff ~e-02\n"]]}}
               for cell, found in reference.items()}
    [mismatch] = claims.compare("e", "0.18.2-cpu", claims.claims(executed), changed)
    text = str(mismatch)
    assert "e on 0.18.2-cpu, cell 1 (id claim01): print(verdict)" in text
    assert "-Reproduced: KeyError: 1 at engine.step()" in text and "+Reproduced: KeyError: 0 at engine.step()" in text


def test_when_outputs_differ_only_in_what_the_sanitize_file_masks_then_the_claims_are_equal(tmp_path):
    one = claims.claims(_executed(tmp_path, f"[2026-11-24 06:19:54,791] [WARNING] [engine.py:1] x\n"
                                            "/tmp/tmpab12/ckpt saved; Δ 1.51e-02 at 0x7f0252143af0\n"))
    two = claims.claims(_executed(tmp_path, "/scratch/tmp/other/x/lib/python3.12/site-packages/deepspeed\n"
                                            "/var/tmp/tmpzz99/ckpt saved; Δ 1.49e-02 at 0x7f0000000000\n"))
    assert one["claim01"]["shown"]["stdout"] == [["ckpt saved; Δ ~e-02 at 0x…\n"]]
    assert two["claim01"]["shown"]["stdout"] == [["site-packages/deepspeed\n", "ckpt saved; Δ ~e-02 at 0x…\n"]]
    assert "stderr" not in one["claim01"]["shown"], "stderr is chatter, never a claim"


def test_when_two_cpus_round_below_every_tolerance_differently_then_the_claims_are_equal(tmp_path):
    # What two machines printed for one run (AVX2 and AVX-512 kernels): the same verdicts, other last bits.
    one = claims.claims(_executed(tmp_path, "ZeRO-2 float32   4.768e-07   yes\n"
                                            "grad norm: DeepSpeed [0.6462189555168152] plain [0.8537516593933105]\n"
                                            "max abs diff 1.2e-08 (within float32 tolerance rtol=1.3e-06, atol=1e-05)\n"))
    two = claims.claims(_executed(tmp_path, "ZeRO-2 float32   5.960e-08   yes\n"
                                            "grad norm: DeepSpeed [0.64621901512146] plain [0.8537515997886658]\n"
                                            "max abs diff 9.3e-09 (within float32 tolerance rtol=1.3e-06, atol=1e-05)\n"))
    assert claims.compare("e", "r", two, one) == []
    assert one["claim01"]["shown"]["stdout"] == [["ZeRO-2 float32   <1e-05   yes\n",
                                                  "grad norm: DeepSpeed [0.6462…] plain [0.8537…]\n",
                                                  "max abs diff (within float32 tolerance rtol=~e-06, atol=1e-05)\n"]]
    # A difference of 1e-05 or more is outside some dtype's tolerance: its order of magnitude stays a claim, and so
    # do a float's first four decimals.
    bigger = claims.claims(_executed(tmp_path, "ZeRO-2 float32   1.192e-05   yes\n"
                                               "grad norm: DeepSpeed [0.6463189555168152] plain [0.8537516593933105]\n"
                                               "max abs diff 1.2e-08 (within float32 tolerance rtol=1.3e-06, atol=1e-05)\n"))
    [mismatch] = claims.compare("e", "r", bigger, one)
    assert "+ZeRO-2 float32   ~e-05   yes" in str(mismatch) and "+grad norm: DeepSpeed [0.6463…]" in str(mismatch)


def test_when_a_cell_is_not_tagged_then_it_is_not_a_claim(tmp_path):
    assert claims.claims(_executed(tmp_path, "x\n", tagged=False)) == {}


def test_when_the_sanitize_file_drops_log_lines_then_they_are_the_lines_the_site_drops():
    rules = claims.chatter()
    assert len(rules) >= 2, "the log-line and memory-report rules of docs/nbval-sanitize.cfg"
    assert site.CHATTER == rules  # one statement of what is chatter: the sanitize file's
    text = ("[2026-11-24 06:19:54,791] [INFO] [engine.py:1] x\nMA 0.0 GB  Max_MA 0.0 GB  CA 0.0 GB\n"
            "Δ 1.51e-02\n/usr/bin/ld: cannot find -laio\n")
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "", outputs=[nbformat.v4.new_output("stream", name="stdout", text=text)])])
    assert site.clean_outputs(notebook).cells[0].outputs[0]["text"] == "Δ 1.51e-02\n"
    assert claims.sanitize(text, claims.sanitize_patterns()) == "Δ ~e-02\n"


@pytest.mark.parametrize("entry", fixes.available())
def test_when_a_notebook_is_stored_then_it_has_claim_cells_and_a_reference_for_each_run_of_its_matrix(entry):
    notebook = nbformat.read(runner.notebook_path(entry), as_version=4)
    tagged = {cell.id for _, cell in claims.claim_cells(notebook)}
    assert tagged, f"{entry}: no cell tagged {claims.TAG}"
    for cell in notebook.cells:
        tags = set(cell.get("metadata", {}).get("tags", []))
        assert not (claims.TAG in tags and tags & {"colab-setup", "parameters", "entry-card"}), (entry, cell.id)
    for _, release, environment in [run for run in runner.matrix([entry])]:
        reference = claims.load_reference(entry, release, environment)
        assert set(reference) == tagged, (f"{entry} on {release}-{environment}: the reference covers "
                                          f"{sorted(reference)}, the notebook tags {sorted(tagged)}: "
                                          "`python -m ci.notebooks.claims refresh` after its run")


def test_when_a_reference_is_missing_then_the_error_says_how_to_make_it(tmp_path):
    with pytest.raises(claims.ClaimsError, match=re.escape("python -m ci.notebooks.claims refresh")):
        claims.load_reference("zero2-offload-grad-accum", "0.18.9", "cpu", root=tmp_path)


def test_when_refresh_names_an_entry_then_only_that_entrys_reference_is_written(tmp_path, monkeypatch):
    executed = _executed(tmp_path, "Reproduced: KeyError: 0\n")
    runs = [("one", "0.18.2", "cpu", executed), ("two", "0.18.2", "cpu", executed)]
    monkeypatch.setattr(claims, "_passed_runs", lambda build: runs)
    monkeypatch.setattr(claims, "notebook_path", lambda entry: executed)
    root = tmp_path / "refs"
    (root).mkdir()
    (root / "two.json").write_text("{}\n")
    assert claims.refresh(tmp_path, root, entries=["one"]) == [root / "one.json"]
    assert "0.18.2-cpu" in (root / "one.json").read_text()
    assert (root / "two.json").read_text() == "{}\n"


def test_when_a_sanitize_rule_is_newer_than_a_reference_then_it_applies_to_the_reference_too(tmp_path):
    now = claims.sanitize_patterns()
    before = [(regex, replacement) for regex, replacement in now if "within" not in regex]  # without the noise rule
    assert len(before) == len(now) - 1
    recorded = claims.claims(_executed(tmp_path, "weights: max abs diff 7.451e-09 (within float32 tolerance)\n"), patterns=before)
    later = claims.claims(_executed(tmp_path, "weights: max abs diff 1.490e-08 (within float32 tolerance)\n"), patterns=now)
    assert claims.compare("e", "r", later, recorded), "as recorded, the reference keeps the order of magnitude"
    assert claims.compare("e", "r", later, claims.resanitized(recorded, now)) == []
    outside = claims.claims(_executed(tmp_path, "weights: max abs diff 1.490e-02 (outside float32 tolerance)\n"), patterns=now)
    assert claims.compare("e", "r", outside, claims.resanitized(recorded, now))
