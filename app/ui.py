"""The Gradio Blocks: Configure, Run, Export & evaluate and Chat tabs wired to the workspace, the runs, the jobs
and the chat models.

`build_app` lays out the page and hands each tab what it needs: the services (`AppContext`), the page's own
components (`Page`) and, for the Run tab, the recipe inputs the Configure tab returns (`RecipeInputs`), all
from app/context.py. Each tab is a module of its own that no other tab imports (app/configure_tab.py,
app/run_tab.py, app/export_tab.py, app/chat_tab.py); what an endpoint decides (is the recipe launchable, which
command runs it, what the planner says, what a run shows) lives in plain modules without gradio
(app/recipe_check.py, app/form_state.py, app/run_views.py, app/jobs.py, app/chat_messages.py, ...), so tests
call them without a server.

Named API endpoints (see the app's "Use via API" page or `gradio_client.Client.view_api()`):
form_to_yaml, yaml_to_form, find_setting, load_recipe, save_recipe, launch_command, memory_plan, data_preview,
start_run, stop_run, run_status (structured), compare_runs (structured), export_merge, export_gguf, export_push,
evaluate (these four queue a background job), job_status (structured), load_model, unload_models, chat.
"""

from __future__ import annotations

import gradio as gr

from app.chat_models import ChatModels
from app.chat_tab import chat_tab
from app.configure_tab import configure_tab
from app.context import AppContext, Page
from app.export_tab import export_tab
from app.jobs import JobQueue
from app.recipe_form import form_fields, grouped
from app.run_tab import run_tab
from app.run_views import RunViews
from app.runs import RunRegistry
from app.workspace import Workspace

CSS = """
.field-error .info, .field-error span[data-testid='block-info'] + div { color: #c62828 !important; }
.field-error { outline: 2px solid #e53935; border-radius: 6px; }
.section-errors p { color: #c62828; }
#status-ok p { color: #2e7d32; }
.preview-example { white-space: pre-wrap; font-size: 0.85em; }
.preview-example mark { background: #ffe08a; }
/* the memory plan: no word is broken (gradio's markdown breaks anywhere: headers and numbers went a letter or two
   a line), the figures on one line, the backend and the "fits" prose wrap between words; a table wider than the
   page scrolls */
#memory-plan table, #memory-plan span { word-break: normal; overflow-wrap: normal; }
#memory-plan th, #memory-plan td { padding: 0.3em 0.6em; white-space: nowrap; }
#memory-plan td:first-child, #memory-plan td:nth-last-child(2) { white-space: normal; }
#memory-plan td:nth-last-child(2) { min-width: 16em; }
#memory-plan .prose { overflow-x: auto; }
"""
# Gradio's Textbox sends its input event on a keypress only, so a deletion, a cut, a paste or an undo changed a
# field without telling the server (a cleared field stayed in the YAML until another edit). Such an edit sends it
# too: a keypress of no key on the box, which the textbox answers with its input event.
JS = """() => {
  document.addEventListener('input', (e) => {
    const box = e.target;
    if (!(box instanceof HTMLInputElement || box instanceof HTMLTextAreaElement)) return;
    if (!box.closest('[data-testid="textbox"]')) return;
    if (e.inputType === 'insertText' || e.inputType === 'insertLineBreak') return;  // keypresses already
    box.dispatchEvent(new KeyboardEvent('keypress', {key: 'Unidentified'}));
  });
}"""


def build_app(ws: Workspace) -> gr.Blocks:
    """The page: a header and the Configure, Run, Export & evaluate and Chat tabs."""
    runs = RunRegistry(ws)
    ctx = AppContext(
        ws, runs, RunViews(runs), ChatModels(ws), JobQueue(ws, runs.run_dirs), grouped(form_fields())
    )
    with gr.Blocks(title="llm-forge", analytics_enabled=False) as demo:
        gr.Markdown(
            f"# llm-forge\nWorkspace: `{ws.root}` — runs in `runs/`, recipes in `recipes/`, data in `data/`."
        )
        with gr.Tabs() as tabs:
            page = Page(demo, tabs)
            with gr.Tab("Configure", id="configure"):
                recipe = configure_tab(ctx, page)
            with gr.Tab("Run", id="run"):
                run_tab(ctx, page, recipe)
            with gr.Tab("Export & evaluate", id="export"):
                export_tab(ctx, page)
            with gr.Tab("Chat", id="chat"):
                chat_tab(ctx, page)
        progress_on_leaves(demo)  # before the block closes: gradio writes the page's config as it does
    return demo


def progress_on_leaves(demo: gr.Blocks) -> None:
    """Each event's progress shows on its output components but not on the layouts among them (the page's tabs
    for Start, the form's tabs and folds), and not at all where it is hidden. Gradio's page keeps a loading status
    for every component an event has ever shown progress on, and at each status change of any event (several per
    request) finds each of them in its tree of components and reads its value and that of everything inside it:
    with the page's tabs among them, the whole page, after Start, at every refresh of the Run and Export tabs."""
    for fn in demo.fns.values():
        if fn.show_progress_on is None:
            leaves = [b for b in fn.outputs if not isinstance(b, gr.blocks.BlockContext)]
            fn.show_progress_on = [] if fn.show_progress == "hidden" else leaves
