"""Build, ahead of the first run, the C++ ops every DeepSpeed run on this machine compiles as it starts, so
that the first ZeRO run does not stall for minutes (`make install` runs `python -m
training.parallel.deepspeed_ops` in the background while pip installs the project). Ops that only some
runs use (GPU fused kernels) still build on first use. Where they build, and the refusal of a dead build's
lock: training.launch.op_builds.
"""

from __future__ import annotations

import sys
import time

from training.core.errors import cli
from training.launch.op_builds import (
    build_root,
    cache_cpu_info,
    check_op_build_locks,
    use_environment_build_dir,
)

# DeepSpeed's builders of the ops its runs compile as they start: CPU Adam (optimizer offload: every ZeRO
# config with `offload_optimizer_device: cpu`) and the CPU accelerator's shared-memory collectives (every
# DeepSpeed run on CPU processes; deepspeed.comm.torch.build_shm_op). An accelerator without one skips it.
PREBUILT = ("CPUAdamBuilder", "ShareMemCommBuilder")


def prebuild() -> list[str]:
    """Build the PREBUILT ops this machine's DeepSpeed accelerator offers into the directory runs load them
    from (use_environment_build_dir); return the names of the ops now built. An op already built for these
    sources, flags and torch only loads."""
    check_op_build_locks(use_environment_build_dir())
    cache_cpu_info()  # the builds' flags probe the CPU: probed here once, for every later run on this machine
    import deepspeed.ops  # here, not at the top: the directory above must be chosen before DeepSpeed loads
    from deepspeed.accelerator import get_accelerator

    built = []
    for name in PREBUILT:
        builder = get_accelerator().create_op_builder(name)
        if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
            continue
        builder.load(verbose=False)
        built.append(builder.NAME)
    return built


@cli
def main() -> int:
    start = time.time()
    built = prebuild()
    print(
        f"DeepSpeed ops ready in {build_root()}: {', '.join(built) or 'none'} ({time.time() - start:.0f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
