"""The recipe form, generated from the `Recipe` pydantic schema (not mapped field by field).

`form_fields()` walks `Recipe.model_fields` recursively and returns one `FormField` per leaf key
(dotted, e.g. `train.lr`) with the widget kind its type calls for: Literal -> dropdown, bool ->
checkbox, int/float -> number, str/list/tuple -> text, a list of sub-records (rl.rewards) -> YAML text. Optional sub-sections (`model.from_scratch`)
get an "enabled" checkbox. The only hand-written part is `GROUPS`: which tab of the form a key
belongs to, because users think "precision & attention", not "model.dtype". A key not named there
lands in its section's group, so new schema fields show up by themselves.

The YAML is the source of truth and stays the user's: an edit of the form changes only the keys whose
widgets changed, in the YAML text itself (`edit_yaml`, ruamel.yaml's round trip: comments, key order,
flow style and quoting survive), and YAML -> `dict_to_values` -> form. A key the YAML does not set is
written only when its new value differs from the schema's default, so defaults are shown, not written.
"""

from __future__ import annotations

import re
import types
import typing
from dataclasses import dataclass, field
from io import StringIO
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticUndefined
from ruamel.yaml import YAML, YAMLError
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.scalarstring import DoubleQuotedScalarString
from ruamel.yaml.util import load_yaml_guess_indent

from training.config import Recipe

# Group title -> dotted-key prefixes it takes (checked in order; the first match wins).
GROUPS: dict[str, tuple[str, ...]] = {
    "Precision & memory": (
        "precision",
        "model.dtype",
        "model.attn_implementation",
        "model.gradient_checkpointing",
        "model.tiled_mlp",
        "model.activation_offloading",
        "model.rope_scaling",
    ),
    "Model": ("model",),
    "Data": ("data",),
    "Method": ("method", "preference", "rl", "distill"),
    "Optimisation": ("train", "seed"),
    "Eval & checkpoints": ("eval", "checkpoint", "output_dir", "resume", "resume_changes", "report_to"),
}
ORDER = ["Model", "Data", "Method", "Optimisation", "Precision & memory", "Eval & checkpoints"]
# What most runs set, shown first in each tab; every other field sits behind the tab's "More settings" fold
# (a field with an error, or one a search finds, is shown there too).
COMMON = frozenset(
    (
        "model.name_or_path",
        "model.tokenizer",
        "model.from_scratch",
        "model.from_scratch.type",
        "model.from_scratch.hidden_size",
        "model.from_scratch.num_hidden_layers",
        "model.from_scratch.num_attention_heads",
        "model.from_scratch.num_experts",
        "model.vision",
        "data.train",
        "data.eval",
        "data.format",
        "data.max_length",
        "data.packing",
        "data.train_on",
        "method.type",
        "method.lora.r",
        "method.lora.alpha",
        "method.lora.dropout",
        "method.lora.target_modules",
        "method.quantization.bits",
        "method.qat",
        "preference",
        "preference.objective",
        "preference.beta",
        "rl",
        "rl.loss_type",
        "rl.num_generations",
        "rl.max_new_tokens",
        "rl.temperature",
        "rl.rewards",
        "rl.tools",
        "rl.environment",
        "rl.max_turns",
        "distill",
        "distill.teacher",
        "train.lr",
        "train.scheduler",
        "train.warmup_steps",
        "train.batch_size",
        "train.grad_accum",
        "train.max_steps",
        "train.epochs",
        "precision",
        "model.dtype",
        "model.attn_implementation",
        "model.gradient_checkpointing",
        "output_dir",
        "eval.every_steps",
        "checkpoint.every_steps",
        "checkpoint.keep_last",
        "report_to",
    )
)
# The unit a number is counted in, shown in its label ("Max length (tokens)"); keys not named here get one from
# their name's ending (UNIT_ENDINGS), the rest are plain counts or have none.
UNITS = {
    "train.batch_size": "sequences per process",
    "train.grad_accum": "micro-batches",
    "train.epochs": "passes",
    "eval.batch_size": "sequences",
    "eval.max_batches": "batches",
    "data.stream_window": "records",
    "model.vision.image_size": "pixels",
    "model.vision.patch_size": "pixels",
    "model.train_tokenizer.vocab_size": "tokens",
    "model.from_scratch.vocab_size": "tokens",
}
UNIT_ENDINGS = {
    "_timeout_s": "s",
    "_steps": "steps",
    "log_every": "steps",
    "max_length": "tokens",
    "max_new_tokens": "tokens",
    "max_position_embeddings": "tokens",
    "_chars": "characters",
    "_ratio": "share, 0-1",
    "_fraction": "share, 0-1",
}
NONE_CHOICE = "(none)"
# A key's last part in words, where capitalising it is not enough (the rest: "max_steps" -> "Max steps").
WORDS = {
    "lr": "Learning rate",
    "r": "Rank",
    "betas": "AdamW betas",
    "name_or_path": "Model (directory, hub name or .gguf)",
    "dtype": "Weight dtype",
    "attn_implementation": "Attention kernel",
    "qat": "Quantization-aware training",
    "rl": "Online RL",
    "from_scratch": "New model from scratch",
    "tiled_mlp": "Tiled MLP (off, on or a tile count)",
    "rope_scaling": "RoPE scaling",
    "rope_theta": "RoPE theta",
    "kl_coef": "KL coefficient",
    "top_k": "Top-k",
    "top_p": "Top-p",
    "eval": "Eval set(s)",
    "dpo_beta": "DPO beta",
    "distill": "Distillation",
    "lmbda": "Lambda",
    "train": "Training data",
    "every_steps": "Every N steps",
    "grad_accum": "Gradient accumulation",
    "tool_output_chars": "Tool output limit",
}


@dataclass
class FormField:
    key: str  # dotted key, e.g. "train.lr"; "model.from_scratch" for an optional section's switch
    kind: str  # dropdown | checkbox | int | float | text | list | records | str_or_list | pair | mapping | section
    default: Any
    description: str = ""
    choices: list[Any] = field(default_factory=list)
    optional: bool = False  # None is allowed
    required: bool = False  # no default: always written
    section: str | None = None  # for fields inside an optional section: that section's key

    @property
    def label(self) -> str:
        """What the form shows: words (and the unit), then the recipe key (so that either can be searched for)."""
        last = self.key.split(".")[-1]
        words = WORDS.get(last) or last.removesuffix("_s").replace("_", " ").capitalize()
        unit = self.unit
        said = unit is None or unit.split()[0] in words.lower().split()  # "Max steps" needs no "(steps)"
        return f"{words}{'' if said else f' ({unit})'} · {self.key}"

    @property
    def unit(self) -> str | None:
        if self.key in UNITS:
            return UNITS[self.key]
        if self.kind in ("int", "float"):
            return next((u for end, u in UNIT_ENDINGS.items() if self.key.endswith(end)), None)
        return None

    @property
    def common(self) -> bool:
        """Shown first in its tab; the others are behind the tab's "More settings" fold."""
        return self.key in COMMON

    def matches(self, query: str) -> bool:
        """Whether a search for `query` finds this field: every word of it in the label (words or key), any case."""
        label = self.label.lower()
        return all(word in label for word in query.lower().split())

    @property
    def group(self) -> str:
        for title, prefixes in GROUPS.items():
            if any(self.key == p or self.key.startswith(p + ".") for p in prefixes):
                return title
        return self.key.split(".")[0].capitalize()


def _plain(t):
    """PositiveInt (Annotated[int, Gt(0)]) -> int."""
    while typing.get_origin(t) is typing.Annotated:
        t = typing.get_args(t)[0]
    return t


def _unwrap(annotation) -> tuple[Any, bool]:
    """(annotation without None and Annotated constraints, whether None is allowed)."""
    annotation = _plain(annotation)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [_plain(a) for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        return (args[0] if len(args) == 1 else typing.Union[tuple(args)]), optional  # noqa: UP007 (built from a tuple)
    return annotation, False


def _is_model(t) -> bool:
    return isinstance(t, type) and issubclass(t, BaseModel)


def _kind(t) -> tuple[str, list]:
    origin = typing.get_origin(t)
    if origin is Literal:
        return "dropdown", list(typing.get_args(t))
    if t is bool:
        return "checkbox", []
    if t is int:
        return "int", []
    if t is float:
        return "float", []
    if origin is list and any(_is_model(a) for a in typing.get_args(t)):
        return "records", []  # rl.rewards: a YAML list of {function, weight, ...}
    if origin is list:
        return "list", []
    if origin is tuple:
        return "pair", []
    if origin is dict or t is dict:
        return "mapping", []
    if origin in (typing.Union, types.UnionType):  # e.g. str | list[str]
        if set(typing.get_args(t)) == {bool, int}:  # model.tiled_mlp: off, on, or a count
            return "switch_or_count", []
        arms = {typing.get_origin(a) for a in typing.get_args(t)}
        if arms == {list}:  # data.train: paths (or a mixture, which the form shows as its paths;
            return "list", []  # weights are set in the YAML)
        if arms == {list, dict}:  # data.eval: paths, or named sets {web: a.jsonl, code: b.jsonl}
            return "list_or_mapping", []
        return "str_or_list", []
    return "text", []


def _default(info) -> Any:
    if info.default is not PydanticUndefined:
        return info.default
    if info.default_factory is not None:
        return info.default_factory()
    return PydanticUndefined


def _walk(model: type[BaseModel], prefix: str, section: str | None) -> list[FormField]:
    out = []
    for name, info in model.model_fields.items():
        key = f"{prefix}{info.alias or name}"  # rl.async is the field async_
        t, optional = _unwrap(info.annotation)
        default = _default(info)
        if _is_model(t):
            if optional:  # an optional section: a switch, then its fields
                out.append(
                    FormField(
                        key,
                        "section",
                        default is not None,
                        info.description or t.__doc__ or "",
                        section=section,
                    )
                )
            out += _walk(t, key + ".", key if optional else section)
            continue
        kind, choices = _kind(t)
        required = default is PydanticUndefined
        if isinstance(default, BaseModel):
            default = default.model_dump(mode="json")
        out.append(
            FormField(
                key,
                kind,
                None if required else default,
                info.description or "",
                choices,
                optional,
                required,
                section,
            )
        )
    return out


# Parts of the recipe that apply only to some methods: section -> the method types it is for.
FOR_METHODS = {"method.lora": ("lora", "qlora"), "method.quantization": ("qlora",), "method.qat": ("full",)}
# The form's "Objective" choice -> the optional section that makes it (supervised: none of them). The choice
# switches these sections on and off; their own switches are not shown.
OBJECTIVE_GROUP = "Method"  # the form tab that offers the choice
OBJECTIVES = {"supervised": None, "preference": "preference", "online RL": "rl", "distillation": "distill"}


def objective_of(raw: dict | None) -> str:
    """The objective a recipe trains with: the first of the objective sections it sets, else supervised."""
    raw = raw if isinstance(raw, dict) else {}
    return next((name for name, key in OBJECTIVES.items() if key and raw.get(key) is not None), "supervised")


def with_objective(fields: list[FormField], values: list, objective: str) -> list:
    """The form's values with the objective sections' switches set for `objective` (only its own on)."""
    chosen = OBJECTIVES.get(objective)
    switches = {key for key in OBJECTIVES.values() if key}
    return [(f.key == chosen) if f.key in switches else v for f, v in zip(fields, values)]


def switches_others(f: FormField) -> bool:
    """Whether an edit of `f` shows or hides other fields (an optional section's switch, the method), whose
    values the form then writes back where they apply (edit_yaml of the whole form)."""
    return f.kind == "section" or f.key == "method.type"


def written_back(fields: list[FormField], switch: FormField) -> list[FormField]:
    """The fields an edit of `switch` (switches_others) writes back, itself first: an optional section's own
    keys; the method's, the settings some methods use only (FOR_METHODS). The others are as the YAML has them
    already, and the page sends only these (it keeps a status for every input of an event it ran, and reads
    every one of them at each status change after: a switch sending the whole form slowed every later edit)."""
    parts = tuple(FOR_METHODS) if switch.key == "method.type" else (switch.key,)
    inside = [f for f in fields if f.key != switch.key and any(within(f.key, p) for p in parts)]
    return [switch, *inside]


def within(key: str, part: str) -> bool:
    """Whether the recipe key `key` is `part` or lies inside it (`method.lora.r` within `method.lora`)."""
    return key == part or key.startswith(part + ".")


def for_method(key: str, kind: str) -> bool:
    """Whether a recipe key is used by the method `kind` (FOR_METHODS: LoRA's settings by LoRA and QLoRA, ...)."""
    return not any(within(key, part) and kind not in kinds for part, kinds in FOR_METHODS.items())


def applies(f: FormField, raw: dict | None) -> bool:
    """Whether the form shows `f` for this recipe: an optional section's fields while it is switched on (the
    switch itself always, but for the objective sections': the "Objective" choice stands for those), and the
    method's own settings for that method only. Hidden fields keep their values: the recipe is not changed by
    what the form folds away."""
    if raw is None:
        return True
    if f.key in OBJECTIVES.values():  # the "Objective" choice stands for these switches
        return False
    method = raw.get("method") if isinstance(raw.get("method"), dict) else {}
    if not for_method(f.key, method.get("type", "full")):
        return False
    parts = f.key.split(".")
    for i in range(1, len(parts)):  # every enclosing optional section must be on
        section = ".".join(parts[:i])
        if section in _OPTIONAL_SECTIONS:
            value, present = _get(raw, section, None)
            if not present or value is None:
                return False
    return True


def form_fields() -> list[FormField]:
    return _walk(Recipe, "", None)


_OPTIONAL_SECTIONS = {f.key for f in form_fields() if f.kind == "section"}


def grouped(fields: list[FormField]) -> dict[str, list[FormField]]:
    """Tab title -> its fields, the common ones first (each part in the schema's order)."""
    groups: dict[str, list[FormField]] = {}
    for f in sorted(fields, key=lambda f: not f.common):
        groups.setdefault(f.group, []).append(f)
    return {g: groups[g] for g in ORDER if g in groups} | {g: v for g, v in groups.items() if g not in ORDER}


# ----------------------------------------------------------------------------- value conversion


def to_widget(f: FormField, value: Any) -> Any:
    """A recipe value as the widget shows it."""
    if f.kind == "section":
        return bool(value)
    if f.kind == "dropdown":
        return NONE_CHOICE if value is None else str(value)
    if f.kind in ("int", "float") and not f.optional:
        return value
    if f.kind == "checkbox":
        return bool(value)
    if f.kind == "switch_or_count":
        return str(value).lower() if isinstance(value, bool) else str(value)
    if value is None:
        return ""
    if f.kind == "records":
        return (
            yaml.safe_dump(value, default_flow_style=None, sort_keys=False, width=1000).strip()
            if value
            else ""
        )
    if f.kind == "mapping" or (f.kind == "list_or_mapping" and isinstance(value, dict)):
        return yaml.safe_dump(value, default_flow_style=True, width=1000).strip() if value else ""
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value)
    return str(value)


def _split(text: str) -> list[str]:
    return [p.strip() for p in text.replace("\n", ",").split(",") if p.strip()]


def from_widget(f: FormField, value: Any) -> Any:
    """A widget's value as the recipe value (the schema then validates it)."""
    if f.kind in ("section", "checkbox"):
        return bool(value)
    if f.kind == "dropdown":
        if value in (None, NONE_CHOICE, ""):
            return None
        for c in f.choices:  # Literal[4, 8]: give back the int, not "4"
            if str(c) == str(value):
                return c
        return value  # not a choice: left for the schema to refuse, naming the key
    if f.kind in ("int", "float"):  # a number box, or a text box when the number is optional
        if isinstance(value, str):
            value = value.strip()
            if not value:
                return None
            try:
                value = float(value)
            except ValueError:
                return value  # the schema refuses it, naming the key
        if value is None:
            return None
        if f.kind == "int" and isinstance(value, float) and value.is_integer():
            return int(value)
        return value
    text = "" if value is None else str(value).strip()
    if f.kind == "switch_or_count":
        return _switch_or_count(text)
    if not text:
        if f.kind == "mapping" and not f.optional:
            return {}
        if f.kind in ("list", "records") and f.default == []:  # rl.tools, rl.rewards: none
            return []
        return None if (f.optional or f.kind != "text" or f.default is None) else ""
    if f.kind == "list" or (f.kind == "list_or_mapping" and not text.startswith("{")):
        return _split(text)
    if f.kind in ("mapping", "list_or_mapping", "records"):
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError:
            return text  # the schema refuses it, naming the key
    if f.kind == "pair":
        return [_number(p) for p in _split(text)]
    if f.kind == "str_or_list":
        parts = _split(text)
        return parts if len(parts) > 1 else text
    return text


def _switch_or_count(text: str):
    word = text.lower()
    if word in ("", "false", "off", "no"):
        return False
    if word in ("true", "on", "yes"):
        return True
    return int(word) if word.isdigit() else text  # not a number: the schema refuses it, naming the key


def _number(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return a == b


def _set(d: dict, key: str, value: Any) -> None:
    """d[dotted key] = value, making (or replacing a non-mapping value by) each section on the way."""
    *parents, last = key.split(".")
    for p in parents:
        if not isinstance(d.get(p), dict):
            d[p] = {}
        d = d[p]
    d[last] = value


def _get(d: Any, key: str, default: Any) -> tuple[Any, bool]:
    for p in key.split("."):
        if not isinstance(d, dict) or p not in d:
            return default, False
        d = d[p]
    return d, True


def values_to_dict(fields: list[FormField], values: list[Any]) -> dict:
    """Form values -> a recipe dict holding the required keys and every non-default value."""
    raw: dict = {}
    enabled = {f.key: bool(v) for f, v in zip(fields, values) if f.kind == "section"}
    order = {f.key: i for i, f in enumerate(form_fields())}  # write keys in schema order, as recipes are
    for f, v in sorted(zip(fields, values), key=lambda fv: order.get(fv[0].key, len(order))):
        if f.section is not None and not enabled.get(f.section, True):
            continue
        if f.kind == "section":
            if v:
                _set(raw, f.key, {})
            continue
        value = from_widget(f, v)
        if f.required or not _same(value, f.default):
            _set(raw, f.key, value)
    return raw


def dict_to_values(fields: list[FormField], raw: dict) -> list[Any]:
    """A recipe dict -> one widget value per field (schema defaults for keys it does not set)."""
    out = []
    for f in fields:
        if f.kind == "section":
            value, present = _get(raw, f.key, None)
            out.append(present and value is not None)
        else:
            value, _ = _get(raw, f.key, f.default)
            out.append(to_widget(f, value))
    return out


def to_yaml(raw: dict) -> str:
    return yaml.safe_dump(raw, sort_keys=False, default_flow_style=False, width=100)


def edit_yaml(text: str, fields: list[FormField], values: list[Any], whole_form: bool = True) -> str:
    """`text` with the form's values applied in place: a key whose widget shows what the YAML holds is left
    as written (comments, order, flow style, quoting and all); a changed one is set where it is; a new one is
    added to its section (the section created at the end when missing) only when it differs from the schema
    default; an optional section switched off is removed, one switched on is added. Text that is not a YAML
    mapping is replaced by the form's recipe (values_to_dict) when `fields` are the `whole_form`'s, else left
    as it is (one field's value is no recipe)."""
    rt = YAML()  # round trip; the quotes kept: `precision: "no"` must not become PyYAML's False
    rt.preserve_quotes = True
    try:
        _, indent, offset = load_yaml_guess_indent(text or "")
        doc = rt.load(text or "")
    except YAMLError:
        doc = None
    if not isinstance(doc, CommentedMap):
        return to_yaml(values_to_dict(fields, values)) if whole_form else text
    method_before = _get(doc, "method.type", "full")[0]
    enabled = {f.key: bool(v) for f, v in zip(fields, values) if f.kind == "section"}
    kind = next((from_widget(f, v) for f, v in zip(fields, values) if f.key == "method.type"), method_before)
    for f, v in zip(fields, values):
        if any(not on and f.key.startswith(k + ".") for k, on in enabled.items()):
            continue  # inside a section that is off (removed with it)
        if not for_method(f.key, kind or "full"):
            continue  # another method's settings (hidden, their widgets unchanged): not written back
        node, present = _get(doc, f.key, None)
        present, old = present and node is not None, _plain_data(node)
        if f.kind == "section":
            if bool(v) != present:
                _set(doc, f.key, {}) if v else _delete(doc, f.key)
            continue
        value = from_widget(f, v)
        if present and _same(from_widget(f, to_widget(f, old)), value):
            continue  # the widget shows what the YAML says: the user's spelling stays
        if value is None and f.default is None:  # a cleared field: its key goes (`key:` null is no "unset")
            if _get(doc, f.key, None)[1]:
                _delete(doc, f.key)
            continue
        if present or f.required or not _same(value, from_widget(f, to_widget(f, f.default))):
            _set(doc, f.key, _shaped(_as_written(value), node))
    _drop_other_methods(doc, method_before)
    out = StringIO()  # in the text's own indents: ruamel keeps no per-document layout but these
    mapping = _mapping_indent(text)
    rt.indent(mapping=mapping, sequence=indent if offset is not None else mapping, offset=offset or 0)
    rt.width = 100
    rt.dump(doc, out)
    return out.getvalue()


def _shaped(value: Any, node: Any) -> Any:
    """A list value in the shape the YAML wrote the key's old value: one item of a key written as a scalar
    stays a scalar (`train: a.jsonl` is not turned into a block list), a flow list stays a flow list."""
    if isinstance(value, list) and isinstance(node, str) and len(value) == 1:
        return value[0]
    if isinstance(value, list) and isinstance(node, CommentedSeq) and node.fa.flow_style():
        flow = CommentedSeq(value)
        flow.fa.set_flow_style()
        return flow
    return value


def _drop_other_methods(doc: CommentedMap, before: Any) -> None:
    """After the method was switched (from `before`), the sections of other methods go: `method.lora` for full
    fine-tuning, `method.quantization` but for QLoRA, `method.qat` but for full (FOR_METHODS)."""
    now = _get(doc, "method.type", "full")[0]
    if now == before:
        return
    for part in FOR_METHODS:
        if not for_method(part, now) and _get(doc, part, None)[1]:
            _delete(doc, part)


def _mapping_indent(text: str) -> int:
    """The smallest indent of a nested mapping key in the text (2 when there is none)."""
    indents = [
        len(line) - len(line.lstrip(" "))
        for line in text.splitlines()
        if line.startswith(" ") and line.strip() and line.lstrip()[0] not in "-#"
    ]
    return min(indents, default=2)


def _plain_data(x: Any) -> Any:
    """ruamel's round-trip values (CommentedMap, CommentedSeq, ScalarFloat, ...) as plain Python."""
    if isinstance(x, dict):
        return {str(k): _plain_data(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain_data(v) for v in x]
    for kind in (bool, int, float, str):
        if isinstance(x, kind):
            return kind(x)
    return x


def _as_written(value: Any) -> Any:
    """A string PyYAML (which reads recipes: YAML 1.1) would read as something else ("no", "on", "1e-4")
    double-quoted; ruamel writes YAML 1.2, where they are plain strings."""
    if isinstance(value, str) and yaml.safe_load(value or "''") != value:
        return DoubleQuotedScalarString(value)
    if isinstance(value, list):
        return [_as_written(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_written(v) for k, v in value.items()}
    return value


def _delete(doc: CommentedMap, key: str) -> None:
    *parents, last = key.split(".")
    for p in parents:
        doc = doc[p]
    del doc[last]


class YamlError(ValueError):
    pass


def parse_yaml(text: str) -> dict:
    try:
        raw = yaml.safe_load(text or "") or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise YamlError(f"the recipe is not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    if not isinstance(raw, dict):
        raise YamlError("the recipe must be a mapping of keys (model:, data:, train: ...) at the top level")
    return raw


# ----------------------------------------------------------------------------- validation errors


def field_errors(raw: dict, fields: list[FormField]) -> dict[str, list[str]]:
    """Validate `raw` against the schema; {dotted key of the field (or section, or "") -> messages}.

    Pydantic's error locations are mapped onto form keys: the longest field key that prefixes the
    location wins (`method.lora.target_modules.list[str].0` -> `method.lora.target_modules`); a
    location that is a section (a cross-field check, an unknown key) keeps its own path.
    """
    return validated(raw, fields)[1]


def validated(raw: dict, fields: list[FormField]) -> tuple[Recipe | None, dict[str, list[str]]]:
    """One validation of `raw` against the schema: (the recipe, {}), or (None, its errors as field_errors
    gives them)."""
    try:
        return Recipe.model_validate(raw), {}
    except ValidationError as err:
        keys = {f.key for f in fields}
        out: dict[str, list[str]] = {}
        for e in err.errors():
            loc = [str(p) for p in e["loc"] if not str(p).startswith("function-")]
            key = field_key(loc, keys)
            msg = e["msg"].removeprefix("Value error, ")
            if e["type"] == "extra_forbidden":
                key, msg = ".".join(loc[:-1]), f"unknown key `{'.'.join(loc)}` (not in the recipe schema)"
            elif e["type"] == "missing":
                msg = "required"
            elif not key:
                key = ".".join(loc)
            out.setdefault(key, []).append(msg)
        return None, out


def field_key(loc: list[str], keys: set[str]) -> str:
    """The form field a location belongs to: the longest field key that prefixes it
    (`rl.rewards.0.function` -> `rl.rewards`), else ""."""
    for n in range(len(loc), 0, -1):
        if ".".join(loc[:n]) in keys:
            return ".".join(loc[:n])
    return ""


def on_fields(errors: dict[str, list[str]], fields: list[FormField]) -> dict[str, list[str]]:
    """Errors keyed by dotted recipe keys (`rl.rewards[1].function`) moved onto the form fields they belong
    to, each message still naming its own key; a key no field holds stays as it is."""
    keys, out = {f.key for f in fields}, {}
    for key, msgs in errors.items():
        loc = re.sub(r"\[(\d+)\]", r".\1", key).split(".")
        out.setdefault(field_key(loc, keys) or key, []).extend(msgs)
    return out


def said(key: str, message: str) -> str:
    """An error's message where its key is said already: without a leading `key: ` of its own (the workspace's
    refusals name their key, which read "data.train: data.train: /etc/passwd is outside ...")."""
    return message.removeprefix(f"{key}: ") if key else message


def errors_text(errors: dict[str, list[str]]) -> str:
    return "\n".join(f"- **{k or 'recipe'}**: {said(k, m)}" for k, msgs in errors.items() for m in msgs)


def errors_plain(errors: dict[str, list[str]]) -> str:
    """The errors on one line of plain text (a toast shows markdown as typed: `- **train**:`)."""
    return "; ".join(f"{k or 'recipe'}: {said(k, m)}" for k, msgs in errors.items() for m in msgs)
