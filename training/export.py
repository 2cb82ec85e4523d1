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
import logging
import shutil
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from training.config import Recipe, load_recipe
from training.dtypes import DTYPES
from training.errors import UserError, cli
from training.fs import atomic_dir
from training.models import adapter_base
from training.rundir import FINAL, Source, is_adapter, is_model, resolve_source

log = logging.getLogger("training.export")
PROBE = "The quick brown fox jumps over the lazy dog. 2024-01-31"


def find_adapter(source: str | Path) -> Source:
    """The adapter of a run directory, its final/, or an adapter directory (with its run, if any)."""
    found = resolve_source(source, hub=False)
    if found.kind == "model":
        raise UserError(
            f"{source}: holds a full model (method.type=full), not an adapter: there is nothing to merge; "
            f"its {FINAL}/ already loads with plain transformers"
        )
    if found.kind == "checkpoint":
        raise UserError(
            f"{source}: the run has no {FINAL}/ yet (training did not finish); export needs {FINAL}/"
        )
    return found


def run_recipe(adapter: Source) -> Recipe | None:
    return load_recipe(adapter.run.config) if adapter.run is not None else None


def pick_dtype(requested: str, recipe: Recipe | None) -> torch.dtype:
    if requested != "auto":
        return DTYPES[requested]
    return DTYPES[recipe.model.dtype] if recipe is not None else torch.float32


def probe_logits(model, tokenizer) -> torch.Tensor:
    ids = tokenizer(PROBE, return_tensors="pt").input_ids.to(model.device)
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def write_dir(out: Path, save) -> None:
    """Write an export directory atomically (fs.atomic_dir); only an earlier export or an empty
    directory is replaced."""
    if out.exists() and any(out.iterdir()) and not is_model(out) and not is_adapter(out):
        raise UserError(f"--out {out}: exists and does not hold an earlier export; choose another directory")
    with atomic_dir(out) as tmp:
        save(tmp)


def merge(adapter: Path, out: Path, dtype: torch.dtype, base: str) -> float:
    """Merge the adapter into an unquantised base and save it to `out`. Returns max |logit difference|."""
    # peft imports bitsandbytes (seconds): not for --help or a refused source
    from peft import PeftModel

    tokenizer = AutoTokenizer.from_pretrained(adapter)
    model = AutoModelForCausalLM.from_pretrained(
        base, dtype=dtype
    )  # no quantization_config: 16/32-bit weights
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
    ap.add_argument(
        "--merge", action="store_true", help="merge the adapter into the base and save a full model"
    )
    ap.add_argument("--out", help="output directory (default with --merge: RUN_DIR/merged)")
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPES],
        help="merged weights' dtype (auto: the recipe's model.dtype)",
    )
    return ap.parse_args(argv)


@cli
def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    transformers.logging.set_verbosity_error()
    adapter = find_adapter(args.run)
    if not args.merge:
        if not args.out:
            raise UserError(
                f"{adapter.path} already is the adapter export; "
                "pass --merge for a full model, or --out DIR to copy it"
            )
        write_dir(Path(args.out), lambda tmp: shutil.copytree(adapter.path, tmp, dirs_exist_ok=True))
        print(f"adapter copied to {args.out}")
        return 0
    recipe = run_recipe(adapter)
    home = adapter.run.root if adapter.run else Path(adapter.path).parent
    out = Path(args.out) if args.out else home / "merged"
    dtype = pick_dtype(args.dtype, recipe)
    base = adapter_base(adapter)
    qlora = recipe is not None and recipe.method.type == "qlora"
    note = "QLoRA adapter; base reloaded unquantised, " if qlora else ""
    print(f"merging {adapter.path} into {base} ({note}{str(dtype).split('.')[-1]})")
    diff = merge(Path(adapter.path), out, dtype, base)
    print(f"max |logit difference| merged vs base+adapter: {diff:.2e}")
    print(f"merged model written to {out} (load with AutoModelForCausalLM.from_pretrained)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
