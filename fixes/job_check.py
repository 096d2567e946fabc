"""Which known bugs of the installed DeepSpeed hit *this* job: ``fixes.check(engine)`` and ``fixbook doctor --config``.

A release that has a bug hits only the jobs its trigger describes (:mod:`fixes.trigger`). :func:`triggered` sorts the
installed release's known bugs for one job into those the job triggers (silent wrong results first), those it may
trigger (a condition it leaves open: an ``"auto"`` value, a use nobody stated), and those it has but does not trigger,
with the condition that rules each out. Which bugs the release has comes from the release sweep, or the entry's
probe where the release was not swept. On a CUDA job, a bug measured on CPU only (no CUDA run showed it,
:mod:`fixes.accelerators`) is named as such (:data:`CPU_ONLY`): its trigger says what CPU runs showed, not what the CUDA
job does. :func:`check` reads the job from a live engine, warns once, patches nothing and never raises into the job.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

from .exceptions import FixbookWarning
from .trigger import UNSET, Job, Verdict, job_from_config

if TYPE_CHECKING:
    from .fix import Fix

SYMPTOM_ORDER = {"silent wrong result": 0, "hang": 1, "crash": 2}
# What a live engine shows of the uses: these are known (present or absent) after deepspeed.initialize.
ENGINE_USES = frozenset({"pipeline", "param-groups", "param-group-lrs", "moe-top-k"})


@dataclass(frozen=True)
class Finding:
    fix: "Fix"
    verdict: Verdict

    @property
    def line(self) -> str:
        info = self.fix.info
        return f"{info.id}: {info.title} [{info.label}]"


@dataclass(frozen=True)
class Report:
    """One job against the known bugs of one release."""

    release: str
    job: Job
    triggers: tuple[Finding, ...]  # this job hits them
    may_trigger: tuple[Finding, ...]  # they depend on what the job leaves open
    not_triggered: tuple[Finding, ...]  # the release has them; this job does not meet a condition
    no_trigger: tuple["Fix", ...]  # the release has them, and the entry states no trigger

    def depends_on(self) -> dict[str, list[str]]:
        """{open condition: the entries whose answer it decides}."""
        found: dict[str, list[str]] = {}
        for finding in self.may_trigger:
            for condition in finding.verdict.open:
                found.setdefault(condition, []).append(finding.fix.id)
        return found


_HAS_BUG: dict[tuple[str, str], bool] = {}  # (entry, release): the installed code does not change in a process


def _has_bug(fix: "Fix", release: str) -> bool:
    """Whether ``release`` has the entry's bug: the sweep's measurement, or the probe where it was not swept (asked
    once per process)."""
    key = (fix.id, release)
    if key not in _HAS_BUG:
        measured = fix.info.expected_affected(release)
        if measured is None:
            try:
                measured = fix.probe().affected
            except Exception:  # noqa: BLE001 - an entry that cannot tell is left out, never fatal
                measured = False
        _HAS_BUG[key] = measured
    return _HAS_BUG[key]


CPU_ONLY = "measured on CPU; on CUDA not measured"


def measured_on_cpu_only(fix: "Fix") -> bool:
    """Whether no CUDA run (every process on the GPU) showed the entry's bug: the sweep, the trigger grid and the
    notebook measured it on CPU (:mod:`fixes.accelerators`), so on a CUDA job its trigger says what was measured on
    CPU, not what the CUDA job does."""
    from .accelerators import measured

    return not measured(fix.id).on_cuda


def on_cuda_unmeasured(report: Report) -> tuple[Finding, ...]:
    """Of the bugs a CUDA job meets the trigger of, those measured on CPU only (none where the job is not on CUDA)."""
    if report.job.accelerator != "cuda":
        return ()
    return tuple(finding for finding in report.triggers if measured_on_cpu_only(finding.fix))


def triggered(job: Job, release: str, fixes: Iterable["Fix"] | None = None) -> Report:
    """Sort the known bugs of ``release`` (not those already fixed in this process) by what ``job`` does."""
    from .registry import all_fixes

    hits, maybe, not_hit, no_trigger = [], [], [], []
    for fix in (all_fixes() if fixes is None else fixes):
        if fix.applied or not _has_bug(fix, release):
            continue
        trigger = fix.trigger
        if trigger is None:
            no_trigger.append(fix)
            continue
        verdict = trigger.evaluate(job)
        (hits if verdict.triggered else not_hit if verdict.triggered is False else maybe).append(Finding(fix, verdict))

    def order(finding: Finding) -> tuple[int, int, str]:
        info = finding.fix.info
        return (int(info.is_behaviour_change), SYMPTOM_ORDER.get(info.symptom, 3), info.id)

    return Report(release, job, tuple(sorted(hits, key=order)), tuple(sorted(maybe, key=order)),
                  tuple(sorted(not_hit, key=order)), tuple(no_trigger))


def job_from_engine(engine: Any, uses: Iterable[str] | None = None) -> Job:
    """The job a live DeepSpeed engine runs, as its resolved config says, with what the engine shows of the uses
    (:data:`ENGINE_USES`); ``uses``: what the caller states besides (the other uses then count as absent)."""
    import torch

    config = getattr(getattr(engine, "_config", None), "_param_dict", None)
    if not isinstance(config, dict):
        config = getattr(engine, "config", None) if isinstance(getattr(engine, "config", None), dict) else {}
    try:
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator().device_name()
    except Exception:  # noqa: BLE001
        accelerator = None
    world = getattr(engine, "dp_world_size", None) or getattr(engine, "world_size", None)
    job = job_from_config(config, world, None, accelerator, torch.__version__)
    changes: dict[str, Any] = {}
    for field_name, method in (("zero_stage", "zero_optimization_stage"), ("gradient_accumulation_steps",
                                                                            "gradient_accumulation_steps")):
        value = _call(engine, method)
        if value is not None:
            changes[field_name] = int(value)
    if _call(engine, "bfloat16_enabled"):
        changes["precision"] = "bf16"
    elif _call(engine, "fp16_enabled"):
        changes["precision"] = "fp16"
    elif _call(engine, "bfloat16_enabled") is False:
        changes["precision"] = "fp32"
    offload = _call(engine, "zero_offload_optimizer")
    if offload is not None:
        device = getattr(offload, "device", offload)
        changes["offload_optimizer"] = str(getattr(device, "value", device)).lower() in ("cpu", "nvme")
    if config.get("gradient_clipping", UNSET) != UNSET and _call(engine, "gradient_clipping") is not None:
        changes["gradient_clipping"] = float(_call(engine, "gradient_clipping"))
    scheduler = type(getattr(engine, "lr_scheduler", None)).__name__
    if job.scheduler == UNSET and scheduler in ("WarmupLR", "WarmupCosineLR", "WarmupDecayLR", "OneCycle", "LRRangeTest"):
        changes.update(scheduler=scheduler, warmup_max_lr=None)  # passed as an object: its params are not in the config
    found = set(_engine_uses(engine))
    stated = set(uses or ())
    return job.with_(**changes, uses=frozenset(found | stated),
                     known_uses=None if uses is not None else frozenset(ENGINE_USES), unresolved=())


def _call(engine: Any, method: str) -> Any:
    try:
        return getattr(engine, method)()
    except Exception:  # noqa: BLE001 - an engine of another release may lack one
        return None


def _engine_uses(engine: Any) -> Iterable[str]:
    if any(cls.__name__ == "PipelineEngine" for cls in type(engine).__mro__):
        yield "pipeline"
    optimizer = getattr(engine, "basic_optimizer", None) or getattr(engine, "optimizer", None)
    groups = getattr(optimizer, "param_groups", None) or []
    if len(groups) > 1:
        yield "param-groups"
        if len({group.get("lr") for group in groups}) > 1:
            yield "param-group-lrs"
    module = getattr(engine, "module", None)
    if module is not None and any(type(m).__name__ == "TopKGate" and getattr(m, "k", 0) > 2 for m in module.modules()):
        yield "moe-top-k"


def summary(report: Report) -> str:
    """The answer in a few lines: each bug this job triggers with its fix line, then those that depend on what the
    job does that the engine cannot show, in one line with how to state it."""
    lines = []
    unmeasured = on_cuda_unmeasured(report)
    if report.triggers:
        lines.append(f"this job triggers {len(report.triggers)} known bug(s) of DeepSpeed {report.release}"
                     + (f" ({len(unmeasured)} of them {CPU_ONLY})" if unmeasured else "") + ":")
        for finding in report.triggers:
            lines.append(f"  {finding.line}" + (f" ({CPU_ONLY})" if finding in unmeasured else "")
                         + f"\n    fix: {finding.fix.info.apply_call}")
    if report.may_trigger:
        uses = sorted({c.key.split(":", 1)[1] for f in report.may_trigger for c in f.fix.trigger.conditions
                       if c.label in f.verdict.open and c.key.startswith("uses:")})
        lines.append(f"{len(report.may_trigger)} more depend on what the job does that the engine cannot show "
                     f"({', '.join(f.fix.id for f in report.may_trigger)}): state it with fixes.check(engine, "
                     f"uses=[...]) from {', '.join(uses) or 'fixes.trigger.USES'}")
    return "\n".join(lines)


def check(engine: Any, uses: Iterable[str] | None = None) -> Report | None:
    """After ``deepspeed.initialize``: which known bugs of the installed DeepSpeed this engine's job triggers, as one
    :class:`~fixes.FixbookWarning` naming each with its fix line (and those that depend on what the engine cannot
    show: pass ``uses`` to state it, :data:`fixes.trigger.USES`). Patches nothing; a bug already fixed in this
    process (``fixes.apply()``) is not named. Never raises into the job: where the engine cannot be read, the
    warning says so and it returns None."""
    try:
        import sys

        from .versions import installed_deepspeed

        imported = getattr(sys.modules.get("deepspeed"), "__version__", None)  # the engine's own, read at no cost
        release = imported.split("+")[0] if imported else installed_deepspeed()
        if release is None:
            return None
        report = triggered(job_from_engine(engine, uses), release)
    except Exception as exc:  # noqa: BLE001 - a check never breaks the job it checks
        warnings.warn(f"fixes.check could not read this engine: {type(exc).__name__}: {exc}", FixbookWarning,
                      stacklevel=2)
        return None
    text = summary(report)
    if text:
        warnings.warn("fixes.check: " + text, FixbookWarning, stacklevel=2)
    return report
