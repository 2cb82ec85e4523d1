"""Distributed backends and the one list of what cannot run where.

A backend is what one accelerate config file asks for (single process, DDP, FSDP or DeepSpeed ZeRO,
sharding, offload, and the device mesh of its `parallelism_config` block: tensor parallelism, HSDP). The planner reads it from the YAML file (`read_backend`); the training processes
read it from the environment variables `accelerate launch --config_file FILE` turns that file into
(`launched_backend`). Both go through the same parser, so they see the same backend.

`refusal(recipe, backend, cuda)` is the single table of recipe settings a backend or a machine without
CUDA cannot run: the trainer raises its error before anything loads (exit 2), and the planner shows
its message as the reason a configuration does not fit. `check_tensor_parallel(config, backend)` adds
the checks that need the model's config (a tensor-parallel plan, heads divisible by tp_size).

Meshes keep the backend's kind: a MULTI_GPU file with `parallelism_config_tp_size: 2` (tp.yaml) is kind
"ddp" with tp_size 2 (dp_size 1), fsdp_tp.yaml is kind "fsdp" with dp_shard 2 x tp 2, hsdp.yaml kind
"fsdp" with dp_replicate 2 x dp_shard 2. What a backend shards (kind, shard) and what its mesh splits
(tp_size, dp_shard_size, dp_replicate_size) are independent, so every rule reads only the field it is about.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from training.core.errors import UserError
from training.core.paths import ROOT


@dataclass
class Backend:
    """What matters, for memory and for what can run, in one accelerate config."""

    name: str
    file: str
    kind: str  # single | ddp | fsdp | deepspeed
    cpu: bool = False  # runs on CPU processes (use_cpu: true)
    zero_stage: int = 0
    shard: str = "none"  # none | grads_optim (ZeRO-1 optim only: "optim") | full | hybrid
    offload_optimizer: bool = False
    offload_params: bool = False
    activation_checkpointing: bool = False
    num_machines: int = 1
    num_processes: int = 1  # on all machines together, as accelerate counts them (the launched WORLD_SIZE)
    zero3_init: bool = False
    gathers_16bit: bool = False  # ZeRO-3 gathers 16-bit weights when saving, so final/ can be exported
    deepspeed_file: Path | None = None  # the DeepSpeed JSON, found
    ds: dict = field(default_factory=dict, repr=False)  # its zero_optimization section
    ds_config: dict = field(default_factory=dict, repr=False)  # the whole DeepSpeed JSON
    # the device mesh of the file's parallelism_config block (accelerate's ParallelismConfig); 1 = unused
    dp_replicate_size: int = 1
    dp_shard_size: int = 1
    tp_size: int = 1
    cp_size: int = 1
    # DeepSpeed Ulysses (parallelism_config_sp_size): DeepSpeed's own groups, not in the mesh
    sp_size: int = 1
    # expert parallelism (training/parallel/expert_parallel.py): MoE experts sharded over this many DDP ranks
    ep_size: int = 1
    # pipeline parallelism (training/parallel/pipeline.py): stages, schedule, micro-batches per optimizer micro-step
    pp_size: int = 1
    pp_schedule: str = "1F1B"
    pp_microbatches: int | None = None  # None: one per row of train.batch_size

    @property
    def shards_parameters(self) -> bool:
        """FSDP and ZeRO-3 split every parameter across ranks as the model loads."""
        return self.kind == "fsdp" or (self.kind == "deepspeed" and self.zero_stage == 3)

    @property
    def mesh_sizes(self) -> dict[str, int]:
        """The mesh dimensions in use (size > 1), in accelerate's order (tp innermost)."""
        sizes = {
            "pp": self.pp_size,
            "dp_replicate": self.dp_replicate_size,
            "dp_shard": self.dp_shard_size,
            "cp": self.cp_size,
            "tp": self.tp_size,
        }
        return {k: v for k, v in sizes.items() if v > 1}

    @property
    def mesh(self) -> str:
        """e.g. "dp_shard=2 x tp=2"; "" without a mesh (no parallelism_config, or all its sizes 1)."""
        return " x ".join(f"{k}={v}" for k, v in self.mesh_sizes.items())

    @property
    def mesh_size(self) -> int:
        """Processes the mesh needs: pp x dp_replicate x dp_shard x cp x tp (1 without a mesh)."""
        return math.prod(self.mesh_sizes.values())

    @property
    def dp_size(self) -> int:
        """Data-parallel degree (ranks that see different batches): dp_replicate x dp_shard of a mesh,
        else all processes (= world / (tp x cp) whenever the mesh matches the processes)."""
        if self.mesh:
            return self.dp_replicate_size * self.dp_shard_size
        return max(1, self.num_processes // self.sp_size)  # a Ulysses group shares its sequences


# ----------------------------------------------------------------------------- reading accelerate configs


def _truthy(v) -> bool:
    return str(v).strip().lower() in ("true", "1", "yes")


def read_backend(path: Path) -> Backend:
    """Parse one accelerate config YAML generically (distributed_type, fsdp_config, deepspeed_config)."""
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise UserError(f"accelerate config {path}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(raw, dict):
        raise UserError(f"accelerate config {path}: expected a mapping of keys")
    return parse_backend(raw, path.stem, str(path), f"accelerate config {path}", near=path.parent)


def read_backends(configs_dir: Path) -> list[Backend]:
    if not configs_dir.is_dir():
        raise UserError(f"no accelerate configs: {configs_dir} is not a directory")
    files = sorted(p for p in configs_dir.iterdir() if p.suffix in (".yaml", ".yml"))
    if not files:
        raise UserError(f"no accelerate configs (*.yaml) in {configs_dir}")
    return [read_backend(p) for p in files]


def parse_backend(raw: dict, name: str, file: str, origin: str, near: Path | None = None) -> Backend:
    """The Backend of an accelerate config mapping; `origin` names it in errors, `near` is the folder
    a relative deepspeed_config_file is also looked up in."""
    dtype = str(raw.get("distributed_type", "NO")).upper()
    b = Backend(
        name=name,
        file=file,
        kind="single",
        cpu=_truthy(raw.get("use_cpu", False)) or dtype == "MULTI_CPU",
        num_machines=int(raw.get("num_machines", 1) or 1),
        num_processes=int(raw.get("num_processes", 1) or 1),
    )
    if dtype in ("MULTI_GPU", "MULTI_CPU", "MULTI_XPU", "MULTI_NPU"):
        b.kind = "ddp"
    elif dtype == "FSDP":
        _read_fsdp(b, raw.get("fsdp_config") or {})
    elif dtype == "DEEPSPEED":
        _read_deepspeed(b, raw.get("deepspeed_config") or {}, origin, near)
    _read_mesh(b, raw.get("parallelism_config") or {}, origin)
    return b


MESH_KEYS = {  # accelerate config key -> Backend field (sp_size: DeepSpeed Ulysses' degree, not a mesh dimension)
    "parallelism_config_dp_replicate_size": "dp_replicate_size",
    "parallelism_config_dp_shard_size": "dp_shard_size",
    "parallelism_config_tp_size": "tp_size",
    "parallelism_config_cp_size": "cp_size",
    "parallelism_config_sp_size": "sp_size",
    "parallelism_config_pp_size": "pp_size",  # ours: accelerate has no pipeline (see PIPELINE_KEYS)
}
# Pipeline keys: accelerate 1.15 copies a parallelism_config block's keys onto its launch arguments but
# exports only its own sizes to the training processes, so these (and EP_KEY) reach them through
# launcher_keys(), which reads the launcher's --config_file.
PIPELINE_KEYS = (
    "parallelism_config_pp_size",
    "parallelism_config_pp_schedule",
    "parallelism_config_pp_microbatches",
)
PIPELINE_SCHEDULES = ("GPipe", "1F1B")


def _read_mesh(b: Backend, pc: dict, origin: str) -> None:
    """The sizes of a `parallelism_config` block. accelerate copies its keys verbatim onto its launch
    arguments, so a key without the `parallelism_config_` prefix would be ignored without a word."""
    if not isinstance(pc, dict):
        raise UserError(f"{origin}: parallelism_config must be a mapping of parallelism_config_* keys")
    for key, value in pc.items():
        if not str(key).startswith("parallelism_config_"):
            raise UserError(
                f"{origin}: parallelism_config key {key} would be ignored by accelerate; "
                f"spell it parallelism_config_{key} (as in accelerate_configs/fsdp_tp.yaml)"
            )
        if key in MESH_KEYS:
            try:
                size = int(value)
            except (TypeError, ValueError):
                size = 0
            if size < 1 or str(value).strip() != str(size):
                raise UserError(f"{origin}: {key} must be a whole number >= 1 (got {value!r})")
            setattr(b, MESH_KEYS[key], size)
        elif key == EP_KEY:
            b.ep_size = _read_ep_size(value, origin)
        elif key == "parallelism_config_pp_schedule":
            names = {n.lower(): n for n in PIPELINE_SCHEDULES}
            if str(value).lower() not in names:
                raise UserError(
                    f"{origin}: {key} must be one of {', '.join(PIPELINE_SCHEDULES)} (got {value!r})"
                )
            b.pp_schedule = names[str(value).lower()]
        elif key == "parallelism_config_pp_microbatches" and value is not None:
            if not str(value).strip().isdigit() or int(value) < 1:
                raise UserError(f"{origin}: {key} must be a whole number >= 1 (got {value!r})")
            b.pp_microbatches = int(value)


# Expert parallelism: ours (accelerate 1.15 has no such key). It is not a mesh dimension of its own: the
# experts are sharded over the data-parallel (DDP) ranks, which keep every other weight whole. Like the
# pipeline keys it reaches the training processes through launcher_keys().
EP_KEY = "parallelism_config_ep_size"


def _read_ep_size(value, origin: str) -> int:
    if not str(value).strip().isdigit() or int(value) < 1:
        raise UserError(f"{origin}: {EP_KEY} must be a whole number >= 1 (got {value!r})")
    return int(value)


def launcher_config_file() -> Path | None:
    """The accelerate config file this process was launched with: $LLM_FORGE_ACCELERATE_CONFIG if set
    (for launchers other than `accelerate launch`), else the `--config_file` of the `accelerate launch`
    process that started this one (its parent: torch's elastic agent runs inside it), else accelerate's
    default config file when that launch named none. None when not launched by accelerate."""
    if path := os.environ.get("LLM_FORGE_ACCELERATE_CONFIG"):
        return Path(path)
    try:
        import psutil

        argv = psutil.Process(os.getppid()).cmdline()
    except Exception:  # no such process, or not allowed to read it
        return None
    if "launch" not in argv or not any(Path(a).name.startswith("accelerate") for a in argv[:3]):
        return None
    from accelerate.commands.config import default_config_file
    from accelerate.commands.launch import launch_command_parser

    args, _ = launch_command_parser().parse_known_args(argv[argv.index("launch") + 1 :])
    path = args.config_file or (default_config_file if os.path.isfile(default_config_file) else None)
    return Path(path) if path else None


def launcher_keys() -> dict:
    """Our own parallelism_config keys (PIPELINE_KEYS, EP_KEY) of the launcher's accelerate config file,
    which accelerate does not pass on to the training processes; {} when there is none."""
    path = launcher_config_file()
    return own_keys(path) if path is not None and path.is_file() else {}


def own_keys(path: Path) -> dict:
    """The parallelism_config keys of accelerate config file `path` that are ours (PIPELINE_KEYS, EP_KEY)."""
    raw = yaml.safe_load(path.read_text()) or {}
    pc = (raw.get("parallelism_config") or {}) if isinstance(raw, dict) else {}
    return {k: v for k, v in pc.items() if k in (*PIPELINE_KEYS, EP_KEY)} if isinstance(pc, dict) else {}


_FSDP_SHARDING = {
    "1": "full",
    "FULL_SHARD": "full",
    "2": "grads_optim",
    "SHARD_GRAD_OP": "grads_optim",
    "3": "none",
    "NO_SHARD": "none",
    "4": "hybrid",
    "HYBRID_SHARD": "hybrid",
    "5": "hybrid",
    "HYBRID_SHARD_ZERO2": "hybrid",
}


def _read_fsdp(b: Backend, fs: dict) -> None:
    b.kind = "fsdp"
    strategy = str(fs.get("fsdp_sharding_strategy", "FULL_SHARD")).upper()
    if "fsdp_reshard_after_forward" in fs:  # FSDP2 spelling
        reshard = fs["fsdp_reshard_after_forward"]
        if _truthy(reshard):
            strategy = "FULL_SHARD"
        else:
            strategy = "SHARD_GRAD_OP" if str(reshard).lower() == "false" else str(reshard).upper()
    b.shard = _FSDP_SHARDING.get(strategy, "full")
    b.offload_params = b.offload_optimizer = _truthy(fs.get("fsdp_offload_params", False))
    b.activation_checkpointing = _truthy(fs.get("fsdp_activation_checkpointing", False))


def _read_deepspeed(b: Backend, dc: dict, origin: str, near: Path | None) -> None:
    """A DeepSpeed JSON (deepspeed_config_file) decides over the accelerate config's own keys; accelerate
    refuses a config that sets both. ZeRO stage 2 is DeepSpeedPlugin's default."""
    b.kind = "deepspeed"
    if dc.get("deepspeed_config_file"):
        b.deepspeed_file = find_deepspeed_json(str(dc["deepspeed_config_file"]), origin, near)
        b.ds_config = read_deepspeed_json(b.deepspeed_file)
        zo = b.ds_config.get("zero_optimization", {})
    else:
        zo = {}
    b.ds = zo
    b.zero_stage = int(zo.get("stage", dc.get("zero_stage", 2)) or 0)

    def offloads(key: str, alt: str) -> bool:
        return str((zo.get(key) or {}).get("device", dc.get(alt, "none")) or "none").lower() not in (
            "none",
            "",
        )

    b.offload_optimizer = offloads("offload_optimizer", "offload_optimizer_device")
    b.offload_params = offloads("offload_param", "offload_param_device")
    b.zero3_init = _truthy(dc.get("zero3_init_flag", False))
    b.gathers_16bit = zo.get("stage3_gather_16bit_weights_on_model_save") is True or _truthy(
        dc.get("zero3_save_16bit_model", False)
    )
    b.shard = {0: "none", 1: "optim", 2: "grads_optim", 3: "full"}.get(b.zero_stage, "full")


def find_deepspeed_json(raw: str, origin: str, near: Path | None = None) -> Path:
    """The DeepSpeed JSON an accelerate config names: as given (absolute, or relative to the working
    directory), next to the accelerate config, or relative to the repository root (so
    `accelerate_configs/ds_*.json` works from any directory)."""
    path = Path(raw).expanduser()
    folders = [Path.cwd(), *([near] if near is not None else []), ROOT]
    candidates = [path, *([near / path] if near is not None else []), ROOT / path]
    if near is not None:
        candidates.append(near / path.name)
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    raise UserError(
        f"{origin}: deepspeed_config_file {raw} does not exist (looked in {', '.join(map(str, folders))}); "
        f"use a path relative to the repository root, e.g. accelerate_configs/ds_zero2.json, or an absolute path"
    )


def read_deepspeed_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"DeepSpeed config {path} line {e.lineno}: not valid JSON ({e.msg})") from None


# ----------------------------------------------------------------------------- the backend this process was launched with

# accelerate config key -> the variable `accelerate launch` sets from it for the training processes
_DEEPSPEED_ENV = {
    "deepspeed_config_file": "ACCELERATE_DEEPSPEED_CONFIG_FILE",
    "zero_stage": "ACCELERATE_DEEPSPEED_ZERO_STAGE",
    "offload_optimizer_device": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
    "offload_param_device": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
    "zero3_init_flag": "ACCELERATE_DEEPSPEED_ZERO3_INIT",
    "zero3_save_16bit_model": "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
}
_FSDP_ENV = {
    "fsdp_sharding_strategy": "FSDP_SHARDING_STRATEGY",
    "fsdp_reshard_after_forward": "FSDP_RESHARD_AFTER_FORWARD",
    "fsdp_offload_params": "FSDP_OFFLOAD_PARAMS",
    "fsdp_activation_checkpointing": "FSDP_ACTIVATION_CHECKPOINTING",
}


def _flag(name: str) -> bool:
    return _truthy(os.environ.get(name, "false"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def elastic_attempt() -> str | None:
    """The start-up line of an elastic job (torchrun with restarts allowed: `accelerate launch
    --max_restarts N`, our SLURM launcher's MAX_RESTARTS): which attempt this is. None without restarts."""
    allowed = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if allowed <= 0:
        return None
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + 1
    return (
        f"elastic: attempt {attempt} of {allowed + 1}: when a rank is lost, torchrun stops the others and "
        f"starts the group again, which resumes from the newest complete checkpoint"
    )


_ENV_PREFIXES = (
    "ACCELERATE_",
    "PARALLELISM_CONFIG_",
    "FSDP_",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "LLM_FORGE_",
)


def launched_backend() -> Backend:
    """The backend `accelerate launch` asked for, rebuilt from the environment it gives each process:
    ACCELERATE_USE_DEEPSPEED / ACCELERATE_USE_FSDP and their settings, ACCELERATE_USE_CPU, the mesh
    (ACCELERATE_USE_PARALLELISM_CONFIG and PARALLELISM_CONFIG_*_SIZE), and the WORLD_SIZE /
    LOCAL_WORLD_SIZE of torchrun (several processes without either flag: DDP).

    Parsed once per process (and again only if those variables change, as in tests); the training
    set-up reads it once and hands it on."""
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)))
    return _launched_backend((env, os.getcwd()))  # a relative DeepSpeed JSON is found from the cwd


@functools.lru_cache(maxsize=8)
def _launched_backend(_env_key: tuple) -> Backend:
    env = os.environ
    local = int(env.get("LOCAL_WORLD_SIZE", world_size()))
    raw: dict = {
        "use_cpu": _flag("ACCELERATE_USE_CPU"),
        "num_processes": world_size(),
        "num_machines": max(1, world_size() // local),
    }
    if _flag("ACCELERATE_USE_PARALLELISM_CONFIG"):
        raw["parallelism_config"] = {
            key: env[var]
            for key in MESH_KEYS
            if (var := key.upper()) in env  # PARALLELISM_CONFIG_TP_SIZE, ...
        }
        raw["parallelism_config"].update(launcher_keys())  # ours: pipeline stages, expert parallelism
    if _flag("ACCELERATE_USE_DEEPSPEED"):
        raw["distributed_type"] = "DEEPSPEED"
        raw["deepspeed_config"] = {
            k: env[v] for k, v in _DEEPSPEED_ENV.items() if env.get(v, "none") not in ("", "none")
        }
    elif _flag("ACCELERATE_USE_FSDP"):
        raw["distributed_type"] = "FSDP"
        raw["fsdp_config"] = {k: env[v] for k, v in _FSDP_ENV.items() if v in env}
    else:
        raw["distributed_type"] = "MULTI_GPU" if world_size() > 1 else "NO"
    return parse_backend(raw, "launched", "", "accelerate config")
