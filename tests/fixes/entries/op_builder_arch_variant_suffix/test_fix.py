"""op-builder-arch-variant-suffix beyond the contract and the notebook (0.19.3, both paths vs PyTorch's targets): the
release whose JIT path alone has the bug (0.19.0), the lists the fix hands to the original, and what the wrapper keeps.
Nothing is compiled: PyTorch's ``load`` is recorded (``reproduce.jit_build``)."""
from tests.helpers import call_in_release

AFFECTED = "0.19.3"
JIT_ONLY = "0.19.0"  # the JIT path parses the minor with int(); the install path keeps it as text
FIX_ID = "op-builder-arch-variant-suffix"


def _reproduction():
    from fixes.harness import setup

    setup()
    from fixes.entries.op_builder_arch_variant_suffix import reproduce

    return reproduce


def check_jit_only_release_crashes_in_load_and_the_fix_repairs_it():
    import fixes

    r = _reproduction()
    jit, install = r.builds(r.ARCH_LIST)
    assert jit.error == f"ValueError: {r.INT_ERROR}: '0a'", jit
    assert install.flags == ("-gencode=arch=compute_90a,code=sm_90a",), install  # this release's install path is right
    fixes.apply(FIX_ID)
    for arch_list in r.VERIFY_LISTS:
        build = r.jit_build(arch_list)
        assert (build.sass, build.ptx) == r.expected_targets("jit", arch_list), (arch_list, build)
    assert r.install_build(r.ARCH_LIST) == install


def check_without_a_variant_the_original_answers():
    """Lists without a variant, and lists the wrapper cannot parse, get the original's flags, TORCH_CUDA_ARCH_LIST
    after, and error."""
    import os

    import fixes

    r = _reproduction()

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
    assert outcomes() == before


def check_variant_keeps_flag_order_filter_bf16_and_the_override_warning():
    import contextlib
    import io
    import os

    import fixes

    r = _reproduction()
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    class AmpereAndNewer(FusedAdamBuilder):  # as FPQuantizerBuilder and the inference builders filter, by major
        def filter_ccs(self, ccs):
            return [cc.split(".") for cc in ccs if int(cc.split(".")[0]) >= 8]

    fixes.apply(FIX_ID)
    assert r.jit_build("9.0a").flags == ("-gencode=arch=compute_90a,code=compute_90a",
                                         "-gencode=arch=compute_90a,code=sm_90a")
    assert r.install_build("9.0a").flags == ("-gencode=arch=compute_90a,code=sm_90a",)
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
    op, out = r.builder(), io.StringIO()
    with r.arch_list("9.0a"), contextlib.redirect_stdout(out):
        assert op.compute_capability_args("8.0") == ["-gencode=arch=compute_90a,code=sm_90a"]
    assert "env var TORCH_CUDA_ARCH_LIST=9.0a overrides cross_compile_archs=8.0" in out.getvalue(), out.getvalue()
    with r.arch_list(None):
        assert op.compute_capability_args("8.0;9.0a+PTX") == [
            "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90a,code=sm_90a",
            "-gencode=arch=compute_90a,code=compute_90a"]


def test_when_only_the_jit_path_parses_the_minor_then_load_raises_and_the_fix_repairs_it():
    call_in_release(JIT_ONLY, check_jit_only_release_crashes_in_load_and_the_fix_repairs_it)


def test_when_no_variant_or_unparseable_list_then_the_fix_returns_the_originals_answer():
    call_in_release(AFFECTED, check_without_a_variant_the_original_answers)


def test_when_variant_then_flag_order_filter_bf16_sort_dedupe_and_override_warning_are_kept():
    call_in_release(AFFECTED, check_variant_keeps_flag_order_filter_bf16_and_the_override_warning)
