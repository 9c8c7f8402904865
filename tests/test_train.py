"""train.py's loop: config files and the command line, schedules, batches and losses against hand-made
references, short runs per architecture, non-finite steps, optimizer steps, bf16, shipped configs, Hugging
Face folders. Resume and checkpoints: test_resume.py; DDP and FSDP: test_distributed.py; torch.compile:
test_compile.py."""

import copy
import dataclasses
import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny_run import CONFIGS, REPO, REVERSE, SHRINK, TINY, ckpt_weights, cli_argv, tiny

import data
import log
import runtime
import start
import synthetic
import tokens
import train
from checkpoint import load_checkpoint
from config import ConfigError, parse_config
from generate import translate
from model import IGNORE_INDEX, MODEL_KEYS, Block, ModelConfig, build_model
from optim import configure_optimizers
from runtime import Models, Runtime, split_accumulation
from start import model_from_checkpoint
from tasks import make_task
from tasks.base import windows
from tasks.lm import CausalLM
from tasks.masked_lm import MaskedLM, mask_tokens
from tasks.seq2seq import Seq2Seq, seq2seq_batch
from train import Schedule, TrainConfig, accumulate_gradients, cli, main, make_schedule, update_weights

# the sort dataset as the tests train on it, always prepared with the same options (so built once)
SORT = {"num_train": 4000, "num_val": 200, "num_test": 100, "max_len": 4}


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


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


def test_init_from_pretrained_errors_are_one_line(tmp_path, data_root, capsys):
    common = [f"--data_dir={data_root}", f"--out_dir={tmp_path / 'out'}", "--device=cpu"]
    assert cli(["--dataset=shakespeare", f"--init_from={tmp_path / 'no-such-gpt2'}", *common]) == 2
    assert cli(["--dataset=shakespeare_char", "--init_from=gpt2", *common]) == 2  # char data, GPT-2's BPE model
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 2 and "no-such-gpt2" in errors[0] and "GPT-2 BPE dataset" in errors[1]
    assert not (tmp_path / "out").exists()


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


def test_a_step_predicted_to_take_minutes_is_said_before_it_starts(tmp_path, data_root, monkeypatch, capsys):
    # a CPU of 1,000 FLOP/s, and the ceiling under which steps are not timed lowered to it
    monkeypatch.setattr(runtime, "cpu_matmul_flops", lambda threads: 1e3)
    monkeypatch.setattr(runtime, "CPU_FLOPS_CEILING", 1e3)
    main(tiny(data_root, tmp_path, max_iters=1))
    lines = capsys.readouterr().out.splitlines()
    note = next(i for i, line in enumerate(lines) if "on this cpu at the rate --plan uses" in line)
    assert "block_size=32" in lines[note] and "a second Ctrl-C stops a step at once" in lines[note]
    assert note < next(i for i, line in enumerate(lines) if line.startswith("eval 0"))
    monkeypatch.undo()  # at this machine's real rate a tiny step takes milliseconds: no note
    main(tiny(data_root, tmp_path / "fast", max_iters=1))
    assert "at the rate --plan uses" not in capsys.readouterr().out


def test_a_block_size_that_dwarfs_the_longest_pair_is_said_before_the_run(tmp_path, data_root, capsys):
    # the longest training pair's positions, by a loop: a source, or a target with bos
    pairs = tokens.load_pairs(data.prepared_dataset("reverse", data_root, REVERSE), "train")
    longest = max(max(len(pairs[i][0]), len(pairs[i][1]) + 1) for i in range(len(pairs)))
    reverse = dict(arch="encoder_decoder", dataset="reverse", data_options=REVERSE, eval_accuracy_examples=0)
    main(tiny(data_root, tmp_path / "wide", block_size=4 * longest, max_iters=1, **reverse))
    out = capsys.readouterr().out
    note = f"block_size={4 * longest} is 4x the longest training pair ({longest} positions)"
    assert note in out and f"--block_size={longest} fits every one" in out
    assert out.index(note) < out.index("eval 0")
    main(tiny(data_root, tmp_path / "fitting", block_size=4 * longest - 1, max_iters=1, **reverse))
    assert "the longest training pair" not in capsys.readouterr().out


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


def test_auto_dtype_takes_float16_where_bfloat16_is_only_emulated(monkeypatch):
    """A V100 or T4: is_bf16_supported() says True by emulation unless asked not to count it."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert runtime.resolve_dtype("auto", cuda) == torch.float16
    with pytest.raises(ConfigError, match="no native bfloat16"):
        runtime.resolve_dtype("bfloat16", cuda)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)  # an A100 or newer
    assert runtime.resolve_dtype("auto", cuda) == torch.bfloat16


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


def test_the_closing_memory_line_counts_weights_gradients_and_adam_state(tmp_path, data_root, capsys):
    """fp32 AdamW: 4 bytes a parameter each for the weights and gradients, 8 for the moments."""
    main(tiny(data_root, tmp_path, n_embd=128, n_head=4, max_iters=1))
    n_params = sum(v.numel() for k, v in ckpt_weights(tmp_path / "ckpt.pt").items() if k != "lm_head.weight")
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("memory rank 0: "))
    weights = float(re.search(r"weights ([\d.]+) MiB", line)[1])
    assert weights == pytest.approx(4 * n_params / 2**20, abs=0.05)
    m = re.search(r"gradients ([\d.]+) MiB, optimizer state ([\d.]+) MiB, peak ([\d.]+) MiB", line)
    state, peak = weights + float(m[1]) + float(m[2]), float(m[3])
    assert state == pytest.approx(16 * n_params / 2**20, abs=0.2) and peak > state


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
