"""torchvision beside the installed torch (training/core/torchvision_ops.py): where its C++ library does not load
(PyPI's wheel, built for the CUDA torch, beside the CPU one), `import torchvision` fails without the hook and works
with it, in a process that never imports `training` too (the .pth make install writes); where the library loads,
the hook defines nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from training.core import torchvision_ops

pytest.importorskip("torchvision")

WITHOUT_HOOK = """
import sys
from pathlib import Path
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "llm_forge_torchvision", False)]
try:
    import torchvision
    print("imported")
except RuntimeError as e:
    print(e)
"""

PLAIN = """
import sys, torch
from transformers import Qwen2VLImageProcessor  # the torchvision backend
out = Qwen2VLImageProcessor(size={"shortest_edge": 64, "longest_edge": 4096})(torch.rand(3, 28, 28), return_tensors="pt")
print("training" in sys.modules, tuple(out["image_grid_thw"][0].tolist()))
"""


def python(code: str, cwd) -> str:
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=cwd)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.strip().splitlines()[-1]


def test_torchvision_imports_with_the_hook_and_only_needs_it_where_its_library_does_not_load(tmp_path):
    without = python(WITHOUT_HOOK, tmp_path)
    if torchvision_ops.torchvision_needs_schemas():
        assert without == "operator torchvision::nms does not exist"
    else:
        assert without == "imported"
    # a process that never imports `training` (run outside the checkout): the .pth's hook, the transforms work
    assert python(PLAIN, tmp_path) == "False (1, 2, 2)"


def test_where_the_schemas_were_defined_the_operators_say_torchvisions_own_error():
    import torch
    import torchvision

    if not torchvision_ops.torchvision_needs_schemas():
        pytest.skip("torchvision's C++ library loads here: its operators are real")
    with pytest.raises(RuntimeError, match="Couldn't load custom C\\+\\+ ops"):
        torchvision.ops.nms(torch.rand(2, 4), torch.rand(2), 0.5)
    assert torchvision_ops.define_missing_schemas() is False  # defined once in a process, by whichever copy


def test_the_pth_file_and_its_module_are_written_where_needed_and_removed_where_not(tmp_path, monkeypatch):
    monkeypatch.setattr(torchvision_ops, "torchvision_needs_schemas", lambda: True)
    assert torchvision_ops.write_pth(tmp_path).endswith(
        "written (torchvision's C++ library does not load into torch here)"
    )
    module = tmp_path / f"{torchvision_ops.MODULE}.py"
    assert module.read_text() == Path(torchvision_ops.__file__).read_text()
    line = (tmp_path / torchvision_ops.PTH).read_text()
    assert line.startswith(f"import {torchvision_ops.MODULE}; {torchvision_ops.MODULE}.install()")
    monkeypatch.setattr(torchvision_ops, "torchvision_needs_schemas", lambda: False)
    assert torchvision_ops.write_pth(tmp_path).endswith("not needed (no torchvision, or its library loads)")
    assert not module.exists() and not (tmp_path / torchvision_ops.PTH).exists()
