"""
A dataset of one's own, added as one new file to recipes/ in a copy of the project and used through the command
line as a user would: prepare_data.py lists it and prepares it, train.py prepares it again and trains on it. Its
files are checked against the text written out here. And a run that names a dataset imports that recipe alone.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoint import load_checkpoint
from tokens import load_meta, load_tokens

ROOT = Path(__file__).resolve().parent.parent

# The alphabet, line after line: a new dataset, made with what recipes/base.py offers
ALPHABET = '''
"""The alphabet, --repeats times, one a line, character-level."""

from recipes.base import Recipe, char_vocab, count_option, write_lm


def build(stage, name, opts, files, check_tokenizer):
    text = "abcdefghijklmnopqrstuvwxyz\\n" * opts["repeats"]
    chars = sorted(set(text))
    vocab = char_vocab(chars)
    check_tokenizer(vocab["tokenizer"])
    ids = [chars.index(c) for c in text]
    n = len(ids) * 9 // 10
    return {"kind": "lm", **vocab, "files": write_lm(stage, [("train", ids[:n]), ("val", ids[n:])], len(chars))}


RECIPES = {
    "alphabet": Recipe(
        "the alphabet, REPEATS times, one a line, character-level",
        options=(count_option("repeats", 100, "how many alphabets"),),
        build=build,
    ),
}
'''

TINY = [
    "--n_layer=2",
    "--n_head=2",
    "--n_embd=32",
    "--block_size=32",
    "--batch_size=8",
    "--gradient_accumulation_steps=1",
    "--eval_iters=2",
    "--log_interval=1000",
    "--device=cpu",
    "--dtype=float32",
    "--compile=false",
    "--tensorboard=false",
    "--learning_rate=3e-3",
    "--warmup_iters=0",
]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A copy of the project with one new file in recipes/, and nothing else changed."""
    copy = tmp_path_factory.mktemp("project") / "nanoformer"
    ignored = shutil.ignore_patterns(".*", "tests", "out*", "data", "docs", "__pycache__", "hf-*", "runs")
    shutil.copytree(ROOT, copy, ignore=ignored)
    (copy / "recipes" / "alphabet.py").write_text(ALPHABET)
    return copy


def run(project, script, *args):
    """script's command line in the copy: (exit status, stdout, stderr), bounded in time."""
    result = subprocess.run(
        [sys.executable, script, *map(str, args)], cwd=project, capture_output=True, text=True, timeout=300
    )
    return result.returncode, result.stdout, result.stderr


def test_a_new_recipe_file_is_listed_prepared_and_trained(project, tmp_path):
    code, stdout, stderr = run(project, "prepare_data.py", "--help")
    assert code == 0, stderr
    # after the datasets of the table, whose order --help keeps
    assert stdout.index("  num2words ") < stdout.index("  alphabet ") and "REPEATS times, one a line" in stdout
    code, stdout, stderr = run(project, "prepare_data.py", "alphabte")
    assert code == 2 and "did you mean 'alphabet'?" in stderr

    code, stdout, stderr = run(project, "prepare_data.py", "alphabet", "--repeats=200", f"--data_dir={tmp_path / 'a'}")
    assert code == 0, stderr
    # the text, written out here: 5,400 characters, the first 90% of them train
    text = "abcdefghijklmnopqrstuvwxyz\n" * 200
    chars = ["\n", *"abcdefghijklmnopqrstuvwxyz"]
    folder = tmp_path / "a" / "alphabet"
    meta = load_meta(folder)
    assert meta["tokenizer"] == {"type": "char", "chars": chars} and meta["vocab_size"] == 27
    assert meta["source"] == {"dataset": "alphabet", "inputs": None, "repeats": 200}
    train, val = (load_tokens(folder / f"{split}.bin") for split in ("train", "val"))
    assert "".join(chars[i] for i in train) == text[:4860] and "".join(chars[i] for i in val) == text[4860:]
    assert f"{folder}: train.bin 4,860 tokens, val.bin 540 tokens; vocab_size 27" in stdout

    # train.py finds it by name too, and prepares it where it is missing: the same files
    out = tmp_path / "out"
    data = [f"--data_dir={tmp_path / 'b'}", "--dataset=alphabet", "--data_options={'repeats': 200}"]
    code, stdout, stderr = run(
        project, "train.py", *TINY, *data, "--max_iters=100", "--eval_interval=100", f"--out_dir={out}"
    )
    assert code == 0, stderr
    for name in ("train.bin", "val.bin", "meta.json"):
        assert (tmp_path / "b" / "alphabet" / name).read_bytes() == (folder / name).read_bytes(), name
    # it learnt: from ln 27 = 3.30 nats, uniform over the 27 characters, to under 0.5 (0.26 when written)
    assert load_checkpoint(out / "ckpt.pt")["best_val_loss"] < 0.5


def test_a_run_imports_the_recipe_of_its_dataset_alone(tmp_path):
    """Preparing shakespeare_char as train.py does (data.prepared_dataset) loads no other recipe, nor what they use."""
    script = (
        "import json, sys, data\n"
        f"data.prepared_dataset('shakespeare_char', {str(tmp_path)!r}, {{}})\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('recipes', 'synthetic', 'chat', 'jinja2', 'datasets', 'prepare_data'))))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True
    )
    assert json.loads(result.stdout.splitlines()[-1]) == ["recipes", "recipes.base", "recipes.shakespeare_char"]
