"""
The house's plan, read from the source: every import of the project's modules (those inside functions too) forms
no circle, and a project import inside a function is a rare one that says why beside it.
"""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def project_modules():
    """
    {module name: path} of the top-level .py files, the packages' modules (tasks.lm, recipes.text) and the
    developer tools (tools/ is plain scripts, not a package: its modules import by name, as bench_train).
    """
    modules = {p.stem: p for p in [*ROOT.glob("*.py"), *(ROOT / "tools").glob("*.py")]}
    for package in ("tasks", "converters", "recipes"):
        for path in (ROOT / package).glob("*.py"):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def imports(path, modules):
    """(the project module imported, whether inside a function, the line) for every import statement of path."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # `from tasks.base import Task` imports tasks.base; `from tasks import lm` imports tasks.lm
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        name = next((n for n in names if n in modules), None)
        if name is not None:
            found.append((name, id(node) not in top, node.lineno))
    return found


def test_no_module_imports_another_that_imports_it_back():
    modules = project_modules()
    graph = {name: {m for m, _, _ in imports(path, modules)} - {name} for name, path in modules.items()}
    # depth-first search for a back edge: a module reached again while its own imports are being followed
    state, circle = {}, []

    def visit(name, trail):
        state[name] = "open"
        for other in sorted(graph[name]):
            if state.get(other) == "open":
                circle.append(trail[trail.index(other) :] + [other])
            elif other not in state:
                visit(other, [*trail, other])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circle, f"import circles: {[' -> '.join(c) for c in circle]}"
    # the layering: the library never imports the scripts a user runs, and nothing outside tools/ imports the
    # developer tools (which may import anything)
    tools = {name for name, path in modules.items() if path.parent.name == "tools"}
    scripts = {"train", "sample", "eval", "serve", "export", "prepare_data"}
    library = set(modules) - scripts - tools - {"plan"}
    against = sorted(f"{m} -> {s}" for m in library for s in graph[m] & scripts)
    assert not against, f"library modules importing scripts: {against}"
    against = sorted(f"{m} -> {t}" for m in set(modules) - tools for t in graph[m] & tools)
    assert not against, f"modules outside tools/ importing a tool: {against}"


def test_project_imports_inside_functions_are_few_and_say_why():
    modules = project_modules()
    inner = []
    for name, path in modules.items():
        lines = path.read_text(encoding="utf-8").splitlines()
        for module, inside, line in imports(path, modules):
            if inside:
                # the reason: a comment on the import's line or the line before it
                said = "#" in lines[line - 1] or lines[line - 2].strip().startswith("#")
                inner.append((f"{name}:{line} imports {module}", said))
    # each a wing's door, opened where a run names the wing: Hugging Face weights (a nanoGPT checkpoint's GPT-2 names,
    # an init_from folder, a hub base kept), the chat templates (sample.py --chat), the planner (train.py --plan)
    assert len(inner) <= 6, inner
    assert all(said for _, said in inner), [where for where, said in inner if not said]


def test_model_py_imports_nothing_of_the_project():
    """The ground floor: model.py is the Transformer alone, readable and usable without any other file of ours."""
    modules = project_modules()
    assert imports(modules["model"], modules) == []


# The quick start's core: what `python train.py configs/shakespeare.py` may load of the project. Everything else is a
# wing, loaded only where a run names it (docs/layout.md)
CORE = {
    "train",
    "model",
    "config",
    "log",
    "runtime",
    "compiling",
    "checkpoint",
    "elastic",
    "start",
    "data",
    "optim",
    "muon",
    "tokens",
    "generate",
    "tasks",
    "tasks.base",
    "tasks.lm",
    "converters",
    "converters.base",
    "recipes",
    "recipes.base",
    "recipes.shakespeare_char",
}


def test_the_quick_start_loads_the_core_alone(tmp_path, shakespeare_path):
    """
    configs/shakespeare.py run for real (its data prepared from the mirror into an empty folder, two steps, an
    evaluation, a save) imports nothing of the project but CORE: no other task, converter or recipe, no chat
    templates, Hugging Face, planner, server or tool.
    """
    modules = project_modules()
    argv = [
        "configs/shakespeare.py",
        f"--data_dir={tmp_path / 'data'}",
        f"--out_dir={tmp_path / 'out'}",
        "--max_minutes=0",
        "--max_iters=2",
        "--eval_interval=2",
        "--eval_iters=1",
        "--compile=false",
        "--tensorboard=false",
    ]
    script = (
        "import json, runpy, sys\n"
        f"sys.argv = ['train.py', *{argv!r}]\n"
        "try:\n"
        "    runpy.run_path('train.py', run_name='__main__')\n"
        "finally:\n"
        "    print(json.dumps(sorted(sys.modules)))\n"
    )
    env = {**os.environ, "NANOFORMER_DATA_MIRROR": str(shakespeare_path.parent), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    loaded = set(json.loads(run.stdout.splitlines()[-1])) & set(modules)
    assert loaded - {"__main__"} <= CORE, sorted(loaded - CORE)
    assert {"model", "recipes.shakespeare_char", "tasks.lm"} <= loaded
