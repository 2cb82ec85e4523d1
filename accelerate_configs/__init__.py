"""The accelerate config files shipped with llm-forge (one YAML per backend, DeepSpeed JSONs beside them).

A package only so that `pip install .` ships the files and the planner, the app and the trainer find them
from any directory: training.core.paths.CONFIGS_DIR is this folder."""
