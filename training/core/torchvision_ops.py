"""torchvision's Python part beside a torch whose build its C++ operators were not made for.

The image processors transformers prefers (the "fast" ones, and every video processor) use torchvision's
transforms, which are plain torch. PyPI's torchvision wheel is built against the CUDA torch of its release: beside
the CPU build of the same torch (2.13.0+cpu here) its C++ library does not load, and `import torchvision` then
fails in `torchvision/_meta_registrations.py`, which registers fake kernels for `torchvision::nms` and
`torchvision::qnms` whether or not the library that defines them loaded ("operator torchvision::nms does not
exist"). Where the library does not load, `install()` defines those two operators' schemas, with no kernel, the
first time torchvision is imported: the import then succeeds, the transforms work, and the operators themselves
(detection's `torchvision.ops`, which no image processor here calls) raise torchvision's own "Couldn't load custom
C++ ops". Where the library loads (a torchvision built for the installed torch), nothing is defined.

Installed by `training/__init__.py`, before anything can import torchvision, and, for the processes of the venv
that never import `training` (a script loading final/ with plain transformers, whose modeling code imports
torchvision too), by the `.pth` file `main()` writes into site-packages, with a copy of this module (it imports
nothing from `training`), where it is needed (`make install` runs it; it removes both where torchvision's library
loads).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import sysconfig
from pathlib import Path

# the operators torchvision's Python code registers fake kernels for unconditionally (torchvision 0.28, 0.29)
SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_defined: list = []  # the torch.library.Library that holds the schemas: alive as long as the process


def extension_loads(package: Path) -> bool:
    """Whether torchvision's C++ library (`_C*.so` in `package`) loads into this torch."""
    import torch

    libraries = sorted(package.glob("_C*.so")) + sorted(package.glob("_C*.pyd"))
    if not libraries:
        return False
    try:
        torch.ops.load_library(str(libraries[0]))
    except OSError:
        return False
    return True


def define_missing_schemas() -> bool:
    """Define SCHEMAS where torchvision is installed, its C++ library does not load and they are not defined
    yet (by another copy of this module: the .pth's); True if it did."""
    if not torchvision_needs_schemas():
        return False
    import torch

    try:
        torch.ops.torchvision.nms  # noqa: B018 - defined already?
        return False
    except (AttributeError, RuntimeError):
        pass
    library = torch.library.Library("torchvision", "DEF")
    for schema in SCHEMAS:
        library.define(schema)
    _defined.append(library)
    return True


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    """Runs define_missing_schemas once, at the first `import torchvision`, and finds nothing itself (it stays in
    sys.meta_path: taking itself out while the import system walks that list would skip the next finder)."""

    llm_forge_torchvision = True

    def __init__(self):
        self.done = False

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" and not self.done:
            self.done = True
            define_missing_schemas()
        return None


def install() -> None:
    if "torchvision" in sys.modules or any(getattr(f, "llm_forge_torchvision", False) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _BeforeTorchvision())


PTH = "llm_forge_torchvision.pth"
MODULE = "llm_forge_torchvision_ops"  # this file's copy beside the .pth: startup imports no `training` (whose
# checkout may not be the one a process runs from, as in a git worktree sharing the venv)


def torchvision_needs_schemas() -> bool:
    """Whether torchvision is installed and its C++ library does not load into this torch."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    return not extension_loads(Path(next(iter(spec.submodule_search_locations))))


def write_pth(site_packages: Path) -> str:
    """Write (or remove) the .pth file, and this module's copy it imports, that install the hook in every process
    of this Python; what was done."""
    pth, module = site_packages / PTH, site_packages / f"{MODULE}.py"
    if torchvision_needs_schemas():
        module.write_text(Path(__file__).read_text())
        pth.write_text(f"import {MODULE}; {MODULE}.install()  # llm-forge: torchvision beside a CPU torch\n")
        return f"{pth}: written (torchvision's C++ library does not load into torch here)"
    pth.unlink(missing_ok=True)
    module.unlink(missing_ok=True)
    return f"{pth}: not needed (no torchvision, or its library loads)"


def main() -> None:
    """`make install`'s step (`python -c "from training.core import torchvision_ops; torchvision_ops.main()"`: not
    `-m`, which would run a second copy of this module once the .pth has imported the first)."""
    print(write_pth(Path(sysconfig.get_paths()["purelib"])))
