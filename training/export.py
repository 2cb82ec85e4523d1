"""Export a run's adapter, or merge it into its base model.

    python -m training.export RUN_DIR --merge [--out DIR] [--dtype auto|float32|bfloat16|float16]
    python -m training.export RUN_DIR --out DIR      # copy the adapter-only final/ (adapter + tokenizer)

RUN_DIR is a run directory (its final/ is used) or an adapter directory. A LoRA/QLoRA run's final/
holds only the adapter (that stays the default: small, and loadable with peft on top of the base).
--merge folds the adapter into the base weights (peft `merge_and_unload`) and writes a plain
transformers model directory (default RUN_DIR/merged) that needs neither peft nor bitsandbytes.
A QLoRA base is reloaded from its original weights in 16/32-bit, never merged into 4-bit weights
(re-quantising would round the learned update away). Before saving, the merged model's logits are
compared with base+adapter on a probe sentence and the largest difference is printed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
from pathlib import Path

import torch

from training.errors import UserError, cli

log = logging.getLogger("training.export")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PROBE = "The quick brown fox jumps over the lazy dog. 2024-01-31"


def find_adapter(source: str | Path) -> tuple[Path, Path | None]:
    """(adapter directory, run directory or None) for a run directory, its final/, or an adapter directory."""
    p = Path(source)
    if not p.is_dir():
        raise UserError(f"{source}: no such run or adapter directory")
    for cand in (p, p / "final"):
        if (cand / "adapter_config.json").is_file():
            run = cand.parent if (cand.parent / "config.yaml").is_file() else None
            return cand, run
    if (p / "final" / "config.json").is_file() or (p / "config.json").is_file():
        raise UserError(
            f"{source}: holds a full model (method.type=full), not an adapter: there is nothing to merge; "
            f"its final/ already loads with plain transformers"
        )
    if (p / "config.yaml").is_file():
        raise UserError(f"{source}: the run has no final/ yet (training did not finish); export needs final/")
    raise UserError(f"{source}: not a run directory or adapter directory (no adapter_config.json)")


def run_recipe(run: Path | None):
    if run is None:
        return None
    from training.config import load_recipe

    return load_recipe(run / "config.yaml")


def base_source(adapter: Path, recipe) -> str:
    """Where the base weights are: adapter_config.json's base if it is still there, else the recipe's model."""
    from training.models import resolve_source

    base = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if base and Path(base).exists():
        return base
    if recipe is not None and recipe.model.name_or_path:
        return resolve_source(recipe.model.name_or_path)
    if base:
        return base  # a hub name
    raise UserError(f"{adapter}/adapter_config.json names no base model and there is no run config.yaml to ask")


def pick_dtype(requested: str, recipe) -> torch.dtype:
    if requested != "auto":
        return DTYPES[requested]
    return DTYPES[recipe.model.dtype] if recipe is not None else torch.float32


def probe_logits(model, tokenizer) -> torch.Tensor:
    ids = tokenizer(PROBE, return_tensors="pt").input_ids.to(model.device)
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def write_dir(out: Path, save) -> None:
    """Write a directory atomically (temp dir + rename); only an earlier export or an empty dir is replaced."""
    if out.exists() and any(out.iterdir()) and not (out / "config.json").is_file() and not (out / "adapter_config.json").is_file():
        raise UserError(f"--out {out}: exists and does not hold an earlier export; choose another directory")
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    save(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


def merge(adapter: Path, out: Path, dtype: torch.dtype, base: str) -> float:
    """Merge the adapter into an unquantised base and save it to `out`. Returns max |logit difference|."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(adapter)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)  # no quantization_config: 16/32-bit weights
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))  # as training did
    model = PeftModel.from_pretrained(model, str(adapter)).eval()
    before = probe_logits(model, tokenizer)
    merged = model.merge_and_unload()
    diff = (probe_logits(merged, tokenizer) - before).abs().max().item()
    merged.config.use_cache = True

    def save(tmp: Path) -> None:
        merged.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

    write_dir(out, save)
    return diff


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m training.export", description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="run directory (uses its final/) or adapter directory")
    ap.add_argument("--merge", action="store_true", help="merge the adapter into the base and save a full model")
    ap.add_argument("--out", help="output directory (default with --merge: RUN_DIR/merged)")
    ap.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="merged weights' dtype (auto: the recipe's model.dtype)")
    return ap.parse_args(argv)


@cli
def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import transformers

    transformers.logging.set_verbosity_error()
    adapter, run = find_adapter(args.run)
    if not args.merge:
        if not args.out:
            raise UserError(f"{adapter} already is the adapter export; pass --merge for a full model, or --out DIR to copy it")
        write_dir(Path(args.out), lambda tmp: shutil.copytree(adapter, tmp))
        print(f"adapter copied to {args.out}")
        return 0
    recipe = run_recipe(run)
    out = Path(args.out) if args.out else (run or adapter.parent) / "merged"
    dtype = pick_dtype(args.dtype, recipe)
    base = base_source(adapter, recipe)
    qlora = recipe is not None and recipe.method.type == "qlora"
    print(f"merging {adapter} into {base} ({'QLoRA adapter; base reloaded unquantised, ' if qlora else ''}{str(dtype).split('.')[-1]})")
    diff = merge(adapter, out, dtype, base)
    print(f"max |logit difference| merged vs base+adapter: {diff:.2e}")
    print(f"merged model written to {out} (load with AutoModelForCausalLM.from_pretrained)")
    return 0


if __name__ == "__main__":
    main()
