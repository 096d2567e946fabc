"""``fixbook``: the Fixbook from a terminal.

    fixbook list                 every entry and its status for the installed DeepSpeed
    fixbook show ID              one entry: what, why, which releases, how to fix
    fixbook doctor               which known bugs this install has, probed, and the line that fixes them
    fixbook bisect SCRIPT        which DeepSpeed releases your reproduction script affects
    fixbook search "ERROR TEXT"  which entry explains a pasted error (a line or a whole traceback;
                                 "-" reads stdin): strong / possible / no match

Exit codes: 0 success, 1 nothing found (search), 2 bad input or no DeepSpeed where one is needed.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from . import registry
from . import search as search_module
from .card import SITE_URL, related_ids, release_page_url
from .exceptions import DeepSpeedNotInstalledError, FixbookError
from .fix import Fix, Probe
from .search import Match
from .versions import SWEEP_SINCE, installed_deepspeed, installed_torch


def _status(fix: Fix) -> str:
    try:
        probe = fix.probe()
    except DeepSpeedNotInstalledError:
        return "no DeepSpeed"
    except Exception as exc:  # noqa: BLE001 - one entry's probe must not stop the list
        return f"cannot probe: {_first_line(exc)}"
    if fix.info.is_behaviour_change:
        return "NEW BEHAVIOUR" if probe.affected else "old behaviour"
    return "AFFECTED" if probe.affected else "not affected"


def _bugs_and_changes(fixes: Sequence[Fix]) -> tuple[list[Fix], list[Fix]]:
    """``fixes`` split into bugs and behaviour changes (``FixInfo.kind``), each in registry order."""
    return ([f for f in fixes if not f.info.is_behaviour_change], [f for f in fixes if f.info.is_behaviour_change])


def cmd_list(_: argparse.Namespace) -> int:
    release = installed_deepspeed()
    print(f"DeepSpeed {release or '(not installed)'}")
    bugs, changes = _bugs_and_changes(registry.all_fixes())
    for fix in bugs:
        status = _status(fix) if release else "-"
        print(f"{fix.id:<34} {status:<13} {fix.info.title}")
    if changes:
        print("\nBehaviour changes (not bugs: intended upstream changes; `fixes.apply()` leaves them alone, "
              "`fixes.apply(ID)` pins the old behaviour):")
        for fix in changes:
            status = _status(fix) if release else "-"
            print(f"{fix.id:<34} {status:<13} {fix.info.title}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from .accelerators import measured as accelerators

    info = registry.get(args.id).info
    lines = [
        f"{info.id}: {info.title}",
        "",
        info.summary,
        "",
        f"kind:        {info.kind}" + (" (not a bug; 'affected' = has the new behaviour, the fix pins the old one, "
                                         "fixes.apply() with no ids leaves it alone)" if info.is_behaviour_change else ""),
        f"symptom:     {info.symptom}",
        f"components:  {', '.join(info.components)}",
        f"affected:    {info.sweep.range_text} (measured on {len(info.sweep.releases)} releases"
        + (f", under {info.measured_under}" if info.measured_under else "") + ")",
        f"fixed in:    {info.sweep.first_fixed or 'no release measured fixed yet'} (measured); upstream says "
        f"{info.upstream_fixed_in or 'not fixed'}" + (f" — {info.upstream_disagreement}" if info.upstream_disagreement else ""),
        f"fix works:   {info.sweep.coverage_text} (applied and re-checked by the sweep)",
        f"measured on: {accelerators(info.id).text}",
        f"root cause:  {info.root_cause}",
        f"upstream:    {'; '.join(f'{name} {url}' for name, url in info.links) or 'none filed'}",
        "errors:      " + "\n             ".join(info.error_signatures),
        f"fix:         {info.apply_call}",
    ]
    related = related_ids(info)
    if related:
        lines.append(f"related:     {', '.join(related)} (same cause or same symptom: fixbook show ID)")
    print("\n".join(lines))
    return 0


@dataclass(frozen=True)
class Diagnosis:
    """One entry on the installed DeepSpeed: what the sweep measured for this release, what the
    entry's probe finds in the installed code, and whether its fix can be applied here."""

    fix: Fix
    measured: bool | None  # None: this release was not swept (or not decisively)
    probe: Probe | None  # None: the probe could not run
    error: str = ""  # why the probe could not run
    no_fix: str = ""  # why the fix cannot be applied here ("" where it can)

    @property
    def applies(self) -> bool:
        return self.probe.affected if self.probe is not None else bool(self.measured)

    @property
    def fixable(self) -> bool:
        return self.probe is not None and self.applies and not self.no_fix

    @property
    def line(self) -> str:
        info, sweep = self.fix.info, self.fix.info.sweep
        measured = {True: "measured affected", False: "measured NOT affected", None: self._unmeasured}[self.measured]
        if sweep.observations:
            measured += f"; affected range {sweep.range_text}"
        if self.probe is None:
            return f"?  could not check {info.id}: {self.error} [{measured}]"
        remedy = f"fix: {info.apply_call}" if self.fixable else f"no fix for this release: {self.no_fix}"
        return f"!  {info.id}: {info.title} [{measured}; probe: affected] {remedy}"

    @property
    def _unmeasured(self) -> str:
        """Why the sweep has no answer for the installed release: not swept, or swept and it could not tell."""
        row = self.fix.info.sweep.get(installed_deepspeed() or "")
        return f"release swept, {row.status}" if row is not None else "release not swept"

    @property
    def change_line(self) -> str:
        """The line of a behaviour change (``FixInfo.kind``): not a bug, so no "fix", a way to pin the old behaviour."""
        info = self.fix.info
        measured = {True: "measured: has it", False: "measured: does NOT have it", None: self._unmeasured}[self.measured]
        if self.probe is None:
            return f"?  could not check {info.id}: {self.error} [{measured}]"
        remedy = (f"to pin the old behaviour: {info.apply_call}" if self.fixable else
                  f"the old behaviour cannot be pinned on this release: {self.no_fix}")
        return f"~  {info.id}: {info.title} [{measured}; probe: has it] {remedy}"

    @property
    def disagreement(self) -> str | None:
        """Why the probe and the sweep disagree here, unless the entry measures under a condition
        this install does not have (then the probe's answer is the one for this install)."""
        if self.probe is None or self.measured is None or self.probe.affected == self.measured:
            return None
        if self.fix.info.measured_under and self.measured and not self.probe.affected:
            return None
        return (f"?  {self.fix.id}: the sweep measured this release {'affected' if self.measured else 'not affected'}"
                f" but the probe of the installed code says otherwise ({self.probe.evidence}); the probe decides")


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


def _no_fix(fix: Fix, release: str) -> str:
    """Why ``fix`` cannot fix ``release`` (its drift checks, then the sweep's coverage); "" if it can."""
    try:
        fix.check_applicable()
    except Exception as exc:  # noqa: BLE001 - DriftError, or a check that itself fails
        return _first_line(exc)
    observation = fix.info.sweep.get(release)
    if observation is not None and observation.fix not in (None, "fixed"):
        return f"measured {observation.fix} on {release}: {observation.fix_reason}"
    return ""


def diagnose(release: str) -> list[Diagnosis]:
    """Every entry on the installed ``release``: the sweep's answer, the probe's, and whether the fix
    can be applied (no training). A probe or check that raises is reported, never fatal."""
    from .measured import environment_for_torch

    _, rows = environment_for_torch(installed_torch())
    found = []
    for fix in registry.all_fixes():
        # the environment matching the user's torch where it measured this entry, else the default rows
        own = rows.entry(fix.id)
        measured = own.expected_affected(release) if own.get(release) is not None else fix.info.expected_affected(release)
        try:
            probe = fix.probe()
        except Exception as exc:  # noqa: BLE001 - doctor never crashes on one entry
            found.append(Diagnosis(fix, measured, None, _first_line(exc)))
            continue
        found.append(Diagnosis(fix, measured, probe, no_fix=_no_fix(fix, release) if probe.affected else ""))
    return found


def cmd_doctor(args: argparse.Namespace) -> int:
    if getattr(args, "config", None):
        return doctor_config(args)
    release = installed_deepspeed()
    print(f"torch {installed_torch() or '(not installed)'}, deepspeed {release or '(not installed)'}")
    if release is None:
        print("DeepSpeed is not installed here: nothing to check.", file=sys.stderr)
        return 2
    from .measured import environment_for_torch

    matched, rows = environment_for_torch(installed_torch())
    if matched is None:
        print(f"no measurement matches torch {installed_torch()} (measured: torch {rows.torch}"
              + "".join(f", torch {r.torch} ({n})" for n, r in sorted(rows.environments.items()))
              + f"); comparing with the default one (torch {rows.torch})")
    else:
        print(f"comparing with the measurements of environment {matched} (torch {rows.torch}, Python {rows.python})")
    everything = diagnose(release)
    diagnoses = [d for d in everything if not d.fix.info.is_behaviour_change]  # the bugs; changes come after
    changes = [d for d in everything if d.fix.info.is_behaviour_change and (d.applies or d.probe is None)]
    applying = [d for d in diagnoses if d.applies or d.probe is None]
    for diagnosis in applying:
        print(diagnosis.line)
    for diagnosis in everything:
        if diagnosis.disagreement:
            print(diagnosis.disagreement)
    found = [d for d in diagnoses if d.applies and d.probe is not None]
    fixable = [d for d in found if d.fixable]
    summary = f"{len(found)} of {len(diagnoses)} known bug(s) apply to DeepSpeed {release}"
    if fixable:
        summary += (f"; {len(fixable)} can be fixed: `import fixes; fixes.apply()`"
                    + (" (it skips the others and says why)" if len(fixable) < len(found) else ""))
    elif found:
        summary += "; none has a fix for this release"
    unchecked = len(diagnoses) - len(found) - sum(1 for d in diagnoses if d.probe is not None and not d.applies)
    if unchecked:
        summary += f"; {unchecked} could not be checked"
    print(summary)
    if changes:
        print(f"behaviour changes in DeepSpeed {release} (not bugs: intended upstream changes that alter results of "
              "configs relying on the old behaviour; `fixes.apply()` leaves them alone):")
        for diagnosis in changes:
            print(diagnosis.change_line)
    print(f"known bugs of DeepSpeed {release}, as measured: {release_page_url(release)}")
    lacking = search_module.upstream_lacking(release)
    if lacking:
        per = ", ".join(f"{component} {count}" for component, count in lacking.items())
        print(f"known upstream fixes this release lacks (no entry, no fix module): {sum(lacking.values())} "
              f"({per}); the list: {SITE_URL}generated/coverage/")
        shown = search_module.upstream_reproduced_lacking(release)
        if shown:
            print(f"  of which upstream's own fix-PR test fails here on CPU without the fix: {sum(shown.values())} "
                  f"({', '.join(f'{component} {count}' for component, count in shown.items())})")
    return 0


def search(text: str, release: str | None = None) -> list[Match]:
    """Entries that strongly or possibly explain ``text`` (see :mod:`fixes.search`), best first."""
    return search_module.search(text, registry.all_fixes(), release)


# The "auto" values a Hugging Face Trainer / accelerate config leaves for them to fill in, and where from.
AUTO_SOURCES = {"gradient_accumulation_steps": "TrainingArguments.gradient_accumulation_steps",
                "bf16.enabled": "TrainingArguments.bf16", "fp16.enabled": "TrainingArguments.fp16",
                "gradient_clipping": "TrainingArguments.max_grad_norm (1.0 by default)",
                "train_batch_size": "the per-device batch size x gradient_accumulation_steps x world size",
                "train_micro_batch_size_per_gpu": "TrainingArguments.per_device_train_batch_size"}


def doctor_config(args: argparse.Namespace) -> int:
    """``fixbook doctor --config ds_config.json``: which known bugs of the installed DeepSpeed this job triggers."""
    from .accelerators import measured as accelerators
    from .batch import GAS, NEITHER, RULE
    from .batch import from_config as batch_sizes
    from .job_check import CPU_ONLY, measured_on_cpu_only, on_cuda_unmeasured, triggered
    from .trigger import USES, job_from_config

    release = installed_deepspeed()
    if release is None:
        print("DeepSpeed is not installed here: nothing to check.", file=sys.stderr)
        return 2
    path = Path(args.config)
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise FixbookError(f"cannot read the DeepSpeed config {path}: {exc}") from exc
    uses = None
    if args.uses is not None:
        uses = [u.strip() for u in args.uses.split(",") if u.strip()]
        unknown = sorted(set(uses) - set(USES))
        if unknown:
            raise FixbookError(f"unknown --uses {', '.join(unknown)}; known: {', '.join(USES)}")
    if not isinstance(config, dict):
        raise FixbookError(f"the DeepSpeed config {path} is not a JSON object")
    sizes = batch_sizes(config, args.world_size)
    elastic = isinstance(config.get("elasticity"), dict) and config["elasticity"].get("enabled") is True
    if sizes.rejected and not sizes.incomplete and not elastic:  # elasticity computes the three itself
        raise FixbookError(f"{path.name}: {sizes.error}. No bug is judged on batch sizes DeepSpeed would not run "
                           "with: correct the config (or --world-size) and check again")
    accelerator, seen = (args.accelerator, "") if args.accelerator else (_visible_accelerator(), " (torch sees a GPU here)")
    job = job_from_config(config, args.world_size, uses, accelerator, installed_torch())
    report = triggered(job, release)
    print(f"DeepSpeed {release}, torch {installed_torch() or '(not installed)'}; job: {path.name} "
          f"({_job_text(job)}{seen if accelerator else ''})")
    if sizes.incomplete and not elastic:
        print(f"note: the config gives neither train_batch_size nor train_micro_batch_size_per_gpu; DeepSpeed "
              f"itself stops with \"{NEITHER}\" unless what launches it (accelerate, a trainer) adds them")
    elif GAS in sizes.open and GAS not in sizes.auto:
        print("note: gradient_accumulation_steps is not given, so DeepSpeed derives it from the data-parallel size "
              f"({RULE}): state it with --world-size")
    unmeasured = on_cuda_unmeasured(report)
    hits = [finding for finding in report.triggers if finding not in unmeasured]
    if hits:
        print(f"this job triggers {len(hits)} known bug(s) (silent wrong results first):")
        for finding in hits:
            info = finding.fix.info
            print(f"!  {finding.line}\n     because: {'; '.join(finding.fix.trigger.labels)}\n     fix: {info.apply_call}")
    else:
        print("this job triggers none of the known bugs of this release" + (" that CUDA runs measured" if unmeasured else ""))
    if unmeasured:
        print(f"it meets the trigger of {len(unmeasured)} more, {CPU_ONLY} (whether this CUDA job hits them is not "
              "known: the trigger says what CPU runs showed):")
        for finding in unmeasured:
            print(f"?  {finding.line} [{CPU_ONLY}]\n     because: {'; '.join(finding.fix.trigger.labels)}\n"
                  f"     where: {accelerators(finding.fix.id).text}\n     fix, if it does: {finding.fix.info.apply_call}")
    if report.may_trigger:
        print(f"it may trigger {len(report.may_trigger)} more, depending on what the config leaves open:")
        for finding in report.may_trigger:
            cpu_only = job.accelerator == "cuda" and measured_on_cpu_only(finding.fix)
            print(f"?  {finding.line}" + (f" [{CPU_ONLY}]" if cpu_only else "") + f"\n     {finding.verdict.why}")
        if uses is None:
            named = sorted({key.split(":")[1] for f in report.may_trigger for key in _open_keys(f) if key.startswith("uses:")})
            if named:
                print(f"   (state what the job does: --uses {','.join(named)}; or --uses '' for none of them)")
    if report.not_triggered:
        print(f"DeepSpeed {release} has {len(report.not_triggered)} more this job does not trigger:")
        for finding in report.not_triggered:
            print(f"-  {finding.fix.id}: {finding.verdict.why}")
    if report.no_trigger:
        print(f"and {len(report.no_trigger)} whose trigger is not stated: {', '.join(f.id for f in report.no_trigger)}")
    from .card import SITE_URL
    from .checked import SCRIPTS, statement

    print("\n".join(statement(job, release, scripts_url=f"{SITE_URL}{SCRIPTS}")))
    if job.unresolved:
        print("config values it could not resolve (\"auto\": filled in by the Hugging Face Trainer / accelerate):")
        decides = report.depends_on()
        for key in job.unresolved:
            by = [f"{entry} ({condition})" for condition, entries in decides.items() for entry in entries
                  if _condition_reads(condition, key)]
            print(f"   {key}: from {AUTO_SOURCES.get(key, 'the trainer')}"
                  + (f"; it decides {', '.join(by)}" if by else "; no known bug of this release depends on it"))
    return 0


def _visible_accelerator() -> str | None:
    """"cuda" where torch sees a GPU here (a job checked on its own machine runs there); None otherwise (unknown:
    ``--accelerator`` says)."""
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - no torch, or one that cannot ask: the accelerator stays unknown
        return None


def _job_text(job: Any) -> str:
    parts = [f"ZeRO stage {job.zero_stage}" if job.zero_stage is not None else "ZeRO stage ?",
             job.precision or "precision ?",
             f"gradient_accumulation_steps {job.gradient_accumulation_steps if job.gradient_accumulation_steps is not None else '?'}"]
    if job.world_size:
        parts.append(f"{job.world_size} ranks")
    if job.accelerator:
        parts.append(f"accelerator {job.accelerator}")
    if job.offload_optimizer:
        parts.append("offload_optimizer")
    if job.known_uses is None:
        parts.append("uses: " + (", ".join(sorted(job.uses)) or "none"))
    return ", ".join(parts)


def _open_keys(finding: Any) -> list[str]:
    """The keys of the conditions ``finding`` leaves open (``uses:no-sync``, ``gradient_accumulation_steps``...)."""
    return [c.key for c in finding.fix.trigger.conditions if c.label in finding.verdict.open]


# Which config keys a condition reads (by the words of its label), for "it decides ...".
_KEY_WORDS = {"gradient_accumulation_steps": ("gradient_accumulation_steps",), "bf16.enabled": ("bf16", "fp16", "fp32"),
              "fp16.enabled": ("bf16", "fp16", "fp32"), "gradient_clipping": ("gradient_clipping",),
              "train_batch_size": ("gradient_accumulation_steps",), "zero_optimization.stage": ("ZeRO stage",)}


def _condition_reads(condition: str, key: str) -> bool:
    return any(word in condition for word in _KEY_WORDS.get(key, (key.rsplit(".", 1)[-1],)))


def next_steps(text: str, release: str | None) -> str:
    """What to do when nothing matches: the release's page, the known upstream fixes of the component the words
    point at, and bisecting one's own reproduction."""
    component = search_module.guess_component(text)
    lines = ["what next:"]
    if release:
        lines.append(f"  - the known bugs of DeepSpeed {release}, measured: {release_page_url(release)}")
    else:
        lines.append(f"  - the known bugs of your release: `fixbook doctor` (or {SITE_URL}generated/releases/)")
    lines.append(f"  - known upstream fixes {'of ' + component if component else 'per component'} that no entry "
                 f"proves yet: {SITE_URL}generated/coverage/")
    lines.append("  - find the release where your own reproduction changes: `fixbook bisect repro.py` (repro.py exits 0 "
                 "without the bug, 1 with it)")
    return "\n".join(lines)


def cmd_search(args: argparse.Namespace) -> int:
    text = sys.stdin.read() if args.text == "-" else args.text
    release = args.release or installed_deepspeed()
    matches = search(text, release)
    known_upstream = search_module.upstream(text, release)
    if not matches and not known_upstream:
        print("no match: no entry explains this" + (f" (DeepSpeed {release})" if release else "")
              + "; `fixbook list` shows them all", file=sys.stderr)
        print(next_steps(text, release), file=sys.stderr)
        return 1
    for found in matches:
        fix = registry.get(found.fix_id)
        note = f" ({found.release_note})" if found.release_note else ""
        remedy = ("a behaviour change, not a bug; to pin the old behaviour: " if fix.info.is_behaviour_change
                  else "") + fix.info.apply_call
        print(f"{found.level:<8}  {fix.id:<34} {fix.info.title}{note}\n"
              f"{'':<10}why: {'; '.join(found.why)}\n{'':<10}fix: {remedy}")
    if known_upstream:
        print(("\n" if matches else "") + "Known upstream fixes that name what this error shows "
              "(no entry: no notebook proof, no fix module; upgrading past the release is upstream's remedy):")
        for known in known_upstream[:5]:
            when = f"fixed upstream in {known.first_release}" if known.first_release else "fixed upstream after 0.19.5"
            note = f"; {known.release_note}" if known.release_note else ""
            print(f"  PR #{known.pr}: {known.subject} [{known.component}, {known.symptom}; {when}{note}]\n"
                  f"  {'':<8}{'shares' if known.prose else 'names'}: {', '.join(known.named)}  {known.url}"
                  + (f"\n  {'':<8}{known.upstream_test}" if known.upstream_test else ""))
    return 0


def cmd_bisect(args: argparse.Namespace) -> int:
    from . import bisect

    script = Path(args.script)
    if not script.is_file():
        raise bisect.BisectError(f"no such script: {script}")
    cache = Path(args.cache) if args.cache else bisect.DEFAULT_CACHE
    releases = bisect.final_releases(args.since, cache, args.offline)
    known: dict[str, bisect.Outcome] = {}
    for name, release, outcome in (("--good", args.good, "absent"), ("--bad", args.bad, "present")):
        if release:
            if release not in releases:
                raise bisect.BisectError(f"{name} {release} is not among the releases considered "
                                         f"({releases[0] if releases else '-'} - {releases[-1] if releases else '-'})")
            known[release] = outcome  # type: ignore[assignment]
    if known:  # between the given good and bad only
        ends = sorted((releases.index(r) for r in known))
        releases = releases[ends[0]:ends[-1] + 1] if len(ends) == 2 else releases
    if not releases:
        raise bisect.BisectError(f"no DeepSpeed release >= {args.since} to run" + (" in the cache (--offline)" if args.offline else ""))
    print(f"bisecting {script} over {len(releases)} releases {releases[0]} - {releases[-1]} "
          f"(python {args.python}, cache {cache})", file=sys.stderr)

    def progress(run: "bisect.Run", done: int) -> None:
        print(f"  [{done:>2} runs] {run.release:<8} {run.outcome:<14} {run.seconds:5.0f} s"
              + (f"  {run.detail}" if run.detail else ""), file=sys.stderr, flush=True)

    result = bisect.bisect(releases, lambda r: bisect.run_script(script, r, cache, args.python, args.timeout, args.marker),
                           known, args.jobs, progress)
    print(bisect.table(result))
    print(result.summary)
    for fix_id, measured_range in bisect.similar_entries(result):
        print(f"looks like {fix_id} (measured affected {measured_range}): fixbook show {fix_id}")
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_json(), indent=1))
    return 130 if result.interrupted else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fixbook", description="DeepSpeed Fixbook: proven fixes for DeepSpeed bugs.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="every entry and its status here").set_defaults(run=cmd_list)
    show = commands.add_parser("show", help="one entry in full")
    show.add_argument("id")
    show.set_defaults(run=cmd_show)
    doctor = commands.add_parser("doctor", help="which known bugs this install has; with --config, which one job triggers")
    doctor.add_argument("--config", help="a DeepSpeed config (JSON): which known bugs this job triggers")
    doctor.add_argument("--world-size", type=int, help="with --config: the number of data-parallel ranks")
    doctor.add_argument("--accelerator", choices=["cpu", "cuda"],
                        help="with --config: where the job runs (default: cuda where torch sees a GPU here, else "
                             "unknown); on cuda, a bug measured on CPU only is named as such")
    doctor.add_argument("--uses", help="with --config: what the job does that a config cannot show, comma-separated "
                                       "(fixes.trigger.USES: direct-backward, no-sync, torch-func, pipeline, ...)")
    doctor.set_defaults(run=cmd_doctor)
    find = commands.add_parser("search", help="which entry explains a pasted error or traceback ('-': stdin)")
    find.add_argument("text", help="the error line or the whole traceback; '-' reads it from stdin")
    find.add_argument("--release", help="the DeepSpeed release it happened on (default: the installed one)")
    find.set_defaults(run=cmd_search)
    bisect = commands.add_parser("bisect", help="which DeepSpeed releases your reproduction script affects")
    bisect.add_argument("script", help="exits 0 where the bug is absent, 1 where it is present (else: could not run)")
    bisect.add_argument("--since", default=SWEEP_SINCE,
                        help=f"the oldest release to consider (default {SWEEP_SINCE}, the oldest the sweep measures)")
    bisect.add_argument("--good", help="a release known to be free of the bug (not run)")
    bisect.add_argument("--bad", help="a release known to have it (not run)")
    bisect.add_argument("--python", default=sys.executable, help="the interpreter to install and run with")
    bisect.add_argument("--jobs", type=int, default=1, help="runs at once (default 1)")
    bisect.add_argument("--marker", help="the bug is present when this text is in the output (instead of exit 1)")
    bisect.add_argument("--timeout", type=float, default=600, help="seconds per run (default 600)")
    bisect.add_argument("--json", help="also write the runs and the verdict to this file")
    bisect.add_argument("--cache", help="where releases are installed (default $FIXBOOK_CACHE or ~/.cache/fixbook/deepspeed)")
    bisect.add_argument("--offline", action="store_true", help="only the releases already in the cache")
    bisect.set_defaults(run=cmd_bisect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None and hasattr(signal, "SIGPIPE"):
        # As a program: a reader that goes away (`fixbook search ... | head -2`) ends it quietly, as it ends `cat`,
        # instead of a BrokenPipeError traceback (and DeepSpeed's logger's own, on import).
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except FixbookError as exc:
        print(f"fixbook: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # where there is no SIGPIPE: the rest of the output goes nowhere, quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
