"""
The docs check: every command in the shell blocks of README.md and docs/*.md is read by the script it names (the
arguments of the batch script slurm/train.sbatch by train.py), so no page drifts from the code. Nothing is trained or
run: each `python X.py ...` (or `torchrun ... train.py ...`) line is checked for a script that exists, config files
that exist, and options that its own parser accepts with values of the right type (config.parse_config with the
script's config class; prepare_data.parse_args, which builds one). Links between the pages must point to files and
headings that exist.

Commands that start a run must each write into a folder of their own, since train.py refuses to start a run into a
folder that holds one: two commands that train into the same out_dir must describe the same run.
"""

import ast
import contextlib
import dataclasses
import importlib
import io
import json
import re
import shlex
import tempfile
from pathlib import Path

import pytest

from config import parse_config

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = ("sh", "bash", "shell", "console")

# each script's config class, which its cli() fills with config.parse_config; prepare_data.py builds one per dataset
CONFIG_CLASSES = {
    "train.py": ("train", "TrainConfig"),
    "sample.py": ("sample", "SampleConfig"),
    "eval.py": ("eval", "EvalConfig"),
    "export.py": ("export", "ExportConfig"),
    "tools/bench.py": ("bench", "BenchConfig"),
    "serve.py": ("serve", "ServeConfig"),
}
# scripts of other projects that a page tells the reader to run in their own checkout
ELSEWHERE = {"convert_hf_to_gguf.py"}  # llama.cpp's converter (docs/export.md)
# scripts that take no options (docs/distributed.md's interconnect check): a command gives them none
NO_OPTIONS = {"slurm/all_reduce.py"}
# train.py settings that change where or how fast a run goes, not what it trains
# (or how it outlives failures)
SAME_RUN = {"device", "dtype", "compile", "threads", "backend", "dist_timeout", "data_options", "overwrite"}
SAME_RUN |= {"auto_resume", "checkpoint_minutes"}


@dataclasses.dataclass
class Command:
    where: str  # page:line, for messages and test ids
    script: str  # as written: train.py
    args: list  # the words after the script
    written: set  # files the block writes before this line (`> old.py`): they exist when the command runs


def fenced_blocks(text):
    """The fenced code blocks of a markdown text: (language, first line number of the body, body lines)."""
    blocks, open_block = [], None
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            if open_block is None:
                open_block = (line.strip()[3:].strip(), number + 1, [])
            else:
                blocks.append(open_block)
                open_block = None
        elif open_block is not None:
            open_block[2].append(line)
    return blocks


def shell_lines(first, lines):
    """(line number, logical line) of a shell block, a line ending in a backslash joined to the next."""
    joined, start, parts = [], None, []
    for number, line in enumerate(lines, first):
        start = number if not parts else start
        if line.rstrip().endswith("\\"):
            parts.append(line.rstrip()[:-1])
            continue
        joined.append((start, " ".join([*parts, line])))
        parts = []
    return joined


def split_words(line):
    """The words of a shell line, comments dropped, with `&&`, `|`, `;` and `>` as words of their own."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def commands(text, page):
    """Every python/torchrun command of the text's shell blocks."""
    found = []
    for language, first, lines in fenced_blocks(text):
        if language not in SHELL:
            continue
        written = set()
        for number, line in shell_lines(first, lines):
            words = split_words(line)
            # a redirect's target is a file this block creates for the lines after it
            written |= {words[i + 1] for i, w in enumerate(words[:-1]) if w == ">"}
            segment = []
            for word in [*words, ";"]:
                if word not in ("&&", "||", ";", "|", ">", ">>"):
                    segment.append(word)
                    continue
                command = command_of(segment, f"{page}:{number}", set(written))
                if command is not None:
                    found.append(command)
                # words after a redirect name its file, not arguments
                segment = [] if word != ">" else [">"]
    return found


def command_of(words, where, written):
    """The Command in one segment of a shell line, or None if it runs no Python script."""
    if not words or words[0] == ">":
        return None
    for i, word in enumerate(words):
        if word in ("python", "python3") and i + 1 < len(words) and words[i + 1] != "-m":
            return Command(where, words[i + 1], words[i + 2 :], written)
        if word.endswith("slurm/train.sbatch"):  # the batch script hands its arguments to train.py
            return Command(where, "train.py", words[i + 1 :], written)
        if word == "torchrun":
            # torchrun's own options come first; the script is the first .py after them
            rest = words[i + 1 :]
            at = next((j for j, w in enumerate(rest) if w.endswith(".py")), None)
            return None if at is None else Command(where, rest[at], rest[at + 1 :], written)
    return None


def stand_ins(args, written, folder):
    """args with each file the block writes earlier (whole, or one of a comma-separated value) made to exist."""
    made = {}
    for name in written:
        made[name] = str(Path(folder) / Path(name).name)
        Path(made[name]).touch()

    def swap(text):
        return ",".join(made.get(part, part) for part in text.split(","))

    swapped = []
    for arg in args:
        key, eq, value = arg.partition("=")
        swapped.append(f"{key}={swap(value)}" if arg.startswith("--") and eq else swap(arg))
    return swapped


def parse(script, args):
    """The script's parsed settings for args (None for --help), or raise with the parser's one-line reason."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            if script == "prepare_data.py":
                return importlib.import_module("prepare_data").parse_args(args)
            module, name = CONFIG_CLASSES[script]
            return parse_config(getattr(importlib.import_module(module), name), args)
        except SystemExit as e:
            if e.code == 0:  # --help
                return None
            lines = out.getvalue().strip().splitlines()
            raise ValueError(lines[-1] if lines else f"exit status {e.code}") from None


def check_command(command):
    """The problems with one command, as lines naming where it is; [] if its script would accept it."""
    where = f"{command.where}: {command.script} {' '.join(command.args)}"
    if command.script in ELSEWHERE:
        return []
    if not (ROOT / command.script).is_file():
        return [f"{where}: no script {command.script}"]
    if command.script in NO_OPTIONS:
        return [f"{where}: {command.script} takes no options"] if command.args else []
    if command.script not in CONFIG_CLASSES and command.script != "prepare_data.py":
        return [f"{where}: the docs check does not know {command.script}'s options; add it to CONFIG_CLASSES"]
    problems = [
        f"{where}: config file {arg} not found"
        for arg in command.args
        if arg.endswith(".py") and not arg.startswith("-") and arg not in command.written and not (ROOT / arg).is_file()
    ]
    with tempfile.TemporaryDirectory() as folder:
        try:
            settings = parse(command.script, stand_ins(command.args, command.written, folder))
            # tools/bench.py hands train_args to train.py: they must be train.py's options too
            if command.script == "tools/bench.py" and settings is not None and settings.train_args:
                parse("train.py", shlex.split(settings.train_args))
        except Exception as e:  # the parser's own error: an unknown option, a bad value, a missing file
            problems.append(f"{where}: {str(e).strip().splitlines()[0]}")
    return problems


def headings(text):
    """The anchors of a markdown text's headings, as GitHub makes them."""
    prose = strip_code(text)
    titles = re.findall(r"^#+\s+(.*?)\s*$", prose, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-") for title in titles}


def strip_code(text):
    """text without its fenced blocks and inline code, where brackets and '#' are not markdown."""
    kept, inside = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
        elif not inside:
            kept.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(kept)


def check_links(text, page):
    """Relative links of a page whose file or heading does not exist."""
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", strip_code(text)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.is_file():
            problems.append(f"{page.name}: link to {target}: no file {path}")
        elif anchor and linked.suffix == ".md" and anchor not in headings(linked.read_text(encoding="utf-8")):
            problems.append(f"{page.name}: link to {target}: no heading #{anchor} in {linked.name}")
    return problems


def out_dir_clashes(found):
    """The out_dirs into which the commands start different runs: train.py would refuse all but the first."""
    runs = {}
    for command in found:
        if command.script != "train.py" or check_command(command):
            continue  # a command its parser refuses is reported on its own
        cfg = parse("train.py", command.args)
        # resuming, evaluating, planning or replacing a run on purpose is no clash
        if cfg is None or cfg.init_from == "resume" or cfg.eval_only or getattr(cfg, "plan", False):
            continue
        if getattr(cfg, "overwrite", False):
            continue
        run = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in SAME_RUN}
        runs.setdefault(cfg.out_dir, []).append((command.where, run))
    return [
        f"{out_dir}: {', '.join(where for where, _ in same)}"
        for out_dir, same in runs.items()
        if any(run != same[0][1] for _, run in same)
    ]


ALL_COMMANDS = [c for page in PAGES for c in commands(page.read_text(encoding="utf-8"), page.relative_to(ROOT))]


def test_the_pages_hold_commands():
    # a change in how blocks are found must not silently check nothing
    assert len(PAGES) >= 9 and len(ALL_COMMANDS) >= 50, (len(PAGES), len(ALL_COMMANDS))


@pytest.mark.parametrize("command", ALL_COMMANDS, ids=[c.where for c in ALL_COMMANDS])
def test_command_is_accepted(command):
    assert check_command(command) == []


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_links_and_blocks(page):
    text = page.read_text(encoding="utf-8")
    assert check_links(text, page) == []
    for language, first, lines in fenced_blocks(text):
        # a block without a language would hide its commands from this check
        assert language, f"{page.name}:{first - 1}: a fenced block without a language (sh, text, python, ...)"
        body = "\n".join(lines)
        if language == "python":
            ast.parse(body, filename=f"{page.name}:{first}")
        elif language == "json":
            json.loads(body)


def test_new_runs_have_folders_of_their_own():
    assert out_dir_clashes(ALL_COMMANDS) == [], "different runs into one out_dir; give each its own --out_dir"


def test_readme_holds_the_ci_command():
    # .ci/run runs the README's test line verbatim
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("pip install")]
    readme = [line for _, _, lines in fenced_blocks((ROOT / "README.md").read_text()) for line in lines]
    assert ci and ci[-1] in readme


def test_the_check_can_fail(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[a](missing.md) [b](#nowhere)\n\n# Here\n")
    snippet = """
```sh
python train.py configs/shakespeare.py --learning_rat=1e-3
python train.py configs/shakespeare.py --max_iters=many
python train.py configs/nowhere.py
python nowhere.py --x=1
python sample.py --top_k 5 --tempreature=0.5
python prepare_data.py shakespeare_char --vocab_sise=10
torchrun --standalone --nproc_per_node=2 train.py configs/shakespeare.py --fsdp=maybe
python tools/bench.py --parts=train --train_args="--n_layr=4"
python eval.py --out_dir=out-shakespeare --stride=32 && python export.py --out_dir=out-x --dest=hf-x
```
"""
    found = commands(snippet, "page.md")
    assert [len(check_command(c)) > 0 for c in found] == [True] * 8 + [False, False]
    assert check_command(found[0])[0].endswith("did you mean 'learning_rate'?")
    assert check_command(commands("```sh\nsbatch slurm/train.sbatch --max_iter=9\n```", "p")[0])
    no_options = commands("```sh\ntorchrun --standalone slurm/all_reduce.py --size=1\n```", "page.md")
    assert check_command(no_options[0])[0].endswith("slurm/all_reduce.py takes no options")
    assert len(check_links(page.read_text(), page)) == 2
    assert check_links("[c](#here)\n\n## Here\n", page) == []
    # two different runs into out-shakespeare clash; the same run twice, or a resume, does not
    runs = commands(
        "```sh\npython train.py configs/shakespeare.py\npython train.py configs/shakespeare.py --device=cpu\n"
        "python train.py configs/shakespeare.py --init_from=resume --max_iters=9000\n```\n",
        "page.md",
    )
    assert out_dir_clashes(runs) == []
    assert out_dir_clashes(runs + commands("```sh\npython train.py configs/shakespeare.py --n_layer=4\n```", "p")) != []
