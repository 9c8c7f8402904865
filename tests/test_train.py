"""train.py: config parsing, batches and losses against hand-made references, short runs per architecture,
exact resume, checkpoints, signals, DDP against one process, compile and bf16 on the CPU."""

import contextlib
import copy
import dataclasses
import errno
import io
import json
import math
import os
import pickle
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from functorch.compile import aot_module_simplified, make_boxed_compiler
from tiny_run import TINY, tiny

import checkpoint
import compiling
import data
import log
import plan
import runtime
import start
import synthetic
import tokens
import train
from checkpoint import kept_weights, load_checkpoint, move_into_place, save_checkpoint
from compiling import trial_step
from config import ConfigError, parse_config
from generate import translate
from model import (
    IGNORE_INDEX,
    LOSS_CHUNK_BYTES,
    MODEL_KEYS,
    Block,
    ModelConfig,
    build_model,
    loss_chunk_budget,
    sized_loss_chunk,
)
from optim import configure_optimizers
from runtime import Models, Runtime, split_accumulation
from start import model_from_checkpoint, start_run
from tasks import make_task
from tasks.base import windows
from tasks.lm import CausalLM
from tasks.masked_lm import MaskedLM, mask_tokens
from tasks.seq2seq import Seq2Seq, seq2seq_batch
from train import (
    Schedule,
    TrainConfig,
    accumulate_gradients,
    cli,
    main,
    make_schedule,
    update_ema,
    update_weights,
)

REPO = Path(__file__).resolve().parent.parent
CONFIGS = sorted((REPO / "configs").glob("*.py"))
# the synthetic datasets the tests train on, each always prepared with the same options (so built once)
REVERSE = {"num_train": 2000, "num_val": 200, "num_test": 100}
SORT = {"num_train": 4000, "num_val": 200, "num_test": 100, "max_len": 4}
SHRINK = [
    "--n_layer=2",
    "--n_head=2",
    "--n_embd=32",
    "--d_ff=None",
    "--block_size=32",
    "--batch_size=4",
    "--gradient_accumulation_steps=1",
    "--max_iters=3",
    "--eval_iters=2",
    "--eval_interval=1000",
    "--eval_accuracy_examples=8",
    "--device=cpu",
    "--dtype=float32",
    "--compile=false",
    "--tensorboard=false",
]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def env(data_root):
    """The environment for train.py subprocesses: datasets from the session's data dir."""
    return {**os.environ, "NANOFORMER_DATA_DIR": data_root, "OMP_NUM_THREADS": "1"}


def ckpt_weights(path, key="weights"):
    return torch.load(path, map_location="cpu", weights_only=True)[key]


def one_step(model, optimizers, scaler, batches, rt, *, n_targets, lrs, grad_clip, step_model=None):
    """
    What train_step does with these micro-batches: each optimizer at its learning rate, the gradients of the step
    (with step_model, e.g. a compiled model, in the forward), the update. Returns (mean loss, grad norm, skipped).
    """
    for name, optimizer in optimizers.items():
        for group in optimizer.param_groups:
            group["lr"] = lrs[name]
    models = Models(raw=model, step=model if step_model is None else step_model)
    loss = accumulate_gradients(models, CausalLM({}), batches, n_targets, scaler, rt)
    return (loss / n_targets, *update_weights(model, optimizers, scaler, grad_clip))


# -----------------------------------------------------------------------------
# Config files and command line


def test_config_file_and_overrides_are_typed_by_field(tmp_path):
    config = tmp_path / "c.py"
    config.write_text(
        '"""a docstring is fine"""\nn_layer = 4  # comments too\nlearning_rate = 1e-3\nbias = True\n'
        'data_options = {"num_train": 10}\ndropout = 0.2\n'
    )
    overrides = [
        "--dropout=0",
        "--learning_rate",
        "2",
        "--init_from=a=b",
        "--d_ff=None",
        "--compile=false",
        "--eval_only",
        "--n_head",
        "2",
        "--min_lr=-0",
        "--max_iters=1e4",
    ]
    cfg = parse_config(TrainConfig, [str(config), *overrides])
    assert (cfg.n_layer, cfg.bias, cfg.data_options, cfg.init_from, cfg.d_ff, cfg.compile, cfg.eval_only) == (
        4,
        True,
        {"num_train": 10},
        "a=b",
        None,
        False,
        True,
    )
    assert cfg.dropout == 0.0 and type(cfg.dropout) is float
    assert cfg.learning_rate == 2.0 and type(cfg.learning_rate) is float
    assert cfg.max_iters == 10000 and type(cfg.max_iters) is int and cfg.n_head == 2


def test_later_files_and_overrides_win(tmp_path):
    (tmp_path / "a.py").write_text("n_layer = 3\nn_head = 3\nn_embd = 96\n")
    (tmp_path / "b.py").write_text("n_layer = 5\n")
    cfg = parse_config(TrainConfig, [str(tmp_path / "a.py"), str(tmp_path / "b.py"), "--n_head=6"])
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd) == (5, 6, 96)


def test_shipped_config_found_from_any_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse_config(TrainConfig, ["configs/shakespeare.py"]).out_dir == "out-shakespeare"


def test_typo_in_config_file_names_the_line_and_the_nearest_key(tmp_path):
    (tmp_path / "c.py").write_text("n_layer = 2\nlearning_rat = 1e-3\n")
    with pytest.raises(ConfigError, match=r"line 2: unknown key 'learning_rat'; did you mean 'learning_rate'"):
        parse_config(TrainConfig, [str(tmp_path / "c.py")])


@pytest.mark.parametrize(
    "body",
    [
        "import os",
        "n_layer = __import__('os').system('touch pwned')",
        "n_layer = 2 * 3",
        "def f():\n    pass",
        "n_layer: int = 3",
        "n_layer = n_head = 2",
        "for i in []:\n    pass",
        "out_dir = open('pwned', 'w').name",
    ],
)
def test_config_file_cannot_run_code(tmp_path, monkeypatch, body):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.py").write_text(body + "\n")
    with pytest.raises(ConfigError, match="line 1"):
        parse_config(TrainConfig, ["c.py"])
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--learning_rat=1"], "did you mean 'learning_rate'"),
        (["--n_layer=abc"], "--n_layer must be int"),
        (["--n_layer=2.5"], "--n_layer must be int"),
        (["--bias=maybe"], r"--bias takes true or false \(or 1, 0\), got 'maybe'"),
        (["--dropout=true"], "--dropout must be float"),
        (["--n_layer"], "--n_layer needs a value"),
        (["missing_config.py"], "config file missing_config.py not found"),
        (["--dtype=float8"], "dtype='float8' is not one of"),
        (["--n_embd=30", "--n_head=4"], "divisible by n_head"),
        (["--arch=rnn"], "arch='rnn' is not one of"),
        # only the setting that is wrong, with its value: muon_lr keeps its default here
        (["--learning_rate=-1e-3"], "^learning_rate must be positive, got -0.001$"),
        (["--learning_rate=0"], "^learning_rate must be positive, got 0.0$"),
        (["--muon_lr=-1"], "^muon_lr must be positive, got -1.0$"),
        (["--optimizer=sgd"], "optimizer='sgd' is not one of adamw, muon"),
        (["--ema_decay=1"], "ema_decay must be in"),
    ],
)
def test_bad_settings_are_one_line_errors(argv, message):
    with pytest.raises(ConfigError, match=message) as error:
        parse_config(TrainConfig, argv)
    assert "\n" not in str(error.value)


def test_help_lists_every_key_with_its_default_and_doc(capsys):
    with pytest.raises(SystemExit) as done:
        parse_config(TrainConfig, ["--help"])
    assert done.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    for f in dataclasses.fields(TrainConfig):
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        shown = f"--{f.name}={default if isinstance(default, str) else repr(default)}"
        line = next((line for line in lines if line.split() and line.split()[0] == shown), None)
        assert line is not None, f"{f.name} is missing from --help"
        assert len(line.split(maxsplit=1)) == 2, f"{f.name} has no doc"


def test_train_config_sets_every_model_setting():
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)} - {"vocab_size", "pad_token_id"}
    assert set(MODEL_KEYS) == model_fields <= {f.name for f in dataclasses.fields(TrainConfig)}


def test_cli_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys, data_root):
    out = tmp_path / "out"
    assert cli(["--learning_rat=1", f"--out_dir={out}"]) == 2
    assert cli(["--dataset=no_such_dataset", f"--data_dir={data_root}", f"--out_dir={out}"]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 2 and "learning_rate" in errors[0] and "no_such_dataset" in errors[1]
    assert not out.exists()


def test_a_new_run_never_overwrites_a_run_unless_told(tmp_path, capsys, data_root):
    out = tmp_path / "out"
    args = [f"--{k}={v}" for k, v in TINY.items()]
    args += ["--dataset=shakespeare_char", f"--data_dir={data_root}", f"--out_dir={out}", "--eval_interval=2"]
    assert cli([*args, "--tensorboard=true"]) == 0
    kept = {name: (out / name).read_bytes() for name in ("best.pt", "ckpt.pt", "config.json")}
    events = sorted(out.glob("events.out.tfevents.*"))
    capsys.readouterr()
    # the quick start's mistake: a second run into the same folder, with another seed
    assert cli([*args, "--seed=7"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "--init_from=resume" in error and "--overwrite=True" in error
    assert {name: (out / name).read_bytes() for name in kept} == kept and sorted(out.glob("events.*")) == events
    # a resume goes on as before; with overwrite the new run replaces the old one's checkpoints and curves
    assert cli([*args, "--init_from=resume", "--max_iters=6"]) == 0
    assert cli([*args, "--seed=7", "--overwrite=True"]) == 0
    assert load_checkpoint(out / "ckpt.pt")["iter_num"] == TINY["max_iters"]
    assert (out / "best.pt").read_bytes() != kept["best.pt"] and not list(out.glob("events.*"))


def test_a_checkpoint_of_other_ids_names_what_it_was_trained_on_and_what_fits(tmp_path, data_root, capsys):
    main(tiny(data_root, tmp_path / "chars", max_iters=1))
    reverse = ["--dataset=reverse", f"--data_dir={data_root}", f"--data_options={REVERSE}", "--device=cpu"]
    ckpt = tmp_path / "chars" / "ckpt.pt"
    assert cli([f"--init_from={ckpt}", *reverse, f"--out_dir={tmp_path / 'new'}", "--arch=encoder_decoder"]) == 2
    error = capsys.readouterr().err.strip()
    assert f"{ckpt} was trained on shakespeare_char (65 characters), but dataset=reverse holds reverse (" in error
    assert error.endswith("use --dataset=shakespeare_char, as configs/shakespeare.py has it")


def test_no_config_is_refused_before_any_download(tmp_path, capsys, monkeypatch):
    """No config: the defaults' OpenWebText, not prepared, is named with how to prepare it; nothing is downloaded."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NANOFORMER_DATA_DIR", str(tmp_path / "data"))
    assert cli([]) == 2 and cli(["--max_iters=10"]) == 2
    errors = capsys.readouterr().err.splitlines()
    expected = ("python prepare_data.py openwebtext", "configs/shakespeare.py")
    assert len(errors) == 2 and all(all(words in e for words in expected) for e in errors)
    assert list(tmp_path.iterdir()) == []


def test_the_starting_weights_of_a_new_run_can_be_its_best(tmp_path, data_root):
    main(tiny(data_root, tmp_path / "base", max_iters=20))
    base = load_checkpoint(tmp_path / "base" / "ckpt.pt")
    # a fine-tune that only makes the model worse: its best.pt keeps the weights it started from
    tuned = tmp_path / "tuned"
    result = main(tiny(data_root, tuned, init_from=str(tmp_path / "base" / "ckpt.pt"), learning_rate=3.0, min_lr=3.0))
    best = load_checkpoint(tuned / "best.pt")
    assert result["evals"][0]["iter"] == 0 and result["evals"][-1]["val"] > result["evals"][0]["val"]
    assert best["iter_num"] == 0 and best["best_val_loss"] == result["evals"][0]["val"]
    assert all(torch.equal(best["weights"][k], v) for k, v in base["weights"].items())


def test_cli_runs_from_another_directory_and_logs_tensorboard(tmp_path, env):
    """The real entry point: configs/ found from elsewhere, exit 0, checkpoint and TensorBoard events in out_dir."""
    argv = [
        sys.executable,
        str(REPO / "train.py"),
        "configs/shakespeare.py",
        *SHRINK,
        "--tensorboard=true",
        "--log_interval=1",
        "--out_dir=out",
    ]
    run = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "iter 3/3" in run.stdout
    assert load_checkpoint(tmp_path / "out" / "ckpt.pt")["iter_num"] == 3
    assert list((tmp_path / "out").glob("events.out.tfevents.*"))
    bad = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "configs/shakespeare.py", "--n_layers=2"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


# -----------------------------------------------------------------------------
# Helpers against hand-computed references


def test_cosine_schedule():
    def lr(it):
        return Schedule(learning_rate=1.0, min_lr=0.1, warmup_iters=10, decay_iters=110).lr(it)

    assert lr(0) == pytest.approx(0.1) and lr(4) == pytest.approx(0.5) and lr(9) == pytest.approx(1.0)
    assert lr(10) == pytest.approx(1.0)
    assert lr(60) == pytest.approx(0.55)  # halfway through the cosine: (max + min) / 2
    assert lr(110) == pytest.approx(0.1) and lr(1000) == pytest.approx(0.1)
    assert all(lr(i) >= lr(i + 1) for i in range(10, 200))


def test_noam_schedule():
    def lr(it):
        return Schedule(learning_rate=2.0, min_lr=0.0, warmup_iters=100, decay_iters=0, kind="noam").lr(it)

    assert lr(49) == pytest.approx(1.0) and lr(99) == pytest.approx(2.0)  # linear warmup to the peak
    assert lr(399) == pytest.approx(1.0)  # 1/sqrt(step): four times the steps, half the rate
    # the paper's formula d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), scaled to peak 2.0 at step 100
    paper = [512**-0.5 * min(s**-0.5, s * 100**-1.5) for s in (1, 50, 100, 1000)]
    assert [lr(s - 1) for s in (1, 50, 100, 1000)] == pytest.approx([p * 2.0 / paper[2] for p in paper])


def logged_lrs(text):
    """{iteration: learning rate} from the progress lines of a run with log_interval=1."""
    found = re.findall(r"^iter (\d+)/\d+ \| loss \S+ \| lr (\S+) \|", text, re.MULTILINE)
    return {int(it): float(lr) for it, lr in found}


def cosine(fraction, peak, floor):
    """The cosine decay at fraction (0 -> 1) of its length, written out for the tests."""
    return floor + 0.5 * (1 + math.cos(math.pi * min(fraction, 1.0))) * (peak - floor)


def test_max_iters_alone_ends_the_schedule_with_the_run(tmp_path, data_root, capsys):
    # a config whose schedule is 1,000 steps long, shortened to 8 on the command line only
    config = tmp_path / "long.py"
    config.write_text("max_iters = 1000\nwarmup_iters = 2\nlearning_rate = 1e-3\nmin_lr = 1e-4\n")
    schedule = ("max_iters", "warmup_iters", "lr_decay_iters", "learning_rate", "min_lr")
    shrink = [f"--{k}={v}" for k, v in TINY.items() if k not in schedule]
    paths = [f"--data_dir={data_root}", "--dataset=shakespeare_char", f"--out_dir={tmp_path / 'out'}"]
    cfg = parse_config(TrainConfig, [str(config), *shrink, *paths, "--log_interval=1", "--max_iters=8"])
    main(cfg)
    lrs = logged_lrs(capsys.readouterr().out)
    # iteration it + 1 ran step it: warmup over steps 0-1, then the cosine over steps 2-7 towards min_lr at 8
    expected = {it + 1: (it + 1) / 2 * 1e-3 if it < 2 else cosine((it - 2) / 6, 1e-3, 1e-4) for it in range(8)}
    assert lrs == pytest.approx(expected, rel=0.01)  # the line prints 3 digits


def test_a_schedule_longer_than_the_run_is_said_in_one_line(tmp_path, data_root, capsys):
    main(tiny(data_root, tmp_path, max_iters=4, lr_decay_iters=100, warmup_iters=0))
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: lr_decay_iters=100")]
    assert len(notes) == 1 and "--lr_decay_iters=0" in notes[0]


def test_a_time_budget_decays_with_the_time_and_a_resume_goes_on_from_it(tmp_path, data_root, capsys):
    # 1.5 s of training, far fewer than the steps allowed: the time ends the run and its schedule
    cfg = tiny(data_root, tmp_path, max_minutes=0.025, max_iters=10**6, log_interval=1, warmup_iters=0)
    result = main(cfg)
    lrs = list(logged_lrs(capsys.readouterr().out).values())
    assert 10 < result["iter_num"] < 10**6
    assert lrs[0] > 0.9 * cfg.learning_rate  # the first step starts at about no time used
    assert lrs[-1] == pytest.approx(cfg.min_lr)  # the last step began once the budget was spent
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    spent = load_checkpoint(tmp_path / "ckpt.pt")["train_seconds"]
    assert 1.5 <= spent < 30
    # resumed with twice the budget: the schedule goes on from where it was (min_lr), never back up the cosine
    main(dataclasses.replace(cfg, init_from="resume", max_minutes=0.05))
    out = capsys.readouterr().out
    assert f"resuming {tmp_path / 'ckpt.pt'} at iteration {result['iter_num']:,}" in out.splitlines()[0]
    resumed = list(logged_lrs(out).values())
    assert all(lr == pytest.approx(cfg.min_lr) for lr in resumed)
    # a budget spent: nothing to train, said before any work
    with pytest.raises(ConfigError, match=r"max_minutes=0.05 has reached: nothing to train.*larger --max_minutes"):
        main(dataclasses.replace(cfg, init_from="resume", max_minutes=0.05))


def test_a_resumed_run_given_more_steps_or_switched_to_steps_goes_on_at_min_lr(tmp_path, data_root, capsys):
    """A run that ended its decay (4 of 4 steps; a spent time budget) resumed longer: no step goes back up."""
    cfg = tiny(data_root, tmp_path / "steps", max_iters=4, lr_decay_iters=0, log_interval=1)
    main(cfg)
    capsys.readouterr()
    main(dataclasses.replace(cfg, init_from="resume", max_iters=8))
    lrs = logged_lrs(capsys.readouterr().out)
    assert list(lrs) == [5, 6, 7, 8] and all(lr == pytest.approx(cfg.min_lr) for lr in lrs.values())  # not halfway
    timed = tiny(data_root, tmp_path / "time", max_minutes=0.005, max_iters=10**6, lr_decay_iters=0, log_interval=1)
    done = main(timed)["iter_num"]
    capsys.readouterr()
    main(dataclasses.replace(timed, init_from="resume", max_minutes=0.0, max_iters=done + 3))
    resumed = logged_lrs(capsys.readouterr().out)
    assert len(resumed) == 3 and all(lr == pytest.approx(cfg.min_lr) for lr in resumed.values())


def cosine_at(fraction, learning_rate=1.0, min_lr=0.1):
    """The cosine schedule's learning rate a fraction of the way through its decay, written out."""
    return min_lr + 0.5 * (1 + math.cos(math.pi * fraction)) * (learning_rate - min_lr)


def test_a_changed_time_budget_decays_from_where_the_schedule_was():
    """
    A run stopped after 60 s of a 2-minute budget (half decayed), resumed with 4 minutes: the decay goes on from half,
    to all of it at 4 minutes, over the 180 s added (at 60 s / 240 s it would jump back to a quarter, and the
    learning rate up the cosine). Resumed again with the same 4 minutes, it goes on as it was; with 8, from where
    the 4 had got to.
    """
    saved = dict(learning_rate=1.0, min_lr=0.1, warmup_iters=0, lr_decay_iters=0, max_iters=10**6, max_minutes=2.0)
    cfg = types.SimpleNamespace(**{**saved, "lr_schedule": "cosine", "max_minutes": 4.0})
    first = make_schedule(cfg, {"train_config": saved, "iter_num": 100, "train_seconds": 60.0})
    assert [first.lr(100, t) for t in (60.0, 150.0, 240.0)] == pytest.approx([cosine_at(f) for f in (0.5, 0.75, 1)])
    again = {"train_config": vars(cfg), "iter_num": 200, "train_seconds": 150.0, "schedule_from": first.resumed_at}
    assert make_schedule(cfg, again).lr(200, 150.0) == pytest.approx(cosine_at(0.75))
    longer = make_schedule(types.SimpleNamespace(**{**vars(cfg), "max_minutes": 8.0}), again)
    assert [longer.lr(200, t) for t in (150.0, 480.0)] == pytest.approx([cosine_at(0.75), 0.1])


@pytest.mark.parametrize(
    ("before", "after", "fraction"),
    [
        # 50 of 100 steps: half decayed; max_iters=300 spreads the other half over the 250 steps left
        ({"max_iters": 100}, {"max_iters": 300}, lambda it, t: 0.5 + 0.5 * (it - 50) / 250),
        # a spent 2-minute budget (all decayed) switched to steps with max_minutes=0: min_lr from there on
        ({"max_minutes": 2.0, "max_iters": 10**6}, {"max_minutes": 0.0, "max_iters": 600}, lambda it, t: 1.0),
        # half of 100 steps, then a 4-minute budget on top: the other half over the steps or the time, whichever leads
        (
            {"max_iters": 100},
            {"max_iters": 100, "max_minutes": 4.0},
            lambda it, t: 0.5 + 0.5 * max((it - 50) / 50, (t - 30) / 210),
        ),
    ],
)
def test_a_resume_with_another_length_goes_on_from_where_the_schedule_stood(before, after, fraction):
    """At the checkpoint (step 50, 30 s trained in a run of 120 s budgets), then on: never back up the cosine."""
    common = dict(
        learning_rate=1.0, min_lr=0.1, warmup_iters=0, lr_decay_iters=0, max_minutes=0.0, lr_schedule="cosine"
    )
    saved = {**common, **before}
    seconds = 120.0 if saved["max_minutes"] else 30.0  # the budget run stopped as its 2 minutes ran out
    ckpt = {"train_config": saved, "iter_num": 50, "train_seconds": seconds}
    schedule = make_schedule(types.SimpleNamespace(**{**common, **after}), ckpt)
    for it, t in ((50, seconds), (60, seconds + 20), (90, seconds + 150)):
        assert schedule.lr(it, t) == pytest.approx(cosine_at(min(fraction(it, t), 1.0)))
    # where it stood: the checkpoint's own schedule at its step and time
    assert schedule.lr(50, seconds) == pytest.approx(make_schedule(types.SimpleNamespace(**saved)).lr(50, seconds))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["configs/shakespere.py"],
            "config file configs/shakespere.py not found; did you mean configs/shakespeare.py?",
        ),
        (["--config", "configs/shakespeare.py"], "a config file is named on its own, not with --config"),
        (["configs/shakespeare.py", "--overwrite=yes"], "--overwrite takes true or false (or 1, 0), got 'yes'"),
        (["configs/shakespeare.py", "--compile=maybe"], "--compile takes true or false (or 1, 0, None), got 'maybe'"),
        (["configs/shakespeare.py", "--dataset=shakespear_char"], "; did you mean shakespeare_char?"),
        (["configs/shakespeare.py", "--init_from=resume", "--out_dir=run-a"], "did you mean --out_dir=run-b?"),
    ],
)
def test_a_mistyped_path_name_or_switch_is_answered_with_what_was_meant(
    tmp_path, data_root, monkeypatch, capsys, args, message
):
    """One line each, nothing written, the thread note (a busy machine here) never printed before a refusal."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run-b").mkdir()
    (tmp_path / "run-b" / "ckpt.pt").write_bytes(b"")  # a run folder beside the mistyped one
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(runtime, "busy_cores", lambda: 1.0)
    assert cli([*args, f"--data_dir={data_root}", "--threads=0"]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("train.py: error: ") and message in err and err.count("\n") == 1, err
    assert "thread" not in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run-b"]


def test_the_thread_note_comes_with_the_run_s_description(tmp_path, data_root, monkeypatch, capsys):
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(runtime, "busy_cores", lambda: 1.0)
    main(tiny(data_root, tmp_path, threads=0, max_iters=1))
    lines = capsys.readouterr().out.splitlines()
    note = next(i for i, line in enumerate(lines) if "thread(s) per process: other jobs keep about 1" in line)
    assert lines[0].startswith("gpt on shakespeare_char") and 0 < note < 4


def test_threads_leave_busy_cores_to_other_jobs(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    for load, ranks, expected in [(0.2, 1, 4), (1.4, 1, 3), (3.0, 1, 1), (9.0, 1, 1), (0.0, 2, 2), (2.0, 2, 1)]:
        monkeypatch.setattr(runtime, "busy_cores", lambda load=load: load)
        threads, note = runtime.pick_threads(0, ranks)
        assert threads == expected and (note is None) == (round(load) == 0)
    monkeypatch.setattr(runtime, "busy_cores", lambda: 0.0)
    assert runtime.pick_threads(0, 1, spare=1) == (3, None)  # serve.py's HTTP loop keeps a core
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert runtime.pick_threads(0, 1, spare=1) == (1, None)  # never none
    assert runtime.pick_threads(3, 1) == (3, None)  # --threads wins
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert runtime.pick_threads(0, 1) == (2, None)


def test_busy_cores_sees_a_job_that_just_started():
    # one spinning process beside this one: always running, long before a 1-minute load average would show it
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert runtime.busy_cores() >= 1
    finally:
        spin.kill()
        spin.wait()


def test_accumulation_steps_are_shared_over_ranks():
    assert split_accumulation(40, 8) == 5
    with pytest.raises(ConfigError, match="make it a multiple of 4"):
        split_accumulation(6, 4)


def test_masking_follows_bert_proportions():
    tokens = torch.randint(0, 50, (400, 500), generator=torch.Generator().manual_seed(0))
    task = MaskedLM({"vocab_size": 50, "special_tokens": {}}, mask_prob=0.15)  # [MASK] is id 50, after the data's
    inputs, targets = mask_tokens(tokens, task, torch.Generator().manual_seed(1))
    chosen = targets != IGNORE_INDEX
    assert chosen.float().mean().item() == pytest.approx(0.15, abs=0.003)
    assert torch.equal(targets[chosen], tokens[chosen]) and torch.equal(inputs[~chosen], tokens[~chosen])
    shown = inputs[chosen]
    assert (shown == 50).float().mean().item() == pytest.approx(0.8, abs=0.01)
    # unchanged: the 10% kept plus the random 10% that happen to draw the same token (1 in 50)
    assert (shown == tokens[chosen]).float().mean().item() == pytest.approx(0.1 + 0.1 / 50, abs=0.01)
    assert shown.max().item() == 50


def test_seq2seq_batch_pads_and_shifts():
    pairs = [
        (np.array([5, 6, 7], dtype=np.uint16), np.array([8, 9], dtype=np.uint16)),
        (np.array([5], dtype=np.uint16), np.array([8, 9, 10, 11], dtype=np.uint16)),
    ]
    task = Seq2Seq({"vocab_size": 20, "special_tokens": {"pad": 0, "bos": 1, "eos": 2}})
    src, tgt_in, targets = seq2seq_batch(pairs, [1, 0], task)
    assert src.tolist() == [[5, 0, 0], [5, 6, 7]]
    assert tgt_in.tolist() == [[1, 8, 9, 10, 11], [1, 8, 9, 0, 0]]
    assert targets.tolist() == [[8, 9, 10, 11, 2], [8, 9, 2, -100, -100]]


def test_windows_start_wherever_a_whole_window_fits_and_evenly():
    """
    Tokens 0..9, so that a window's first token is its offset: 28,000 windows of 4 start at each of the 7 offsets a
    whole window fits at, the last (tokens 6-9) included, each 1/7 of the time within 5 binomial standard deviations
    (a false failure about once in 10^6), and hold consecutive tokens. A GPT batch is one window shifted by one.
    """
    n, length, draws = 10, 4, 28_000
    drawn = windows(np.arange(n, dtype=np.uint16), draws, length, torch.Generator().manual_seed(0))
    assert drawn.dtype == torch.int64 and torch.equal(drawn - drawn[:, :1], torch.arange(length).expand(draws, -1))
    counts, p = torch.bincount(drawn[:, 0], minlength=n).double(), 1 / (n - length + 1)
    assert (counts[n - length + 1 :] == 0).all()
    assert ((counts[: n - length + 1] / draws - p).abs() <= 5 * math.sqrt(p * (1 - p) / draws)).all()
    generator = torch.Generator().manual_seed(0)
    (x,), y = CausalLM({"vocab_size": n}).batch(np.arange(n, dtype=np.uint16), 100, length, generator)
    assert x.shape == y.shape == (100, length) and torch.equal(y, x + 1)
    assert y.max() == n - 1  # the last token is a target too


@pytest.mark.parametrize("arch", ["gpt", "encoder", "encoder_decoder"])
def test_batches_reach_the_device_from_dense_pinned_memory(monkeypatch, shakespeare_char_dir, data_root, arch):
    """
    Everything pinned is contiguous (a strided view would be copied through a pageable temporary) and copied with
    non_blocking=True; a GPT's inputs and targets travel as their one (B, T + 1) window. A CPU cannot pin: pinning
    is recorded and stood in for by a copy.
    """
    pinned, copied, real_to = [], [], torch.Tensor.to

    def pin_memory(self):
        pinned.append(self.is_contiguous())
        return self.clone()

    def to(self, *args, **kwargs):
        copied.append((tuple(self.shape), self.is_contiguous(), kwargs.get("non_blocking")))
        return real_to(self, *args, **kwargs)

    if arch == "encoder_decoder":
        folder = data.prepared_dataset("reverse", data_root, REVERSE)
        meta = tokens.load_meta(folder)
        split = make_task("auto", arch, meta).load_split(folder, "train", 16)
    else:
        meta, split = tokens.load_meta(shakespeare_char_dir), tokens.load_tokens(shakespeare_char_dir / "train.bin")
    inputs, targets = make_task("auto", arch, meta).batch(split, 4, 16, torch.Generator().manual_seed(0))
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    monkeypatch.setattr(torch.Tensor, "to", to)
    moved_inputs, moved_targets = data.model_inputs(*data.pinned(inputs, targets), torch.device("cpu"))
    assert pinned and all(pinned)
    assert copied and all(contiguous and non_blocking for _, contiguous, non_blocking in copied)
    if arch == "gpt":
        assert pinned == [True] and [shape for shape, _, _ in copied] == [(4, 17)]  # the window, once
    assert all(torch.equal(a, b) for a, b in zip((*moved_inputs, moved_targets), (*inputs, targets)))


def test_loss_is_the_mean_over_all_targets_of_the_step():
    """Two micro-batches with 3 and 32 targets: gradients equal those of one batch's plain mean cross-entropy."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(arch="encoder", vocab_size=20, block_size=16, n_layer=1, n_head=2, n_embd=16))
    x = torch.randint(0, 20, (6, 16))
    targets = torch.full((6, 16), IGNORE_INDEX)
    targets[0, :3] = x[0, :3]  # micro-batch 1 (rows 0-2): 3 targets
    targets[3:5, :8] = x[3:5, :8]  # micro-batch 2 (rows 3-5): 8 + 8 + 16 = 32 targets
    targets[5] = x[5]
    n = int((targets != IGNORE_INDEX).sum())
    assert n == 35
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    micro_batches = [((x[:3],), targets[:3]), ((x[3:],), targets[3:])]
    total = accumulate_gradients(Models(model, model), CausalLM({}), micro_batches, n, scaler, Runtime())
    ours = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logits, _ = model(x)
    reference = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
    reference.backward()
    assert total.item() / n == pytest.approx(reference.item(), rel=1e-5)
    for mine, theirs in zip(ours, (p.grad for p in model.parameters())):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-7)
    # a mean of the two micro-batch means would weigh 3 targets like 32: clearly another number
    means = [
        F.cross_entropy(logits[s].flatten(0, 1), targets[s].flatten(), ignore_index=IGNORE_INDEX)
        for s in (slice(0, 3), slice(3, 6))
    ]
    assert abs((means[0] + means[1]).item() / 2 - reference.item()) > 1e-3


# -----------------------------------------------------------------------------
# Short runs


def test_val_bpb_is_the_val_loss_in_bits_per_byte_of_its_targets(data_root, shakespeare_char_dir):
    """
    evaluate's val_bpb against a float64 loop over the same batches: each target's -log p in bits, summed, over the
    bytes its id stands for (random lengths here, 0 to 3, so that bytes and tokens differ).
    """
    cfg = tiny(data_root, "unused", eval_iters=3, batch_size=2)
    meta = tokens.load_meta(shakespeare_char_dir)
    task = make_task("auto", "gpt", meta)
    splits = {split: task.load_split(shakespeare_char_dir, split, cfg.block_size) for split in ("train", "val")}
    vocab_size = task.model_vocab
    torch.manual_seed(0)
    model = build_model(cfg.model_config(vocab_size))
    byte_lengths = np.random.default_rng(0).integers(0, 4, size=vocab_size)
    task.byte_lengths = byte_lengths
    result = train.evaluate(model, splits, task, cfg, Runtime())
    bits = n_bytes = 0.0
    # the val split is the second: its batches come from the seeds evaluate draws for it
    for seed in data.micro_seeds(torch.Generator().manual_seed(cfg.seed + 2), cfg.eval_iters):
        (x,), y = task.batch(splits["val"], cfg.batch_size, cfg.block_size, torch.Generator().manual_seed(seed))
        log_p = torch.log_softmax(model(x)[0].double(), dim=-1)
        for b in range(y.size(0)):
            for t in range(y.size(1)):
                bits -= log_p[b, t, y[b, t]].item() / math.log(2)
                n_bytes += int(byte_lengths[y[b, t]])
    assert result["val_bpb"] == pytest.approx(bits / n_bytes, rel=1e-6)
    task.bits_per_byte = False  # a task whose targets spell no text (a masked LM's, pairs')
    assert "val_bpb" not in train.evaluate(model, splits, task, cfg, Runtime())


@pytest.mark.parametrize("arch, extra", [("gpt", {}), ("encoder", {"batch_size": 16})])
def test_loss_falls_from_uniform(tmp_path, data_root, arch, extra):
    cfg = tiny(
        data_root,
        tmp_path,
        arch=arch,
        max_iters=80,
        eval_interval=80,
        eval_iters=8,
        learning_rate=1e-2,
        min_lr=1e-3,
        lr_decay_iters=80,
        **extra,
    )
    result = main(cfg)
    vocab_size = load_checkpoint(tmp_path / "ckpt.pt")["model_config"]["vocab_size"]
    first, last = result["evals"][0], result["evals"][-1]
    # a fresh model predicts about uniformly: the loss starts at log(vocabulary), so it is a mean per target token
    assert first["val"] == pytest.approx(math.log(vocab_size), abs=0.1)
    assert last["val"] < first["val"] - 0.5, result["evals"]
    assert all(math.isfinite(v) for v in result["losses"].values())


def test_seq2seq_learns_and_its_exact_match_agrees_with_the_task_solver(tmp_path, data_root):
    """Sorting short strings: the loss falls from uniform, and the logged accuracy equals one computed here by
    decoding the checkpoint greedily, one source at a time, and grading with synthetic.solve."""
    cfg = tiny(
        data_root,
        tmp_path,
        arch="encoder_decoder",
        dataset="sort",
        data_options=SORT,
        block_size=8,
        batch_size=32,
        n_embd=64,
        max_iters=150,
        eval_interval=150,
        eval_iters=8,
        learning_rate=3e-3,
        min_lr=1e-4,
        warmup_iters=10,
        lr_decay_iters=150,
        eval_accuracy_examples=100,
    )
    result = main(cfg)
    first, last = result["evals"][0], result["evals"][-1]
    assert first["val"] == pytest.approx(math.log(41), abs=0.1)  # 38 characters + pad, bos, eos
    assert last["val"] < first["val"] - 1.0, result["evals"]
    ckpt = load_checkpoint(tmp_path / "ckpt.pt")
    model, tokenizer = model_from_checkpoint(ckpt), tokens.Tokenizer.from_meta(ckpt["meta"])
    bos, eos = ckpt["meta"]["special_tokens"]["bos"], ckpt["meta"]["special_tokens"]["eos"]
    pairs = tokens.load_pairs(tokens.dataset_dir("sort", data_root), "val")
    correct = 0
    for i in range(100):
        src_text = tokenizer.decode(pairs[i][0])
        out = translate(model, torch.tensor([tokenizer.encode(src_text)]), 8, bos, eos)[0].tolist()
        correct += eos in out and tokenizer.decode(out[: out.index(eos)]) == synthetic.solve("sort", src_text)
    assert 20 <= correct < 100  # partly trained: right and wrong answers to tell apart
    # padded batches there, single sources here: a near-tie could flip one answer
    assert last["accuracy"] == pytest.approx(correct / 100, abs=0.011)


@pytest.mark.parametrize(
    "extra",
    [
        {"arch": "gpt", "dropout": 0.1},
        {"arch": "encoder", "dropout": 0.1},
        {
            "arch": "encoder_decoder",
            "dataset": "reverse",
            "data_options": REVERSE,
            "dropout": 0.1,
            "label_smoothing": 0.1,
            "eval_accuracy_examples": 4,
        },
        {"arch": "gpt", "ema_decay": 0.9},
        {  # every ModelConfig option of grouped-query attention, qk_norm, swiglu, softcap and zero init at once
            "arch": "gpt",
            "n_head": 4,
            "n_kv_head": 2,
            "qk_norm": True,
            "activation": "swiglu",
            "logit_softcap": 30.0,
            "zero_init_proj": True,
            "pos_encoding": "rope",
            "window_size": 5,
            "tie_embeddings": False,
        },
        {
            "arch": "encoder_decoder",
            "dataset": "reverse",
            "data_options": REVERSE,
            "n_kv_head": 1,
            "qk_norm": True,
            "activation": "relu2",
            "logit_softcap": 30.0,
            "zero_init_proj": True,
            "eval_accuracy_examples": 4,
        },
        {
            "arch": "encoder_decoder",
            "dataset": "reverse",
            "data_options": REVERSE,
            "ema_decay": 0.9,
            "eval_accuracy_examples": 4,
        },
        {"arch": "gpt", "dropout": 0.1, "optimizer": "muon", "activation": "swiglu"},
    ],
)
def test_exact_resume(tmp_path, data_root, extra):
    """Six steps straight == three steps, stop, resume, three more: bitwise the same losses and weights."""
    common = dict(
        max_iters=6, eval_interval=2, warmup_iters=2, lr_decay_iters=6, gradient_accumulation_steps=2, **extra
    )
    straight = main(tiny(data_root, tmp_path / "a", **common))
    first = main(tiny(data_root, tmp_path / "b", **{**common, "max_iters": 3}))
    second = main(tiny(data_root, tmp_path / "b", **{**common, "init_from": "resume"}))
    assert sorted(second["losses"]) == [4, 5, 6]
    assert {**first["losses"], **second["losses"]} == straight["losses"]
    assert second["best_val_loss"] == straight["best_val_loss"]
    for key in ("weights", "average") if "ema_decay" in extra else ("weights",):
        a, b = ckpt_weights(tmp_path / "a" / "ckpt.pt", key), ckpt_weights(tmp_path / "b" / "ckpt.pt", key)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_checkpoint_of_format_3_resumes_exactly(tmp_path, data_root):
    """
    ckpt.pt as formats 3 and 4 wrote it: AdamW's state as "optimizer", Muon's as "muon", groups without their peak
    learning rate; it resumes bitwise as a run that never stopped, the run's learning rates applying.
    """
    common = dict(max_iters=6, eval_interval=3, warmup_iters=2, lr_decay_iters=6, optimizer="muon", dropout=0.1)
    straight = main(tiny(data_root, tmp_path / "a", **common))
    main(tiny(data_root, tmp_path / "b", **{**common, "max_iters": 3}))
    path = tmp_path / "b" / "ckpt.pt"
    ckpt = torch.load(path, weights_only=True)
    optimizers = ckpt.pop("optimizers")
    for state in optimizers.values():
        for group in state["param_groups"]:
            del group["initial_lr"]
    save_checkpoint({**ckpt, "format_version": 3, "optimizer": optimizers["adamw"], "muon": optimizers["muon"]}, path)
    second = main(tiny(data_root, tmp_path / "b", **{**common, "init_from": "resume"}))
    assert {k: straight["losses"][k] for k in (4, 5, 6)} == second["losses"]
    a, b = ckpt_weights(tmp_path / "a" / "ckpt.pt"), ckpt_weights(path)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_sharded_checkpoint_of_format_3_resumes_exactly(tmp_path, data_root):
    """
    A sharded folder as format 3 wrote it (AdamW's state as "optimizer", its groups without their peak), made in one
    process from a run's ckpt.pt: it resumes bitwise as a run that never stopped.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    import checkpoint

    common = dict(max_iters=6, eval_interval=3, warmup_iters=2, lr_decay_iters=6)
    straight = main(tiny(data_root, tmp_path / "a", **common))
    cfg = tiny(data_root, tmp_path / "b", **{**common, "max_iters": 3})
    main(cfg)
    path = tmp_path / "b" / "ckpt.pt"
    ckpt = torch.load(path, weights_only=True)
    model = build_model(ModelConfig.from_dict(ckpt["model_config"]))
    model.load_state_dict(ckpt.pop("weights"))
    optimizers, _ = train.make_optimizers(model, cfg, Runtime())
    optimizers["adamw"].load_state_dict(ckpt.pop("optimizers")["adamw"])
    old = get_optimizer_state_dict(model, optimizers["adamw"])
    for group in old["param_groups"]:
        del group["initial_lr"]
    path.unlink()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        tensors = {"weights": get_model_state_dict(model), "optimizer": old}
        checkpoint.save_sharded(tensors, {**ckpt, "format_version": 3}, path, rank=0)
    finally:
        dist.destroy_process_group()
    second = main(tiny(data_root, tmp_path / "b", **{**common, "init_from": "resume"}))
    assert {k: straight["losses"][k] for k in (4, 5, 6)} == second["losses"]


def test_a_resume_keeps_the_best_val_loss_and_best_pt(tmp_path, data_root, monkeypatch):
    """
    A run whose val loss at iteration 6 is worse than at 4: a run stopped at 4 and resumed must keep best.pt and
    best_val_loss from 4, as the straight run does, not take 6's. The worse evaluation is built directly (100 added
    to the val loss measured after step 6), so that the premise holds on any CPU and thread count, where a
    diverging learning rate's losses would depend on the vector kernels' rounding.
    """
    evaluate_and_save, evaluate, at = train.evaluate_and_save, train.evaluate, []

    def noting_the_iteration(run, iter_num, last):
        at[:] = [iter_num]
        return evaluate_and_save(run, iter_num, last)

    def worse_at_6(*args, **kwargs):
        losses = evaluate(*args, **kwargs)
        return {**losses, "val": losses["val"] + 100.0} if at == [6] else losses

    monkeypatch.setattr(train, "evaluate_and_save", noting_the_iteration)
    monkeypatch.setattr(train, "evaluate", worse_at_6)
    common = dict(max_iters=6, eval_interval=2)
    straight = main(tiny(data_root, tmp_path / "a", **common))
    val = {e["iter"]: e["val"] for e in straight["evals"]}
    assert val[6] > val[4] + 50 and val[4] == straight["best_val_loss"]  # what makes this run a test of the resume
    main(tiny(data_root, tmp_path / "b", **{**common, "max_iters": 4}))
    resumed = main(tiny(data_root, tmp_path / "b", **{**common, "init_from": "resume"}))
    assert [e["iter"] for e in resumed["evals"]] == [6] and resumed["evals"][0]["val"] > val[4] + 50
    assert resumed["best_val_loss"] == straight["best_val_loss"]
    for run in ("a", "b"):
        assert load_checkpoint(tmp_path / run / "ckpt.pt")["best_val_loss"] == straight["best_val_loss"]
    a, b = (load_checkpoint(tmp_path / run / "best.pt") for run in ("a", "b"))
    assert a["iter_num"] == b["iter_num"] == 4 and a["best_val_loss"] == b["best_val_loss"]
    assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])


def script_evaluations(monkeypatch, scripted):
    """Each evaluation's (val loss, exact match) taken from scripted, by the iteration it is made at."""
    evaluate_and_save, at = train.evaluate_and_save, []

    def noting_the_iteration(run, iter_num, last):
        at[:] = [iter_num]
        return evaluate_and_save(run, iter_num, last)

    monkeypatch.setattr(train, "evaluate_and_save", noting_the_iteration)
    monkeypatch.setattr(train, "evaluate", lambda *args, **kwargs: {"train": 1.0, "val": scripted[at[0]][0]})
    monkeypatch.setattr(train, "val_accuracy", lambda run: scripted[at[0]][1])


def test_best_pt_is_the_best_exact_match_where_the_data_has_exact_answers(tmp_path, data_root, monkeypatch, capsys):
    """
    Evaluations whose val loss and exact match disagree (scripted: the lowest loss at 4, the best exact match at 6):
    best.pt is 6's, chosen by exact match and said so, and a resume keeps it; data without exact answers keeps the
    lowest val loss (4).
    """
    scripted = {0: (3.0, 0.0), 2: (2.0, 0.10), 4: (1.5, 0.05), 6: (1.8, 0.20), 8: (1.9, 0.20)}
    script_evaluations(monkeypatch, scripted)
    common = dict(max_iters=6, eval_interval=2, eval_accuracy_examples=4)
    for exact, best_at in ((True, 6), (False, 4)):
        monkeypatch.setattr(CausalLM, "exact_answers", exact)
        main(tiny(data_root, tmp_path / str(exact), **common))
        best = load_checkpoint(tmp_path / str(exact) / "best.pt")
        assert best["iter_num"] == best_at and best["best_val_loss"] == scripted[best_at][0]
        assert best["best_accuracy"] == (scripted[best_at][1] if exact else None)
        saving = [line for line in capsys.readouterr().out.splitlines() if "saved best.pt" in line]
        metric = "exact match" if exact else "val loss"
        assert saving[-1].startswith(f"eval {best_at}: ") and f"saved best.pt, by {metric}" in saving[-1]
    # resumed to 8, whose exact match only ties 6's with a worse loss: best.pt stays 6's
    main(tiny(data_root, tmp_path / "True", **{**common, "max_iters": 8, "init_from": "resume"}))
    assert load_checkpoint(tmp_path / "True" / "best.pt")["iter_num"] == 6


def test_a_best_pt_without_exact_match_is_replaced_only_by_a_lower_val_loss(tmp_path, data_root, monkeypatch, capsys):
    """
    A run that measured no exact match (eval_accuracy_examples=0), resumed on data with exact answers measuring it:
    best.pt's exact match is unknown, so the val loss decides until an evaluation beats it; a worse model whose exact
    match is higher than none (scripted at 6) does not replace best.pt, a better one (8) does, and its exact match
    decides from then on (10's higher val loss wins by exact match).
    """
    scripted = {0: (3.0, 0.0), 2: (2.0, 0.1), 4: (1.5, 0.1), 6: (1.8, 0.5), 8: (1.4, 0.3), 10: (1.6, 0.4)}
    script_evaluations(monkeypatch, scripted)
    monkeypatch.setattr(CausalLM, "exact_answers", True)
    main(tiny(data_root, tmp_path, max_iters=4, eval_interval=2, eval_accuracy_examples=0))
    assert load_checkpoint(tmp_path / "ckpt.pt")["best_accuracy"] is None
    best = {}
    for until in (6, 8, 10):
        main(tiny(data_root, tmp_path, max_iters=until, eval_interval=2, eval_accuracy_examples=4, init_from="resume"))
        best[until] = load_checkpoint(tmp_path / "best.pt")
    assert [best[until]["iter_num"] for until in (6, 8, 10)] == [4, 8, 10]
    assert best[8]["best_accuracy"] == 0.3 and best[10]["best_accuracy"] == 0.4
    saving = [line for line in capsys.readouterr().out.splitlines() if "saved best.pt" in line]
    assert saving[-2].startswith("eval 8: ") and "saved best.pt, by val loss" in saving[-2]
    assert saving[-1].startswith("eval 10: ") and "saved best.pt, by exact match" in saving[-1]


def test_a_checkpoint_of_format_1_or_2_is_one_line_naming_the_commit_that_reads_it(tmp_path, data_root, capsys):
    """
    Formats 1 and 2, of the repo's first days ("model" and "train_model"; cross-attention's q and kv stacked), are no
    longer read: loading, resuming, starting a run from one, sampling and evaluating all stop with one line that
    names the last commit that reads them. A sharded folder too.
    """
    import eval as evaluation
    import sample

    model = build_model(ModelConfig(vocab_size=65, block_size=8, n_layer=1, n_head=2, n_embd=8))
    old = {"model_config": dataclasses.asdict(model.config), "train_config": {}, "meta": None, "iter_num": 3}
    expected = "was written by an early nanoformer (checkpoint format {}), a format this code no longer reads: read "
    expected += "it with the code of git checkout c78f975ac3b32fa5adf6932ebeae1d7ad92e24fb, or start a new run"
    for version in (1, 2):
        run, message = tmp_path / str(version), expected.format(version)
        run.mkdir()
        save_checkpoint({**old, "format_version": version, "model": model.state_dict()}, run / "ckpt.pt")
        folder = run / "sharded"  # as fsdp wrote it: only its state.pt is read before the refusal
        folder.mkdir()
        save_checkpoint({**old, "format_version": version, "sharded_keys": ["model"]}, folder / "state.pt")
        for path in (run / "ckpt.pt", folder):
            with pytest.raises(ConfigError) as error:
                load_checkpoint(path)
            assert str(error.value).endswith(message) and "\n" not in str(error.value)
        capsys.readouterr()
        for out_dir, init_from in ((run, "resume"), (run / "new", run / "ckpt.pt")):
            assert cli(cli_argv(data_root, out_dir, max_iters=4, init_from=init_from)) == 2
            error = capsys.readouterr().err
            assert error.count("\n") == 1 and message in error, error
        for script, name in ((sample, "sample.py"), (evaluation, "eval.py")):
            assert script.cli([f"--out_dir={run}", "--checkpoint=ckpt.pt"]) == 2
            error = capsys.readouterr().err
            assert error.startswith(f"{name}: error: ") and error.count("\n") == 1 and message in error, error


def test_each_rank_saves_and_restores_its_own_gpus_generator_only(monkeypatch):
    """
    Format 3 as first written saved every visible GPU's generator and restored them all: on a machine with fewer
    visible GPUs that was an IndexError. A rank now keeps its own device's state, and takes its own entry from an
    old list.
    """
    visible, restored = 1, []

    def set_state(state, device):  # what CUDA does for a GPU that is not there
        if torch.device(device).index >= visible:
            raise IndexError("CUDA device index out of range")
        restored.append((torch.device(device).index, state))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: [set_state(s, i) for i, s in enumerate(states)])
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: torch.full((4,), torch.device(device).index))
    saved = checkpoint.rng_state(torch.device("cuda", 1))  # rank 1 of a 2-GPU machine
    assert torch.equal(saved["cuda"], torch.full((4,), 1))
    old = {**saved, "cuda": [torch.full((4,), 7), torch.full((4,), 8)]}  # as first written, on a 2-GPU machine
    checkpoint.set_rng_state(old, torch.device("cuda", 0))
    checkpoint.set_rng_state(saved, torch.device("cuda", 0))  # rank 1's state, resumed as rank 0 of 1
    checkpoint.set_rng_state(old, torch.device("cuda", 3))  # no entry for this device: its generator is left alone
    checkpoint.set_rng_state(saved, torch.device("cpu"))  # a GPU run resumed on a CPU
    assert [(i, s.tolist()) for i, s in restored] == [(0, [7] * 4), (0, [1] * 4)]


def test_update_ema_is_the_weighted_average_of_past_weights():
    """Against the closed form in float64: ema_n = prod(d_i) * w_0 + sum_i (1 - d_i) * prod_{j > i} d_j * w_i."""
    torch.manual_seed(0)
    model, decay = torch.nn.Linear(3, 2), 0.8
    ema = torch.nn.Linear(3, 2).requires_grad_(False)
    ema.load_state_dict(model.state_dict())
    history = [model.weight.detach().double().clone()]
    for step in range(1, 31):
        with torch.no_grad():
            model.weight.add_(torch.randn(2, 3))
        history.append(model.weight.detach().double().clone())
        update_ema(list(ema.parameters()), list(model.parameters()), decay, step)
    d = [min(decay, (1 + i) / (10 + i)) for i in range(1, 31)]  # d[i - 1] mixes in the weights after step i
    expected = math.prod(d) * history[0]
    for i in range(1, 31):
        expected = expected + (1 - d[i - 1]) * math.prod(d[i:]) * history[i]
    torch.testing.assert_close(ema.weight.double(), expected, rtol=1e-5, atol=1e-6)


def test_ema_is_what_is_evaluated_saved_and_resumed(tmp_path, data_root):
    trained = main(tiny(data_root, tmp_path, max_iters=6, ema_decay=0.5))
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert not torch.equal(ckpt["average"]["lm_head.weight"], ckpt["weights"]["lm_head.weight"])
    best = torch.load(tmp_path / "best.pt", weights_only=True)
    assert "weights" not in best  # the average, not the raw weights
    assert all(torch.equal(best["average"][k], ckpt["average"][k]) for k in best["average"])
    for ema_decay in (0.5, 0.0):  # eval_only evaluates the checkpoint's average either way
        evaluated = main(tiny(data_root, tmp_path, init_from="resume", eval_only=True, ema_decay=ema_decay))
        assert evaluated["evals"][0]["val"] == pytest.approx(trained["evals"][-1]["val"], rel=1e-6)
    # training on without the average starts from the optimizer's own weights
    cfg = tiny(data_root, tmp_path, init_from="resume", max_iters=7)
    model = start_run(cfg, tokens.load_meta(Path(data_root) / "shakespeare_char")).model
    assert all(torch.equal(v, ckpt["weights"][k]) for k, v in model.state_dict().items())


def test_checkpoints_load_safely_and_describe_the_run(tmp_path, data_root):
    result = main(tiny(data_root, tmp_path, arch="encoder", max_iters=6, eval_interval=2))
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)  # plain torch: no code can run
    assert {
        "format_version",
        "weights",
        "model_config",
        "train_config",
        "meta",
        "optimizers",
        "scaler",
        "iter_num",
        "best_val_loss",
        "rng",
        "sampler",
    } <= ckpt.keys()
    assert not any(k.startswith(("_orig_mod.", "module.")) for k in ckpt["weights"])
    assert ckpt["iter_num"] == 6 and ckpt["train_config"]["arch"] == "encoder"
    # masked LM adds a [MASK] id after the characters, recorded so a tokenizer can be rebuilt from the checkpoint
    assert ckpt["meta"]["special_tokens"]["mask"] == 65 and ckpt["model_config"]["vocab_size"] == 66
    assert tokens.Tokenizer.from_meta(ckpt["meta"]).decode([65]) == "<mask>"
    best = torch.load(tmp_path / "best.pt", weights_only=True)
    trained_evals = [e["val"] for e in result["evals"] if e["iter"] > 0]
    assert best["best_val_loss"] == ckpt["best_val_loss"] == min(trained_evals)
    model = model_from_checkpoint(best)
    assert model.config.arch == "encoder" and not model.training
    assert (tmp_path / "config.json").read_text().count('"arch": "encoder"') == 2  # the train and model configs


def test_load_checkpoint_refuses_bad_files(tmp_path):
    good = tmp_path / "good.pt"
    save_checkpoint({"format_version": checkpoint.PLAIN_FORMAT, "x": torch.ones(1000)}, good)
    assert load_checkpoint(good)["x"].sum() == 1000
    truncated, newer, code = tmp_path / "truncated.pt", tmp_path / "newer.pt", tmp_path / "code.pt"
    truncated.write_bytes(good.read_bytes()[:2000])
    torch.save({"format_version": 99}, newer)

    class Exploit:
        def __reduce__(self):
            return os.system, (f"touch {tmp_path / 'pwned'}",)

    code.write_bytes(pickle.dumps({"format_version": checkpoint.PLAIN_FORMAT, "x": Exploit()}, protocol=2))
    for path, message in [
        (tmp_path / "missing.pt", "no checkpoint at"),
        (truncated, "not a readable checkpoint"),
        (newer, "format 99, newer than"),
        (code, "not a readable checkpoint"),
    ]:
        with pytest.raises(ConfigError, match=message) as error:
            load_checkpoint(path)
        assert "\n" not in str(error.value)
    assert not (tmp_path / "pwned").exists()


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    save_checkpoint({"format_version": checkpoint.PLAIN_FORMAT, "step": 1}, path)

    def dies_halfway(obj, f):
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt  # as if killed mid-write

    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint({"format_version": checkpoint.PLAIN_FORMAT, "step": 2}, path)
    monkeypatch.undo()
    assert load_checkpoint(path)["step"] == 1 and [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


def test_non_finite_loss_stops_with_the_iteration_and_keeps_the_checkpoint(tmp_path, data_root, capsys):
    main(tiny(data_root, tmp_path, max_iters=2))
    before = (tmp_path / "ckpt.pt").read_bytes()
    argv = [f"--{k}={v}" for k, v in TINY.items()] + [
        "--dataset=shakespeare_char",
        f"--data_dir={data_root}",
        f"--out_dir={tmp_path}",
        "--init_from=resume",
        "--max_iters=50",
        "--learning_rate=1e30",
        "--decay_lr=false",
    ]
    capsys.readouterr()
    assert cli(argv) == 1
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "at iteration 4" in error and "untouched" in error
    assert (tmp_path / "ckpt.pt").read_bytes() == before


def test_sigterm_finishes_the_step_saves_and_exits_0(tmp_path, env):
    argv = [
        sys.executable,
        str(REPO / "train.py"),
        "configs/shakespeare.py",
        *SHRINK,
        "--max_iters=100000",
        "--log_interval=1",
        f"--out_dir={tmp_path}",
    ]
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)
    try:
        for line in process.stdout:
            if line.startswith("iter 3/"):
                break
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 0 and "stopped by SIGTERM" in output
    stopped = load_checkpoint(tmp_path / "ckpt.pt")["iter_num"]
    assert stopped >= 3
    # the stop line's command goes on with the run as it was (its config, data and settings); here 2 steps more
    command = re.search(r"; resume with (python train\.py .*)$", output, re.MULTILINE).group(1)
    assert command == f"python train.py --init_from=resume --out_dir={tmp_path}"
    argv = [sys.executable, *command.split()[1:], f"--max_iters={stopped + 2}"]
    resumed = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert load_checkpoint(tmp_path / "ckpt.pt")["iter_num"] == stopped + 2


def test_eval_only_reports_the_checkpoint_and_writes_nothing(tmp_path, data_root):
    """The same weights and the same (fixed) eval batches: the val loss logged at the end of training again."""
    trained = main(tiny(data_root, tmp_path, max_iters=4, tensorboard=True))
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    evaluated = main(tiny(data_root, tmp_path, init_from="resume", eval_only=True, tensorboard=True))
    assert evaluated["losses"] == {} and len(evaluated["evals"]) == 1
    assert evaluated["evals"][0]["val"] == pytest.approx(trained["evals"][-1]["val"], rel=1e-6)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == files


def test_init_from_pretrained_errors_are_one_line(tmp_path, data_root, capsys):
    common = [f"--data_dir={data_root}", f"--out_dir={tmp_path / 'out'}", "--device=cpu"]
    assert cli(["--dataset=shakespeare", f"--init_from={tmp_path / 'no-such-gpt2'}", *common]) == 2
    assert cli(["--dataset=shakespeare_char", "--init_from=gpt2", *common]) == 2  # char data, GPT-2's BPE model
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 2 and "no-such-gpt2" in errors[0] and "GPT-2 BPE dataset" in errors[1]
    assert not (tmp_path / "out").exists()


def assert_close_at_scale(mine, reference, rel, name=""):
    """Every entry of mine within rel of reference's largest magnitude: float32 sums taken in another order."""
    error, scale = (mine - reference).abs().max().item(), reference.abs().max().item()
    assert error <= rel * scale, f"{name}: differs by {error:.3g}, {error / scale:.3g} of its largest entry"


@pytest.mark.parametrize("config", ["shakespeare", "shakespeare_mlm", "reverse"])  # gpt, encoder, encoder_decoder
def test_compiled_steps_equal_eager_steps(config):
    """
    Three steps through torch.compile's default backend (Inductor's C++ kernels, what train.py compiles with)
    against eager PyTorch from the same weights: every loss, gradient and updated weight within 1e-5 of its largest
    entry (fused kernels sum in another order; measured at most 1.5e-6). SGD, whose step is linear in the gradient:
    Adam's g / sqrt(v) would blow a rounding difference in a near-zero gradient up to a whole step. The pairs' two
    lengths take the encoder-decoder through one dynamic graph, their length marked dynamic as in training.
    """
    cfg, model, batches = shrunk_model_and_batches(REPO / "configs" / f"{config}.py")
    varying = cfg.arch == "encoder_decoder"
    batches = [data.model_inputs(*batch, torch.device("cpu"), varying) for batch in batches]
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, dynamic=None if varying else False)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    runs = [  # (the module stepped, its optimizers)
        (Models(raw=m, step=step), {"adamw": torch.optim.SGD(m.parameters(), lr=0.1)})
        for m, step in ((model, compiled), (eager, eager))
    ]
    for batch in (*batches, batches[0]):
        losses = [
            accumulate_gradients(models, CausalLM({}), [batch], batch[1].numel(), scaler, Runtime())
            for models, optimizers in runs
        ]
        assert_close_at_scale(losses[0], losses[1], 1e-5, "loss")
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            assert_close_at_scale(p.grad, q.grad, 1e-5, f"{name}'s gradient")
        for models, optimizers in runs:
            update_weights(models.raw, optimizers, scaler, grad_clip=0)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert_close_at_scale(p.detach(), q.detach(), 1e-5, name)


def test_bfloat16_autocast_on_cpu(tmp_path, data_root):
    """bf16 autocast runs, learns, and really changes the arithmetic (its losses differ slightly from float32's)."""
    bf16 = main(tiny(data_root, tmp_path / "bf16", dtype="bfloat16", max_iters=20, eval_interval=20))
    fp32 = main(tiny(data_root, tmp_path / "fp32", dtype="float32", max_iters=20, eval_interval=20))
    assert bf16["evals"][-1]["val"] < bf16["evals"][0]["val"] - 0.3
    assert bf16["losses"] != fp32["losses"]
    assert bf16["losses"][20] == pytest.approx(fp32["losses"][20], abs=0.1)


@needs_cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_amp_fused_adamw_and_compile(tmp_path, data_root, capsys, dtype):
    if dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16")
    result = main(
        tiny(
            data_root,
            tmp_path,
            device="cuda",
            dtype=dtype,
            compile=None,
            max_iters=40,
            eval_interval=40,
            learning_rate=1e-2,
            min_lr=1e-3,
            lr_decay_iters=40,
        )
    )
    out = capsys.readouterr().out
    assert "AdamW (fused)" in out and "torch.compile failed" not in out
    assert result["evals"][-1]["val"] < result["evals"][0]["val"] - 0.5
    ckpt = load_checkpoint(tmp_path / "ckpt.pt")
    assert not any(k.startswith("_orig_mod.") for k in ckpt["weights"])
    assert (ckpt["scaler"].get("scale", 0) > 0) == (dtype == "float16")  # the GradScaler runs for float16 only


@needs_cuda
def test_a_cuda_training_step_never_waits_for_the_gpu(data_root):
    """Between progress lines nothing is read back from the GPU: any synchronising call in a step is an error here."""
    torch.manual_seed(0)
    device = torch.device("cuda")
    cfg = tiny(data_root, "unused", device="cuda", log_interval=100)  # iteration 0's line only: a step not checked
    model = build_model(cfg.model_config(vocab_size=65)).to(device)
    optimizers, _ = configure_optimizers(model, 0.1, 1e-3, (0.9, 0.95), "cuda")  # fused: skips on the device
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    train_tokens = tokens.load_tokens(Path(data_root) / "shakespeare_char" / "train.bin")
    rt = Runtime(device=device, dtype=torch.bfloat16)
    stream = data.TrainBatches(train_tokens, CausalLM({}), cfg, torch.Generator().manual_seed(0), rt, per_rank=2)
    steps = log.Progress(cfg, rt, log.Scalars(cfg, active=False), peak_flops=None)
    try:
        for iteration in range(4):  # the first step creates the optimizer's state: not checked
            micro_batches, n_targets, _ = stream.peek()
            stream.advance()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error" if iteration else "default")
            try:
                loss, grad_norm, skipped = one_step(
                    model,
                    optimizers,
                    scaler,
                    micro_batches,
                    rt,
                    n_targets=n_targets,
                    lrs={"adamw": 1e-3},
                    grad_clip=1.0,
                )
                step = log.Step(loss, grad_norm, skipped, lr=1e-3, tokens=0, flops=0.0, seconds=0.0)
                steps.add(iteration, step)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        stream.close()
    steps.read()
    assert sorted(steps.losses) == [0, 1, 2, 3] and all(math.isfinite(v) for v in steps.losses.values())
    assert steps.unreported == 0


# -----------------------------------------------------------------------------
# DDP (torchrun, two processes: gloo on the CPU, nccl on GPUs)


def torchrun(args, env, timeout=300):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(REPO / "train.py"),
            *args,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def torchrun_script(source, tmp_path, env, *args):
    """A script of this source run on 2 ranks under torchrun, the repository importable: the finished process."""
    script = tmp_path / "script.py"
    script.write_text(source)
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), *args],
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )


def tensorboard_scalars(folder, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)}


# the model options of the modern recipe, all at once: under DDP they must change nothing about the equality
MODERN = {
    "n_kv_head": 1,
    "qk_norm": True,
    "activation": "relu2",
    "logit_softcap": 30.0,
    "zero_init_proj": True,
    "pos_encoding": "rope",
    "window_size": 5,
    "tie_embeddings": False,
    "activation_checkpointing": True,
}


@pytest.mark.parametrize(
    "device, optimizer, options",
    [
        ("cpu", "adamw", {}),
        ("cpu", "muon", MODERN),
        pytest.param(
            "cuda",
            "adamw",
            {},
            marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (nccl)"),
        ),
    ],
)
def test_ddp_matches_one_process_with_the_same_global_batch(tmp_path, data_root, env, device, optimizer, options):
    """
    Masked LM: micro-batches hold different numbers of targets, so the global token mean is really exercised.
    With a weight average, which must start from the weights DDP gives every rank (rank 1 draws others at init).
    """
    settings = dict(
        arch="encoder",
        batch_size=4,
        gradient_accumulation_steps=4,
        max_iters=4,
        eval_interval=4,
        eval_iters=3,
        log_interval=1,
        warmup_iters=1,
        dropout=0.0,
        ema_decay=0.5,
        device=device,
        optimizer=optimizer,
        **options,
    )
    tolerance = 1e-5 if device == "cpu" else 1e-3  # TF32 matmuls and reduction order on GPUs
    # Newton-Schulz's matrix powers amplify the reduction order's last-bit differences: on this tiny model Muon's
    # matrices differ by up to ~4e-3 after 4 steps between two single-process runs with different thread counts
    weight_atol = 1e-2 if optimizer == "muon" else tolerance / 10
    if optimizer == "muon":
        tolerance *= 10
    single = main(tiny(data_root, tmp_path / "single", **settings))
    args = [f"--{k}={v}" for k, v in {**TINY, **settings}.items()] + [
        "--dataset=shakespeare_char",
        "--tensorboard=true",
        f"--out_dir={tmp_path / 'ddp'}",
    ]
    run = torchrun(args, env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "2 rank(s)" in run.stdout and "4 x 2 micro-batches x 2 rank(s)" in run.stdout
    assert "FutureWarning" not in run.stderr, run.stderr[-3000:]  # DDP built with the current options
    ddp_losses = tensorboard_scalars(tmp_path / "ddp", "train/loss")
    assert sorted(ddp_losses) == [1, 2, 3, 4]
    single_losses = [single["losses"][i] for i in range(1, 5)]
    assert [ddp_losses[i] for i in range(1, 5)] == pytest.approx(single_losses, rel=tolerance)
    ddp_val = tensorboard_scalars(tmp_path / "ddp", "eval/val")
    assert [ddp_val[0], ddp_val[4]] == pytest.approx([e["val"] for e in single["evals"]], rel=tolerance)
    for key in ("weights", "average"):
        a, b = ckpt_weights(tmp_path / "single" / "ckpt.pt", key), ckpt_weights(tmp_path / "ddp" / "ckpt.pt", key)
        assert a.keys() == b.keys()  # no "module." prefix
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=100 * tolerance, atol=weight_atol)


def test_ddp_indivisible_accumulation_fails_fast_on_every_rank(tmp_path, data_root, env, monkeypatch, capsys):
    args = [f"--{k}={v}" for k, v in TINY.items()]
    args += [
        "--dataset=shakespeare_char",
        f"--data_dir={data_root}",
        "--gradient_accumulation_steps=3",
        f"--out_dir={tmp_path}",
    ]
    message = "gradient_accumulation_steps=3 does not divide among 2 ranks"
    run = torchrun(args, env, timeout=120)
    # the ranks fail alike, and the error shows once: rank 0's, before the other rank's grace is over
    assert run.returncode != 0 and run.stderr.count(message) == 1
    # each rank finds the error by itself, before any collective (so none waits for the other), and would say so
    # if it were the only one: rank by rank
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(log, "ERROR_GRACE", 0.0)
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", rank)
        assert cli(args) == 2
        assert capsys.readouterr().err.count(message) == 1
    assert not tmp_path.joinpath("ckpt.pt").exists()


def test_an_error_of_one_rank_alone_shows_under_torchrun(tmp_path, env):
    """
    torchrun ends every rank once one exits: an error that only rank 1 meets must be printed by rank 1 (after its
    grace), not lost with rank 0's silence. Rank 1 alone fails here, at its start.
    """
    script = "import os, sys, train\n"
    script += "if os.environ['RANK'] == '1':\n    sys.exit(train.fail('rank 1 alone cannot go on', 2))\n"
    script += "import time\ntime.sleep(60)\n"  # rank 0 would go on: torchrun ends it when rank 1 exits
    run = torchrun_script(script, tmp_path, env)
    assert run.returncode != 0 and run.stderr.count("train.py: error: rank 1 alone cannot go on") == 1
    assert "traceback : train.py: error: rank 1 alone cannot go on" in root_cause(run.stderr)


def root_cause(stderr):
    """The block torchrun prints last when a rank fails (its summary of the first failure), without its border."""
    head, _, block = stderr.rpartition("Root Cause (first observed failure):\n")
    *lines, border = block.rstrip().splitlines()
    assert head and set(border) == {"="}  # nothing printed after the summary
    return "\n".join(lines) + "\n"


def test_the_default_run_needs_its_data_prepared_and_says_how_once(tmp_path, env):
    """
    torchrun train.py with no config: the defaults are GPT-2 124M on OpenWebText, which is not prepared here. One
    line, once for the two ranks, saying how to prepare it (a download of hours is never started by accident).
    """
    run = torchrun([], {**env, "NANOFORMER_DATA_DIR": str(tmp_path / "data")}, timeout=120)
    assert run.returncode != 0
    lines = [line for line in run.stderr.splitlines() if "train.py: error:" in line]
    assert len(lines) == 1 and "python prepare_data.py openwebtext" in lines[0] and "configs/shakespeare.py" in lines[0]
    assert "  rank      : 0 (local_rank: 0)\n" in root_cause(run.stderr) and lines[0] in root_cause(run.stderr)
    assert not (tmp_path / "data").exists()


def test_the_default_run_trains_configs_gpt2_model_when_its_data_is_prepared(tmp_path, data_root, env):
    """
    The same command with OpenWebText prepared (a stand-in: the session's characters under its name) trains the
    model of configs/gpt2.py on both ranks: one step of 2 micro-batches of 1 x 32 positions, to keep it short.
    """
    data = tmp_path / "data"
    data.mkdir()
    shutil.copytree(Path(data_root) / "shakespeare_char", data / "openwebtext")
    small = ["--block_size=32", "--batch_size=1", "--gradient_accumulation_steps=2", "--max_iters=1", "--eval_iters=1"]
    run = torchrun([*small, f"--out_dir={tmp_path / 'out'}"], {**env, "NANOFORMER_DATA_DIR": str(data)}, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    gpt2 = parse_config(TrainConfig, [str(REPO / "configs" / "gpt2.py"), *small]).model_config(65)
    expected = build_model(gpt2).num_params()
    assert f"gpt on openwebtext: {expected:,} parameters" in run.stdout
    assert load_checkpoint(tmp_path / "out" / "ckpt.pt")["iter_num"] == 1


def test_running_out_of_cpu_memory_is_one_line(tmp_path, env):
    """A micro-batch too large for the process's memory (capped at 3 GiB here): one line, exit 1, no traceback."""

    def cap_memory():
        resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30))

    args = [str(REPO / "configs" / "shakespeare.py"), "--batch_size=50000", "--eval_iters=1", "--max_iters=2"]
    run = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *args, f"--out_dir={tmp_path}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=cap_memory,
    )
    assert run.returncode == 1
    error = run.stderr.strip()
    assert len(error.splitlines()) == 1 and "Traceback" not in error, error
    assert error.startswith("train.py: error: out of CPU memory with batch_size=50000, block_size=64")
    assert "--plan" in error


def child_processes(pid):
    """Linux: the ids of the processes whose parent is pid."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # "pid (name) state ppid ..."
        except (OSError, IndexError):
            continue  # the process ended meanwhile
        if parent == pid:
            children.append(int(stat.parent.name))
    return children


def running(pid):
    """Linux: whether process pid is alive, neither ended nor a zombie that its parent has yet to reap."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds torchrun's workers through /proc")
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["dead", "stopped"])
def test_a_dead_or_stopped_rank_ends_the_job_instead_of_hanging(tmp_path, env, how):
    """
    A dead rank (SIGKILL) is seen by torchrun; a hung one (SIGSTOP) must not hold the others in any collective
    past dist_timeout. Once the healthy rank has left, the test kills the stopped one itself: torchrun would give it
    30 s to answer a SIGTERM that it cannot (torch 2.13's agent ignores --shutdown-timeout when a worker fails).
    """
    args = [f"--{k}={v}" for k, v in TINY.items()] + [
        "--dataset=shakespeare_char",
        "--max_iters=100000",
        "--gradient_accumulation_steps=2",
        "--log_interval=1",
        "--dist_timeout=10",
        f"--out_dir={tmp_path}",
    ]
    torchrun_args = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(REPO / "train.py")]
    process = subprocess.Popen(
        [sys.executable, *torchrun_args, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    workers = []
    try:
        for line in process.stdout:
            if line.startswith("iter 3/"):
                break
        workers = child_processes(process.pid)
        assert len(workers) == 2
        os.kill(workers[-1], how)
        for _ in range(600):  # a hang would end here, as a failure after 60 s; dist_timeout is 10
            if not running(workers[0]):
                break
            time.sleep(0.1)
        assert not running(workers[0]), "the healthy rank still waits for the stopped one"
        with contextlib.suppress(ProcessLookupError):  # the dead one is gone already
            os.kill(workers[-1], signal.SIGKILL)
        process.communicate(timeout=60)
    finally:
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.kill()
    assert process.returncode not in (0, None)


# -----------------------------------------------------------------------------
# FSDP (torchrun, two processes, gloo on the CPU): sharded weights, gradients, optimizer state and checkpoints


def cli_args(settings, out_dir):
    """train.py's command line for TINY + settings, writing into out_dir with TensorBoard on."""
    settings = {**TINY, "dataset": "shakespeare_char", "tensorboard": True, **settings, "out_dir": out_dir}
    return [f"--{k}={v}" for k, v in settings.items()]


# a step of two micro-batches per rank and a gradient norm (0.6-1.1 on these models) that clipping at 0.5 cuts
FSDP_RUN = dict(
    batch_size=4,
    gradient_accumulation_steps=4,
    grad_clip=0.5,
    max_iters=20,
    eval_interval=10,
    eval_iters=3,
    log_interval=1,
    dropout=0.0,
)


@pytest.mark.parametrize(
    "options",
    [
        # weight average and activation checkpointing, both running on the sharded model
        {"arch": "gpt", "ema_decay": 0.9, "activation_checkpointing": True},
        # untied head, grouped-query attention, rotary, RMSNorm, SwiGLU: parameters of every shape and kind sharded;
        # torch.compile of the sharded model
        {
            "arch": "encoder",
            "tie_embeddings": False,
            "n_kv_head": 1,
            "pos_encoding": "rope",
            "norm": "rmsnorm",
            "activation": "swiglu",
            "qk_norm": True,
            "compile": True,
        },
        # shared source/target embedding, exact match decoded on rank 0 with the gathered weights
        {
            "arch": "encoder_decoder",
            "dataset": "reverse",
            "data_options": REVERSE,
            "share_embeddings": True,
            "eval_accuracy_examples": 8,
        },
    ],
)
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")  # from inside torch.compile
def test_fsdp_matches_one_process_with_the_same_global_batch(tmp_path, data_root, env, options, capsys):
    """
    20 steps with accumulation and clipping: the same losses, evaluations and best weights as one process. The
    compiled one-process run (Inductor's C++ kernels) compiles without a fallback and saves its weights unwrapped.
    """
    settings = {**FSDP_RUN, **options}
    single = main(tiny(data_root, tmp_path / "single", **settings))
    assert "torch.compile failed" not in capsys.readouterr().out
    run = torchrun(cli_args({**settings, "fsdp": True}, tmp_path / "fsdp"), env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "(4 x 2 micro-batches x 2 rank(s))" in run.stdout
    losses = tensorboard_scalars(tmp_path / "fsdp", "train/loss")
    assert [losses[i] for i in range(1, 21)] == pytest.approx([single["losses"][i] for i in range(1, 21)], rel=1e-5)
    for name in ("val", "train") + (("accuracy",) if options["arch"] == "encoder_decoder" else ()):
        evals = tensorboard_scalars(tmp_path / "fsdp", f"eval/{name}")
        assert [evals[i] for i in (0, 10, 20)] == pytest.approx([e[name] for e in single["evals"]], rel=1e-5)
    # best.pt: one file, gathered on rank 0, the same weights (the average, with ema_decay) with the same keys
    ours, theirs = load_checkpoint(tmp_path / "fsdp" / "best.pt"), load_checkpoint(tmp_path / "single" / "best.pt")
    ours, theirs = kept_weights(ours), kept_weights(theirs)
    assert ours.keys() == theirs.keys()
    assert not any(k.startswith(("_orig_mod.", "module.")) for k in theirs)
    # Adam divides by the gradient's running size: where that is tiny, last-bit differences in the reductions (each
    # micro-batch reduce-scattered, then added up, against one sum) grow to ~1.5e-5 after 20 steps of lr 3e-3
    for k in theirs:
        torch.testing.assert_close(ours[k], theirs[k], rtol=1e-3, atol=3e-5)
    # ckpt.pt: a folder of both ranks' shards, read whole into one process
    folder = tmp_path / "fsdp" / "ckpt.pt"
    assert folder.is_dir() and {p.name for p in folder.glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    whole, plain = load_checkpoint(folder), load_checkpoint(tmp_path / "single" / "ckpt.pt")
    assert whole["iter_num"] == 20 and kept_weights(whole).keys() == kept_weights(plain).keys()
    for k in kept_weights(plain):
        torch.testing.assert_close(kept_weights(whole)[k], kept_weights(plain)[k], rtol=1e-3, atol=3e-5)


def killing_train(folder):
    """
    A train.py that SIGKILLs itself (rank 0) in the middle of its first sharded save: every rank's shards are
    written, state.pt is being written, nothing is renamed yet.
    """
    script = folder / "train_killed.py"
    script.write_text(
        f"import os, signal, sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "import checkpoint, train\n"
        "write = checkpoint.write_file\n"
        "def write_file(state, path):\n"
        "    write(state, path)\n"
        "    if path.name == checkpoint.STATE_FILE:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "checkpoint.write_file = write_file\n"
        "sys.exit(train.cli(sys.argv[1:]))\n"
    )
    return script


def test_a_sharded_checkpoint_resumes_on_one_or_two_ranks_and_outlives_a_kill(tmp_path, data_root, env):
    """
    Saved by 2 FSDP ranks at iteration 10 (with a weight average, saved beside the weights), resumed in one
    process, on 2 DDP ranks and on 2 FSDP ranks: the losses of iterations 11-20 are those of an uninterrupted run.
    The FSDP resume is killed in its first save (iteration 15) and resumed again: from iteration 10, as if nothing
    had happened.
    A single-file ckpt.pt (a run without fsdp) also resumes under FSDP, its optimizer state sharded.
    """
    settings = {**FSDP_RUN, "eval_interval": 5, "ema_decay": 0.9}
    # the reference: one process, 10 steps, then 10 more from its single-file checkpoint (exact, tested above)
    single = main(tiny(data_root, tmp_path / "single", **{**settings, "max_iters": 10}))
    shutil.copytree(tmp_path / "single", tmp_path / "from_file")
    single["losses"].update(main(tiny(data_root, tmp_path / "single", **settings, init_from="resume"))["losses"])
    expected = [single["losses"][i] for i in range(11, 21)]

    run = torchrun(cli_args({**settings, "max_iters": 10, "fsdp": True}, tmp_path / "a"), env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "a" / "ckpt.pt").is_dir()
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.copytree(tmp_path / "a", tmp_path / "ddp")
    # under DDP: every rank reads every part (whole tensors), together
    run = torchrun(cli_args({**settings, "init_from": "resume"}, tmp_path / "ddp"), env)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = tensorboard_scalars(tmp_path / "ddp", "train/loss")
    assert [losses[i] for i in range(11, 21)] == pytest.approx(expected, rel=1e-5)
    # in one process: weights, optimizer state and average read whole from both ranks' shards
    one = main(tiny(data_root, tmp_path / "a", **settings, init_from="resume"))
    assert [one["losses"][i] for i in range(11, 21)] == pytest.approx(expected, rel=1e-5)
    assert (tmp_path / "a" / "ckpt.pt").is_file()  # a run without fsdp writes the single file again

    resume = cli_args({**settings, "fsdp": True, "init_from": "resume"}, tmp_path / "b")
    killed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        + [str(killing_train(tmp_path)), *resume],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode != 0 and "saved ckpt.pt" not in killed.stdout
    assert (tmp_path / "b" / ".ckpt.pt.new").is_dir()  # the new checkpoint, complete but for its rename
    assert load_checkpoint(tmp_path / "b" / "ckpt.pt", weights=False)["iter_num"] == 10  # the previous, intact
    run = torchrun(resume, env)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = tensorboard_scalars(tmp_path / "b", "train/loss")
    assert [losses[i] for i in range(11, 21)] == pytest.approx(expected, rel=1e-5)
    assert not (tmp_path / "b" / ".ckpt.pt.new").exists()  # the next save cleared what the kill left

    run = torchrun(cli_args({**settings, "fsdp": True, "init_from": "resume"}, tmp_path / "from_file"), env)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = tensorboard_scalars(tmp_path / "from_file", "train/loss")
    assert [losses[i] for i in range(11, 21)] == pytest.approx(expected, rel=1e-5)


def test_a_save_killed_between_its_renames_leaves_the_previous_checkpoint_readable(tmp_path):
    """move_into_place: the previous checkpoint is .NAME.old for a moment; load_checkpoint reads it then."""
    model = build_model(ModelConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8))
    state = {"format_version": checkpoint.PLAIN_FORMAT, "model_config": dataclasses.asdict(model.config), "iter_num": 3}
    save_checkpoint({**state, "weights": model.state_dict()}, tmp_path / "ckpt.pt")
    (tmp_path / "ckpt.pt").rename(tmp_path / ".ckpt.pt.old")  # the first rename done, the second not yet
    assert load_checkpoint(tmp_path / "ckpt.pt")["iter_num"] == 3
    # the next save puts a folder (a sharded checkpoint) in its place and removes the leftover
    (tmp_path / "new").mkdir()
    move_into_place(tmp_path / "new", tmp_path / "ckpt.pt")
    assert (tmp_path / "ckpt.pt").is_dir() and not (tmp_path / ".ckpt.pt.old").exists()
    # and a file over a folder (a run without fsdp after one with it)
    save_checkpoint({**state, "iter_num": 4, "weights": model.state_dict()}, tmp_path / "ckpt.pt")
    assert load_checkpoint(tmp_path / "ckpt.pt")["iter_num"] == 4 and not (tmp_path / ".ckpt.pt.old").exists()


def test_the_closing_memory_line_counts_weights_gradients_and_adam_state(tmp_path, data_root, capsys):
    """fp32 AdamW: 4 bytes a parameter each for the weights and gradients, 8 for the moments; as bench.py reads it."""
    import bench

    main(tiny(data_root, tmp_path, n_embd=128, n_head=4, max_iters=1))
    n_params = sum(v.numel() for k, v in ckpt_weights(tmp_path / "ckpt.pt").items() if k != "lm_head.weight")
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("memory rank 0: "))
    weights = float(re.search(r"weights ([\d.]+) MiB", line)[1])
    assert weights == pytest.approx(4 * n_params / 2**20, abs=0.05)
    state, peak = bench.memory_lines(line)[0]
    assert state == pytest.approx(16 * n_params / 2**20, abs=0.2) and peak > state


def test_a_failed_sharded_save_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """A full disk in the middle of torch.distributed.checkpoint's write (on any rank) is save_checkpoint's OSError."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException

    import checkpoint

    model = build_model(ModelConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8))
    optimizer = torch.optim.AdamW(model.parameters())
    state = {"format_version": checkpoint.PLAIN_FORMAT, "model_config": dataclasses.asdict(model.config), "meta": None}
    path = tmp_path / "ckpt.pt"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        tensors = checkpoint.sharded_state(model, ema_model=None, optimizers={"adamw": optimizer})
        checkpoint.save_sharded(tensors, {**state, "iter_num": 5}, path, rank=0)
        (tmp_path / ".ckpt.pt.new").write_text("a file where the next save writes its folder")

        def full_disk(*args, **kwargs):
            raise CheckpointException("save", {1: (OSError(errno.ENOSPC, "No space left on device"), None)})

        monkeypatch.setattr(torch.distributed.checkpoint, "save", full_disk)
        with pytest.raises(OSError, match=r"ckpt.pt \(No space left on device; [\d.]+ GiB free there\); the previous"):
            checkpoint.save_sharded(tensors, {**state, "iter_num": 6}, path, rank=0)
        assert load_checkpoint(path, weights=False)["iter_num"] == 5
        monkeypatch.undo()

        def read_only(state, file):  # rank 0's state.pt, after every rank's shards: the same line
            raise OSError(errno.EROFS, "Read-only file system")

        monkeypatch.setattr(checkpoint, "write_file", read_only)
        with pytest.raises(OSError, match=r"ckpt.pt \(Read-only file system; [\d.]+ GiB free there\); the previous"):
            checkpoint.save_sharded(tensors, {**state, "iter_num": 6}, path, rank=0)
        assert load_checkpoint(path, weights=False)["iter_num"] == 5
        monkeypatch.undo()
        checkpoint.save_sharded(tensors, {**state, "iter_num": 7}, path, rank=0)
        assert load_checkpoint(path, weights=False)["iter_num"] == 7
    finally:
        dist.destroy_process_group()


def test_a_sharded_save_failing_on_rank_0_stops_both_ranks_with_one_line(tmp_path, env):
    """Rank 0's state.pt cannot be written: rank 1, past its own shards, hears of it and raises the same OSError."""
    script = tmp_path / "save.py"
    script.write_text(
        "import errno, sys, torch, torch.distributed as dist\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "import checkpoint\n"
        "from model import ModelConfig, build_model\n"
        "dist.init_process_group('gloo')\n"
        "def read_only(state, path):\n"
        "    raise OSError(errno.EROFS, 'Read-only file system')\n"
        "checkpoint.write_file = read_only\n"
        "model = build_model(ModelConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8))\n"
        "optimizers = {'adamw': torch.optim.AdamW(model.parameters())}\n"
        "tensors = checkpoint.sharded_state(model, ema_model=None, optimizers=optimizers)\n"
        "try:\n"
        "    checkpoint.save_sharded(tensors, {}, sys.argv[1], dist.get_rank())\n"
        "except OSError as e:\n"
        "    print(f'rank {dist.get_rank()}: {e}', flush=True)\n"
        # as train.main does: gloo's threads let go of the last collective's tensors before the group goes
        "dist.barrier()\n"
        "dist.destroy_process_group()\n"
    )
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
        + [str(tmp_path / "ckpt.pt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: could not write {tmp_path / 'ckpt.pt'} (Read-only file system; " in run.stdout
    assert not (tmp_path / "ckpt.pt").exists() and not (tmp_path / ".ckpt.pt.new").exists()  # nothing left


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save's, in this one process
def test_a_damaged_sharded_checkpoint_is_one_line(tmp_path):
    """A folder read whole into one process; a part missing, its index missing, or its state.pt missing: one line."""
    import torch.distributed.checkpoint as dcp

    model = build_model(ModelConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8))
    folder = tmp_path / "ckpt.pt"
    dcp.save({"weights": model.state_dict()}, checkpoint_id=folder, no_dist=True)
    state = {"format_version": checkpoint.PLAIN_FORMAT, "model_config": dataclasses.asdict(model.config)}
    save_checkpoint({**state, "iter_num": 3, "meta": None, "sharded_keys": ["weights"]}, folder / "state.pt")
    whole = load_checkpoint(folder)
    assert whole["iter_num"] == 3 and whole["weights"].keys() == model.state_dict().keys()
    assert all(torch.equal(whole["weights"][k], v) for k, v in model.state_dict().items())
    (folder / "__0_0.distcp").unlink()
    with pytest.raises(ConfigError, match=r"ckpt.pt is not a readable sharded checkpoint: FileNotFoundError"):
        load_checkpoint(folder)
    (folder / ".metadata").unlink()
    with pytest.raises(ConfigError, match=r"it has no .metadata \(a save cut short\?\)$"):
        load_checkpoint(folder)
    (folder / "state.pt").unlink()
    with pytest.raises(ConfigError, match="is a folder but not a sharded checkpoint: it has no state.pt"):
        load_checkpoint(folder)


def test_fsdp_refuses_muon_and_trains_whole_in_one_process(tmp_path, data_root, capsys):
    with pytest.raises(ConfigError, match="fsdp=True cannot train with optimizer='muon': Muon orthogonalises"):
        tiny(data_root, tmp_path, fsdp=True, optimizer="muon")
    alone = main(tiny(data_root, tmp_path / "fsdp", fsdp=True))
    assert "note: fsdp=True with one process" in capsys.readouterr().out
    assert alone["losses"] == main(tiny(data_root, tmp_path / "plain"))["losses"]
    assert (tmp_path / "fsdp" / "ckpt.pt").is_file()


# -----------------------------------------------------------------------------
# Every shipped config runs (shrunk)


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory):
    """A 2-layer GPT-2 in the Hugging Face layout, standing in for the real weights offline."""
    import transformers

    folder = tmp_path_factory.mktemp("tiny-gpt2")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=50257)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def pairs_tsv(tmp_path_factory):
    """A small English-French TSV standing in for opus_books offline."""
    words = [
        ("cat", "chat"),
        ("dog", "chien"),
        ("house", "maison"),
        ("tree", "arbre"),
        ("book", "livre"),
        ("car", "voiture"),
    ]
    lines = [f"the {a} sees the {b}.\tle {x} voit le {y}." for a, x in words for b, y in words for _ in range(10)]
    path = tmp_path_factory.mktemp("pairs") / "pairs.tsv"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_configs_are_all_tested():
    assert {p.name for p in CONFIGS} == {
        "shakespeare.py",
        "shakespeare_gpu.py",
        "finetune_shakespeare.py",
        "gpt2.py",
        "gpt2_modern.py",
        "reverse.py",
        "translation.py",
        "shakespeare_mlm.py",
        "chat_shakespeare.py",
        "chat_gpt2.py",
        "chat_llama.py",
    }


@pytest.mark.parametrize("config", ["configs/gpt2.py", "configs/gpt2_modern.py"])
def test_gpt2_config_steps_half_a_million_tokens_on_8_gpus(config):
    cfg = parse_config(TrainConfig, [config])
    assert split_accumulation(cfg.gradient_accumulation_steps, 8) * 8 == cfg.gradient_accumulation_steps
    assert cfg.batch_size * cfg.gradient_accumulation_steps * cfg.block_size == pytest.approx(0.5e6, rel=0.05)


@pytest.fixture(scope="session")
def talk_jsonl(tmp_path_factory):
    """A few short conversations in the messages format, standing in for a user's chat file."""
    path = tmp_path_factory.mktemp("talk") / "talk.jsonl"
    lines = [
        json.dumps(
            {"messages": [{"role": "user", "content": f"{a} and {b}?"}, {"role": "assistant", "content": str(a + b)}]}
        )
        for a in range(12)
        for b in range(5)
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def char_checkpoint(shakespeare_char_dir, tmp_path_factory):
    """A few steps of a character-level GPT: the stand-in for the quick-start model that chat_shakespeare tunes."""
    out = tmp_path_factory.mktemp("char-base")
    main(tiny(str(shakespeare_char_dir.parent), out, max_iters=2, eval_interval=2, eval_iters=1, tensorboard=False))
    return out / "ckpt.pt"


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_shipped_config_runs_shrunk(
    config, tmp_path, data_root, tiny_gpt2_dir, pairs_tsv, talk_jsonl, char_checkpoint, llama_dir
):
    chat = {"input": str(talk_jsonl), "block_size": 32, "val_fraction": 0.2}
    offline = {  # what each config needs in place of the network
        "finetune_shakespeare": [f"--init_from={tiny_gpt2_dir}"],
        "chat_shakespeare": [f"--init_from={char_checkpoint}"],
        "chat_gpt2": [f"--init_from={tiny_gpt2_dir}", f"--data_options={chat}"],
        "chat_llama": [f"--init_from={llama_dir}", f"--data_options={ {**chat, 'tokenizer': str(llama_dir)} }"],
        "gpt2": ["--dataset=shakespeare"],
        "gpt2_modern": ["--dataset=shakespeare"],
        "reverse": [f"--data_options={REVERSE}"],
        "translation": [f"--data_options={{'input': '{pairs_tsv}', 'val_fraction': 0.1, 'test_fraction': 0.1}}"],
    }.get(config.stem, [])
    places = [f"--data_dir={data_root}", f"--out_dir={tmp_path}"]
    cfg = parse_config(TrainConfig, [str(config), *SHRINK, *offline, *places])
    result = main(cfg)
    assert sorted(result["losses"]) == [1, 2, 3] and all(math.isfinite(v) for v in result["losses"].values())
    assert load_checkpoint(tmp_path / "ckpt.pt")["train_config"]["dataset"] == cfg.dataset


def shrunk_model_and_batches(config):
    """A shipped config's model at SHRINK's size in training mode, and two training batches of random tokens for it."""
    # LoRA configs adapt given weights: any init_from passes the settings' check (the model here is built plain)
    cfg = parse_config(TrainConfig, [str(config), *SHRINK, "--dropout=0.0", "--init_from=base.pt"])
    V, g = 40, torch.Generator().manual_seed(0)
    model = build_model(cfg.model_config(V, 0 if cfg.arch == "encoder_decoder" else None)).train()
    if config.stem.startswith("chat_"):  # conversations of two different lengths: one dynamic graph serves both
        batches = [tuple(torch.randint(1, V, (4, T), generator=g) for _ in range(2)) for T in (20, 13)]
        return cfg, model, [((x,), y) for x, y in batches]
    if cfg.arch == "encoder_decoder":  # pairs of two different lengths: one dynamic graph must serve both
        shapes = [((4, 20), (4, 24)), ((4, 13), (4, 9))]
        batches = [tuple(torch.randint(1, V, s, generator=g) for s in (src, tgt, tgt)) for src, tgt in shapes]
        return cfg, model, [((src, tgt), targets) for src, tgt, targets in batches]
    batches = [tuple(torch.randint(1, V, (4, 32), generator=g) for _ in range(2)) for _ in range(2)]
    return cfg, model, [((x,), y) for x, y in batches]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_every_shipped_config_compiles_to_one_graph_that_never_recompiles(config):
    """
    The training call as train.py makes it: no graph break (each would split the compiled step); and after a first
    train step and evaluation (warm-up), train / evaluate / train again compiles nothing new.
    """
    cfg, model, batches = shrunk_model_and_batches(config)
    # conversations and pairs vary in length (Task.varying), windows do not
    varying = config.stem.startswith("chat_") or cfg.arch == "encoder_decoder"
    call = {"label_smoothing": cfg.label_smoothing, "reduction": "sum", "return_logits": False}
    inputs, targets = data.model_inputs(*batches[0], torch.device("cpu"), varying)
    explanation = torch._dynamo.explain(model)(*inputs, targets, **call)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    dynamic = None if varying else False
    compiled = torch.compile(model, backend="eager", dynamic=dynamic)

    def train_then_evaluate(batch):
        inputs, targets = data.model_inputs(*batch, torch.device("cpu"), varying)
        compiled.train()
        compiled(*inputs, targets, **call)[1].backward()
        with torch.no_grad():
            compiled.eval()
            compiled(*inputs, targets, reduction="sum", return_logits=False)

    train_then_evaluate(batches[0])  # warm-up: the training graph and the evaluation graph
    with torch._dynamo.config.patch(error_on_recompile=True):
        train_then_evaluate(batches[1])
        train_then_evaluate(batches[0])


def test_gpt2_at_full_size_traces_without_memory():
    """configs/gpt2.py's model, batch and block, forward and backward under FakeTensorMode: shapes, no allocation."""
    import resource

    from torch._subclasses.fake_tensor import FakeTensorMode

    cfg = parse_config(TrainConfig, [str(REPO / "configs" / "gpt2.py")])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with FakeTensorMode():
        model = build_model(cfg.model_config(50304))
        x = torch.randint(0, 50304, (cfg.batch_size, cfg.block_size))
        _, loss = model(x, x, reduction="sum", return_logits=False)
        loss.backward()
    assert loss.shape == () and all(p.grad is not None for p in model.parameters())
    assert model.num_params() > 120e6  # the real size, traced
    # a real run of this would take GBs: the weights alone are 0.5 GB, the logits of a batch 2.4 GB
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024
    assert grown_mib < 200


# -----------------------------------------------------------------------------
# bench.py


def test_bench_prints_every_measure_for_each_config(tmp_path, env):
    """The table's rows and their formats, a column per config; the numbers are the machine's business, not a test's."""
    train_args = " ".join([*SHRINK, "--log_interval=1", "--dataset=shakespeare_char"])
    other = tmp_path / "relu2.py"  # a second config, outside the repository
    other.write_text((REPO / "configs/shakespeare.py").read_text() + 'activation = "relu2"\n')
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench.py"),
            f"--config=configs/shakespeare.py,{other}",
            "--runs=2",
            "--repeats=2",
            "--samples=2",
            "--sample_tokens=8",
            "--target_loss=10",
            "--budget=600",
            f"--train_args={train_args}",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    table = [line for line in lines if line.startswith("| ")]  # the header, then the rows (the rule is "|---")
    assert lines[0].startswith("device: CPU") and table[0].split("|")[2:4] == [
        " configs/shakespeare.py median (min-max) ",
        f" {other} median (min-max) ",
    ]
    rows = {cells[1].strip(): [c.strip() for c in cells[2:-1]] for cells in (line.split("|") for line in table[1:])}
    number = r"[\d,.]+ \([\d,.]+-[\d,.]+\)"  # median (min-max)
    for name in ("training tokens/s (per progress line)", "seconds to val loss <= 10.0", "best val loss within 600 s"):
        assert len(rows[name]) == 2 and all(re.fullmatch(number, value) for value in rows[name]), (name, rows[name])
    speedup = rows[next(k for k in rows if k.startswith("sampling speedup"))]
    assert len(speedup) == 2 and all(re.fullmatch(r"[\d.]+x \([\d.]+x-[\d.]+x\)", value) for value in speedup)


def test_bench_refuses_a_config_that_does_not_exist(tmp_path):
    run = subprocess.run(
        [sys.executable, str(REPO / "bench.py"), "--config=configs/shakespeare.py,configs/nope.py"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert run.returncode == 2 and run.stderr.strip() == (
        "bench.py: error: config configs/nope.py not found; pass --config=PATH[,PATH...] of train.py configs"
    )


# -----------------------------------------------------------------------------
# Non-finite gradients, losses and evaluations


def poison_gradient(model, at_call):
    """Make the gradient of lm_head.weight infinite in the backward pass number `at_call` (1-based)."""
    calls = []

    def hook(grad):
        calls.append(1)
        if len(calls) == at_call:
            grad = grad.clone()
            grad[0, 0] = math.inf  # what an overflow in a bf16 backward leaves
        return grad

    model.lm_head.weight.register_hook(hook)
    return model


@pytest.mark.parametrize("fused", [True, False])
def test_a_step_with_a_non_finite_gradient_changes_nothing(fused):
    """Against plain PyTorch: a finite step is AdamW after clipping; an infinite gradient leaves weights and state."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=20, block_size=8, n_layer=1, n_head=2, n_embd=16)
    model, reference = build_model(config), build_model(config)
    reference.load_state_dict(model.state_dict())
    step = {"n_targets": 16, "lrs": {"adamw": 0.1}, "grad_clip": 1.0}
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused, foreach=None if fused else False)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    x, y = torch.randint(0, 20, (2, 8)), torch.randint(0, 20, (2, 8))

    loss, norm, skipped = one_step(model, {"adamw": optimizer}, scaler, [((x,), y)], Runtime(), **step)
    ref_loss = F.cross_entropy(reference(x)[0].flatten(0, 1), y.flatten())
    ref_loss.backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    ref_optimizer.step()
    assert skipped.item() == 0 and loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    assert norm.item() == pytest.approx(ref_norm.item(), rel=1e-5)
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)

    before = {k: v.clone() for k, v in model.state_dict().items()}
    state_before = {k: v.clone() for k, v in optimizer.state[model.lm_head.weight].items()}
    poison_gradient(model, at_call=1)
    loss, norm, skipped = one_step(model, {"adamw": optimizer}, scaler, [((x,), y)], Runtime(), **step)
    assert skipped.item() == 1 and not math.isfinite(norm.item()) and math.isfinite(loss.item())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    state_after = optimizer.state[model.lm_head.weight]
    assert all(torch.equal(state_before[k], state_after[k]) for k in state_before)  # step count and moments too
    assert all(p.grad is None for p in model.parameters())


def test_a_muon_step_is_muon_and_adamw_by_hand_and_skips_a_non_finite_gradient():
    """optimizer='muon': Muon on the blocks' matrices, AdamW on the rest, each at its own lr; both skip an inf step."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=20, block_size=8, n_layer=2, n_head=2, n_embd=16, arch="encoder_decoder")
    model, reference = build_model(config), build_model(config)
    reference.load_state_dict(model.state_dict())
    optimizers, _ = configure_optimizers(model, 0.1, 1.0, (0.9, 0.95), "cpu", optimizer="muon", muon_lr=1.0)
    # the reference's dtype: torch.optim.Muon orthogonalises in bfloat16, muon.Muon in float32 on a CPU by default
    optimizers["muon"].ns_dtype = torch.bfloat16
    step = {"n_targets": 16, "lrs": {"adamw": 1e-3, "muon": 0.02}, "grad_clip": 1.0}
    # the split by name, independently of configure_optimizers
    hidden = re.compile(r"(encoder|decoder)\.blocks\.\d+\.(attn|cross_attn|mlp)\.(qkv|q|kv|proj|fc)\.weight")
    named = list(reference.named_parameters())
    muon_ref = torch.optim.Muon(
        [p for n, p in named if hidden.fullmatch(n)], lr=0.02, weight_decay=0.1, adjust_lr_fn="original"
    )
    adamw_ref = torch.optim.AdamW(
        [
            {"params": [p for n, p in named if not hidden.fullmatch(n) and p.dim() == 2], "weight_decay": 0.1},
            {"params": [p for n, p in named if not hidden.fullmatch(n) and p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=1e-3,
        betas=(0.9, 0.95),
        # fused as configure_optimizers's: unfused AdamW differs in the last bits, which Newton-Schulz's bfloat16
        # matrix powers in the next step amplify up to ~3e-4
        fused=True,
    )
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    src, tgt, y = (torch.randint(0, 20, (2, 8)) for _ in range(3))

    for _ in range(2):  # the second step uses the momentum and moments of the first
        loss, norm, skipped = one_step(model, optimizers, scaler, [((src, tgt), y)], Runtime(), **step)
        ref_loss = F.cross_entropy(reference(src, tgt)[0].flatten(0, 1), y.flatten())
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)  # over all parameters
        muon_ref.step()
        adamw_ref.step()
        muon_ref.zero_grad()
        adamw_ref.zero_grad()
        assert skipped.item() == 0 and loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
        assert norm.item() == pytest.approx(ref_norm.item(), rel=1e-5)
        for (name, mine), theirs in zip(model.named_parameters(), reference.parameters()):
            # Muon's matrices: a batched bfloat16 matmul may round an update element (at most ~0.5) one bfloat16
            # ulp (2^-8) otherwise than torch.optim.Muon's per-matrix one, as test_muon allows: at lr 0.02, twice,
            # under 1e-4 (measured: 0 with AVX-512 kernels, 2e-10 with AVX2, 3.9e-5 with ATEN_CPU_CAPABILITY=default)
            atol = 1e-4 if hidden.fullmatch(name) else 1e-6
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=atol, msg=name)

    before = {k: v.clone() for k, v in model.state_dict().items()}
    states_before = [copy.deepcopy(opt.state_dict()) for opt in optimizers.values()]
    poison_gradient(model, at_call=1)
    loss, norm, skipped = one_step(model, optimizers, scaler, [((src, tgt), y)], Runtime(), **step)
    assert skipped.item() == 1 and not math.isfinite(norm.item())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    for opt, state_before in zip(optimizers.values(), states_before):
        after = opt.state_dict()["state"]
        assert after.keys() == state_before["state"].keys()
        assert all(torch.equal(state_before["state"][i][k], v) for i in after for k, v in after[i].items())


def test_resuming_with_another_optimizer_is_a_one_line_error(tmp_path, data_root):
    main(tiny(data_root, tmp_path, max_iters=1, optimizer="muon"))
    assert "muon" in load_checkpoint(tmp_path / "ckpt.pt")["optimizers"]
    with pytest.raises(ConfigError, match="optimizer='muon': resume it with --optimizer=muon"):
        main(tiny(data_root, tmp_path, max_iters=2, init_from="resume"))


def test_an_infinite_gradient_mid_run_is_skipped_said_and_never_saved(tmp_path, data_root, monkeypatch, capsys):
    real_build = start.build_model
    monkeypatch.setattr(start, "build_model", lambda config: poison_gradient(real_build(config), at_call=3))
    result = main(tiny(data_root, tmp_path, max_iters=6, eval_interval=3, log_interval=1))
    out = capsys.readouterr().out
    assert re.search(r"iter 3/6 .*1 step\(s\) skipped: gradient not finite", out)
    assert "skipped" not in out.replace(re.search(r"iter 3/6 .*\n", out)[0], "")  # only that step
    assert all(math.isfinite(v) for v in result["losses"].values()) and sorted(result["losses"]) == list(range(1, 7))
    for name in ("ckpt.pt", "best.pt"):
        assert all(torch.isfinite(v).all() for v in ckpt_weights(tmp_path / name).values())


def test_a_skipped_step_after_the_last_progress_line_is_still_reported(tmp_path, data_root, monkeypatch, capsys):
    real_build = start.build_model
    monkeypatch.setattr(start, "build_model", lambda config: poison_gradient(real_build(config), at_call=2))
    main(tiny(data_root, tmp_path, max_iters=4, eval_interval=3, log_interval=5))  # evaluations read the losses
    assert "1 step(s) skipped since the last progress line: gradient not finite" in capsys.readouterr().out


def test_a_non_finite_evaluation_saves_nothing(tmp_path, data_root, monkeypatch, capsys):
    argv = [f"--{k}={v}" for k, v in TINY.items()] + [
        "--dataset=shakespeare_char",
        f"--data_dir={data_root}",
        f"--out_dir={tmp_path}",
        "--max_iters=4",
        "--eval_interval=2",
    ]
    real_evaluate = train.evaluate
    evaluations = []

    def evaluate(*args, **kwargs):
        evaluations.append(1)
        losses = real_evaluate(*args, **kwargs)
        return {**losses, "val": math.nan} if len(evaluations) == 3 else losses  # at iteration 4

    monkeypatch.setattr(train, "evaluate", evaluate)
    assert cli(argv) == 1
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "iteration 4" in error and "nothing saved" in error
    assert load_checkpoint(tmp_path / "ckpt.pt")["iter_num"] == 2 and load_checkpoint(tmp_path / "best.pt")


# -----------------------------------------------------------------------------
# Compilation


def counting_backend(graphs, fail_after=None):
    """A torch.compile backend that runs each graph as traced (no code generation) and records it."""

    def backend(gm, example_inputs):
        graphs.append(gm)
        if fail_after is not None and len(graphs) > fail_after:
            raise RuntimeError("this backend fails on purpose")
        return gm.forward

    return backend


def test_a_failed_recompilation_falls_back_to_eager(tmp_path, data_root, monkeypatch, capsys):
    """The first graph compiles, the evaluation's (a recompilation) fails: one warning, then eager numbers."""
    eager = main(tiny(data_root, tmp_path / "eager", max_iters=3, eval_interval=3))
    real_compile, graphs = torch.compile, []
    monkeypatch.setattr(
        torch, "compile", lambda module, **kwargs: real_compile(module, backend=counting_backend(graphs, 1), **kwargs)
    )
    compiled = main(tiny(data_root, tmp_path / "compiled", max_iters=3, eval_interval=3, compile=True))
    out = capsys.readouterr().out
    assert out.count("warning: torch.compile failed") == 1 and len(graphs) == 2
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-6)
    assert [e["val"] for e in compiled["evals"]] == pytest.approx([e["val"] for e in eager["evals"]], rel=1e-6)


def test_a_failed_regional_recompilation_falls_back_to_the_whole_eager_model(tmp_path, data_root, monkeypatch, capsys):
    """
    compile_regions: the blocks' graph (one for both blocks) and the loss's compile; the evaluation's recompilation
    of the blocks fails: one warning, every region back to eager, and the eager run's numbers.
    """
    eager = main(tiny(data_root, tmp_path / "eager", max_iters=3, eval_interval=3))
    real_compile, graphs = torch.compile, []
    monkeypatch.setattr(
        torch, "compile", lambda module, **kwargs: real_compile(module, backend=counting_backend(graphs, 2), **kwargs)
    )
    settings = dict(max_iters=3, eval_interval=3, compile=True, compile_regions=True)
    compiled = main(tiny(data_root, tmp_path / "compiled", **settings))
    out = capsys.readouterr().out
    assert out.count("warning: torch.compile failed") == 1 and len(graphs) == 3
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-6)
    assert [e["val"] for e in compiled["evals"]] == pytest.approx([e["val"] for e in eager["evals"]], rel=1e-6)


@pytest.mark.parametrize("config", ["shakespeare", "reverse"])  # gpt, encoder_decoder (two lengths, dynamic)
def test_regional_compilation_equals_eager_with_one_graph_for_every_block(config):
    """
    compile_regions: each block and the loss compiled (through AOTAutograd, as Inductor compiles, run as traced:
    Inductor's kernels are checked on the whole model above), the embeddings between them eager. Losses and
    gradients equal eager ones; the GPT's two blocks share one graph (two in all, with the loss's); with
    enabled=False every region is eager again and nothing more compiles.
    """
    cfg, model, batches = shrunk_model_and_batches(REPO / "configs" / f"{config}.py")
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):  # AOTAutograd's forward and backward graphs, run as traced
        graphs.append(gm)
        as_traced = make_boxed_compiler(lambda graph, inputs: graph)
        return aot_module_simplified(gm, example_inputs, fw_compiler=as_traced, bw_compiler=as_traced)

    dynamic = None if cfg.arch == "encoder_decoder" else False
    compiling.compile_regions(model, backend=backend, dynamic=dynamic)
    for batch in (*batches, batches[0]):
        inputs, targets = batch
        losses = []
        for m in (model, eager):
            m.zero_grad()
            loss = m(*inputs, targets, reduction="sum", return_logits=False)[1]
            loss.backward()
            losses.append(loss)
        assert_close_at_scale(losses[0], losses[1], 1e-5, "loss")
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            assert_close_at_scale(p.grad, q.grad, 1e-5, f"{name}'s gradient")
    if cfg.arch == "gpt":
        assert len(graphs) == 2
    compiling.compile_regions(model, enabled=False)
    assert all(b._compiled_call_impl is None for b in model.modules() if isinstance(b, Block))
    assert "chunk_loss" not in vars(model)
    before = len(graphs)
    model(*batches[0][0], batches[0][1])
    assert len(graphs) == before


def test_the_loss_chunk_starts_at_the_cap_or_loss_chunk_mb(monkeypatch):
    """
    None on a CPU (the model's budget); on a GPU an eighth of the card until the trial step sizes it, whatever is
    free; loss_chunk_mb anywhere, for good. The planner counts the cap of the GPU it plans for.
    """
    cfg, gpu = TrainConfig(), Runtime(device=torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * 2**30, 80 * 2**30))
    assert train.loss_chunk_bytes(cfg, Runtime(), None) is None
    assert train.loss_chunk_bytes(cfg, gpu, None) == 10 * 2**30
    given = TrainConfig(loss_chunk_mb=64)
    assert train.loss_chunk_bytes(given, Runtime(), None) == train.loss_chunk_bytes(given, gpu, None) == 64 * 2**20
    h100, cpu = plan.find_target("H100", 0.0, 1), plan.Target("cpu", 2**34, 1e11, 0.5, "given", gpu=False)
    assert plan.planned_loss_chunk(cfg, h100) == h100.memory // 8
    assert plan.planned_loss_chunk(cfg, cpu) == 16 * 2**20
    assert plan.planned_loss_chunk(given, h100) == 64 * 2**20


def test_the_loss_chunk_is_sized_from_what_a_step_leaves_and_capped():
    """
    model.loss_chunk_budget: GPT-2 124M's logits stay one chunk on an 80 GB card (the -8% of docs/performance.md),
    at 12 and 24 x 1024 positions; an eager run's three copies of a chunk fit in what its step left; a step that
    lacked memory shrinks the chunk, never below LOSS_CHUNK_BYTES; plenty of memory never takes it past the cap.
    """
    card = 80 * 10**9  # an H100's 80 GB
    cap = card // 8
    for batch in (12, 24):
        logits = batch * 1024 * 50304 * 4
        assert loss_chunk_budget(cap, 60 * 2**30, card, copies=1) == cap >= logits
    # eager, 24 GB card, 6 GiB left by a step in 16 MiB chunks: a third of it more per chunk
    chunk = loss_chunk_budget(LOSS_CHUNK_BYTES, 6 * 2**30, 24 * 10**9, copies=3)
    assert chunk == LOSS_CHUNK_BYTES + 2 * 2**30 and 3 * (chunk - LOSS_CHUNK_BYTES) <= 6 * 2**30
    # compiled at the cap, 2 GiB short: 2 GiB less chunk
    assert loss_chunk_budget(cap, -2 * 2**30, card, copies=1) == cap - 2 * 2**30
    assert loss_chunk_budget(LOSS_CHUNK_BYTES, -(2**30), card, copies=3) == LOSS_CHUNK_BYTES
    assert loss_chunk_budget(LOSS_CHUNK_BYTES, 10**15, card, copies=3) == cap


def test_the_trial_step_sizes_the_chunk_from_its_peak_and_leaves_no_trace(monkeypatch):
    """
    model.sized_loss_chunk (a GPU's memory figures given here): an eager trial step in the smallest chunks, its peak and
    AdamW's two moments (not made yet) counted, a tenth of the card kept, three copies a chunk; the trial leaves no
    gradient and the random generator as it was.
    """
    gib = 2**30
    memory = {"mem_get_info": (20 * gib, 80 * gib), "memory_reserved": 10 * gib, "max_memory_allocated": 12 * gib}
    for name, value in memory.items():
        monkeypatch.setattr(torch.cuda, name, lambda device, value=value: value)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: None)
    model = build_model(ModelConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32, dropout=0.1))
    cfg = TrainConfig(batch_size=2, block_size=16, dropout=0.1)
    optimizers, _ = train.make_optimizers(model, cfg, Runtime())
    trials = []
    model.register_forward_hook(lambda module, args, output: trials.append(module.loss_chunk_bytes))
    rng = torch.get_rng_state()

    def trial():  # the trial step as train.py's setup hands it over
        trial_step(model, CausalLM({"vocab_size": 64}), cfg.batch_size, cfg.block_size, Runtime())

    chunk = sized_loss_chunk(model, trial, optimizers, compiled=False)
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert trials == [LOSS_CHUNK_BYTES]
    assert chunk == LOSS_CHUNK_BYTES + (20 * gib + 10 * gib - 12 * gib - 2 * weights - 8 * gib) // 3
    assert all(p.grad is None for p in model.parameters()) and torch.equal(torch.get_rng_state(), rng)


AGREED_CHUNK = """
import os, sys, torch.distributed as dist
import runtime
dist.init_process_group("gloo")
rank = dist.get_rank()
chunk = runtime.agreed_minimum([7 * 2**30, 5 * 2**30][rank], 2)  # what each rank's own memory would give
with open(os.path.join(sys.argv[1], f"chunk{rank}.txt"), "w") as f:
    f.write(str(chunk))
dist.barrier()  # as train.main ends: gloo's workers release the last collective's tensors before the teardown
dist.destroy_process_group()
os._exit(0)  # the result is written: no interpreter teardown for gloo's threads to abort
"""


def test_the_ranks_cut_the_loss_alike(tmp_path, env):
    """Each rank sizes the chunk from its own memory; all take the smallest, so that runs and resumes stay equal."""
    run = torchrun_script(AGREED_CHUNK, tmp_path, env, str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    assert [int((tmp_path / f"chunk{rank}.txt").read_text()) for rank in range(2)] == [5 * 2**30] * 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "cuda_graphs=True needs a CUDA GPU, not device cpu"),
        (["--compile=false"], "it needs compile (not --compile=false)"),
        (
            ["--gradient_accumulation_steps=4"],
            "cuda_graphs=True replays one micro-batch per rank a step, not 4 (gradient_accumulation_steps=4 on 1 "
            "rank(s)): for the same step use --batch_size=32 --gradient_accumulation_steps=1, or drop --cuda_graphs",
        ),
    ],
)
def test_cuda_graphs_are_refused_in_one_line_where_they_cannot_replay(tmp_path, data_root, capsys, args, message):
    argv = [f"--{k}={v}" for k, v in TINY.items() if k != "compile"]
    argv += ["--dataset=shakespeare_char", f"--data_dir={data_root}", f"--out_dir={tmp_path}", "--cuda_graphs=true"]
    assert cli(argv + args) == 2
    error = capsys.readouterr().err.strip()
    assert message in error and len(error.splitlines()) == 1, error
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("world_size", "settings", "message"),
    [
        (2, dict(gradient_accumulation_steps=4), "not 2 (gradient_accumulation_steps=4 on 2 rank(s))"),  # DDP no_sync
        (2, dict(gradient_accumulation_steps=2, fsdp=True), "does not replay FSDP's sharded steps"),
        (4, dict(gradient_accumulation_steps=2), None),  # fewer steps than ranks: one micro-batch each
        (2, dict(gradient_accumulation_steps=2), None),
        (1, dict(gradient_accumulation_steps=1, fsdp=True), None),  # one process trains whole: no FSDP
    ],
)
def test_cuda_graphs_take_one_micro_batch_per_rank_and_no_fsdp(monkeypatch, world_size, settings, message):
    """Refused before any process group or data (make_runtime is main's first call), on every rank alike."""
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setattr(runtime, "resolve_device", lambda device, local_rank: torch.device("cuda", local_rank))
    cfg = TrainConfig(cuda_graphs=True, compile=True, dtype="float32", **settings)
    if message is None:
        assert runtime.make_runtime(cfg).world_size == world_size
    else:
        with pytest.raises(ConfigError, match=re.escape(message)):
            runtime.make_runtime(cfg)


def test_cuda_graphs_are_refused_for_batches_of_varying_length(tmp_path, data_root, monkeypatch):
    """Pairs (and conversations) vary in length: refused once the data says so, before any model is parallelized."""
    monkeypatch.setattr(train, "make_runtime", lambda cfg: Runtime())  # past the check for a CUDA GPU
    monkeypatch.setattr(train, "parallelize", None)  # never reached
    settings = dict(arch="encoder_decoder", dataset="reverse", data_options=REVERSE, compile=None, cuda_graphs=True)
    cfg = tiny(data_root, tmp_path, **settings)
    with pytest.raises(ConfigError, match="cuda_graphs=True needs batches of one length, which reverse's vary"):
        main(cfg)


def test_out_of_memory_while_compiling_is_reported_as_such(tmp_path, data_root, monkeypatch, capsys):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(torch, "compile", lambda module, **kwargs: out_of_memory)
    argv = [f"--{k}={v}" for k, v in TINY.items()] + [
        "--dataset=shakespeare_char",
        f"--data_dir={data_root}",
        f"--out_dir={tmp_path}",
        "--compile=true",
    ]
    assert cli(argv) == 1
    captured = capsys.readouterr()
    assert "torch.compile failed" not in captured.out
    error = captured.err.strip()
    assert len(error.splitlines()) == 1 and "out of GPU memory" in error and "batch_size=8" in error


def test_seq2seq_lengths_compile_once(tmp_path, data_root, monkeypatch):
    """Batches of many lengths: one training graph and one evaluation graph, not one per length."""
    real_compile, graphs, dynamic = torch.compile, [], []

    def compile(module, **kwargs):
        dynamic.append(kwargs["dynamic"])
        return real_compile(module, backend=counting_backend(graphs), **kwargs)

    monkeypatch.setattr(torch, "compile", compile)
    # with label smoothing, which the trial compilation must use too, or training compiles a graph of its own
    main(
        tiny(
            data_root,
            tmp_path,
            arch="encoder_decoder",
            dataset="reverse",
            data_options=REVERSE,
            compile=True,
            max_iters=6,
            eval_interval=3,
            eval_iters=3,
            eval_accuracy_examples=0,
            label_smoothing=0.1,
        )
    )
    assert len(graphs) == 2 and dynamic == [None]  # lengths vary: one dynamic graph


def test_windows_compile_static_graphs_and_the_average_is_compiled_too(tmp_path, data_root, monkeypatch):
    """LM windows have one shape: graphs specialised to it (dynamic=False); the evaluated average is compiled."""
    real_compile, compiled = torch.compile, []

    def compile(module, **kwargs):
        compiled.append((type(module).__name__, kwargs["dynamic"]))
        return real_compile(module, backend="eager", **kwargs)

    monkeypatch.setattr(torch, "compile", compile)
    main(tiny(data_root, tmp_path, compile=True, max_iters=2, eval_interval=2, ema_decay=0.9))
    assert compiled == [("GPT", False), ("GPT", False)]  # the trained model, then its average


def test_a_cuda_rank_makes_its_gpu_current_before_anything_else(tmp_path, data_root, monkeypatch):
    """Even alone (--device=cuda:3): else CUDA's first use would open a context on GPU 0."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(torch, "set_float32_matmul_precision", lambda p: calls.append(("matmul precision", p)))
    rt = Runtime(device=torch.device("cuda", 3))
    with contextlib.ExitStack() as stack:
        train.join_processes(tiny(data_root, tmp_path), rt, stack)
    assert calls == [("set_device", torch.device("cuda", 3)), ("matmul precision", "high")]


def second_backward_fails(model):
    """(model compiled so that its second backward graph, a recompilation's, fails to compile; the graphs made)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.exc import InductorError

    backward_graphs = []

    def backward_compiler(gm, example_inputs):
        backward_graphs.append(gm)
        if len(backward_graphs) > 1:  # as Inductor reports any failure to compile a graph
            raise InductorError(RuntimeError("this backward compiler fails on purpose"), None)
        return make_boxed_func(gm)

    backend = aot_autograd(fw_compiler=lambda gm, inputs: make_boxed_func(gm), bw_compiler=backward_compiler)
    compiled = compiling.CompiledModel.__new__(compiling.CompiledModel)
    torch.nn.Module.__init__(compiled)
    compiled.module, compiled.failed = model, False
    compiled.compiled = torch.compile(model, backend=backend, dynamic=False)  # a new length recompiles
    return compiled, backward_graphs


def test_a_failed_backward_recompilation_is_one_line():
    """
    A backward is compiled at its first use, inside loss.backward(): a failure there ends the run with one line (a
    redo on one rank alone would pair its collectives with the other ranks' next step), and no rank falls back.
    Two ranks under DDP: test_a_failed_backward_recompilation_under_ddp_is_one_line_on_each_rank.
    """
    model = build_model(ModelConfig(vocab_size=20, block_size=8, n_layer=1, n_head=2, n_embd=16))
    compiled, backward_graphs = second_backward_fails(model)
    models, rt = Models(raw=model, step=compiled), Runtime()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for length in (8, 6):  # the second length's backward cannot be compiled
        x, y = torch.randint(0, 20, (2, length)), torch.randint(0, 20, (2, length))
        batches, expected = [((x,), y)], contextlib.nullcontext()
        if length == 6:
            expected = pytest.raises(ConfigError, match=r"the compiled backward failed \(RuntimeError: this backward")
        with expected:
            accumulate_gradients(models, CausalLM({}), batches, 2 * length, scaler, rt)
    assert not compiled.failed and len(backward_graphs) == 2


class FailingBackward(torch.autograd.Function):
    """The identity, whose backward fails as a device-side assert does: an error of the step, not of a compiler."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("CUDA error: device-side assert triggered")


def test_a_backward_error_that_is_no_compile_failure_keeps_its_message():
    """Only a failed compilation becomes backward's one line: any other error is raised as it is, cause and all."""
    model = build_model(ModelConfig(vocab_size=20, block_size=8, n_layer=1, n_head=2, n_embd=16))
    compiled = compiling.CompiledModel.__new__(compiling.CompiledModel)
    torch.nn.Module.__init__(compiled)
    compiled.module, compiled.failed = model, False

    def failing(*args, **kwargs):  # the model, its loss passed through FailingBackward
        return None, FailingBackward.apply(model(*args, **kwargs)[1])

    compiled.compiled = failing
    x, y = torch.randint(0, 20, (2, 8)), torch.randint(0, 20, (2, 8))
    models, scaler = Models(raw=model, step=compiled), torch.amp.GradScaler("cpu", enabled=False)
    with pytest.raises(RuntimeError, match="^CUDA error: device-side assert triggered$") as raised:
        accumulate_gradients(models, CausalLM({}), [((x,), y)], 16, scaler, Runtime())
    assert raised.type is RuntimeError and not compiled.failed


DDP_BACKWARD_FAILS = """
import os, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
out, tests = sys.argv[1:3]
sys.path.insert(0, tests)
from test_train import second_backward_fails
import runtime
from config import ConfigError
from tasks.lm import CausalLM
from model import ModelConfig, build_model
from train import accumulate_gradients
dist.init_process_group("gloo")
rt = runtime.Runtime(rank=dist.get_rank(), world_size=2)
torch.manual_seed(0)  # the same weights on both ranks
model = build_model(ModelConfig(vocab_size=20, block_size=8, n_layer=1, n_head=2, n_embd=16))
reference = build_model(model.config)
reference.load_state_dict(model.state_dict())
ddp = DDP(model)
compiled, backward_graphs = second_backward_fails(ddp)  # DDP compiled, as runtime.parallelize does
models, task = runtime.Models(raw=model, step=compiled, ddp=ddp), CausalLM({})
scaler = torch.amp.GradScaler("cpu", enabled=False)
def batches(length):  # each rank's own batch, and both ranks' for the reference
    ids = [torch.randint(0, 20, (2, length + 1), generator=torch.Generator().manual_seed(r)) for r in range(2)]
    return [((ids[rt.rank][:, :-1],), ids[rt.rank][:, 1:])], torch.cat(ids)
# step 1: the real all-reduce of DDP's backward hooks; each rank's gradient is the mean over both ranks' targets
mine, both = batches(8)
accumulate_gradients(models, task, mine, 2 * 2 * 8, scaler, rt)
reference(both[:, :-1], both[:, 1:])[1].backward()
exchanged = all(torch.allclose(p.grad, r.grad, atol=1e-6) for p, r in zip(model.parameters(), reference.parameters()))
# step 2: another length recompiles, and its backward fails to compile on both ranks
try:
    accumulate_gradients(models, task, batches(6)[0], 2 * 2 * 6, scaler, rt)
    error = "no error"
except ConfigError as e:
    error = str(e)
with open(os.path.join(out, f"rank{rt.rank}.txt"), "w") as f:
    f.write(f"{exchanged} {compiled.failed} {len(backward_graphs)}\\n{error}")
dist.barrier()
os._exit(0)  # the results are written; gloo's teardown after a failed backward is not what is tested
"""


def test_a_failed_backward_recompilation_under_ddp_is_one_line_on_each_rank(tmp_path):
    """
    On two ranks, after a step whose DDP all-reduce ran (each rank's gradient is that of both ranks' batches), a
    backward that fails to compile is the one-line error on every rank: none falls back, none waits for the other.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = torchrun_script(DDP_BACKWARD_FAILS, tmp_path, env, str(tmp_path), str(REPO / "tests"))
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in range(2):
        counts, error = (tmp_path / f"rank{rank}.txt").read_text().split("\n", 1)
        assert counts == "True False 2"  # gradients exchanged, no fallback, the second backward graph was tried
        assert error.startswith("the compiled backward failed (RuntimeError: this backward") and "\n" not in error


DDP_GRAPHS = """
import os, sys, torch
import compiling, train
out = sys.argv.pop(1)  # the folder for each rank's count: a file, not stdout, which torchrun's pipes lost once in CI
graphs, counts = [], []
real_compile, real_compile_model = torch.compile, compiling.compile_model
def backend(gm, example_inputs):
    graphs.append(gm)
    return gm.forward
def compile_model(*args, **kwargs):
    compiled = real_compile_model(*args, **kwargs)
    counts.append(len(graphs))  # the graphs of the first forward and backward, inside DDP
    return compiled
torch.compile = lambda module, **kwargs: real_compile(module, backend=backend, **kwargs)
compiling.compile_model = compile_model
code = train.cli(sys.argv[1:])
with open(os.path.join(out, f"graphs{os.environ['RANK']}.txt"), "w") as f:
    f.write(str(counts[0]))
sys.exit(code)
"""


SLOW_PREPARE = """
import sys, time
import recipes, train
real_prepare = recipes.prepare
def prepare(*args, **kwargs):
    time.sleep(6)  # twice --dist_timeout, as preparing OpenWebText is to the default 900 s
    return real_prepare(*args, **kwargs)
recipes.prepare = prepare
sys.exit(train.cli(sys.argv[1:]))
"""


def test_a_dataset_prepared_inside_torchrun_outlasts_dist_timeout(tmp_path, env):
    """Rank 1 waits while rank 0 prepares for longer than dist_timeout: the run goes on, it does not time out."""
    args = [f"--{k}={v}" for k, v in TINY.items()] + [
        "--dataset=shakespeare_char",
        f"--data_dir={tmp_path / 'data'}",  # not prepared yet
        "--dist_timeout=3",
        "--max_iters=1",
        f"--out_dir={tmp_path / 'out'}",
    ]
    run = torchrun_script(SLOW_PREPARE, tmp_path, env, *args)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "preparing it" in run.stdout and "done at iteration 1" in run.stdout


RANK_1_CANNOT_COMPILE = """
import os, sys, torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
import train
where = sys.argv.pop(1)  # "forward" or "backward": the graphs rank 1 cannot compile
def fails(gm, example_inputs):
    raise RuntimeError("this compiler fails on rank 1 on purpose")
def works(gm, example_inputs):
    return make_boxed_func(gm)
broken = os.environ["RANK"] == "1"
backend = aot_autograd(
    fw_compiler=fails if broken and where == "forward" else works,
    bw_compiler=fails if broken and where == "backward" else works,
)
real_compile = torch.compile
torch.compile = lambda module, **kwargs: real_compile(module, backend=backend)
sys.exit(train.cli(sys.argv[1:]))
"""


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_compile_failure_on_one_rank_is_every_ranks(tmp_path, env, where):
    """
    DDP on 2 ranks, torch.compile failing on rank 1 only, in the forward or in the backward graph: both ranks go on
    eagerly (one rank compiled and one not would run different graphs, and a failed backward must not leave the
    other rank waiting in an all-reduce).
    """
    args = [f"--{k}={v}" for k, v in TINY.items()] + [
        "--dataset=shakespeare_char",
        "--compile=true",
        "--max_iters=2",
        "--dist_timeout=60",
        f"--out_dir={tmp_path / 'out'}",
    ]
    run = torchrun_script(RANK_1_CANNOT_COMPILE, tmp_path, env, where, *args)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "torch.compile failed (RuntimeError: it failed on another rank); going on without it" in run.stdout
    assert "done at iteration 2" in run.stdout


FSDP_HELD_GRADIENTS = """
import os, sys, torch, torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
import runtime, train
from model import ModelConfig, build_model
dist.init_process_group("gloo")
rt = runtime.Runtime(rank=dist.get_rank(), world_size=2, fsdp=True)
with torch.device("meta"):
    model = build_model(ModelConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
runtime.shard_model(model, rt, seed=0)
models = runtime.Models(raw=model, step=model)
x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rt.rank))
with runtime.gradient_sync(models, enabled=False):  # a micro-batch before the step's last
    model(x, x)[1].backward()
held = 0  # bytes of whole (unsharded) gradients FSDP keeps on this rank until the step's last micro-batch
for module in model.modules():
    group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
    for param in group.fsdp_params if group else []:
        for grad in (getattr(param, "_unsharded_param", None), param.unsharded_accumulated_grad):
            grad = grad.grad if isinstance(grad, torch.nn.Parameter) else grad
            held += 0 if grad is None else grad.numel() * grad.element_size()
whole = sum(p.numel() for p in model.parameters()) * 4
with open(f"{sys.argv[1]}/rank{rt.rank}.txt", "w") as f:
    f.write(f"{held} {whole}")
dist.barrier()  # as train.main ends: gloo's workers release the last collective's tensors before the teardown
dist.destroy_process_group()
# the results are written: leave without the interpreter's teardown, in which gloo's threads aborted one CI run in
# three here ("terminate called without an active exception")
os._exit(0)
"""


def test_fsdp_accumulation_holds_only_gradient_shards(tmp_path, env):
    """After a micro-batch that is not the step's last: no whole gradient (whole: their bytes, were they held)."""
    run = torchrun_script(FSDP_HELD_GRADIENTS, tmp_path, env, str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in range(2):
        held, whole = map(int, (tmp_path / f"rank{rank}.txt").read_text().split())
        assert held == 0 < whole


def test_ddp_compiles_one_graph_per_gradient_bucket(tmp_path, data_root, env):
    """DDP's graph split (its all-reduce overlapping the backward) needs DDP compiled, not wrapping a compiled model."""
    # 6 x 384-wide layers: 42 MB of fp32 weights, two or more of DDP's 25 MB buckets
    args = [f"--{k}={v}" for k, v in TINY.items()] + [
        "--dataset=shakespeare_char",
        "--n_layer=6",
        "--n_embd=384",
        "--batch_size=2",
        "--block_size=16",
        "--max_iters=1",
        "--eval_iters=2",
        "--compile=true",
        "--gradient_accumulation_steps=2",
        f"--out_dir={tmp_path / 'out'}",
    ]
    run = torchrun_script(DDP_GRAPHS, tmp_path, env, str(tmp_path), *args)
    assert run.returncode == 0, run.stderr[-3000:]
    assert all(int((tmp_path / f"graphs{rank}.txt").read_text()) > 1 for rank in range(2))


# -----------------------------------------------------------------------------
# Devices and ranks


def test_auto_dtype_takes_float16_where_bfloat16_is_only_emulated(monkeypatch):
    """A V100 or T4: is_bf16_supported() says True by emulation unless asked not to count it."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert runtime.resolve_dtype("auto", cuda) == torch.float16
    with pytest.raises(ConfigError, match="no native bfloat16"):
        runtime.resolve_dtype("bfloat16", cuda)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)  # an A100 or newer
    assert runtime.resolve_dtype("auto", cuda) == torch.bfloat16


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_rank_failing_to_prepare_the_data_stops_every_rank_at_once(tmp_path, env):
    """Ranks started by hand, as on two nodes: rank 0 cannot prepare the data, rank 1 must not wait for it."""
    args = [f"--{k}={v}" for k, v in TINY.items()] + [
        "--dataset=text",
        "--data_options={'input': '/no/such/corpus.txt', 'name': 'corpus'}",
        f"--data_dir={tmp_path / 'data'}",
        f"--out_dir={tmp_path / 'out'}",
        "--dist_timeout=600",
        "--gradient_accumulation_steps=2",
    ]
    port = str(free_port())
    ranks = [
        subprocess.Popen(
            [sys.executable, str(REPO / "train.py"), *args],
            stderr=subprocess.PIPE,
            text=True,
            env={
                **env,
                "RANK": str(r),
                "LOCAL_RANK": "0",
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            },
        )
        for r in range(2)
    ]
    try:
        errors = [rank.communicate(timeout=60)[1].strip() for rank in ranks]  # not dist_timeout
    finally:
        for rank in ranks:
            rank.kill()
    # both stop with the error and say so (started by hand, as on two nodes, each on its own console; rank 1 after
    # its grace, which under torchrun would have ended it once rank 0 had)
    assert [rank.returncode for rank in ranks] == [2, 2]
    assert len(errors[0].splitlines()) == 1 and "/no/such/corpus.txt" in errors[0] and errors[1] == errors[0]


def test_fewer_accumulation_steps_than_ranks_give_each_rank_one_micro_batch(tmp_path, data_root, env):
    """The quick-start config's 1 step on 2 ranks works: the same losses as one process accumulating 2."""
    assert split_accumulation(1, 2) == 1 and split_accumulation(3, 8) == 1
    settings = dict(max_iters=3, log_interval=1, warmup_iters=1)
    single = main(tiny(data_root, tmp_path / "single", gradient_accumulation_steps=2, **settings))
    args = [f"--{k}={v}" for k, v in {**TINY, **settings}.items()] + [
        "--dataset=shakespeare_char",
        "--tensorboard=true",
        f"--out_dir={tmp_path / 'ddp'}",
    ]
    assert "--gradient_accumulation_steps=1" in args
    run = torchrun(args, env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "16 sequences per step (8 x 1 micro-batches x 2 rank(s))" in run.stdout
    assert "each rank runs one micro-batch" in run.stdout
    ddp_losses = tensorboard_scalars(tmp_path / "ddp", "train/loss")
    assert [ddp_losses[i] for i in (1, 2, 3)] == pytest.approx([single["losses"][i] for i in (1, 2, 3)], rel=1e-5)


# -----------------------------------------------------------------------------
# Bad input, bad files, failed saves


def cli_argv(data_root, out_dir, **settings):
    return ["--dataset=shakespeare_char", f"--data_dir={data_root}", f"--out_dir={out_dir}"] + [
        f"--{k}={v}" for k, v in {**TINY, **settings}.items()
    ]


def test_an_out_dir_that_cannot_be_written_is_one_line_before_any_work(tmp_path, data_root, capsys):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a folder")
    for out_dir in (a_file, a_file / "run"):
        assert cli(cli_argv(data_root, out_dir)) == 2
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and "is a file" in error and "--out_dir" in error
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_a_full_disk_is_an_oserror_where_torch_save_reports_a_runtimeerror(tmp_path, monkeypatch):
    """
    On a real full disk torch.save raises RuntimeError('... unexpected pos ...') (its writer swallows the OSError):
    save_checkpoint must still give its one line with the OS's message, and leave no temporary file.
    """
    import checkpoint

    class FullDisk(io.BytesIO):
        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    def like_torch(obj, f):  # what torch.save does on a real file whose write fails
        try:
            f.write(b"PK")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None

    monkeypatch.setattr(checkpoint, "open", lambda path, mode: FullDisk(), raising=False)
    monkeypatch.setattr(torch, "save", like_torch)
    with pytest.raises(OSError, match=r"^could not write .*ckpt.pt \(No space left on device\); the previous"):
        save_checkpoint({"format_version": checkpoint.PLAIN_FORMAT}, tmp_path / "ckpt.pt")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_save_mid_run_names_the_file_and_keeps_the_last_checkpoint(tmp_path, data_root, monkeypatch, capsys):
    real_save, saves = torch.save, []

    def disk_fills_up(obj, f):
        saves.append(1)
        if len(saves) > 2:  # best.pt and ckpt.pt at iteration 2 are written, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(obj, f)

    monkeypatch.setattr(torch, "save", disk_fills_up)
    assert cli(cli_argv(data_root, tmp_path, max_iters=4, eval_interval=2)) == 1
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "No space left on device" in error and "best.pt" in error
    assert "Traceback" not in error and "--init_from=resume" in error
    monkeypatch.undo()
    assert load_checkpoint(tmp_path / "ckpt.pt")["iter_num"] == 2
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix in (".pt", ".tmp")) == ["best.pt", "ckpt.pt"]


def test_corrupt_checkpoints_are_short_plain_messages(tmp_path):
    good = tmp_path / "best.pt"
    save_checkpoint({"format_version": checkpoint.PLAIN_FORMAT, "x": torch.ones(10000)}, good)
    ckpt = tmp_path / "ckpt.pt"
    for contents, expected in [
        (good.read_bytes()[:5000], "truncated or corrupted"),
        (os.urandom(5000), "truncated or corrupted"),
        (b"", "is empty"),
    ]:
        ckpt.write_bytes(contents)
        with pytest.raises(ConfigError) as error:
            load_checkpoint(ckpt)
        message = str(error.value)
        assert expected in message and "best.pt beside it still holds the best weights" in message
        assert len(message) < 150 + len(str(ckpt)) and "weights_only" not in message and "\n" not in message


def test_resuming_a_finished_run_says_there_is_nothing_to_do(tmp_path, data_root, capsys):
    main(tiny(data_root, tmp_path, max_iters=3))
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert cli(cli_argv(data_root, tmp_path, max_iters=3, init_from="resume")) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "nothing to train" in error and "--max_iters" in error
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == files


def test_a_checkpoint_from_before_a_setting_existed_resumes_with_its_default(tmp_path, data_root, capsys):
    """A model setting added later (n_kv_head, qk_norm, ...) is missing from older checkpoints: its default applies."""
    main(tiny(data_root, tmp_path, max_iters=2))
    path = tmp_path / "ckpt.pt"
    ckpt = torch.load(path, weights_only=True)
    for key in ("n_kv_head", "qk_norm", "logit_softcap", "zero_init_proj", "window_size"):
        del ckpt["model_config"][key]
    save_checkpoint(ckpt, path)
    capsys.readouterr()
    resumed = main(tiny(data_root, tmp_path, max_iters=3, init_from="resume"))
    assert sorted(resumed["losses"]) == [3] and "note: resuming" not in capsys.readouterr().out
    assert load_checkpoint(path)["model_config"]["n_kv_head"] == TINY["n_head"]


def test_the_resume_note_lists_only_settings_given_that_differ(tmp_path, data_root, capsys):
    main(tiny(data_root, tmp_path, max_iters=2))
    capsys.readouterr()
    main(tiny(data_root, tmp_path, max_iters=3, init_from="resume", n_layer=3))  # d_ff, n_encoder_layer left None
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: resuming")]
    assert notes == ["note: resuming with the checkpoint's model settings: n_layer=2"]
    main(tiny(data_root, tmp_path, max_iters=4, init_from="resume"))
    assert "note: resuming" not in capsys.readouterr().out


def test_a_new_run_from_other_weights_notes_the_settings_given_that_they_decide(tmp_path, data_root, capsys):
    """A checkpoint file and a Hugging Face folder (an export of it) each decide the model: given settings are said."""
    import export

    main(tiny(data_root, tmp_path / "a", max_iters=2))
    assert export.cli([f"--out_dir={tmp_path / 'a'}", "--checkpoint=ckpt.pt", f"--dest={tmp_path / 'hf'}"]) == 0
    for source in (tmp_path / "a" / "ckpt.pt", tmp_path / "hf"):
        capsys.readouterr()
        out = tmp_path / f"from-{source.name}"
        main(tiny(data_root, out, max_iters=1, init_from=str(source), n_layer=3, qk_norm=True))
        notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: init_from")]
        assert notes == [f"note: init_from={source} decides the model settings: n_layer=2, qk_norm=False"]
        assert load_checkpoint(out / "ckpt.pt")["model_config"]["n_layer"] == 2


def test_a_split_shorter_than_block_size_says_by_how_much(tmp_path, data_root):
    with pytest.raises(
        ConfigError,
        match=r"val split has [\d,]+ tokens, too few for block_size=200000: use "
        r"block_size <= [\d,]+",
    ):
        main(tiny(data_root, tmp_path, block_size=200_000))


def test_a_damaged_folder_of_ones_own_names_the_real_cause(tmp_path, shakespeare_char_dir, capsys):
    own = tmp_path / "my_corpus"
    shutil.copytree(shakespeare_char_dir, own)
    with open(own / "train.bin", "r+b") as f:
        f.truncate(50_001)  # half a token short of its header's count
    assert cli(cli_argv(tmp_path, tmp_path / "out", dataset="my_corpus")) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "train.bin is truncated" in error and "nor a folder" not in error


# -----------------------------------------------------------------------------
# Hugging Face folders with their tokenizer.json (Llama and Mistral)


def test_init_from_llama_folder_fine_tunes_on_data_of_its_tokenizer(tmp_path, data_root, llama_dir):
    tokenizer_json = (llama_dir / "tokenizer.json").read_text(encoding="utf-8")
    # dataset='shakespeare' prepared with the folder's tokenizer, as data_options asks: its own folder and ids
    cfg = tiny(
        data_root,
        tmp_path,
        dataset="shakespeare",
        data_options={"tokenizer": str(llama_dir)},
        init_from=str(llama_dir),
        max_iters=3,
    )
    result = main(cfg)
    assert sorted(result["losses"]) == [1, 2, 3] and all(math.isfinite(v) for v in result["losses"].values())
    ckpt = load_checkpoint(tmp_path / "ckpt.pt")
    # the model's settings come from its config.json (grouped-query attention, SwiGLU, RMSNorm, rotary), not TINY's
    settings = {k: ckpt["model_config"][k] for k in ("n_head", "n_kv_head", "activation", "norm", "pos_encoding")}
    assert settings == {"n_head": 4, "n_kv_head": 2, "activation": "swiglu", "norm": "rmsnorm", "pos_encoding": "rope"}
    # the checkpoint carries the tokenizer itself, so sample.py reads it on a machine without the folder
    assert ckpt["meta"]["tokenizer"] == {"type": "huggingface", "json": tokenizer_json}
    assert ckpt["meta"]["name"] == f"shakespeare_{llama_dir.name}" and ckpt["model_config"]["vocab_size"] == 300


def test_init_from_llama_folder_refuses_data_of_another_tokenizer(tmp_path, data_root, llama_dir, capsys):
    common = [f"--data_dir={data_root}", f"--out_dir={tmp_path / 'out'}", "--device=cpu", "--block_size=32"]
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(llama_dir / name, bare / name)
    assert cli(["--dataset=shakespeare", f"--init_from={llama_dir}", *common]) == 2  # GPT-2 BPE data
    assert cli(["--dataset=shakespeare_char", f"--init_from={llama_dir}", *common]) == 2
    assert cli(["--dataset=shakespeare_char", f"--init_from={bare}", *common]) == 2  # no tokenizer.json
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 3 and all(f"--tokenizer={llama_dir}" in e for e in errors[:2])
    assert "shakespeare was not" in errors[0] and f"{bare} has no tokenizer.json" in errors[2]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("arch", ["gpt", "encoder_decoder"])
def test_activation_checkpointing_trains_the_same_steps(tmp_path, data_root, arch, monkeypatch):
    """
    Recomputing the blocks in backward changes no loss and no weight (bitwise, on a CPU), and it does happen:
    every training step runs each block's forward twice.
    """
    extra = {"dropout": 0.1, "max_iters": 4, "log_interval": 1, "eval_interval": 4, "eval_iters": 2}
    if arch == "encoder_decoder":
        extra.update(arch=arch, dataset="reverse", data_options=REVERSE, eval_accuracy_examples=0)
    calls = []
    block_forward = Block.forward

    def counted(self, *args, **kwargs):
        calls[-1] += torch.is_grad_enabled()  # training forwards and their recomputation, not evaluation
        return block_forward(self, *args, **kwargs)

    monkeypatch.setattr(Block, "forward", counted)
    runs = []
    for on in (False, True):
        calls.append(0)
        runs.append(main(tiny(data_root, tmp_path / str(on), activation_checkpointing=on, **extra)))
    assert calls[1] == 2 * calls[0] > 0
    assert runs[0]["losses"] == runs[1]["losses"] and len(runs[0]["losses"]) == 4
    plain, recomputed = (ckpt_weights(tmp_path / str(on) / "ckpt.pt") for on in (False, True))
    assert all(torch.equal(plain[k], recomputed[k]) for k in plain)


def test_a_resume_checks_its_settings_merged_with_the_runs(data_root, tmp_path, capsys):
    """Options given to a resume are checked against the run's own settings, not the defaults (n_head=12)."""
    out = tmp_path / "run"
    main(tiny(data_root, out, max_iters=2))  # n_head=2, n_embd=32
    resume = ["--init_from=resume", f"--out_dir={out}", "--max_iters=3"]
    # 40 heads' worth is no multiple of the default n_head=12, but is of the run's 2: no error, the checkpoint's wins
    assert train.cli([*resume, "--n_embd=40"]) == 0
    assert "resuming with the checkpoint's model settings: n_embd=32" in capsys.readouterr().out
    # a value wrong for the run itself is named with the run's own settings
    assert train.cli([*resume, "--max_iters=4", "--n_kv_head=3"]) == 2
    assert "n_kv_head=3 must divide n_head=2 into equal groups" in capsys.readouterr().err
