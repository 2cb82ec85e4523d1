"""From-scratch models of any transformers causal-LM type, and parameter counts under sharded backends."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import TINY_ARCH, TOKENIZER, train_inprocess
from training.config import ModelSection, load_recipe, parse_recipe
from training.core.errors import RecipeError
from training.data.tokenizer import load_tokenizer
from training.model.build import count_parameters, from_scratch_config
from training.run.metrics import read_metrics

# type -> (model class, extra settings): a dense and an MoE model of each family the issue names
TYPES = {
    "llama": ("LlamaForCausalLM", {}),
    "gpt2": ("GPT2LMHeadModel", {"activation_function": "gelu_new"}),
    "qwen3": ("Qwen3ForCausalLM", {}),
    "mistral": ("MistralForCausalLM", {"sliding_window": 16}),
    "mixtral": ("MixtralForCausalLM", {}),  # its experts: the MoE keys below
}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelSection(name_or_path=TOKENIZER))


@pytest.mark.parametrize("model_type", TYPES)
def test_each_type_builds_trains_and_reloads(model_type, make_recipe, tmp_path, tokenizer):
    cls_name, extra = TYPES[model_type]
    arch = {**TINY_ARCH, "type": model_type, "num_key_value_heads": 2, "extra": extra}
    if model_type == "gpt2":
        del arch["num_key_value_heads"]  # GPT-2 has no grouped-query attention
    if model_type == "mixtral":  # the recipe's MoE keys, under Mixtral's own names in the config
        arch |= {"num_experts": 4, "num_experts_per_tok": 2}
    path = make_recipe(model={"from_scratch": arch}, train={"max_steps": 2})
    recipe = load_recipe(path)

    config = from_scratch_config(recipe.model.from_scratch, tokenizer)
    assert config.model_type == model_type
    # the common keys reach the config class under its own names (GPT-2: n_embd, n_layer, ...)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (64, 2, 4)
    assert config.max_position_embeddings == 256 and config.vocab_size == len(tokenizer)
    assert config.tie_word_embeddings is True
    assert config.eos_token_id == tokenizer.eos_token_id and config.pad_token_id == tokenizer.pad_token_id
    if model_type == "gpt2":
        assert config.n_inner == 128 and config.activation_function == "gelu_new"
    else:
        assert config.intermediate_size == 128 and config.num_key_value_heads == 2
        assert config.head_dim == 16  # hidden_size / heads, not the class default of 128 (qwen3, mistral)
    for key, value in extra.items():
        assert getattr(config, key) == value
    if model_type == "mixtral":
        assert (config.num_local_experts, config.num_experts_per_tok) == (4, 2)

    assert train_inprocess(path) == 0
    losses = [r["loss"] for r in read_metrics(tmp_path / "run/metrics.jsonl") if "loss" in r]
    assert len(losses) == 2 and all(math.isfinite(x) and x > 5 for x in losses), losses
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run/final")
    assert type(model).__name__ == cls_name
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    ids = torch.tensor([tokenizer("Once upon a time").input_ids])
    assert torch.isfinite(model(ids).logits).all()


def test_default_type_is_llama_with_the_same_config_as_before(tokenizer):
    """Existing recipes (no `type`) build the same LlamaConfig as before `type` took other values."""
    from transformers import LlamaConfig

    recipe = parse_recipe(_raw({}))
    arch = recipe.model.from_scratch
    assert arch.type == "llama" and arch.extra == {}
    before = LlamaConfig(
        vocab_size=len(tokenizer),
        **TINY_ARCH,
        num_key_value_heads=4,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    assert from_scratch_config(arch, tokenizer).to_dict() == before.to_dict()


def _raw(arch: dict) -> dict:
    return {
        "output_dir": "runs/x",
        "model": {"tokenizer": TOKENIZER, "from_scratch": {**TINY_ARCH, **arch}},
        "data": {"train": "data/tiny_stories.txt", "format": "text"},
    }


@pytest.mark.parametrize(
    "arch, expected",
    [
        ({"type": "lama"}, r"model\.from_scratch\.type: .*'lama' is unknown model type .*did you mean llama"),
        ({"type": "bert"}, r"model\.from_scratch\.type: .*'bert' is an encoder .*e\.g\. llama, mistral"),
        ({"type": "t5"}, r"model\.from_scratch\.type: .*'t5' is not a causal-LM model type"),
        ({"type": "bart"}, r"model\.from_scratch\.type: .*'bart' is an encoder-decoder"),
        ({"type": "gemma3"}, r"model\.from_scratch\.type: .*composite .*'gemma3_text'"),
        (
            {"type": "gpt2", "extra": {"n_embdd": 8}},
            r"model\.from_scratch\.extra: .*n_embdd: not a setting of transformers' GPT2Config \(gpt2\); "
            r"did you mean n_embd",
        ),
        (
            {"type": "gpt2", "extra": {"n_layer": 8}},
            r"model\.from_scratch\.extra: .*n_layer: set it as model\.from_scratch\.num_hidden_layers",
        ),
        (
            {"extra": {"bos_token_id": 0}},
            r"model\.from_scratch\.extra: .*bos_token_id: taken from the tokenizer",
        ),
        ({"extra": {"return_dict": False}}, r"return_dict: a generic transformers setting"),
        (
            {"type": "gpt2", "rope_theta": 5e5},
            r"model\.from_scratch\.rope_theta: .*GPT2Config \(gpt2\) has no",
        ),
        ({"type": "gpt2", "num_key_value_heads": 2}, r"model\.from_scratch\.num_key_value_heads: .*has no"),
        ({"type": "qwen3", "hidden_size": 66}, r"model\.from_scratch: .*hidden_size must be divisible"),
        ({"type": "gpt2", "hidden_size": 66}, r"model\.from_scratch: .*hidden_size must be divisible"),
        (
            {"type": "qwen3", "extra": {"head_dim": "wide"}},
            r"model\.from_scratch: .*Qwen3Config refuses these settings: .*head_dim",
        ),
    ],
)
def test_bad_architectures_are_refused_naming_the_key(arch, expected):
    with pytest.raises(RecipeError, match=expected):
        parse_recipe(_raw(arch))


def test_a_refused_type_exits_with_code_2(make_recipe, capsys):
    path = make_recipe(model={"from_scratch": {**TINY_ARCH, "type": "bert"}})
    with pytest.raises(SystemExit) as e:
        train_inprocess(path)
    assert e.value.code == 2
    assert "model.from_scratch.type" in capsys.readouterr().err


def test_planner_runs_on_a_gpt2_recipe(make_recipe, capsys):
    from training.plan import main

    path = make_recipe(model={"from_scratch": {**TINY_ARCH, "type": "gpt2"}})
    assert main([str(path), "--num-gpus", "2", "--gpu-memory", "24GiB"]) == 0
    out = capsys.readouterr().out
    assert "| fsdp |" in out and "Recommended" in out


class _Sharded(torch.nn.Module):
    def __init__(self, param: torch.nn.Parameter, frozen: torch.nn.Parameter):
        super().__init__()
        self.w, self.frozen = param, frozen


def test_zero3_partitioned_parameters_count_whole():
    """DeepSpeed ZeRO-3 leaves an empty tensor in each parameter outside its gathers; ds_numel is its size."""
    w = torch.nn.Parameter(torch.empty(0))
    w.ds_numel = 4096
    frozen = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    frozen.ds_numel = 1000
    assert count_parameters(_Sharded(w, frozen)) == (4096, 5096)


def test_dtensor_parameters_count_their_global_size(tmp_path):
    """FSDP2 and TP parameters are DTensors: a quarter-shard of an 8x4 weight counts as 32 elements."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        local = torch.zeros(2, 4)  # this process's rows of the whole (8, 4) weight
        w = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(8, 4), stride=(4, 1))
        frozen = torch.nn.Parameter(
            DTensor.from_local(local.clone(), mesh, [Shard(0)], run_check=False, shape=(8, 4), stride=(4, 1)),
            requires_grad=False,
        )
        assert count_parameters(_Sharded(torch.nn.Parameter(w), frozen)) == (32, 64)
    finally:
        dist.destroy_process_group()
