"""GPU benchmarks (skipped without CUDA): print a table and write benchmarks/results/gpu.json.

1. MFU of bf16 pretraining of a Llama-shaped ~1B model on one GPU, documents packed into full
   2048-token blocks, flash-attention-2 if installed else SDPA (target MFU >= 45%).
2. QLoRA (4-bit NF4 + LoRA r16 all-linear) of a Llama-3-8B-shaped model with random weights at
   sequence length 2048: peak memory (target <= 7 GiB) and tokens/s.
3. Full fine-tuning of a 7B-shaped (Llama-2-7B) model on one GPU through DeepSpeed ZeRO-3 with CPU
   offload of parameters and optimizer states (16 bytes/param would need ~100 GiB without offload).

Each case runs the real training loop (`python -m training.train`, or `accelerate launch` with the
ZeRO-3 offload config) and reports the planner's prediction beside the measurement.

    python -m benchmarks.gpu [--only mfu_1b,qlora_8b,zero3_offload_7b] [--steps N]
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import torch

from benchmarks.common import (
    ROOT,
    TOKENIZER,
    read_rows,
    save_result,
    steady_tokens_per_s,
    table,
    tempdir,
    write_recipe,
)

LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)  # TinyLlama-1.1B shape
LLAMA3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)
LLAMA2_7B = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def corpus(folder) -> str:
    path = folder / "corpus.txt"
    path.write_text((ROOT / "data/tiny_stories.txt").read_text() * 40)  # ~2.4M tokens of real text
    return str(path)


def random_model(folder, name: str, shape: dict) -> str:
    """A random-weight Llama of this shape saved as a bf16 pretrained directory (+ the bundled tokenizer)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from training.config import ModelSection
    from training.models import load_tokenizer

    out = folder / name
    tok = load_tokenizer(ModelSection(name_or_path=TOKENIZER))
    cfg = LlamaConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **shape
    )
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    return str(out)


def run(folder, name: str, raw: dict, launcher: list[str]) -> dict:
    from training.config import load_recipe
    from training.plan import estimate

    path = write_recipe(raw, folder, f"{name}.yaml")
    gpu_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    plans = {
        p.backend: p
        for p in estimate(load_recipe(path), 1, gpu_gib)
        if not p.gradient_checkpointing or raw["model"].get("gradient_checkpointing")
    }
    proc = subprocess.run([*launcher, str(path)], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"case": name, "error": proc.stderr[-2000:]}
    rows = read_rows(raw["output_dir"])
    mfus = [r["mfu"] for r in rows[3:] if r.get("mfu") is not None]
    backend = "zero3_offload" if "zero3" in " ".join(launcher) else "single"
    plan = plans.get(backend)
    return {
        "case": name,
        "tokens_per_s": steady_tokens_per_s(rows, 3),
        "mfu": sum(mfus) / len(mfus) if mfus else None,
        "peak_mem_gib": max(r["peak_mem_gb"] for r in rows),
        "planned_peak_gib": plan.peak_gib if plan else None,
        "attn_implementation": rows[0].get("attn_implementation"),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu")
    ap.add_argument("--only", default="mfu_1b,qlora_8b,zero3_offload_7b")
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("GPU benchmarks: skipped: no CUDA")
        return {"skipped": "no CUDA"}
    folder = tempdir("gpu-bench")
    text = corpus(folder)
    py = [sys.executable, "-m", "training.train"]
    common = {
        "resume": "none",
        "eval": {"at_start": False},
        "data": {"train": text, "format": "text", "max_length": 2048},
    }
    results = []
    wanted = args.only.split(",")
    if "mfu_1b" in wanted:
        results.append(
            run(
                folder,
                "mfu_1b",
                {
                    **common,
                    "output_dir": str(folder / "mfu_1b"),
                    "precision": "bf16",
                    "model": {
                        "tokenizer": TOKENIZER,
                        "from_scratch": LLAMA_1B,
                        "attn_implementation": "auto",
                    },
                    "train": {"batch_size": 8, "max_steps": args.steps, "lr": 3e-4, "warmup_steps": 2},
                },
                py,
            )
        )
    if "qlora_8b" in wanted:
        src = random_model(folder, "llama3-8b-random", LLAMA3_8B)
        results.append(
            run(
                folder,
                "qlora_8b",
                {
                    **common,
                    "output_dir": str(folder / "qlora_8b"),
                    "precision": "bf16",
                    "model": {"name_or_path": src, "dtype": "bfloat16", "gradient_checkpointing": True},
                    "method": {"type": "qlora", "lora": {"r": 16, "target_modules": "all-linear"}},
                    "train": {
                        "batch_size": 1,
                        "max_steps": args.steps,
                        "lr": 1e-4,
                        "optimizer": "paged_adamw_8bit",
                    },
                },
                py,
            )
        )
    if "zero3_offload_7b" in wanted:
        src = random_model(folder, "llama2-7b-random", LLAMA2_7B)
        launch = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            "accelerate_configs/zero3_offload.yaml",
            "--num_processes",
            "1",
            "-m",
            "training.train",
        ]
        results.append(
            run(
                folder,
                "zero3_offload_7b",
                {
                    **common,
                    "output_dir": str(folder / "z3"),
                    "precision": "bf16",
                    "model": {"name_or_path": src, "gradient_checkpointing": True},
                    "train": {"batch_size": 1, "max_steps": max(4, args.steps // 3), "lr": 1e-5},
                },
                launch,
            )
        )
    rows = [
        [
            r["case"],
            round(r.get("tokens_per_s") or 0, 1),
            f"{r['mfu']:.1%}" if r.get("mfu") else "-",
            round(r.get("peak_mem_gib") or 0, 2),
            round(r.get("planned_peak_gib") or 0, 2),
            r.get("error", "ok")[:80],
        ]
        for r in results
    ]
    print(table(["case", "tokens/s", "MFU", "peak GiB", "planned GiB", "status"], rows))
    print(f"\nresults: {save_result('gpu', {'cases': results})}")
    return {"cases": results}


if __name__ == "__main__":
    main()
