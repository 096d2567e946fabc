"""op-builder-arch-variant-suffix on its reproduce release (0.19.3: the JIT and the install path), on the release
whose JIT path only has it (0.19.0), on the newest, and on releases without it (0.18.9, 0.16.0), in child
processes. Nothing is compiled: PyTorch's ``load`` is recorded (``reproduce.jit_build``)."""
from ci import releases
from tests.helpers import assert_fix_repairs_reproduction, assert_noop_on_fixed_release, call_in_release

AFFECTED = "0.19.3"
JIT_ONLY = "0.19.0"  # the JIT path parses the minor with int(); the install path keeps it as text
NOT_AFFECTED = "0.18.9"
OLDEST = "0.16.0"
FIX_ID = "op-builder-arch-variant-suffix"
INT_ERROR = "invalid literal for int() with base 10: '0a'"


def _owner():
    from fixes.harness import setup

    setup()
    from fixes.entries.op_builder_arch_variant_suffix import _TARGET

    return _TARGET.owner_and_name()[0]


def check_both_paths_raise_and_with_the_fix_build_what_pytorch_builds():
    import fixes
    from fixes.entries.op_builder_arch_variant_suffix import reproduce as r

    _owner()
    for build in r.builds(r.ARCH_LIST):
        assert build.error == f"ValueError: {INT_ERROR}", build
    fixes.apply(FIX_ID)
    try:
        for arch_list in r.VERIFY_LISTS:
            for build in r.builds(arch_list):
                assert build.flags is not None, build
                assert (build.sass, build.ptx) == r.expected_targets(build.path, arch_list), (arch_list, build)
        assert r.jit_build("9.0a").flags == ("-gencode=arch=compute_90a,code=compute_90a",
                                             "-gencode=arch=compute_90a,code=sm_90a")
        assert r.install_build("9.0a").flags == ("-gencode=arch=compute_90a,code=sm_90a",)
    finally:
        fixes.revert(FIX_ID)


def check_jit_only_release_crashes_in_load_and_the_fix_repairs_it():
    import fixes
    from fixes.entries.op_builder_arch_variant_suffix import reproduce as r

    _owner()
    jit, install = r.builds(r.ARCH_LIST)
    assert jit.error == f"ValueError: {INT_ERROR}", jit
    assert install.flags == ("-gencode=arch=compute_90a,code=sm_90a",), install  # this release's install path is right
    assert fixes.get(FIX_ID).probe().affected
    fixes.apply(FIX_ID)
    try:
        for arch_list in r.VERIFY_LISTS:
            build = r.jit_build(arch_list)
            assert (build.sass, build.ptx) == r.expected_targets("jit", arch_list), (arch_list, build)
        assert r.install_build(r.ARCH_LIST) == install
    finally:
        fixes.revert(FIX_ID)


def check_without_a_variant_the_original_answers():
    """Lists without a variant, and lists the wrapper cannot parse, reach the original: the same flags, the same
    TORCH_CUDA_ARCH_LIST after, the same error."""
    import os

    import fixes
    from fixes.entries.op_builder_arch_variant_suffix import reproduce as r

    _owner()

    def outcomes():
        found = []
        for arch_list in ("8.0;7.5;8.0+PTX", "9.0", "7.0 8.6+PTX", "Hopper", "9.0a;Hopper", None):
            for path in ("jit", "install"):
                op = r.builder()
                op.jit_mode = path == "jit"
                with r.arch_list(arch_list):
                    try:
                        found.append((arch_list, path, op.compute_capability_args(), op.enable_bf16,
                                      os.environ.get("TORCH_CUDA_ARCH_LIST")))
                    except Exception as exc:  # noqa: BLE001 - compared as they are
                        found.append((arch_list, path, f"{type(exc).__name__}: {exc}"))
        op = r.builder()
        with r.arch_list(None):  # install path, no TORCH_CUDA_ARCH_LIST: the cross_compile_archs argument
            found.append(("cross", op.compute_capability_args("8.0;9.0+PTX"), os.environ.get("TORCH_CUDA_ARCH_LIST")))
        return found

    before = outcomes()
    assert any("Hopper" in str(o[0]) and "ValueError" in str(o[-1]) for o in before), before
    assert any(o[0] is None and o[1] == "jit" and "no CUDA devices" in str(o[-1]) for o in before), before
    fixes.apply(FIX_ID)
    try:
        assert outcomes() == before
    finally:
        fixes.revert(FIX_ID)


def check_variant_keeps_filter_bf16_and_the_override_warning():
    import contextlib
    import io
    import os

    import fixes
    from fixes.entries.op_builder_arch_variant_suffix import reproduce as r

    _owner()
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    class AmpereAndNewer(FusedAdamBuilder):  # as FPQuantizerBuilder and the inference builders filter, by major
        def filter_ccs(self, ccs):
            return [cc.split(".") for cc in ccs if int(cc.split(".")[0]) >= 8]

    fixes.apply(FIX_ID)
    try:
        op = AmpereAndNewer()
        with r.arch_list("7.0;9.0a;8.0"):
            assert op.compute_capability_args() == ["-gencode=arch=compute_80,code=sm_80",
                                                    "-gencode=arch=compute_90a,code=sm_90a"]
            assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0a"
        assert op.enable_bf16 is True
        op = r.builder()
        with r.arch_list("7.0;9.0a"):
            op.compute_capability_args()
        assert op.enable_bf16 is False
        op.jit_mode = True
        with r.arch_list("9.0a;8.0;9.0a"):  # sorted, deduplicated, +PTX on the highest
            assert op.compute_capability_args() == []
            assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0a+PTX"
        op = r.builder()
        out = io.StringIO()
        with r.arch_list("9.0a"), contextlib.redirect_stdout(out):
            assert op.compute_capability_args("8.0") == ["-gencode=arch=compute_90a,code=sm_90a"]
        assert "env var TORCH_CUDA_ARCH_LIST=9.0a overrides cross_compile_archs=8.0" in out.getvalue(), out.getvalue()
        with r.arch_list(None):
            assert op.compute_capability_args("8.0;9.0a+PTX") == [
                "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90a,code=sm_90a",
                "-gencode=arch=compute_90a,code=compute_90a"]
    finally:
        fixes.revert(FIX_ID)


def check_unaffected_release_is_a_noop():
    import fixes
    from fixes.entries.op_builder_arch_variant_suffix import reproduce as r

    owner = _owner()
    fix = fixes.get(FIX_ID)
    assert not fix.probe().affected and "parses no minor part with int()" in fix.probe().evidence
    assert fix.reproduce() is False
    jit, install = r.builds(r.ARCH_LIST)
    assert jit.no_devices and install.flags is not None, (jit, install)  # the JIT path asks the devices: none here
    assert_noop_on_fixed_release(FIX_ID, owner)


def check_newest_release_is_affected():
    import fixes

    _owner()
    assert fixes.get(FIX_ID).probe().affected, "the newest release no longer has the bug: update the entry"
    assert_fix_repairs_reproduction(FIX_ID)


def check_trigger_cells():
    from fixes.entries.op_builder_arch_variant_suffix.reproduce import trigger_cells

    _owner()
    assert [cell.run() for cell in trigger_cells()] == [True, False, False]


def test_when_arch_variant_then_both_paths_raise_and_with_the_fix_build_pytorchs_targets():
    call_in_release(AFFECTED, check_both_paths_raise_and_with_the_fix_build_what_pytorch_builds)


def test_when_only_the_jit_path_parses_the_minor_then_load_raises_and_the_fix_repairs_it():
    call_in_release(JIT_ONLY, check_jit_only_release_crashes_in_load_and_the_fix_repairs_it)


def test_when_no_variant_or_unparseable_list_then_the_fix_returns_the_originals_answer():
    call_in_release(AFFECTED, check_without_a_variant_the_original_answers)


def test_when_variant_then_filter_bf16_sort_dedupe_and_override_warning_are_kept():
    call_in_release(AFFECTED, check_variant_keeps_filter_bf16_and_the_override_warning)


def test_when_release_parses_no_minor_then_not_affected_and_apply_is_a_noop():
    call_in_release(NOT_AFFECTED, check_unaffected_release_is_a_noop)


def test_when_oldest_release_then_not_affected_and_apply_is_a_noop():
    call_in_release(OLDEST, check_unaffected_release_is_a_noop)


def test_when_newest_release_then_still_affected_and_the_fix_repairs_it():
    call_in_release(releases.load().newest, check_newest_release_is_affected)


def test_when_cuda_builder_and_a_variant_then_the_trigger_cell_reproduces_and_the_cpu_builder_or_no_variant_does_not():
    call_in_release(AFFECTED, check_trigger_cells)
