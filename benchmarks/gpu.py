"""GPU benchmarks (skipped without CUDA): print a table and write benchmarks/results/gpu.json.

0. The loss alone at the Llama-3-8B head (vocabulary 128256, width 4096, bf16, 2048 and 8192 tokens):
   full logits vs training.objectives.next_token's chunked loss (and Liger's / cut-cross-entropy's kernels when
   installed): peak memory above the inputs and milliseconds per forward + backward.
1. MFU of bf16 pretraining of a Llama-shaped ~1B model on one GPU, documents packed into full
   2048-token blocks, flash-attention-2 if installed else SDPA, chunked loss (target MFU >= 50%).
2. QLoRA (4-bit NF4 + LoRA r16 all-linear) of a Llama-3-8B-shaped model with random weights at
   sequence length 2048, b=1, gradient checkpointing, paged 8-bit AdamW, embedding and head in bf16,
   chunked loss: peak memory (target <= 7 GiB) and tokens/s.
3. Full fine-tuning of a 7B-shaped (Llama-2-7B) model on one GPU through DeepSpeed ZeRO-3 with CPU
   offload of parameters and optimizer states (16 bytes/param would need ~100 GiB without offload).

Cases 1-3 run the real training loop (`python -m training.train`, or `accelerate launch` with the
ZeRO-3 offload config), report the loss implementation the run logged, and the planner's prediction
beside the measurement.

    python -m benchmarks.gpu [--only loss,mfu_1b,qlora_8b,zero3_offload_7b] [--steps N] [--no-cudnn-sdpa]
"""

from __future__ import annotations

import argparse
import functools
import math
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


def corpus(folder, tokens: int) -> str:
    """Real text for at least `tokens` tokens (the bundled stories repeated; they run ~4.5 characters a token):
    no more, since all of it is tokenized before the first step (a fixed 2.4M tokens took 60 s on an H200)."""
    path = folder / "corpus.txt"
    text = (ROOT / "data/tiny_stories.txt").read_text()
    path.write_text(text * math.ceil(tokens * 6 / len(text)))
    return str(path)


def random_model(folder, name: str, shape: dict) -> str:
    """A random-weight Llama of this shape saved as a bf16 pretrained directory (+ the bundled tokenizer)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from training.config import ModelSection
    from training.data.tokenizer import load_tokenizer

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


# python -m training.train RECIPE with SDPA's cuDNN backend off (the flash and memory-efficient kernels take over)
WITHOUT_CUDNN_SDPA = (
    "import runpy, sys, torch; torch.backends.cuda.enable_cudnn_sdp(False); "
    "sys.argv = ['training.train', *sys.argv[1:]]; runpy.run_module('training.train', run_name='__main__')"
)
GOALS = {"mfu_1b": ("MFU", ">= 50%"), "qlora_8b": ("peak", "<= 7 GiB"), "zero3_offload_7b": ("runs", "fits")}


def _loss_step(impl: str, x, w, targets):
    import torch.nn.functional as F

    from training.objectives.next_token import _full_loss, linear_loss_sum

    x.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16):
        if impl == "full":
            loss = _full_loss(F.linear(x, w), targets)  # targets: every position's next token
        else:
            loss = linear_loss_sum(x, w, None, targets, impl)
    loss.backward()
    return loss


def loss_rows(tokens_list=(2048, 8192), repeats: int = 5) -> list[dict]:
    """The loss alone at the 8B head: full logits vs every chunked/fused implementation importable."""
    import time

    import torch.nn.functional as F

    from training.objectives.next_token import fused_kernel

    vocab, hidden = LLAMA3_8B["vocab_size"], LLAMA3_8B["hidden_size"]
    impls = ["full", "chunked"] + ([k] if (k := fused_kernel(torch.device("cuda"))) else [])
    out = []
    for tokens in tokens_list:
        torch.manual_seed(0)
        w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(1, tokens, hidden, device="cuda", requires_grad=True)
        labels = torch.randint(0, vocab, (1, tokens), device="cuda")
        targets = F.pad(labels[:, 1:], (0, 1), value=-100)
        for impl in impls:
            step = functools.partial(_loss_step, impl, x, w, targets)
            step()  # warm-up
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            start = time.perf_counter()
            for _ in range(repeats):
                loss = step()
            torch.cuda.synchronize()
            ms = (time.perf_counter() - start) / repeats * 1e3
            out.append(
                {
                    "case": f"loss, 8B head, {tokens} tokens, {impl}",
                    "ms": ms,
                    "peak_mem_gib": (torch.cuda.max_memory_allocated() - base) / 2**30,
                    "loss": loss.item(),
                }
            )
        del w, x
        torch.cuda.empty_cache()
    return out


def run(folder, name: str, raw: dict, launcher: list[str]) -> dict:
    from training.config import load_recipe
    from training.planning.memory import estimate

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
        "loss_impl": rows[0].get("loss_impl"),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="loss,mfu_1b,qlora_8b,zero3_offload_7b", help="comma-separated cases")
    ap.add_argument("--steps", type=int, default=12, help="training steps per run (3 warm-up)")
    ap.add_argument(
        "--no-cudnn-sdpa",
        action="store_true",
        help="train with cuDNN's attention kernels off (torch.backends.cuda.enable_cudnn_sdp(False)): the "
        "check for the 1.1B run's NaN gradients (docs/benchmarks.md)",
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("GPU benchmarks: skipped: no CUDA")
        return {"skipped": "no CUDA"}
    wanted = args.only.split(",")
    losses = loss_rows() if "loss" in wanted else []
    if losses:
        print(
            table(
                ["case", "ms fwd+bwd", "peak GiB above inputs", "loss"],
                [
                    [r["case"], round(r["ms"], 2), round(r["peak_mem_gib"], 3), round(r["loss"], 1)]
                    for r in losses
                ],
            )
            + "\n"
        )
    folder = tempdir("gpu-bench")
    text = corpus(folder, args.steps * 8 * 2048)  # the most any case trains: mfu_1b's batch of 8 blocks
    py = (
        [sys.executable, "-c", WITHOUT_CUDNN_SDPA]
        if args.no_cudnn_sdpa
        else [sys.executable, "-m", "training.train"]
    )
    common = {
        "resume": "none",
        "eval": {"at_start": False},
        "data": {"train": text, "format": "text", "max_length": 2048},
    }
    results = []
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
                    "method": {
                        "type": "qlora",
                        "lora": {"r": 16, "target_modules": "all-linear"},
                        "quantization": {"embeddings_dtype": "compute"},  # the default, stated
                    },
                    "train": {
                        "batch_size": 1,
                        "max_steps": args.steps,
                        "lr": 1e-4,
                        "optimizer": "paged_adamw_8bit",
                        # random weights: a step whose gradient is not finite is skipped and counted, so the
                        # memory and speed are measured all the same (the run's log says how many)
                        "on_nonfinite": "skip",
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
            " ".join(GOALS.get(r["case"], ("", ""))),
            goal_met(r),
            (r.get("loss_impl") or "-")[:40],
            r.get("error", "ok")[:80],
        ]
        for r in results
    ]
    head = ["case", "tokens/s", "MFU", "peak GiB", "planned GiB", "goal", "met", "loss", "status"]
    print(table(head, rows))
    print(f"\nresults: {save_result('gpu', {'loss': losses, 'cases': results})}")
    return {"loss": losses, "cases": results}


def goal_met(r: dict) -> str:
    if "error" in r:
        return "no (failed)"
    if r["case"] == "mfu_1b":
        return "yes" if (r.get("mfu") or 0) >= 0.5 else "no"
    if r["case"] == "qlora_8b":
        return "yes" if r["peak_mem_gib"] <= 7 else "no"
    return "yes"


if __name__ == "__main__":
    main()
