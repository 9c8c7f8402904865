"""
Checkpoints written by nanoGPT's train.py (karpathy/nanoGPT): read with weights_only=True, sampled, evaluated and
fine-tuned. nanoGPT's code is not in these tests: its checkpoint dict is built here in its exact format (its key
names, model_args, with and without torch.compile's "_orig_mod." prefix) from a model of ours.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import sample
import tokens
import train
from checkpoint import load_checkpoint, save_checkpoint, weights_state
from generate import generate
from model import ModelConfig, build_model
from start import model_from_checkpoint

# nanoGPT's GPT-2 layout, per block: its module names -> ours
NANOGPT_BLOCK = {
    "ln_1": "norm1",
    "attn.c_attn": "attn.qkv",
    "attn.c_proj": "attn.proj",
    "ln_2": "norm2",
    "mlp.c_fc": "mlp.fc",
    "mlp.c_proj": "mlp.proj",
}


def nanogpt_state(model):
    """Our GPT's weights under the names nanoGPT's GPT.state_dict() gives them (its lm_head tied to wte)."""
    ours = model.state_dict()
    state = {
        "transformer.wte.weight": ours["body.wte.weight"],
        "transformer.wpe.weight": ours["body.wpe.weight"],
    }
    for i in range(model.config.n_layer):
        for theirs, mine in NANOGPT_BLOCK.items():
            for p in ("weight", "bias"):
                if f"body.blocks.{i}.{mine}.{p}" in ours:
                    state[f"transformer.h.{i}.{theirs}.{p}"] = ours[f"body.blocks.{i}.{mine}.{p}"]
    for p in ("weight", "bias"):
        if f"body.norm.{p}" in ours:
            state[f"transformer.ln_f.{p}"] = ours[f"body.norm.{p}"]
    state["lm_head.weight"] = ours["lm_head.weight"]
    return state


def nanogpt_forward(state, args, idx):
    """
    nanoGPT's GPT written out over its own state dict, in float64: x = wte[idx] + wpe; per block x += attn(ln_1(x)),
    x += mlp(ln_2(x)) with exact GELU; logits = ln_f(x) @ wte^T (the tied head). Returns (B, T, V).
    """
    state = {k.removeprefix("_orig_mod."): v.double() for k, v in state.items()}
    B, T = idx.shape
    C, H = args["n_embd"], args["n_head"]

    def layer_norm(x, name):  # nanoGPT's LayerNorm has a bias only with bias=True
        return F.layer_norm(x, (C,), state[f"{name}.weight"], state.get(f"{name}.bias"), 1e-5)

    def linear(x, name):  # nn.Linear: (out, in) weights
        return F.linear(x, state[f"{name}.weight"], state.get(f"{name}.bias"))

    x = state["transformer.wte.weight"][idx] + state["transformer.wpe.weight"][:T]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(args["n_layer"]):
        block = f"transformer.h.{i}"
        q, k, v = linear(layer_norm(x, f"{block}.ln_1"), f"{block}.attn.c_attn").split(C, dim=2)
        q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        weights = (q @ k.transpose(-2, -1) / math.sqrt(C // H)).masked_fill(~causal, -math.inf).softmax(-1)
        x = x + linear((weights @ v).transpose(1, 2).reshape(B, T, C), f"{block}.attn.c_proj")
        x = x + linear(F.gelu(linear(layer_norm(x, f"{block}.ln_2"), f"{block}.mlp.c_fc")), f"{block}.mlp.c_proj")
    return layer_norm(x, "transformer.ln_f") @ state["lm_head.weight"].T


def nanogpt_model(vocab_size, bias, seed=0):
    """
    A GPT of ours in nanoGPT's architecture: GPT-2's layout with exact GELU, tied head, biases or not. Weights
    N(0, 0.2) and norm gains N(1, 0.2): with the 0.02 init, logits are so flat that tanh GELU for exact GELU
    (a 1e-3 difference here) would hide within the tolerance.
    """
    torch.manual_seed(seed)
    config = ModelConfig(
        arch="gpt", vocab_size=vocab_size, block_size=32, n_layer=2, n_head=2, n_embd=32, bias=bias, activation="gelu"
    )
    model = build_model(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(("norm" in name and name.endswith("weight")) + 0.2 * torch.randn(p.shape))
    return model


def write_nanogpt_checkpoint(model, path, compiled):
    """torch.save of the dict nanoGPT's train.py writes: model, optimizer, model_args, iter_num, best_val_loss..."""
    state = nanogpt_state(model)
    if compiled:  # nanoGPT saves the compiled model's state dict as it is
        state = {f"_orig_mod.{k}": v for k, v in state.items()}
    c = model.config
    model_args = dict(
        n_layer=c.n_layer,
        n_head=c.n_head,
        n_embd=c.n_embd,
        block_size=c.block_size,
        bias=c.bias,
        vocab_size=c.vocab_size,
        dropout=0.0,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.save(
        {
            "model": state,
            "optimizer": optimizer.state_dict(),
            "model_args": model_args,
            "iter_num": 150,
            "best_val_loss": torch.tensor(2.6658),
            "config": {"dataset": "shakespeare_char", "compile": compiled, "learning_rate": 1e-3},
        },
        path,
    )
    return path


@pytest.mark.parametrize("vocab_size, bias, compiled", [(65, True, False), (65, False, True), (50304, True, True)])
def test_a_nanogpt_checkpoint_loads_with_its_logits(tmp_path, vocab_size, bias, compiled):
    model = nanogpt_model(vocab_size, bias)
    ckpt = load_checkpoint(write_nanogpt_checkpoint(model, tmp_path / "ckpt.pt", compiled))
    assert ckpt["nanogpt"] and ckpt["iter_num"] == 150 and ckpt["best_val_loss"] == pytest.approx(2.6658)
    # GPT-2 BPE for its GPT-2 vocabulary; its characters are in a pickle that is never read
    assert ckpt["meta"] == (tokens.GPT2_META if vocab_size == 50304 else None)
    loaded = model_from_checkpoint(ckpt)
    x = torch.randint(vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(loaded(x)[0], model(x)[0], atol=0, rtol=0)
    # and what nanoGPT itself computes from the checkpoint (written out here), in float64
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    reference = nanogpt_forward(saved["model"], saved["model_args"], x)
    torch.testing.assert_close(loaded(x)[0].double(), reference, atol=1e-5, rtol=1e-5)


def test_a_nanogpt_checkpoint_of_another_model_is_one_line(tmp_path):
    model = nanogpt_model(65, True)
    path = write_nanogpt_checkpoint(model, tmp_path / "ckpt.pt", compiled=False)
    ckpt = torch.load(path, weights_only=True)
    ckpt["model_args"]["n_layer"] = 3  # the weights hold two blocks
    torch.save(ckpt, path)
    with pytest.raises(ValueError, match=r"looks like a nanoGPT checkpoint but does not load: .* missing \["):
        load_checkpoint(path)


def test_sample_reads_a_char_level_nanogpt_checkpoint_with_the_dataset_named(
    tmp_path, shakespeare_char_dir, monkeypatch, capsys
):
    """Greedy: the same characters as our model's own greedy generation, decoded with shakespeare_char's vocabulary."""
    monkeypatch.setenv("NANOFORMER_DATA_DIR", str(shakespeare_char_dir.parent))
    model = nanogpt_model(65, True)
    path = write_nanogpt_checkpoint(model, tmp_path / "ckpt.pt", compiled=True)
    args = [f"--init_from={path}", "--start=ROMEO:", "--temperature=0", "--max_new_tokens=20", "--device=cpu"]
    assert sample.cli(args) == 2
    assert "is a nanoGPT model of 65 characters" in capsys.readouterr().err
    assert sample.cli([*args, "--dataset=reverse"]) == 2  # not prepared here, or another vocabulary
    capsys.readouterr()
    assert sample.cli([*args, "--dataset=shakespeare_char"]) == 0
    tokenizer = tokens.Tokenizer.from_meta(tokens.load_meta(shakespeare_char_dir))
    prompt = torch.tensor([tokenizer.encode("ROMEO:")])
    expected = tokenizer.decode(generate(model, prompt, 20, temperature=0.0)[0].tolist())
    assert capsys.readouterr().out.strip() == expected.strip()


def test_export_writes_a_char_level_nanogpt_checkpoint_with_the_dataset_named(
    tmp_path, shakespeare_char_dir, monkeypatch, capsys
):
    """Without --dataset one line saying to name one; with it, a GPT-2 folder whose logits are the model's."""
    import transformers

    import export

    monkeypatch.setenv("NANOFORMER_DATA_DIR", str(shakespeare_char_dir.parent))
    model = nanogpt_model(65, True).eval()
    write_nanogpt_checkpoint(model, tmp_path / "ckpt.pt", compiled=False)
    dest = tmp_path / "hf"
    args = [f"--out_dir={tmp_path}", "--checkpoint=ckpt.pt", f"--dest={dest}"]
    assert export.cli(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a nanoGPT model of 65 characters" in err and "--dataset" in err
    assert export.cli([*args, "--dataset=reverse"]) == 2  # not prepared here, or another vocabulary
    assert not dest.exists()
    assert export.cli([*args, "--dataset=shakespeare_char"]) == 0
    hf = transformers.GPT2LMHeadModel.from_pretrained(dest).eval()
    x = torch.randint(65, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x)[0], rtol=1e-4, atol=1e-4)


def test_train_evaluates_and_fine_tunes_a_nanogpt_checkpoint(tmp_path, shakespeare_char_dir, capsys):
    """--init_from=PATH: the same evaluation as the same weights saved as our own checkpoint; then a few steps."""
    model = nanogpt_model(65, False)
    theirs = write_nanogpt_checkpoint(model, tmp_path / "ckpt.pt", compiled=False)
    meta = tokens.load_meta(shakespeare_char_dir)
    cfg = train.TrainConfig(dataset="shakespeare_char", data_dir=str(shakespeare_char_dir.parent))
    ours = tmp_path / "ours.pt"
    save_checkpoint(weights_state(model.state_dict(), model.config, cfg, meta, 0, math.inf), ours)
    settings = dict(
        dataset="shakespeare_char",
        data_dir=str(shakespeare_char_dir.parent),
        batch_size=4,
        eval_iters=3,
        device="cpu",
        compile=False,
        tensorboard=False,
    )
    evals = [
        train.main(train.TrainConfig(**settings, init_from=str(p), eval_only=True, out_dir=str(tmp_path / p.stem)))
        for p in (theirs, ours)
    ]
    assert evals[0]["evals"] == evals[1]["evals"]
    tuned = train.main(
        train.TrainConfig(
            **settings,
            init_from=str(theirs),
            max_iters=4,
            eval_interval=4,
            learning_rate=1e-3,
            warmup_iters=0,
            lr_decay_iters=4,
            out_dir=str(tmp_path / "tuned"),
        )
    )
    assert tuned["iter_num"] == 4 and tuned["evals"][0] == evals[0]["evals"][0]  # a new run, from its weights
    assert load_checkpoint(tmp_path / "tuned" / "ckpt.pt")["meta"]["tokenizer"] == meta["tokenizer"]
    capsys.readouterr()


def test_train_refuses_a_nanogpt_checkpoint_it_cannot_use(tmp_path, shakespeare_char_dir, capsys):
    common = [
        "--dataset=shakespeare_char",
        f"--data_dir={shakespeare_char_dir.parent}",
        "--device=cpu",
        "--tensorboard=false",
    ]
    bpe = write_nanogpt_checkpoint(nanogpt_model(50304, True), tmp_path / "bpe.pt", compiled=False)
    assert train.cli([f"--init_from={bpe}", "--eval_only", *common, f"--out_dir={tmp_path}"]) == 2
    error = capsys.readouterr().err
    assert "gpt2 BPE ids), but dataset=shakespeare_char holds shakespeare_char (65 characters)" in error
    chars = write_nanogpt_checkpoint(nanogpt_model(64, True), tmp_path / "chars.pt", compiled=False)
    assert train.cli([f"--init_from={chars}", "--eval_only", *common, f"--out_dir={tmp_path}"]) == 2
    assert "is a nanoGPT model of 64 characters" in capsys.readouterr().err
    # its optimizer state is not read: a resume from it is refused, a new run from it is the way
    (tmp_path / "nano").mkdir()
    write_nanogpt_checkpoint(nanogpt_model(65, True), tmp_path / "nano" / "ckpt.pt", compiled=False)
    assert train.cli(["--init_from=resume", *common, f"--out_dir={tmp_path / 'nano'}"]) == 2
    assert "was written by nanoGPT: start a new run from it with --init_from=" in capsys.readouterr().err
