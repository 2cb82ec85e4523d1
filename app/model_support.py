"""The Configure tab's "Will this model work?": the recipe's model (model.name_or_path) through
`python -m training.support` (a subprocess, as every training tool the app drives, run in the workspace), its
row of the support matrix shown as a table, each "no" with its reason."""

from __future__ import annotations

from app.recipe_check import RecipeCheck
from app.recipe_form import errors_text
from app.runs import tool_json
from app.workspace import Workspace
from training.config import parse_recipe

SUPPORT_TIMEOUT_S = 600  # an image-text model trains twice, tiny; a busy 2-core machine took 2 min


def model_support(ws: Workspace, text: str) -> str:
    """Markdown: the row of the recipe's model, or why there is none (a recipe to fix first, a model built
    from scratch, the command's refusal)."""
    c = RecipeCheck.of(ws, text)
    if errors := c.errors:
        return f"Fix the recipe first:\n{errors_text(errors)}"
    name = parse_recipe(c.raw, "the form").model.name_or_path
    if name is None:
        return (
            "The recipe builds its model from scratch (model.from_scratch): there is no checkpoint to check."
        )
    try:
        row = tool_json(ws, ["training.support", name, "--json"], SUPPORT_TIMEOUT_S, "training.support")
    except RuntimeError as e:
        return f"training.support: {e}"
    return support_table(row)


def support_table(row: dict) -> str:
    ok = sum(cell.startswith("yes") for cell in row["cells"].values())
    lines = [
        f"**{row['path']}**: {row['model_type']} ({row['kind']}), built tiny from its config: {ok} of "
        f"{len(row['cells'])} checks yes, {row['seconds']:.0f} s. What each check means: docs/models.md.",
        "",
        "| check | answer |",
        "|---|---|",
    ]
    lines += [f"| {name} | {cell.replace('|', '/')} |" for name, cell in row["cells"].items()]
    return "\n".join(lines)
