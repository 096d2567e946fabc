"""fixes.harness.precision: fp16 on DeepSpeed's CPU accelerator only while the harness allows it (a child process
of the newest release)."""
from ci import releases
from tests.helpers import call_in_release


def check_fp16_is_allowed_on_the_cpu_accelerator_only_while_asked():
    import torch
    from deepspeed.accelerator import get_accelerator
    from fixes import harness

    harness.setup()
    accelerator = get_accelerator()
    native, native_dtypes = accelerator.is_fp16_supported(), accelerator.supported_dtypes()  # False/None here
    with harness.fp16_on_cpu() as allowed:
        assert allowed and accelerator.is_fp16_supported() and torch.float16 in accelerator.supported_dtypes()
        assert harness.allow_fp16_on_cpu() and harness.fp16_allowed_on_cpu()  # idempotent
    assert accelerator.is_fp16_supported() == native and accelerator.supported_dtypes() == native_dtypes
    assert "is_fp16_supported" not in vars(accelerator) and not harness.fp16_allowed_on_cpu()


def test_when_fp16_is_allowed_on_cpu_then_only_inside_the_block():
    call_in_release(releases.load().newest, check_fp16_is_allowed_on_the_cpu_accelerator_only_while_asked)
