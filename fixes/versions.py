"""What is installed: DeepSpeed and torch versions, read without importing DeepSpeed."""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
from packaging.version import InvalidVersion, Version

# The oldest DeepSpeed release the release sweep measures (ci.sweep) and `fixbook bisect` considers by default.
# 0.14.4 is the oldest that imports and trains with the project's torch on CPU: 0.14.1 - 0.14.3 import
# torch.distributed.elastic's `_get_socket_with_port`, which newer torch no longer has, and 0.14.0 and older need
# intel_extension_for_pytorch for their CPU accelerator. From 0.14.4 on, the CPU accelerator runs `numactl`.
SWEEP_SINCE = "0.14.4"


def installed_deepspeed() -> str | None:
    """The version of the DeepSpeed that ``import deepspeed`` would load, or None if there is none.

    Reads the distribution metadata next to the package on ``sys.path`` (so it works for
    ``pip install --target`` directories) and never imports DeepSpeed itself, which is slow.
    """
    if importlib.util.find_spec("deepspeed") is None:
        return None
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        import deepspeed  # a source checkout without metadata: ask the package

        return str(deepspeed.__version__)


def installed_torch() -> str | None:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=4096)
def parse(release: str) -> Version:
    """A release string as a comparable version; raises ValueError with the bad string. Cached: the sweep's
    ranges compare every release with every other one, millions of times in a test run, and a Version is immutable."""
    try:
        return Version(release)
    except InvalidVersion as exc:
        raise ValueError(f"not a DeepSpeed release number: {release!r}") from exc
