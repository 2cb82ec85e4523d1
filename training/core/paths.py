"""Where the files that ship with llm-forge are, in a checkout and in an installed package alike.

PACKAGE_DIR   training/ (recipes/, eval_tasks/)
CONFIGS_DIR   accelerate_configs/ (package data of its own: found after `pip install .` too)
ROOT          the folder holding both: the checkout, or site-packages when installed; a path in an
              accelerate config such as `accelerate_configs/ds_zero2.json` is found relative to it
"""

from __future__ import annotations

from pathlib import Path

import accelerate_configs

PACKAGE_DIR = Path(__file__).resolve().parents[1]
CONFIGS_DIR = Path(accelerate_configs.__file__).resolve().parent
ROOT = CONFIGS_DIR.parent
RECIPES_DIR = PACKAGE_DIR / "recipes"
