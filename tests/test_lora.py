"""LoRA (converters/lora.py) and how a fine-tune starts (start.fit_to_data): adapters against the explicit low-rank
product, merged against unmerged, a frozen base, adapter checkpoints and their base, exact resume, DDP and FSDP, and
the vocabulary grown for chat tokens."""

import copy
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from tiny_run import TINY, tiny

import converters
import converters.lora as lora
import eval as evaluation
import export
import hf
import prepare_data
import sample
import start
import tokens
import train
from checkpoint import load_checkpoint, save_checkpoint
from converters.lora import LoRALinear, LoRASettings, add_adapters, merge
from generate import generate
from model import MODEL_KEYS, ModelConfig, build_model
from optim import configure_optimizers
from runtime import Models, Runtime
from start import load_model, model_from_checkpoint
from tasks.lm import CausalLM
from train import TrainConfig, main

REPO = Path(__file__).resolve().parent.parent
LORA = dict(lora_rank=4, lora_alpha=8.0)
BUILTIN = ("system", "user", "assistant", "end_of_turn")


def tiny_gpt(vocab_size=20, **overrides):
    """A random 2-layer GPT, 32 wide."""
    settings = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=vocab_size, **overrides)
    return build_model(ModelConfig(**settings))


def with_random_updates(model, seed=0):
    """model with every adapter's B and every row delta drawn, so that the updates are not zero."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("lora_b", "row_delta")):
                p.copy_(0.1 * torch.randn(p.shape, generator=generator))
    return model


def unmerged_model(ckpt):
    """A LoRA checkpoint's model with its adapters apart, as a resume trains it."""
    return start.converted_model(converters.saved(ckpt), ckpt)


def adapter_names(model):
    return sorted(name for name, p in model.named_parameters() if p.requires_grad)


@pytest.fixture(scope="module")
def base(data_root, tmp_path_factory):
    """A base run's best.pt: 4 steps of a 2-layer GPT on shakespeare_char, 128 wide."""
    out = tmp_path_factory.mktemp("base")
    main(tiny(data_root, out, n_embd=128, n_head=4, eval_interval=4, max_iters=4))
    return out / "ckpt.pt"


@pytest.fixture(scope="module")
def lora_run(data_root, base, tmp_path_factory):
    """A LoRA fine-tune of base: 4 steps at rank 4, evaluated (and saved) after 2; returns its out_dir."""
    out = tmp_path_factory.mktemp("lora")
    main(tiny(data_root, out, init_from=str(base), eval_interval=2, max_iters=4, **LORA))
    return out


# -----------------------------------------------------------------------------
# The adapters against explicit products


@pytest.mark.parametrize("bias", [False, True])
def test_an_adapted_linear_is_the_base_plus_its_scaled_low_rank_product(bias):
    torch.manual_seed(0)
    linear = nn.Linear(24, 40, bias=bias)
    adapted = LoRALinear(linear, LoRASettings(rank=4, alpha=8.0, targets=("attention",)), torch.Generator())
    x = torch.randn(3, 5, 24)
    # B starts at zero: the adapted layer starts as the base, exactly
    assert adapted.weight is linear.weight and adapted.bias is linear.bias
    assert torch.equal(adapted(x), linear(x))
    nn.init.normal_(adapted.lora_b)
    weight = linear.weight.double() + (8.0 / 4) * adapted.lora_b.double() @ adapted.lora_a.double()
    expected = x.double() @ weight.T + (linear.bias.double() if bias else 0.0)
    torch.testing.assert_close(adapted(x).double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_token_rows_add_their_delta_to_those_rows_of_the_embedding_and_head(tied):
    model = with_random_updates(
        add_adapters(
            tiny_gpt(tie_embeddings=tied), LoRASettings(4, 8.0, ("mlp",)), [3, 17], generator=torch.Generator()
        )
    )
    wte, head = model.body.wte, model.lm_head
    table = wte.weight.detach().double().clone()
    table[[3, 17]] += wte.row_delta.double()
    out = head.weight.detach().double().clone()
    out[[3, 17]] += head.row_delta.double()
    idx, x = torch.tensor([[3, 0, 17, 5, 3]]), torch.randn(2, 7, 32)
    torch.testing.assert_close(wte(idx).double(), table[idx])
    torch.testing.assert_close(head(x).double(), x.double() @ (table if tied else out).T, rtol=1e-5, atol=1e-6)
    # tied: one delta for both, as the base has one matrix for both
    assert (head.row_delta is wte.row_delta) == tied


@pytest.mark.parametrize(
    "options",
    [
        {"tie_embeddings": True},
        {"tie_embeddings": False, "activation": "swiglu", "bias": True, "pos_encoding": "rope", "norm": "rmsnorm"},
    ],
)
def test_merged_equals_unmerged_and_has_the_base_names_only(options):
    base = tiny_gpt(**options)
    settings = LoRASettings(4, 8.0, ("attention", "mlp"))
    model = with_random_updates(add_adapters(copy.deepcopy(base), settings, [2, 19], generator=torch.Generator()))
    idx = torch.randint(20, (2, 16), generator=torch.Generator().manual_seed(1))
    unmerged = model(idx)[0]
    merged = merge(copy.deepcopy(model))
    torch.testing.assert_close(merged(idx)[0], unmerged, rtol=1e-5, atol=1e-5)
    assert merged.state_dict().keys() == base.state_dict().keys()
    assert all(
        type(m) in (nn.Linear, nn.Embedding) for m in merged.modules() if isinstance(m, (nn.Linear, nn.Embedding))
    )
    assert all(p.requires_grad for p in merged.parameters())
    # every Linear of the blocks was adapted (swiglu's up too), nothing else but the token rows
    linears = [n for n, m in base.named_modules() if isinstance(m, nn.Linear) and ".blocks." in n]
    expected = sorted([f"{n}.lora_{ab}" for n in linears for ab in "ab"] + ["body.wte.row_delta"])
    expected += [] if options["tie_embeddings"] else ["lm_head.row_delta"]
    assert adapter_names(model) == sorted(expected)


def test_targets_pick_the_attention_or_the_mlp_linears():
    model = add_adapters(tiny_gpt(), LoRASettings(2, 4.0, ("attention",)), generator=torch.Generator())
    assert {re.sub(r"body\.blocks\.\d\.", "", n).rsplit(".", 1)[0] for n in adapter_names(model)} == {
        "attn.qkv",
        "attn.proj",
    }


# -----------------------------------------------------------------------------
# Training: the base frozen


def test_only_the_adapters_change_and_only_they_have_gradients_and_optimizer_state():
    base = tiny_gpt()
    model = add_adapters(
        copy.deepcopy(base), LoRASettings(4, 8.0, ("attention", "mlp")), [5], generator=torch.Generator()
    )
    # weight decay on: a frozen weight it reached would move
    optimizers, _ = configure_optimizers(model, 0.1, 1e-2, (0.9, 0.95), "cpu")
    windows = [torch.randint(20, (4, 17), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    batches = [((w[:, :-1],), w[:, 1:]) for w in windows]
    for _ in range(3):
        models = Models(raw=model, step=model)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        train.accumulate_gradients(models, CausalLM({}), batches, 128, scaler, Runtime())
        assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)
        train.update_weights(model, optimizers, torch.amp.GradScaler("cpu", enabled=False), grad_clip=1.0)
    trained = dict(model.named_parameters())
    for name, tensor in base.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    for name in adapter_names(model):
        assert not torch.equal(trained[name], torch.zeros_like(trained[name])), name
    with_state = {id(p) for p in optimizers["adamw"].state}
    assert with_state == {id(trained[n]) for n in adapter_names(model)}


def test_a_lora_run_saves_small_adapters_that_name_their_base(lora_run, base, capsys):
    ckpt, best = load_checkpoint(lora_run / "ckpt.pt"), load_checkpoint(lora_run / "best.pt")
    assert (ckpt["format_version"], best["format_version"]) == (6, 6) and ckpt["converter"] == best["converter"]
    assert ckpt["converter"]["name"] == "lora"
    record = ckpt["converter"]["record"]
    assert {k: record[k] for k in ("rank", "alpha", "targets", "token_rows")} == {
        "rank": 4,
        "alpha": 8.0,
        "targets": ["attention", "mlp"],
        "token_rows": [],
    }
    base_model = model_from_checkpoint(load_checkpoint(base))
    assert record["base"]["source"] == "checkpoint" and record["base"]["init_from"] == str(base.resolve())
    assert record["base"]["fingerprint"] == start.fingerprint(base_model)
    assert all(k.endswith(("lora_a", "lora_b")) for k in ckpt["weights"])
    # AdamW's state covers the adapters and nothing else
    state = ckpt["optimizers"]["adamw"]["state"]
    assert sorted(tuple(s["exp_avg"].shape) for s in state.values()) == sorted(
        tuple(t.shape) for t in ckpt["weights"].values()
    )
    n_adapters = sum(t.numel() for t in ckpt["weights"].values())
    n_base = base_model.num_params()
    assert n_adapters < 0.05 * n_base
    # the files: the adapters and their moments, against the base's weights and moments
    assert (lora_run / "ckpt.pt").stat().st_size < 0.1 * base.stat().st_size


def test_the_memory_line_shows_gradients_and_adam_state_for_the_adapters_only(data_root, base, tmp_path, capsys):
    main(tiny(data_root, tmp_path, init_from=str(base), max_iters=1, **LORA))
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("memory rank 0: "))
    n_adapters = sum(t.numel() for t in load_checkpoint(tmp_path / "ckpt.pt")["weights"].values())
    n_all = n_adapters + model_from_checkpoint(load_checkpoint(base)).num_params()
    mib = {k: float(v) for k, v in re.findall(r"(\w+(?: state)?) ([\d.]+) MiB", line)}
    assert mib["weights"] == pytest.approx(4 * n_all / 2**20, abs=0.05)
    assert mib["gradients"] == pytest.approx(4 * n_adapters / 2**20, abs=0.05)
    assert mib["optimizer state"] == pytest.approx(8 * n_adapters / 2**20, abs=0.05)


@pytest.mark.parametrize("extra", [{}, {"lora_dropout": 0.1, "dropout": 0.1, "lora_targets": "mlp"}])
def test_lora_resume_is_exact(data_root, base, tmp_path, extra):
    """Six steps straight == three, stop, resume, three more: the same losses and adapters, bitwise."""
    common = dict(max_iters=6, eval_interval=2, gradient_accumulation_steps=2, **LORA, **extra)
    straight = main(tiny(data_root, tmp_path / "a", init_from=str(base), **common))
    first = main(tiny(data_root, tmp_path / "b", init_from=str(base), **{**common, "max_iters": 3}))
    second = main(tiny(data_root, tmp_path / "b", init_from="resume", **common))
    assert {**first["losses"], **second["losses"]} == straight["losses"]
    a, b = (load_checkpoint(tmp_path / run / "ckpt.pt")["weights"] for run in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_resume_takes_the_checkpoints_lora_settings(data_root, lora_run, tmp_path, capsys):
    out = shutil.copytree(lora_run, tmp_path / "run")
    main(tiny(data_root, out, init_from="resume", max_iters=5, lora_rank=8))
    assert "note: resuming with the checkpoint's fine-tuning settings: lora_rank=4" in capsys.readouterr().out
    assert load_checkpoint(out / "ckpt.pt")["converter"]["record"]["rank"] == 4


# -----------------------------------------------------------------------------
# What sample.py, eval.py and export.py get: the adapters merged


def test_load_model_merges_the_adapters_and_samples_as_the_unmerged_model(lora_run):
    model, _, meta, _ = load_model("resume", out_dir=str(lora_run), checkpoint="ckpt.pt", dataset="", device="cpu")
    assert not any(isinstance(m, (LoRALinear, lora.RowsEmbedding, lora.RowsHead)) for m in model.modules())
    unmerged = unmerged_model(load_checkpoint(lora_run / "ckpt.pt")).eval()
    assert any(isinstance(m, LoRALinear) for m in unmerged.modules())
    prompt = torch.tensor([tokens.Tokenizer.from_meta(meta).encode("ROMEO:")])
    greedy = [generate(m, prompt, 24, temperature=0) for m in (model, unmerged)]
    assert torch.equal(*greedy)
    idx = torch.randint(65, (2, 32))
    torch.testing.assert_close(model(idx)[0], unmerged(idx)[0], rtol=1e-5, atol=1e-5)


def test_export_writes_the_merged_weights(lora_run, tmp_path):
    export.main(export.ExportConfig(out_dir=str(lora_run), checkpoint="ckpt.pt", dest=str(tmp_path / "hf")))
    exported = hf.from_pretrained(tmp_path / "hf").eval()
    unmerged = unmerged_model(load_checkpoint(lora_run / "ckpt.pt")).eval()
    idx = torch.randint(65, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(exported(idx)[0], unmerged(idx)[0], rtol=1e-5, atol=1e-5)


def test_a_lora_run_keeps_its_base_and_outlives_the_base_run(data_root, base, tmp_path, capsys):
    """
    The base run going on (its checkpoint rewritten, atomically or in place) leaves a LoRA run whole: it keeps its
    base as a file of its own, which no rewrite of the original reaches (a hard link would share the bytes).
    """
    own_base = shutil.copy(base, tmp_path / "own.pt")
    run = tmp_path / "run"
    main(tiny(data_root, run, init_from=str(own_base), max_iters=2, **LORA))
    assert (run / "base.pt").stat().st_ino != Path(own_base).stat().st_ino
    assert (run / "base.pt").read_bytes() == Path(own_base).read_bytes()
    argv = [f"--out_dir={run}", "--max_new_tokens=8", "--temperature=0", "--device=cpu", "--start=ab"]
    capsys.readouterr()
    assert sample.cli(argv) == 0
    before = capsys.readouterr().out
    # rewritten in place, as cp or torch.save over the same path do: the original's bytes change under its inode
    original = Path(own_base).read_bytes()
    with open(own_base, "r+b") as f:
        f.write(bytes(len(original)))
    assert sample.cli(argv) == 0 and capsys.readouterr().out == before
    # the base run goes on: train.py writes its checkpoint anew (atomically), here with other weights
    Path(own_base).write_bytes(original)
    other = load_checkpoint(own_base)
    other["weights"] = {k: v + 0.01 for k, v in other["weights"].items()}
    save_checkpoint(other, own_base)
    # sample, evaluate, export and resume as before: the adapters' own base, checked against its fingerprint
    assert sample.cli(argv) == 0 and capsys.readouterr().out == before
    assert evaluation.cli([f"--out_dir={run}", "--device=cpu"]) == 0
    assert export.cli([f"--out_dir={run}", f"--dest={tmp_path / 'hf'}"]) == 0
    assert main(tiny(data_root, run, init_from="resume", max_iters=3))["iter_num"] == 3
    # a run that keeps no base (from before) reads the base where it was: changed, then gone, each one line
    (run / "base.pt").unlink()
    capsys.readouterr()
    assert sample.cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"the adapters' base {own_base} has changed since they were trained on it" in err
    Path(own_base).unlink()
    assert sample.cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"the adapters' base checkpoint {own_base} is not there" in err
    with pytest.raises(train.ConfigError, match="is not there"):
        main(tiny(data_root, run, init_from="resume", max_iters=4))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--arch=encoder", "--lora_rank=8", "--init_from=x.pt"], "lora_rank is for fine-tuning decoder-only models"),
        (["--arch=encoder_decoder", "--lora_rank=8", "--init_from=x.pt"], "not arch='encoder_decoder'"),
        (["--lora_rank=8"], "init_from='scratch' has none of"),
        (["--lora_rank=8", "--init_from=x.pt", "--optimizer=muon"], "optimizer='muon'"),
        (["--lora_rank=8", "--init_from=x.pt", "--ema_decay=0.9"], "ema_decay"),
        (["--lora_rank=-1"], "lora_rank must not be negative"),
        (["--lora_rank=8", "--init_from=x.pt", "--lora_targets=attention,lm_head"], "lora_targets='attention,lm_"),
        (["--lora_rank=8", "--init_from=x.pt", "--lora_alpha=0"], "lora_alpha must be positive"),
    ],
)
def test_bad_lora_settings_are_one_line_errors(argv, message, capsys):
    assert train.cli(["--dataset=shakespeare_char", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_a_chain_of_lora_runs_loads_samples_evaluates_exports_and_resumes(data_root, base, tmp_path, capsys):
    """
    LoRA on a LoRA run's checkpoint, and on that one's again: each keeps its base merged, so the last run stands
    alone. Its model equals its adapters on the model of the run before, loaded from that run's own folder, and once
    the earlier runs are gone it loads, samples, evaluates, exports and resumes as before.
    """
    runs = [tmp_path / f"lora{i}" for i in range(3)]
    start_from = base
    for run in runs:
        main(tiny(data_root, run, init_from=str(start_from), max_iters=2, **LORA))
        start_from = run / "ckpt.pt"
    last = load_checkpoint(runs[-1] / "ckpt.pt")
    # the reference: the run before, as it loads from its own folder, with the last run's adapters put on it by hand
    before = model_from_checkpoint(load_checkpoint(runs[-2] / "ckpt.pt"), runs[-2])
    reference = converters.saved(last).restore(before, last).eval()
    idx = torch.randint(65, (2, 32))
    merged, _, _, _ = load_model("resume", out_dir=str(runs[-1]), checkpoint="ckpt.pt", dataset="", device="cpu")
    with torch.no_grad():
        expected = reference(idx)[0]
        torch.testing.assert_close(merged(idx)[0], expected, rtol=1e-5, atol=1e-5)
    for run in runs[:-1]:
        shutil.rmtree(run)
    Path(base).rename(base.with_name("moved.pt"))
    try:
        alone, _, _, _ = load_model("resume", out_dir=str(runs[-1]), checkpoint="ckpt.pt", dataset="", device="cpu")
        with torch.no_grad():
            torch.testing.assert_close(alone(idx)[0], expected, rtol=1e-5, atol=1e-5)
        out_dir = f"--out_dir={runs[-1]}"
        assert sample.cli([out_dir, "--device=cpu", "--max_new_tokens=4", "--start=ab"]) == 0
        assert evaluation.cli([out_dir, "--device=cpu", "--limit=4"]) == 0
        assert export.cli([out_dir, f"--dest={tmp_path / 'hf'}"]) == 0
        assert main(tiny(data_root, runs[-1], init_from="resume", max_iters=3))["iter_num"] == 3
    finally:
        base.with_name("moved.pt").rename(base)


# -----------------------------------------------------------------------------
# A hugging Face folder as the base


def test_lora_on_a_hugging_face_folder(llama_dir, tmp_path, capsys):
    folder = shutil.copytree(llama_dir, tmp_path / "llama")
    data = prepare_data.prepare("shakespeare", data_dir=tmp_path / "data", tokenizer=str(folder))
    settings = dict(dataset=data.name, data_dir=str(tmp_path / "data"), init_from=str(folder), **LORA)
    main(tiny(str(tmp_path / "data"), tmp_path / "run", **{**settings, "block_size": 16, "max_iters": 4}))
    record = load_checkpoint(tmp_path / "run" / "ckpt.pt")["converter"]["record"]
    assert record["base"]["source"] == "pretrained" and record["base"]["model_config"]["block_size"] == 16
    merged, _, _, _ = load_model("resume", out_dir=str(tmp_path / "run"), checkpoint="", dataset="", device="cpu")
    unmerged = unmerged_model(load_checkpoint(tmp_path / "run" / "ckpt.pt")).eval()
    idx = torch.randint(300, (2, 16))
    torch.testing.assert_close(merged(idx)[0], unmerged(idx)[0], rtol=1e-5, atol=1e-5)
    # the folder goes: the run keeps its own copy and merges as before
    assert sorted(p.name for p in (tmp_path / "run" / "base").iterdir()) == sorted(p.name for p in folder.iterdir())
    shutil.rmtree(folder)
    again, _, _, _ = load_model("resume", out_dir=str(tmp_path / "run"), checkpoint="", dataset="", device="cpu")
    torch.testing.assert_close(again(idx)[0], merged(idx)[0])
    shutil.rmtree(tmp_path / "run" / "base")
    with pytest.raises(ValueError, match=f"the adapters' base folder {folder} is not there"):
        load_model("resume", out_dir=str(tmp_path / "run"), checkpoint="", dataset="", device="cpu")


# -----------------------------------------------------------------------------
# DDP and FSDP (torchrun, two processes, gloo), compiled


def torchrun(args, env):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    return subprocess.run(
        [*command, str(REPO / "train.py"), *args], env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("options", [{"fsdp": True}, {"fsdp": False, "compile": True}])
def test_ddp_and_fsdp_train_the_adapters_as_one_process(data_root, base, tmp_path, options):
    import os

    settings = dict(max_iters=6, eval_interval=3, batch_size=4, gradient_accumulation_steps=4, **LORA)
    main(tiny(data_root, tmp_path / "one", init_from=str(base), **settings))
    args = {
        **TINY,
        **settings,
        **options,
        "dataset": "shakespeare_char",
        "init_from": base,
        "out_dir": tmp_path / "two",
    }
    env = {**os.environ, "NANOFORMER_DATA_DIR": data_root, "OMP_NUM_THREADS": "1"}
    run = torchrun([f"--{k}={v}" for k, v in args.items()], env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "torch.compile failed" not in run.stdout + run.stderr
    # ckpt.pt: one file of adapters whatever the ranks, as one process writes it
    one, two = (load_checkpoint(tmp_path / r / "ckpt.pt") for r in ("one", "two"))
    assert one["weights"].keys() == two["weights"].keys()
    # Adam divides by the gradients' running size: last-bit differences of the reductions (and of the compiled
    # kernels) grow where that is tiny, as in test_distributed's FSDP comparison
    for k in one["weights"]:
        torch.testing.assert_close(two["weights"][k], one["weights"][k], rtol=1e-3, atol=3e-5)
    assert [len(o["optimizers"]["adamw"]["state"]) for o in (one, two)] == [len(one["weights"])] * 2


# -----------------------------------------------------------------------------
# Fitting a base to chat data: a vocabulary grown, the chat tokens' rows trained


@pytest.mark.parametrize("tied", [True, False])
def test_a_grown_vocabulary_keeps_the_old_rows_and_the_old_ids_logits(tied):
    model = tiny_gpt(tie_embeddings=tied).eval()
    before = copy.deepcopy(model)
    idx = torch.randint(20, (2, 16))
    model.grow_vocabulary(24)
    assert model.config.vocab_size == 24 and model.body.wte.weight.shape == (24, 32)
    assert model.lm_head.weight.shape == (24, 32) and (model.lm_head.weight is model.body.wte.weight) == tied
    for name, weight in before.state_dict().items():
        grown = model.state_dict()[name]
        assert torch.equal(grown[: len(weight)], weight), name
    for matrix in ("body.wte.weight", "lm_head.weight"):
        old = before.state_dict()[matrix].double()
        torch.testing.assert_close(model.state_dict()[matrix][20:].double(), old.mean(0).expand(4, -1))
    logits = model(idx)[0]
    torch.testing.assert_close(logits[..., :20], before(idx)[0], rtol=0, atol=1e-6)
    # a new id's logit starts as the mean of the old ones' (the head's new rows are their mean)
    torch.testing.assert_close(logits[..., 20:], logits[..., :20].mean(-1, keepdim=True).expand(-1, -1, 4))


def chat_meta(meta):
    """meta with the builtin chat template's four tokens appended, as chat.with_chat_tokens gives it."""
    n = meta["vocab_size"]
    return {
        **meta,
        "kind": "chat",
        "vocab_size": n + 4,
        "special_tokens": {**meta["special_tokens"], **{name: n + i for i, name in enumerate(BUILTIN)}},
        "chat": {"template": "builtin"},
    }


def test_a_lora_fine_tune_on_chat_data_grows_the_vocabulary_and_trains_the_chat_rows(
    shakespeare_char_dir, base, capsys
):
    meta = chat_meta(tokens.load_meta(shakespeare_char_dir))
    cfg = TrainConfig(init_from=str(base), dataset="shakespeare_char", **LORA)
    model = model_from_checkpoint(load_checkpoint(base)).train()
    begin = start.fit_to_data(start.Start(cfg, model, None, meta), meta)
    out = capsys.readouterr().out
    assert "the token embedding grown from 65 to 69 ids" in out and "the rows of token ids 65, 66, 67, 68" in out
    assert begin.converter.record["token_rows"] == [65, 66, 67, 68] and begin.model.config.vocab_size == 69
    # the base the checkpoints name is the one loaded, before its vocabulary grew
    assert begin.converter.record["base"]["model_config"]["vocab_size"] == 65
    assert begin.model.body.wte.row_delta.shape == (4, 128) and begin.model.body.wte.row_delta.requires_grad


def test_the_rows_trained_are_the_builtin_chat_tokens_and_the_new_ids():
    gpt2 = {"vocab_size": 50261, "chat": {"template": "builtin"}}
    gpt2["special_tokens"] = {name: 50257 + i for i, name in enumerate(BUILTIN)}
    # inside GPT-2's padded 50304: no new rows, but the four markers were never trained
    assert lora.trained_rows(gpt2, 50304) == [50257, 50258, 50259, 50260]
    # a folder's own template uses tokens the model knows
    assert lora.trained_rows({"vocab_size": 300, "chat": {"template": "{{ x }}"}, "special_tokens": {}}, 300) == []


@pytest.fixture(scope="module")
def chat_root(shakespeare_path, tmp_path_factory):
    """shakespeare_chat (the quiz, in the built-in template over shakespeare_char's characters), small."""
    root = tmp_path_factory.mktemp("chat")
    prepare_data.prepare("shakespeare_chat", data_dir=root, num_train=400, num_val=150)
    return str(root)


def test_a_lora_chat_fine_tune_of_a_character_model_trains_the_chat_rows_and_resumes_exactly(
    data_root, chat_root, tmp_path
):
    main(tiny(data_root, tmp_path / "base", block_size=64, max_iters=2))
    base = model_from_checkpoint(load_checkpoint(tmp_path / "base" / "ckpt.pt"))
    chat = dict(dataset="shakespeare_chat", init_from=str(tmp_path / "base" / "ckpt.pt"), eval_interval=2, **LORA)
    chat.update(batch_size=4, gradient_accumulation_steps=2, eval_accuracy_examples=2, max_iters=4)
    straight = main(tiny(chat_root, tmp_path / "a", **chat))
    first = main(tiny(chat_root, tmp_path / "b", **{**chat, "max_iters": 2}))
    second = main(tiny(chat_root, tmp_path / "b", **{**chat, "init_from": "resume"}))
    assert {**first["losses"], **second["losses"]} == straight["losses"] and "accuracy" in straight["evals"][-1]
    ckpt = load_checkpoint(tmp_path / "a" / "ckpt.pt")
    assert ckpt["converter"]["record"]["token_rows"] == [65, 66, 67, 68] and ckpt["model_config"]["vocab_size"] == 69
    # the run keeps the chat data's meta: its markers and template, for sample.py --chat
    assert ckpt["meta"]["chat"] == {"template": "builtin"} and ckpt["meta"]["special_tokens"]["end_of_turn"] == 68
    model, _, meta, _ = load_model(
        "resume", out_dir=str(tmp_path / "a"), checkpoint="ckpt.pt", dataset="", device="cpu"
    )
    assert meta == ckpt["meta"]
    # merged: the old rows as the base had them, the chat rows the mean of the old ones plus what they learnt
    table, old = model.body.wte.weight.detach(), base.body.wte.weight.detach()
    assert torch.equal(table[:65], old) and model.lm_head.weight is model.body.wte.weight
    delta = ckpt["weights"]["body.wte.row_delta"]
    assert delta.abs().min() > 0
    torch.testing.assert_close(table[65:], old.mean(0) + delta)


@pytest.mark.parametrize("kind", ["plain", "chat", "lora"])
def test_the_folder_alone_resumes_a_run_with_its_own_settings(kind, data_root, chat_root, base, tmp_path, capsys):
    """
    train.py --init_from=resume --out_dir=DIR, nothing else (the dataset, model, LoRA and schedule its checkpoint's),
    but the larger max_iters given: the same weights, bitwise, as the run trained straight through.
    """
    settings = {
        "plain": dict(data_dir=data_root),
        "chat": dict(data_dir=chat_root, dataset="shakespeare_chat", init_from=str(base), eval_accuracy_examples=2),
        "lora": dict(data_dir=data_root, init_from=str(base), **LORA),
    }[kind]
    common = dict(eval_interval=2, gradient_accumulation_steps=2, block_size=16, **settings)
    main(tiny(data_root, tmp_path / "a", max_iters=4, **common))
    main(tiny(data_root, tmp_path / "b", max_iters=2, **common))
    capsys.readouterr()
    assert train.cli(["--init_from=resume", f"--out_dir={tmp_path / 'b'}", "--max_iters=4"]) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if line.startswith("note: going on")]
    assert notes == [
        f"note: going on with the settings of {tmp_path / 'b'}'s run, except those given: max_iters=4 (was 2)"
    ]
    a, b = (load_checkpoint(tmp_path / run / "ckpt.pt") for run in "ab")
    # the run's settings, as given to it (a resume writes the model settings resolved: d_ff=128 for None)
    settings = [{k: v for k, v in ckpt["train_config"].items() if k not in MODEL_KEYS} for ckpt in (a, b)]
    assert settings[1] == {**settings[0], "init_from": "resume", "out_dir": str(tmp_path / "b")}
    assert b["iter_num"] == 4 and a["weights"].keys() == b["weights"].keys()
    assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])


def test_hugging_face_gpt2_grows_to_the_chat_tokens(chat_root, tmp_path, capsys):
    """GPT-2's 50,257 ids, the built-in template's four after them: the vocabulary grows to 50,261, rows trained."""
    import transformers

    folder = tmp_path / "gpt2"
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=50257)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    prepare_data.prepare("shakespeare_chat", data_dir=chat_root, num_train=400, num_val=150, tokenizer="gpt2")
    settings = dict(dataset="shakespeare_chat_gpt2", init_from=str(folder), block_size=64, max_iters=2, **LORA)
    main(tiny(chat_root, tmp_path / "run", batch_size=4, eval_accuracy_examples=0, **settings))
    assert "the token embedding grown from 50,257 to 50,261 ids" in capsys.readouterr().out
    ckpt = load_checkpoint(tmp_path / "run" / "ckpt.pt")
    assert ckpt["converter"]["record"]["token_rows"] == [50257, 50258, 50259, 50260]
    assert ckpt["model_config"]["vocab_size"] == 50261
    # merged: GPT-2's own rows untouched, the head still tied to them
    model, _, _, _ = load_model("resume", out_dir=str(tmp_path / "run"), checkpoint="", dataset="", device="cpu")
    gpt2 = transformers.GPT2LMHeadModel.from_pretrained(folder)
    assert torch.equal(model.body.wte.weight[:50257], gpt2.transformer.wte.weight)
    assert model.lm_head.weight is model.body.wte.weight
