"""The layers of training/ (docs/architecture.md), read from every module's imports (AST), enforced:
imports point down, never sideways between packages of one layer, never in a cycle, and never hidden in
a function body. The checker is tested on made-up modules too, so that it is known to fail."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

LAYERS = {
    "core": 0,
    "config": 1,
    "launch": 2,
    "run": 2,
    "data": 3,
    "model": 3,
    "generation": 4,
    "objectives": 5,
    "rl": 6,
    "parallel": 7,
    "planning": 7,
    "evals": 7,
    "loop": 8,
    "tools": 9,  # the CLIs (train, plan, export, evaluate, chat, demo) and the bundled eval tasks
}
APP_MAY_IMPORT = ("core", "config", "launch", "run", "planning")
# Function-local project imports that stay, each for a reason of its own:
LOCAL_ALLOWED = {
    ("app/chat_models.py", "training.generation"): "the app loads a model for chat only when a chat starts",
    ("app/__main__.py", "app.ui"): "gradio reads the environment set just before, on import",
    (
        "training/rl/verifiers_env.py",
        "training.generation.http_app",
    ): "the HTTP stack (FastAPI, uvicorn) only for "
    "a run whose verifiers environment calls the policy over it; every RL run imported it (a GPU machine without "
    "uvicorn could not train)",
}
# Third-party modules (and names) only training.parallel may import: the collectives, DTensor and DeviceMesh,
# DeepSpeed, and accelerate's operations across processes. The rules the packages' __init__s state.
ACCELERATE_COLLECTIVES = tuple(
    f"accelerate.utils.{name}"
    for name in (
        "gather",
        "gather_object",
        "broadcast",
        "broadcast_object_list",
        "reduce",
        "pad_across_processes",
    )
) + ("accelerate.utils.operations",)
PARALLEL_ONLY = ("deepspeed", "torch.distributed", *ACCELERATE_COLLECTIVES)
NEVER_IMPORTS = {  # package -> third-party modules it never imports, beyond PARALLEL_ONLY
    "data": ("accelerate",),  # loaders take the data-parallel rank and size as integers
}


def package_of(module: str) -> str:
    """training.parallel.mesh -> "parallel"; training.train -> "tools"; training -> "core"."""
    parts = module.split(".")
    if parts[0] == "app":
        return "app"
    if len(parts) == 1:
        return "core"  # training/__init__.py: the package's own start-up (log filters), imports nothing
    return parts[1] if parts[1] in LAYERS else "tools"


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def resolve(target: str, name: str | None, modules: set[str]) -> str:
    """`from target import name`: the submodule target.name when there is one, else target."""
    if name is not None and f"{target}.{name}" in modules:
        return f"{target}.{name}"
    return target


def imports_of(source: str, modules: set[str]):
    """(module imported, line, at module level?) for every project import and every third-party one; a
    third-party `from M import N` yields M.N (so that a rule can name one function of a module)."""
    tree = ast.parse(source)
    local = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            local |= {id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                if not node.module.startswith(("training", "app")):
                    yield f"{node.module}.{alias.name}", node.lineno, id(node) not in local
                    continue
                yield resolve(node.module, alias.name, modules), node.lineno, id(node) not in local
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, id(node) not in local


def problems(sources: dict[str, tuple[str, str]]) -> list[str]:
    """Every broken rule in {module: (path, source)}: upward or sideways edges, function-local project
    imports, parallel-only libraries elsewhere, and cycles among module-level imports."""
    modules = set(sources)
    found, graph = [], {m: set() for m in modules}
    for module, (path, source) in sources.items():
        pkg = package_of(module)
        for target, line, top in imports_of(source, modules):
            where = f"{path}:{line}"
            third_party = not target.startswith(("training", "app"))
            if third_party:
                if pkg != "parallel" and module.startswith("training") and target.startswith(PARALLEL_ONLY):
                    found.append(f"{where}: {module} imports {target}, which only training.parallel may")
                elif target.startswith(NEVER_IMPORTS.get(pkg, ())):
                    found.append(f"{where}: {module} imports {target}: training.{pkg} never imports it")
                continue
            if target not in modules:
                continue
            if not top and (path, target) not in LOCAL_ALLOWED:
                found.append(f"{where}: {module} imports {target} inside a function (hides a cycle)")
            if top:
                graph[module].add(target)
            tpkg = package_of(target)
            if pkg == "app":
                if tpkg != "app" and tpkg not in APP_MAY_IMPORT and (path, target) not in LOCAL_ALLOWED:
                    found.append(
                        f"{where}: the app imports {target} (it may import {', '.join(APP_MAY_IMPORT)})"
                    )
                continue
            if tpkg == "app":
                found.append(f"{where}: {module} imports the app ({target})")
            elif tpkg != pkg and LAYERS[tpkg] >= LAYERS[pkg]:
                way = "up" if LAYERS[tpkg] > LAYERS[pkg] else "sideways"
                found.append(
                    f"{where}: {module} (layer {LAYERS[pkg]}, {pkg}) imports {way} into {target} "
                    f"(layer {LAYERS[tpkg]}, {tpkg})"
                )
    return list(dict.fromkeys(found)) + [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected group of modules (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph[v]:
                out.append(sorted(group) + [sorted(group)[0]])

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@functools.cache
def project_sources() -> dict[str, tuple[str, str]]:
    """{module: (path, source)} of training/ and app/, read once (callers copy before adding to it)."""
    out = {}
    for top in ("training", "app"):
        for path in sorted((ROOT / top).rglob("*.py")):
            out[module_name(path, ROOT)] = (str(path.relative_to(ROOT)), path.read_text())
    return out


def package_edges(sources: dict[str, tuple[str, str]]) -> dict[str, set[str]]:
    """package -> the packages its modules import at module level (training's and the app; "tools": the CLIs)."""
    modules, edges = set(sources), {}
    for module, (_, source) in sources.items():
        pkg = package_of(module)
        for target, _, top in imports_of(source, modules):
            if top and target in modules and (tpkg := package_of(target)) != pkg:
                edges.setdefault(pkg, set()).add(tpkg)
    return edges


def picture(sources: dict[str, tuple[str, str]]) -> str:
    """The layers as a Mermaid flowchart drawn from the imports: one box per layer, an arrow per package that
    imports another (docs/architecture.md shows it; `python tests/test_layers.py` prints it)."""
    edges = package_edges(sources)
    lines = ["flowchart BT"]
    for level in sorted(set(LAYERS.values())):
        names = sorted(p for p, n in LAYERS.items() if n == level)
        lines += [f"  subgraph L{level}[layer {level}]", *(f"    {n}" for n in names), "  end"]
    lines += ["  app"]
    for pkg in sorted(edges):
        lines += [f"  {pkg} --> {target}" for target in sorted(edges[pkg])]
    return "\n".join(lines) + "\n"


def test_the_architecture_page_shows_the_layers_as_the_imports_draw_them():
    page = (ROOT / "docs/architecture.md").read_text()
    drawn = picture(project_sources())
    assert f"```mermaid\n{drawn}```" in page, (
        f"docs/architecture.md: replace the layers picture with\n{drawn}"
    )


def test_the_layers_hold():
    found = problems(project_sources())
    assert not found, "\n".join(found)


def test_every_package_says_its_rule():
    for pkg in LAYERS:
        if pkg == "tools":
            continue
        doc = ast.get_docstring(ast.parse((ROOT / "training" / pkg / "__init__.py").read_text())) or ""
        assert "Rule" in doc or "rule" in doc, (
            f"training/{pkg}/__init__.py: no one-line rule in its docstring"
        )


# ----------------------------------------------------------------------------- the checker can fail


def with_module(module: str, source: str) -> dict[str, tuple[str, str]]:
    sources = project_sources()
    path = module.replace(".", "/") + ".py"
    return {**sources, module: (path, source)}


@pytest.mark.parametrize(
    "module, source, expected",
    [
        ("training.core.extra", "from training.loop.fit import train\n", "imports up into training.loop.fit"),
        ("training.data.extra", "from training.model.build import build_model\n", "imports sideways"),
        ("training.model.extra", "def f():\n    from training.config import Recipe\n", "inside a function"),
        ("training.objectives.extra", "import torch.distributed as dist\n", "only training.parallel may"),
        (
            "training.model.extra",
            "def f():\n    from torch.distributed.tensor import DTensor\n",
            "only training.parallel",
        ),
        ("training.rl.extra", "from accelerate.utils import gather_object\n", "only training.parallel may"),
        (
            "training.data.extra",
            "from accelerate.utils import send_to_device\n",
            "training.data never imports",
        ),
        (
            "training.generation.extra",
            "from training.rl.build import make_engine\n",
            "imports up into training.rl",
        ),
        (
            "training.objectives.extra",
            "from training.rl.loss import token_logps\n",
            "imports up into training.rl",
        ),
        ("training.rl.extra", "from training.loop.run import Run\n", "imports up into training.loop"),
        ("app.extra", "from training.loop.setup import setup\n", "the app imports training.loop.setup"),
        ("training.config.extra", "from app.ui import build_app\n", "imports the app"),
    ],
)
def test_the_checker_refuses(module, source, expected):
    found = problems(with_module(module, source))
    assert any(expected in p for p in found), found


def test_the_checker_finds_cycles():
    sources = {
        "training.data.a": ("a.py", "from training.data.b import x\n"),
        "training.data.b": ("b.py", "from training.data.a import y\n"),
    }
    assert problems(sources) == ["import cycle: training.data.a -> training.data.b -> training.data.a"]


def test_the_data_check_imports_no_model_code():
    """`python -m training.preview` (the app's data check after each edit of the data settings, and its preview)
    imports no model or processor classes of transformers: they bring its modeling, torchvision and torch._dynamo,
    which took its start from 2.9 s to 5.3 s (quiet 2-core Xeon); processors.py and vision.py reach them through the
    lazy `transformers` module where they are used."""
    heavy = ["transformers.modeling_utils", "transformers.processing_utils", "torchvision", "torch._dynamo"]
    code = f"import sys, training.preview; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


if __name__ == "__main__":  # python tests/test_layers.py: the picture of the layers, from the imports
    print(picture(project_sources()), end="")
