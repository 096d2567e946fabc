"""fixes.accelerators: which accelerator measured what of each entry, from the run records; and every entry's text
held to it (a claim about GPUs, CUDA or NCCL rests on a CUDA run, or says that on CUDA it is not measured)."""
from __future__ import annotations

import re
from dataclasses import replace

import pytest

import fixes
from fixes import accelerators, registry
from fixes.card import card
from fixes.record import RunSummary

# Words that make a sentence about GPU behaviour. ``NCCL_`` (an environment variable's name) is not one.
GPU_WORDS = re.compile(r"\b(?:GPUs?|CUDA|NCCL(?!_)|accelerator memory|multi-GPU)\b")
# Entries whose GPU words are no claim of how a GPU run behaves, each with why.
NOT_A_GPU_CLAIM = {
    "launcher-venv-script-drops-export": "names an NCCL setting as one of the variables the launcher exports",
    "op-builder-arch-variant-suffix": "about building DeepSpeed's CUDA ops: DeepSpeed's CUDA op builder raises while it "
                                      "computes the flags, before any compiler or GPU takes part, which the CPU "
                                      "sweep and grid run",
}


def _sentences(text: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=\.)\s+(?=[A-Z])", text) if s.strip()]


def gpu_claims(fix) -> list[str]:
    """The sentences of an entry's title, summary and trigger that speak of GPU behaviour."""
    info = fix.info
    texts = [info.title, info.summary] + ([fix.trigger.text()] if fix.trigger is not None else [])
    return [s for text in texts for s in _sentences(text) if GPU_WORDS.search(s)]


def unbacked_gpu_claims() -> dict[str, list[str]]:
    found = {}
    for fix in fixes.all_fixes():
        if fix.id in NOT_A_GPU_CLAIM or accelerators.measured(fix.id).on_cuda:
            continue
        bare = [s for s in gpu_claims(fix) if accelerators.NOT_MEASURED_ON_CUDA not in s]
        if bare:
            found[fix.id] = bare
    return found


def test_when_an_entry_speaks_of_gpus_then_a_cuda_run_measured_it_or_the_text_says_it_was_not() -> None:
    assert unbacked_gpu_claims() == {}


def test_when_a_summary_claims_gpu_behaviour_without_a_cuda_run_then_the_check_names_it(monkeypatch) -> None:
    fix = registry.get("zero12-flat-buffer-detach")
    claim = "Every CPU run is affected; on GPUs, whenever the group fits in free accelerator memory."


    monkeypatch.setattr(type(fix), "info", replace(fix.info, summary=claim))
    assert unbacked_gpu_claims() == {"zero12-flat-buffer-detach": [claim]}


def _run(device: str, ranks: str = "", verdict: str = "reproduced → fixed", release: str = "0.18.9") -> RunSummary:
    return RunSummary("zero12-flat-buffer-detach", release, "gpu" if device == "cuda" else "cpu", device, "3.12",
                      "2.9", verdict, "2026-12-01", "NVIDIA H100" if device == "cuda" else "", ranks)


@pytest.mark.parametrize("runs, on_cuda, words", [
    ([_run("cpu")], False, "CUDA, one process: not measured"),
    ([_run("cpu"), _run("cuda", "cpu")], False, "CUDA with the ranks on CPU (a one-GPU machine): the notebook "
                                                "(DeepSpeed 0.18.9); its ranks on GPUs (NCCL) not measured"),
    ([_run("cuda")], True, "CUDA, one process: the notebook (DeepSpeed 0.18.9)"),
    ([_run("cuda", verdict="notebook failed")], False, "CUDA, one process: not measured"),
])
def test_when_runs_are_recorded_then_each_accelerator_is_named_with_what_it_measured(runs, on_cuda, words) -> None:
    found = accelerators.measured("zero12-flat-buffer-detach", runs)
    assert found.on_cuda is on_cuda and words in found.text, found.text
    assert found.text.startswith("CPU (gloo): the release sweep (") and "the trigger grid (DeepSpeed 0.18.9)" in found.text


def test_when_the_card_and_show_are_read_then_they_say_where_cuda_was_and_was_not_measured(capsys) -> None:
    from fixes.cli import main

    info = registry.get("zero12-flat-buffer-detach").info
    text = accelerators.measured(info.id).text
    assert "its ranks on GPUs (NCCL) not measured" in text
    assert f"| **Measured on** | {text} |" in card(info)
    assert main(["show", info.id]) == 0
    assert f"measured on: {text}" in capsys.readouterr().out
