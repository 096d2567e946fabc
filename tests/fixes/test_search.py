"""fixbook search: the whole paste, weighed; a labelled query set of real error output and unrelated errors."""
import io
import json
from pathlib import Path

import fixes
from fixes import registry
from fixes import search as search_module
from fixes.cli import main, search

QUERIES = json.loads((Path(__file__).parent / "data" / "search_queries.json").read_text())


def top(query: dict):
    found = search(query["query"], query.get("release"))
    return found[0] if found else None


def test_when_the_labelled_queries_are_searched_then_each_entry_error_finds_its_entry_and_no_unrelated_one_is_strong():
    related = [q for q in QUERIES if q["expect"]]
    unrelated = [q for q in QUERIES if not q["expect"]]
    assert len(QUERIES) >= 40 and len(unrelated) >= 15
    assert {q["expect"] for q in related} <= set(fixes.available())
    answers = {q["name"]: top(q) for q in QUERIES}
    # "also": other entries that explain the very same text, where nothing in it tells them apart
    correct = [q for q in related if answers[q["name"]] and answers[q["name"]].fix_id in [q["expect"], *q.get("also", [])]]
    strong = [q for q in QUERIES if answers[q["name"]] and answers[q["name"]].level == "strong"]
    strong_right = [q for q in strong if answers[q["name"]].fix_id in [q["expect"], *q.get("also", [])]]
    silent = [q for q in unrelated if answers[q["name"]] is None]
    print(f"\nsearch over {len(QUERIES)} labelled queries: top-1 recall {len(correct)}/{len(related)} entry errors; "
          f"precision of 'strong' {len(strong_right)}/{len(strong)}; unrelated: {len(silent)}/{len(unrelated)} "
          f"'no match', {sum(1 for q in unrelated if q in strong)} 'strong'")
    wrong = {q["name"]: (answers[q["name"]].fix_id if answers[q["name"]] else None) for q in related if q not in correct}
    assert not wrong, f"top-1 is not the entry whose notebook printed it: {wrong}"
    weak = [q["name"] for q in related if q["level"] == "strong" and answers[q["name"]].level != "strong"]
    assert not weak, f"a traceback with the entry's error and frames should be a strong match: {weak}"
    cried = {q["name"]: answers[q["name"]].fix_id for q in unrelated if q in strong}
    assert not cried, f"unrelated errors answered 'strong': {cried}"


def test_when_a_traceback_is_parsed_then_rank_prefixes_go_and_deepspeed_frames_are_kept():
    paste = search_module.parse('[rank1]: Traceback (most recent call last):\n'
                                '[rank1]:   File "/opt/venv/lib/python3.12/site-packages/deepspeed/runtime/zero/'
                                'stage_1_and_2.py", line 1476, in reduce_ipg_grads\n'
                                '[rank1]:   File "/home/u/train.py", line 3, in <module>\n'
                                '[rank1]: IndexError: list index out of range')
    assert paste.frames == (("deepspeed/runtime/zero/stage_1_and_2.py", "reduce_ipg_grads"),)
    assert paste.exceptions == (("IndexError", "list index out of range"),) and paste.has_traceback
    assert "[rank1]" not in paste.text


def test_when_a_signature_is_a_message_any_library_raises_then_it_is_generic():
    assert search_module.is_generic("KeyError: 0")
    assert search_module.is_generic("IndexError: list index out of range")
    assert search_module.is_generic("Fatal Python error: Segmentation fault")
    assert not search_module.is_generic("Output 0 of SplitBackward0 is a view and is being modified inplace")
    assert not search_module.is_generic("bucket.buffer: [], bucket.index: 0, bucket.elements: 0")


def test_when_a_generic_error_comes_from_other_code_then_no_match_and_alone_only_possible():
    elsewhere = ('Traceback (most recent call last):\n  File "/x/site-packages/transformers/tokenization_utils_fast.py", '
                 'line 528, in _batch_encode_plus\nIndexError: list index out of range')
    assert search(elsewhere) == []
    [*found] = search("IndexError: list index out of range")
    assert found and all(m.level == "possible" for m in found)


def test_when_the_release_is_measured_unaffected_then_the_entry_drops_a_level_and_says_so():
    line = "Output 0 of SplitBackward0 is a view and is being modified inplace"
    [affected] = [m for m in search(line, "0.18.9") if m.fix_id == "zero12-flat-buffer-detach"]
    [unaffected] = [m for m in search(line, "0.16.0") if m.fix_id == "zero12-flat-buffer-detach"]
    assert affected.level == "strong" and "measured affected on DeepSpeed 0.18.9" in affected.release_note
    assert unaffected.level == "possible" and "measured not affected on DeepSpeed 0.16.0" in unaffected.release_note


def test_when_a_traceback_is_piped_then_search_reads_stdin(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("RuntimeError: Output 0 of SplitBackward0 is a view and is being "
                                                 "modified inplace. This view is the output of a function"))
    assert main(["search", "-", "--release", "0.18.9"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("strong") and "zero12-flat-buffer-detach" in out and "why:" in out


def test_when_an_unrelated_error_is_searched_then_the_cli_says_no_match(capsys):
    assert main(["search", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."]) == 1
    assert "no match" in capsys.readouterr().err


def test_when_a_paste_names_an_entrys_code_beside_its_error_then_the_match_says_so():
    fix = next(f for f in fixes.all_fixes() if search_module.evidence(f).names and search_module.evidence(f).specific)
    known = search_module.evidence(fix)
    name = sorted(known.names)[0]
    found = search_module.match(search_module.parse(f"{known.specific[0]}\nwhile running {name}"), known)
    assert any("its code is named" in why for why in found.why), found.why
    plain = search_module.match(search_module.parse(known.specific[0]), known)
    assert found.score == plain.score + 0.5


def test_when_a_paste_shares_only_a_python_message_template_with_an_entry_then_it_is_not_strong():
    signature = "ValueError: invalid literal for int() with base 10: '9.0a' in compute_capability_args of the op builder"
    known = search_module.Evidence("an-entry", (signature,), (), (), frozenset(), frozenset(), frozenset(),
                                   error_lines=(search_module.error_line_words(signature.split(": ", 1)[1]),))
    python_error = search_module.match(search_module.parse("ValueError: invalid literal for int() with base 10: 'abc'"),
                                       known)
    assert python_error.level == "no match", python_error.why
    part = search_module.match(search_module.parse("in compute_capability_args of the op builder"), known)
    assert part.level == "strong" and "compute_capability_args of the op builder" in part.why[0], part.why
    assert search_module.match(search_module.parse(signature), known).level == "strong"


def test_when_a_report_names_another_scheduler_than_the_entrys_then_its_error_text_is_only_possible():
    error = "ZeroDivisionError: float division by zero"
    cosine = {m.fix_id: m for m in search(f"WarmupCosineLR\n{error}")}["warmup-cosine-lr-zero-division"]
    assert cosine.level == "strong", cosine.why
    decay = {m.fix_id: m for m in search(f"scheduler WarmupDecayLR, warmup_num_steps 1\n{error}")}
    assert decay["warmup-cosine-lr-zero-division"].level == "possible"
    assert ("but the text names scheduler WarmupDecayLR, and this entry is about scheduler WarmupCosineLR"
            in decay["warmup-cosine-lr-zero-division"].why)
    both = {m.fix_id: m for m in search(f"WarmupDecayLR works, WarmupCosineLR does not:\n{error}")}
    assert both["warmup-cosine-lr-zero-division"].level == "strong"  # the entry's scheduler is among those named


def test_when_a_report_names_a_zero_stage_the_entry_is_not_about_then_it_is_only_possible():
    error = "RuntimeError: Output 0 of SplitBackward0 is a view and is being modified inplace"
    assert dict(search_module.evidence(registry.get("zero12-flat-buffer-detach")).about)["ZeRO stage"] == {"1", "2"}
    for named, level in (("zero_optimization.stage=3", "possible"), ('{"zero_optimization": {"stage": 3}}', "possible"),
                         ("ZeRO-3", "possible"), ("ZeRO-2", "strong"), ("ZeRO stage 1 and ZeRO-3", "strong"), ("", "strong")):
        found = {m.fix_id: m for m in search(f"{named}\n{error}")}["zero12-flat-buffer-detach"]
        assert found.level == level, (named, found.why)
    frames = ('File "/x/deepspeed/runtime/zero/stage3.py", line 1, in step\n' + error)
    assert {m.fix_id: m for m in search(frames)}["zero12-flat-buffer-detach"].level == "possible"


def test_when_an_entry_is_in_no_scheduler_optimizer_or_stage_then_nothing_it_names_contradicts_it():
    entry = next(f for f in fixes.all_fixes() if not search_module.entry_about(f) and search_module.evidence(f).specific)
    known = search_module.evidence(entry)
    found = search_module.match(search_module.parse(f"ZeRO-3, WarmupDecayLR, FusedAdam\n{known.specific[0]}"), known)
    assert found.level == "strong", found.why
