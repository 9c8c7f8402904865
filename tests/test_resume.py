"""train.py's resume and checkpoints: exact resume, old formats, best.pt, the weight average, loading and
saving safely, failed saves, SIGTERM, damaged checkpoints, resume notes, out_dir problems."""

import dataclasses
import errno
import io
import math
import os
import pickle
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_run import REPO, REVERSE, SHRINK, TINY, ckpt_weights, cli_argv, free_port, tiny

import checkpoint
import tokens
import train
from checkpoint import load_checkpoint, move_into_place, save_checkpoint
from config import ConfigError
from model import ModelConfig, build_model
from runtime import Runtime
from start import model_from_checkpoint, start_run
from tasks.lm import CausalLM
from train import cli, main, update_ema

# -----------------------------------------------------------------------------
# Exact resume and checkpoint formats


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


def test_resuming_with_another_optimizer_is_a_one_line_error(tmp_path, data_root):
    main(tiny(data_root, tmp_path, max_iters=1, optimizer="muon"))
    assert "muon" in load_checkpoint(tmp_path / "ckpt.pt")["optimizers"]
    with pytest.raises(ConfigError, match="optimizer='muon': resume it with --optimizer=muon"):
        main(tiny(data_root, tmp_path, max_iters=2, init_from="resume"))


# -----------------------------------------------------------------------------
# best.pt and the weight average


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


# -----------------------------------------------------------------------------
# Loading and saving: bad files, failed saves


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


def test_eval_only_reports_the_checkpoint_and_writes_nothing(tmp_path, data_root):
    """The same weights and the same (fixed) eval batches: the val loss logged at the end of training again."""
    trained = main(tiny(data_root, tmp_path, max_iters=4, tensorboard=True))
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    evaluated = main(tiny(data_root, tmp_path, init_from="resume", eval_only=True, tensorboard=True))
    assert evaluated["losses"] == {} and len(evaluated["evals"]) == 1
    assert evaluated["evals"][0]["val"] == pytest.approx(trained["evals"][-1]["val"], rel=1e-6)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == files


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


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save's, in this one process
class WritesAFile:
    """Unpickled, it writes `path`: what a downloaded folder's .metadata could do with plain pickle."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return Path.write_text, (self.path, "ran")


def test_a_sharded_checkpoint_whose_index_would_run_code_is_refused_by_every_script(tmp_path, env, capsys):
    """
    torch.distributed.checkpoint unpickles a folder's .metadata with plain pickle: one whose pickle writes a file is
    refused in one line by sample.py, eval.py, export.py, serve.py and train.py --init_from, and nothing is written.
    """
    import torch.distributed.checkpoint as dcp

    import eval as evaluation
    import export
    import sample

    model = build_model(ModelConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8))
    folder = tmp_path / "ckpt.pt"
    dcp.save({"weights": model.state_dict()}, checkpoint_id=folder, no_dist=True)
    state = {"format_version": checkpoint.PLAIN_FORMAT, "model_config": dataclasses.asdict(model.config)}
    save_checkpoint({**state, "iter_num": 3, "meta": None, "sharded_keys": ["weights"]}, folder / "state.pt")
    marker, index = tmp_path / "ran.txt", (folder / ".metadata").read_bytes()
    (folder / ".metadata").write_bytes(pickle.dumps(WritesAFile(marker)))
    pickle.loads((folder / ".metadata").read_bytes())  # the payload is live: plain pickle runs it
    assert marker.read_text() == "ran"
    marker.unlink()
    refused = f"{folder} is not a readable sharded checkpoint: its index names pathlib.Path.write_text"
    data = ["--dataset=shakespeare_char", f"--data_dir={env['NANOFORMER_DATA_DIR']}"]
    scripts = [
        (sample.cli, [f"--init_from={folder}", "--device=cpu", "--start=a"]),
        (evaluation.cli, [f"--init_from={folder}", "--device=cpu"]),
        (export.cli, [f"--out_dir={tmp_path}", "--checkpoint=ckpt.pt", f"--dest={tmp_path / 'hf'}"]),
        (train.cli, [f"--init_from={folder}", *data, f"--out_dir={tmp_path / 'run'}", "--device=cpu"]),
    ]
    for script, argv in scripts:
        capsys.readouterr()
        assert script(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and refused in err, (script.__module__, err)
    served = subprocess.run(
        [sys.executable, str(REPO / "serve.py"), f"--init_from={folder}", f"--port={free_port()}", "--device=cpu"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert served.returncode == 2 and refused in served.stderr, served.stderr
    # an index that is no index sends PyTorch to a rank's own (__0.metadata), unpickled as plainly: both are read
    (folder / ".metadata").write_bytes(pickle.dumps({}))
    with pytest.raises(ConfigError, match=r"its .metadata is damaged \(\{\}\)"):
        load_checkpoint(folder)
    (folder / ".metadata").write_bytes(index)
    (folder / "__0.metadata").write_bytes(pickle.dumps(WritesAFile(marker)))
    with pytest.raises(ConfigError, match="its index names pathlib.Path.write_text"):
        load_checkpoint(folder)
    assert not marker.exists() and not (tmp_path / "hf").exists()


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


# -----------------------------------------------------------------------------
# Stopping, resuming, and the run's folder


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


def test_resuming_a_finished_run_says_there_is_nothing_to_do(tmp_path, data_root, capsys):
    main(tiny(data_root, tmp_path, max_iters=3))
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert cli(cli_argv(data_root, tmp_path, max_iters=3, init_from="resume")) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "nothing to train" in error and "--max_iters" in error
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == files


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


def test_an_out_dir_that_cannot_be_written_is_one_line_before_any_work(tmp_path, data_root, capsys):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a folder")
    for out_dir in (a_file, a_file / "run"):
        assert cli(cli_argv(data_root, out_dir)) == 2
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and "is a file" in error and "--out_dir" in error
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
