"""
A task and a converter of one's own, each added as one new file to a copy of the project, and used through the
command line as a user would: the task trains, resumes, evaluates, samples and plans; the converter fine-tunes from
its checkpoint and is found again by name to resume, sample and evaluate. Their numbers are checked here against
explicit loops over the same weights.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from checkpoint import load_checkpoint
from model import ModelConfig, build_model
from tokens import Tokenizer, load_tokens

ROOT = Path(__file__).resolve().parent.parent

# A GPT that reads text backwards: a genuinely new task, not a subclass of the GPT task's class
BACKWARD_LM = '''
"""A GPT reading text backwards: each position predicts the token before it."""

import numpy as np
import torch
import torch.nn.functional as F

from model import IGNORE_INDEX
from tasks.base import Task, lm_tokens, windows


class BackwardLM(Task):
    name, arch, kind, scores = "backward_lm", "gpt", "lm", "text read backwards"

    def batch(self, data, batch_size, block_size, generator):
        window = windows(data, batch_size, block_size + 1, generator).flip(1)
        return (window[:, :-1].contiguous(),), window[:, 1:].contiguous()

    def loss(self, model, inputs, targets, smoothed=True):
        logits, _ = model(*inputs)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")

    def evaluate(self, model, tokenizer, cfg, progress):
        ids, data = lm_tokens(cfg, self.meta, tokenizer)
        block = model.config.block_size
        text = torch.from_numpy(np.asarray(ids[: 4 * block + 1], dtype=np.int64)).flip(0)
        windows = text.unfold(0, block + 1, block)  # (4, block + 1)
        logits, _ = model(windows[:, :-1])
        targets = windows[:, 1:]
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).item()
        accuracy = (logits.argmax(-1) == targets).float().mean().item()
        return {"data": data, "backward_loss": loss, "backward_accuracy": accuracy}

    def sample(self, model, tokenizer, text, cfg, out):
        ids = tokenizer.encode(text)[::-1]
        before = []
        for _ in range(cfg.max_new_tokens):
            logits, _ = model(torch.tensor([ids + before][-model.config.block_size :]))
            before.append(int(logits[0, -1].argmax()))
        print(tokenizer.decode(before[::-1]) + text, file=out)
        return (ids,)
'''

# A converter that trains the last blocks alone: every other weight frozen
FREEZE = '''
"""Freeze every weight but those of the last converter_options["train_last"] blocks."""

from config import ConfigError
from converters.base import Converter


class Freeze(Converter):
    name = "freeze"

    @classmethod
    def check(cls, cfg):
        if cfg.converter == cls.name and not isinstance(cfg.converter_options.get("train_last"), int):
            raise ConfigError("converter=freeze needs converter_options={'train_last': N}")

    @classmethod
    def for_new_run(cls, cfg, base, meta, base_record):
        return cls({"train_last": cfg.converter_options["train_last"]}, cfg)

    def convert(self, model, generator):
        model.requires_grad_(False)
        for block in model.body.blocks[-self.record["train_last"] :]:
            block.requires_grad_(True)
        return model

    def restore(self, base, ckpt):
        base.load_state_dict(ckpt["weights"])
        return self.convert(base, None)
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
    """A copy of the project with one new file in tasks/ and one in converters/, and nothing else changed."""
    copy = tmp_path_factory.mktemp("project") / "nanoformer"
    ignored = shutil.ignore_patterns(".*", "tests", "out*", "data", "docs", "__pycache__", "hf-*", "runs")
    shutil.copytree(ROOT, copy, ignore=ignored)
    (copy / "tasks" / "backward_lm.py").write_text(BACKWARD_LM)
    (copy / "converters" / "freeze.py").write_text(FREEZE)
    return copy


def run(project, script, *args):
    """script's command line in the copy: (exit status, stdout, stderr), bounded in time."""
    result = subprocess.run(
        [sys.executable, script, *map(str, args)], cwd=project, capture_output=True, text=True, timeout=300
    )
    return result.returncode, result.stdout, result.stderr


def tiny_model(ckpt):
    """The checkpoint's GPT, built here from its settings and plain weights."""
    model = build_model(ModelConfig.from_dict(ckpt["model_config"]))
    model.load_state_dict(ckpt["weights"])
    return model.eval()


@pytest.fixture(scope="module")
def backward_run(project, data_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("backward") / "run"
    data = ["--dataset=shakespeare_char", f"--data_dir={data_root}"]
    code, stdout, stderr = run(
        project,
        "train.py",
        *TINY,
        *data,
        "--task=backward_lm",
        "--max_iters=150",
        "--eval_interval=150",
        "--out_dir",
        out,
    )
    assert code == 0, stderr
    return out


def test_a_new_task_file_trains_and_resumes(project, backward_run):
    ckpt = load_checkpoint(backward_run / "ckpt.pt")
    assert ckpt["train_config"]["task"] == "backward_lm" and ckpt["iter_num"] == 150
    # it learnt: from ln 65 = 4.17 nats at the start to under 3.3 (a tiny model reading Shakespeare backwards)
    assert ckpt["best_val_loss"] < 3.3
    code, stdout, stderr = run(
        project, "train.py", "--init_from=resume", f"--out_dir={backward_run}", "--max_iters=160"
    )
    assert code == 0, stderr
    resumed = load_checkpoint(backward_run / "ckpt.pt")
    assert resumed["iter_num"] == 160 and resumed["train_config"]["task"] == "backward_lm"


def test_a_new_task_file_evaluates_samples_and_plans(project, backward_run, data_root):
    code, stdout, stderr = run(project, "eval.py", f"--out_dir={backward_run}", "--json")
    assert code == 0, stderr
    results = json.loads(stdout)
    # the reference: the checkpoint's model built here, and every position's loss summed one by one
    ckpt = load_checkpoint(backward_run / "best.pt")
    model, tokenizer = tiny_model(ckpt), Tokenizer.from_meta(ckpt["meta"])
    val = load_tokens(Path(data_root, "shakespeare_char", "val.bin"))
    ids = torch.from_numpy(val[: 4 * 32 + 1].astype(np.int64)).flip(0)
    nats, right = 0.0, 0
    with torch.no_grad():
        for start in range(0, 4 * 32, 32):
            window = ids[start : start + 33]
            logits = model(window[None, :-1])[0][0]
            for p in range(32):
                nats -= F.log_softmax(logits[p].double(), -1)[window[p + 1]].item()
                right += int(logits[p].argmax()) == int(window[p + 1])
    assert results["task"] == "backward_lm"
    assert results["backward_loss"] == pytest.approx(nats / 128, abs=1e-4)
    assert results["backward_accuracy"] == pytest.approx(right / 128)
    # sampling: the five characters before "ROMEO", chosen greedily one by one
    code, stdout, stderr = run(project, "sample.py", f"--out_dir={backward_run}", "--start=ROMEO", "--max_new_tokens=5")
    assert code == 0, stderr
    before = tokenizer.encode("ROMEO")[::-1]
    with torch.no_grad():
        for _ in range(5):
            before.append(int(model(torch.tensor([before]))[0][0, -1].argmax()))
    assert stdout == tokenizer.decode(before[::-1]) + "\n"
    # and the planner traces its batches like any other
    code, stdout, stderr = run(project, "train.py", "--init_from=resume", f"--out_dir={backward_run}", "--plan")
    assert code == 0 and "peak" in stdout, stderr


def test_a_new_converter_file_fine_tunes_resumes_and_samples(project, backward_run, data_root, tmp_path):
    out = tmp_path / "frozen"
    base = load_checkpoint(backward_run / "best.pt")["weights"]
    settings = [f"--init_from={backward_run / 'best.pt'}", "--dataset=shakespeare_char", f"--data_dir={data_root}"]
    frozen = [*TINY, *settings, "--task=backward_lm", "--converter=freeze", "--eval_interval=10", f"--out_dir={out}"]
    code, stdout, stderr = run(project, "train.py", *frozen, "--converter_options={'train_last': 1}", "--max_iters=10")
    assert code == 0, stderr
    ckpt = load_checkpoint(out / "ckpt.pt")
    assert ckpt["converter"] == {"name": "freeze", "record": {"train_last": 1}}
    # block 0 and the embeddings as in the base, block 1 trained
    for name, tensor in ckpt["weights"].items():
        assert torch.equal(tensor, base[name]) != name.startswith("body.blocks.1."), name
    code, stdout, stderr = run(project, "train.py", "--init_from=resume", f"--out_dir={out}", "--max_iters=12")
    assert code == 0, stderr
    resumed = load_checkpoint(out / "ckpt.pt")
    assert resumed["iter_num"] == 12 and resumed["converter"]["name"] == "freeze"
    assert all(torch.equal(resumed["weights"][n], base[n]) for n in base if n.startswith("body.blocks.0."))
    code, stdout, stderr = run(project, "sample.py", f"--out_dir={out}", "--start=ROMEO", "--max_new_tokens=3")
    assert code == 0 and stdout.endswith("ROMEO\n"), stderr
    # a converter that is not there, named: one line
    code, _, stderr = run(project, "train.py", *TINY, *settings, "--converter=nonesuch", f"--out_dir={tmp_path / 'x'}")
    assert code == 2 and "converter='nonesuch' is not one of the converters" in stderr and stderr.count("\n") == 1
