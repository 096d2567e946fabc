"""Which accelerator measured what of an entry: CPU (gloo), CUDA in one process, or CUDA with the ranks on CPU.

Every measurement the Fixbook keeps names where it ran:

* the release sweep (``fixes/data/sweep.json``) and the trigger grids (``fixes/data/triggers.json``) run on the
  CPU accelerator, ranks talking over gloo (``ci.sweep`` and ``ci.sweep.triggers`` set ``DS_ACCELERATOR=cpu``; every
  environment of ``ci/environments.toml`` is a CPU one);
* each notebook run in the run history (``fixes/data/runs.json``) has its ``device`` (``cpu`` or ``cuda``) and, on
  CUDA, whether the ranks it launched ran on CPU (``ranks: "cpu"``: a one-GPU machine and a two-rank check).

A CUDA run with its ranks on CPU measured the notebook's own process on the GPU, not the ranks' collectives: a bug
that needs two or more ranks is measured on CUDA only by a run whose ranks ran on GPUs (NCCL). :func:`measured`
sorts an entry's records into those three kinds; the card, ``fixbook show`` and ``fixbook doctor --config`` (on a
CUDA job) say it in those words, and a test holds every entry's text to it. Stdlib only.
"""
from __future__ import annotations

from dataclasses import dataclass

from .record import RunSummary, history

FIXED = "reproduced → fixed"
NOT_MEASURED_ON_CUDA = "on CUDA not measured"  # the words every text uses where a GPU claim rests on no CUDA run


@dataclass(frozen=True)
class Measured:
    """Where an entry's bug was shown and its fix verified (release lists, oldest first)."""

    entry: str
    swept: int  # releases the CPU sweep measured
    grid_release: str  # the release the CPU trigger grid ran on ("" where none was recorded)
    cpu: tuple[str, ...]  # notebook runs on the CPU accelerator that reproduced and fixed the bug
    cuda: tuple[str, ...]  # CUDA runs that did, every process on the GPU
    cuda_cpu_ranks: tuple[str, ...]  # CUDA runs that did with the launched ranks on CPU (fewer GPUs than ranks)

    @property
    def on_cuda(self) -> bool:
        """Whether a CUDA run, every process on the GPU, showed the bug and verified the fix."""
        return bool(self.cuda)

    @property
    def text(self) -> str:
        """The card's row and ``fixbook show``'s line."""
        cpu = []
        if self.swept:
            cpu.append(f"the release sweep ({self.swept} releases)")
        if self.grid_release:
            cpu.append(f"the trigger grid (DeepSpeed {self.grid_release})")
        if self.cpu:
            cpu.append(f"the notebook (DeepSpeed {', '.join(self.cpu)})")
        parts = [f"CPU (gloo): {', '.join(cpu) if cpu else 'nothing recorded'}",
                 "CUDA, one process: " + (f"the notebook (DeepSpeed {', '.join(self.cuda)})" if self.cuda
                                          else "not measured")]
        if self.cuda_cpu_ranks:
            parts.append(f"CUDA with the ranks on CPU (a one-GPU machine): the notebook (DeepSpeed "
                         f"{', '.join(self.cuda_cpu_ranks)}); its ranks on GPUs (NCCL) not measured")
        return "; ".join(parts)


def measured(entry: str, runs: list[RunSummary] | None = None) -> Measured:
    """Where ``entry``'s bug was measured, from the sweep, the trigger grid and the run history."""
    import json

    from . import measured as sweep_data
    from .trigger import GRIDS

    runs = history() if runs is None else runs
    mine = [r for r in runs if r.entry == entry and r.verdict == FIXED]
    grids = json.loads(GRIDS.read_text()).get("entries", {}) if GRIDS.exists() else {}

    def releases(kept: list[RunSummary]) -> tuple[str, ...]:
        return tuple(sorted({r.release for r in kept}, key=_key))

    return Measured(entry, len(sweep_data.load().entry(entry).releases), grids.get(entry, {}).get("release", ""),
                    releases([r for r in mine if r.device == "cpu"]),
                    releases([r for r in mine if r.device == "cuda" and not r.ranks]),
                    releases([r for r in mine if r.device == "cuda" and r.ranks == "cpu"]))


def _key(release: str) -> tuple[int, ...]:
    return tuple(int(part) for part in release.split(".") if part.isdigit())
