"""Will my model work? The support matrix's row for the model you mean to train, before you download its
weights.

    python -m training.support PATH [--json]

PATH is a checkpoint directory (its config.json is read; no weight is), a config.json file, a hub name (read
from the hub or its cache) or bundled:NAME. The model is built tiny from that config, shrunk as the matrix
shrinks every type (training/model/tiny.py), and goes through the matrix's checks, printed as they are found,
each "no" with its reason. A causal LM gets the text checks (training/planning/support.py: lora, full,
chunked, varlen, ckpt, tiled, fsdp, tp, reload, gguf, planner); an image-text model (its config has a vision
part) the image-text ones (training/tools/image_text_support.py: LoRA and full fine-tuning through
training.train on two picture records, and the reload of final/). The tiny model has random weights and runs
on the CPU in fp32: the row says what the code does with this architecture, not how the real model's weights
behave or whether they fit in memory (that is `python -m training.plan`). The checks are the ones
`python -m benchmarks.models` and `python -m benchmarks.image_text_models` run on every type for
docs/models.md.

Exit codes: 0 when the row is printed (whatever it says); 2 for a path that holds no model, a config that is
not JSON or names no model_type, a model_type transformers does not know, or one that is neither a causal LM
nor an image-text model.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

import transformers
from transformers import AutoConfig, PreTrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)

from training.config.architectures import has_vision_part
from training.core.errors import UserError, cli
from training.planning import support
from training.run.rundir import MODEL_CONFIG
from training.run.sources import pretrained_source
from training.tools import image_text_support

log = logging.getLogger(__name__)


def config_file(path: Path) -> Path:
    """The config.json PATH names: the file itself, or the one in the directory."""
    if path.is_dir():
        if not (path / MODEL_CONFIG).is_file():
            raise UserError(
                f"{path}: holds no model: expected a {MODEL_CONFIG} (a checkpoint directory as save_pretrained "
                f"writes it, or the {MODEL_CONFIG} itself)"
            )
        return path / MODEL_CONFIG
    return path


def local_config(path: Path) -> PreTrainedConfig:
    """The transformers config of a local config.json, its model_type checked first (named in the message)."""
    file = config_file(path)
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{file}: cannot read it as a model's {MODEL_CONFIG} ({e})") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if not isinstance(model_type, str):
        raise UserError(f"{file}: names no model_type (a transformers {MODEL_CONFIG} has one)")
    if model_type not in CONFIG_MAPPING_NAMES:
        raise UserError(
            f"{file}: model_type {model_type!r} is not a type transformers {transformers.__version__} knows "
            "(a newer transformers, or the model's own code with trust_remote_code, may have it)"
        )
    try:
        return AutoConfig.from_pretrained(file.parent if file.name == MODEL_CONFIG else file)
    except (OSError, ValueError, TypeError) as e:
        raise UserError(f"{file}: transformers cannot read this {model_type} config ({e})") from None


def hub_config(name: str) -> PreTrainedConfig:
    """The config of a name that is no local path: bundled:NAME (training.run.sources), a hub name."""
    try:
        return AutoConfig.from_pretrained(pretrained_source(name))
    except (OSError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(
            f"{name}: no such file or directory, and no model config from the hub or its cache ({first})"
        ) from None


def kind_of(config: PreTrainedConfig, where: str) -> str:
    """'image-text' (a vision part and an image-text class), 'text' (a causal LM), else refused."""
    model_type = config.model_type
    if has_vision_part(config) and model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return "image-text"
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return "text"
    raise UserError(
        f"{where}: model_type {model_type!r} is neither a causal LM nor an image-text model transformers "
        "registers, so it is nothing this trainer trains"
    )


def check(path: str, said) -> tuple[str, support.Row]:
    """(kind, the row) of the model at `path`, each cell told to said(check, cell) as it is found."""
    local = Path(path)
    config = local_config(local) if local.exists() else hub_config(path)
    kind = kind_of(config, path)
    if kind == "image-text":
        os.environ["LLM_FORGE_PRECISION_AUTO"] = "no"  # the trainer in fp32, as the matrix runs it
        return kind, image_text_support.check_type(config.model_type, config=config, said=said)
    return kind, support.check_type(config.model_type, config=config, said=said)


def checks_of(kind: str) -> tuple[str, ...]:
    return image_text_support.CHECKS if kind == "image-text" else support.CHECKS


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.support", description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="a checkpoint directory, its config.json, or a hub model name")
    ap.add_argument("--json", action="store_true", help="print the row as one JSON object instead")
    args = ap.parse_args(argv)
    logging.disable(logging.WARNING)  # the tiny models' and the trainer's warnings: not the row
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    printed: set[str] = set()

    def said(name: str, cell: str) -> None:
        if not args.json:
            print(f"  {name:8s} {cell}", flush=True)
            printed.add(name)

    if not args.json:
        print(f"{args.path}: built tiny from its config, checked on the CPU", flush=True)
    kind, row = check(args.path, said)
    checks = checks_of(kind)
    if args.json:
        print(json.dumps({"path": args.path, "model_type": row.model_type, "kind": kind, **vars(row)}))
        return 0
    # the cells found without running a check (a refused type, one that does not build; reload)
    for name in checks:
        if name not in printed:
            said(name, row.cells.get(name, "no: not checked"))
    ok = sum(row.ok(c) for c in checks)
    print(f"{row.model_type} ({kind}): {ok} of {len(checks)} checks yes, {row.seconds:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
