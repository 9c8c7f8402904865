"""sample.py end to end: the command line on tiny checkpoints, checked against references computed here."""

import ast
import io
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path

import pytest
import torch

import checkpoint
import eval as evaluation
import export
import prepare_data
import sample
import start
import tasks.lm
import tokens
import train
from config import parse_config
from model import ModelConfig, build_model

SEPARATOR = "\n" + "-" * 15 + "\n"  # what sample.py prints between samples
TINY = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32}


def train_tiny(out_dir, data_dir, dataset, arch, **overrides):
    """A few optimizer steps of train.py on a 2-layer, 32-wide model: a real checkpoint, quickly."""
    cfg = train.TrainConfig(
        out_dir=str(out_dir),
        data_dir=str(data_dir),
        dataset=dataset,
        arch=arch,
        **TINY,
        batch_size=4,
        gradient_accumulation_steps=1,
        max_iters=20,
        eval_interval=20,
        eval_iters=1,
        log_interval=100,
        learning_rate=1e-2,
        min_lr=1e-3,
        warmup_iters=0,
        lr_decay_iters=20,
        device="cpu",
        tensorboard=False,
        compile=False,
        **overrides,
    )
    train.main(cfg)
    return out_dir


@pytest.fixture(scope="session")
def gpt_dir(shakespeare_char_dir, tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("gpt"), shakespeare_char_dir.parent, "shakespeare_char", "gpt")


@pytest.fixture(scope="session")
def encoder_dir(shakespeare_char_dir, tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("encoder"), shakespeare_char_dir.parent, "shakespeare_char", "encoder")


@pytest.fixture(scope="session")
def reverse_dir(tmp_path_factory):
    """The synthetic 'reverse' task, small: its meta (character vocabulary, pad/bos/eos) is what matters here."""
    return prepare_data.prepare(
        "reverse", data_dir=tmp_path_factory.mktemp("data"), num_train=300, num_val=20, num_test=20
    )


@pytest.fixture(scope="session")
def seq2seq_dir(reverse_dir, tmp_path_factory):
    return train_tiny(
        tmp_path_factory.mktemp("seq2seq"), reverse_dir.parent, "reverse", "encoder_decoder", eval_accuracy_examples=0
    )


def load(out_dir):
    ckpt = checkpoint.load_checkpoint(Path(out_dir) / "ckpt.pt")
    return start.model_from_checkpoint(ckpt), tokens.Tokenizer.from_meta(ckpt["meta"]), ckpt["meta"]


def cli(capsys, *args):
    """Run sample.py's main in this process: (exit code, stdout, stderr)."""
    code = sample.cli([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def samples(out):
    return out.removesuffix("\n").split(SEPARATOR)


# -----------------------------------------------------------------------------
# Table-driven models: the next-token distribution depends only on the previous token


def bigram_model(arch, vocab_size, table):
    """
    A real GPT or encoder-decoder whose next-token probabilities are table[previous token] (rows not in the table
    are uniform): one-hot token embeddings, every attention and MLP branch zeroed, and an output matrix that
    undoes the final LayerNorm. A row {token: p} gives p to those tokens and 1e-6 to the others, renormalised.
    """
    C = vocab_size + 1  # a spare channel, so that every row of the output matrix can sum to zero
    config = ModelConfig(
        arch=arch,
        vocab_size=vocab_size,
        block_size=32,
        n_layer=1,
        n_head=1,
        n_embd=C,
        bias=False,
        tie_embeddings=False,
        norm_eps=1e-12,
    )
    model = build_model(config).eval()
    sigma = math.sqrt((1 - 1 / C) / C)  # the standard deviation of a one-hot vector of C channels
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.zero_()
        for stack in (model.body,) if arch == "gpt" else (model.encoder, model.decoder):
            stack.wte.weight[:, :vocab_size] = torch.eye(vocab_size)
        # LayerNorm turns one-hot e_i into (e_i - 1/C) / sigma; when the rows of W sum to zero,
        # W (e_i - 1/C) / sigma = W[:, i] / sigma
        for prev in range(vocab_size):
            probs = torch.full((vocab_size,), 1e-6)
            for token, p in table.get(prev, {}).items():
                probs[token] = p
            model.lm_head.weight[:, prev] = sigma * (probs / probs.sum()).log()
        model.lm_head.weight[:, -1] = -model.lm_head.weight[:, :-1].sum(dim=1)
    return model


def save_checkpoint(out_dir, model, meta):
    """model in train.py's checkpoint layout, as far as sample.py reads it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt = {
        "format_version": checkpoint.FORMAT_VERSION,
        "weights": model.state_dict(),
        "model_config": asdict(model.config),
        "meta": meta,
    }
    torch.save(ckpt, out_dir / "ckpt.pt")
    return out_dir


# -----------------------------------------------------------------------------
# GPT


def test_same_seed_same_samples_other_seed_other_samples(gpt_dir, capsys):
    args = ("--out_dir", gpt_dir, "--start", "ROMEO:", "--num_samples=3", "--max_new_tokens=20", "--temperature=1.0")
    code, first, _ = cli(capsys, *args, "--seed=1")
    assert code == 0
    assert cli(capsys, *args, "--seed=1")[1] == first
    assert cli(capsys, *args, "--seed=2")[1] != first
    texts = samples(first)
    assert len(texts) == 3 and len(set(texts)) == 3  # one batch, three different samples
    assert all(t.startswith("ROMEO:") and len(t) == len("ROMEO:") + 20 for t in texts)


@pytest.mark.parametrize("start,context", [("ROMEO:", "ROMEO:"), ("", "\n")])
def test_greedy_equals_argmax_loop(gpt_dir, capsys, start, context):
    model, tokenizer, _ = load(gpt_dir)
    ids = tokenizer.encode(context)
    with torch.no_grad():
        for _ in range(20):
            ids.append(int(model(torch.tensor([ids]))[0][0, -1].argmax()))
    shown = ids if start else ids[len(context) :]  # an empty start prints only what was generated
    code, out, _ = cli(capsys, "--out_dir", gpt_dir, "--start", start, "--temperature=0", "--max_new_tokens=20")
    assert code == 0 and out == tokenizer.decode(shown) + "\n"


def next_token_probs(model, tokenizer, texts, prompt):
    """(probabilities before each generated token (N, V), the generated tokens (N,)) over all texts."""
    probs, tokens = [], []
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([tokenizer.encode(text)])
            p = model(ids)[0][0].softmax(dim=-1)  # position t predicts token t + 1
            probs.append(p[len(prompt) - 1 : -1])
            tokens.append(ids[0, len(prompt) :])
    return torch.cat(probs), torch.cat(tokens)


def test_top_k_never_emits_a_token_outside_the_k_likeliest(gpt_dir, capsys):
    code, out, _ = cli(
        capsys,
        "--out_dir",
        gpt_dir,
        "--start",
        "ROMEO:",
        "--num_samples=8",
        "--max_new_tokens=24",
        "--top_k=3",
        "--temperature=2.0",
    )
    assert code == 0
    model, tokenizer, _ = load(gpt_dir)
    probs, tokens = next_token_probs(model, tokenizer, samples(out), "ROMEO:")
    for p, token in zip(probs, tokens):
        assert token in p.topk(3).indices
    assert (tokens != probs.argmax(dim=-1)).any()  # sampled, not greedy


def test_top_p_samples_only_from_the_nucleus(gpt_dir, capsys):
    top_p = 0.6
    code, out, _ = cli(
        capsys,
        "--out_dir",
        gpt_dir,
        "--start",
        "ROMEO:",
        "--num_samples=8",
        "--max_new_tokens=24",
        f"--top_p={top_p}",
        "--top_k=None",
        "--temperature=1.0",
    )
    assert code == 0
    model, tokenizer, _ = load(gpt_dir)
    probs, tokens = next_token_probs(model, tokenizer, samples(out), "ROMEO:")
    # the nucleus: the likeliest tokens, in order, until they hold top_p; a token is in it when the ones
    # likelier than it hold less than top_p
    ahead = torch.stack([p[p > p[token]].sum() for p, token in zip(probs, tokens)])
    assert (ahead < top_p + 1e-5).all(), f"tokens outside the nucleus: mass ahead of them {ahead.max():.3f}"
    assert (tokens != probs.argmax(dim=-1)).any()  # sampled, not greedy


def test_cached_and_uncached_give_the_same_samples(gpt_dir, capsys, monkeypatch):
    used, generate_stream = [], tasks.lm.generate_stream

    def spy(*args, **options):
        used.append(options["use_cache"])
        return generate_stream(*args, **options)

    monkeypatch.setattr(tasks.lm, "generate_stream", spy)
    # 60 new tokens run past block_size=32: the context window slides, and both paths must agree about it
    args = ("--out_dir", gpt_dir, "--start", "ROMEO:", "--num_samples=2", "--max_new_tokens=60", "--temperature=1.0")
    code, cached, _ = cli(capsys, *args)
    assert code == 0
    assert cli(capsys, *args, "--use_cache=False")[1] == cached
    assert used == [True, False]


def test_bfloat16_autocast(gpt_dir, capsys, monkeypatch):
    """--dtype=bfloat16 generates under CPU autocast to bfloat16: its Linears give bfloat16 outputs; float32 none."""
    outputs, generate_stream = [], tasks.lm.generate_stream

    def spy(model, *args, **options):
        # what a Linear of the model gives while the tokens are generated, inside sample.py's autocast context
        hook = model.lm_head.register_forward_hook(lambda module, inputs, output: outputs.append(output.dtype))
        yield from generate_stream(model, *args, **options)
        hook.remove()

    monkeypatch.setattr(tasks.lm, "generate_stream", spy)
    args = ("--out_dir", gpt_dir, "--start", "ROMEO:", "--max_new_tokens=20", "--temperature=0", "--device=cpu")
    for dtype in ("bfloat16", "float32"):
        outputs.clear()
        code, out, _ = cli(capsys, *args, f"--dtype={dtype}")
        assert code == 0 and out.startswith("ROMEO:") and len(out) == len("ROMEO:") + 20 + 1
        assert outputs and set(outputs) == {getattr(torch, dtype)}


def test_the_best_weights_by_default_and_errors_that_name_what_is_there(gpt_dir, capsys, tmp_path):
    # a run whose best.pt holds other weights than its ckpt.pt: the untrained model's
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(gpt_dir / "ckpt.pt", run / "ckpt.pt")
    ckpt = checkpoint.load_checkpoint(run / "ckpt.pt")
    torch.manual_seed(0)
    untrained = build_model(ModelConfig.from_dict(ckpt["model_config"])).state_dict()
    checkpoint.save_checkpoint({**ckpt, "weights": untrained, "average": untrained}, run / "best.pt")
    args = ("--out_dir", run, "--start", "ROMEO:", "--max_new_tokens=30", "--temperature=0")
    best, latest = cli(capsys, *args, "--checkpoint=best.pt")[1], cli(capsys, *args, "--checkpoint=ckpt.pt")[1]
    assert best != latest and cli(capsys, *args)[1] == best
    # mid-run, before the first save of ckpt.pt: the default is best.pt, and asking for ckpt.pt names it
    (run / "ckpt.pt").unlink()
    assert cli(capsys, *args)[1] == best
    code, _, err = cli(capsys, *args, "--checkpoint=ckpt.pt")
    assert code == 2 and "holds best.pt" in err and "--checkpoint=best.pt" in err and len(err.splitlines()) == 1


def test_prompt_from_file(gpt_dir, capsys, tmp_path):
    (tmp_path / "prompt.txt").write_text("JULIET:\nO", encoding="utf-8")
    args = ("--out_dir", gpt_dir, "--max_new_tokens=10", "--temperature=0")
    code, out, _ = cli(capsys, *args, "--start", f"FILE:{tmp_path / 'prompt.txt'}")
    assert code == 0 and out.startswith("JULIET:\nO")
    assert out == cli(capsys, *args, "--start", "JULIET:\nO")[1]


def test_long_prompt_is_cropped_from_the_left_with_a_notice(gpt_dir, capsys):
    prompt = "First Citizen:\nBefore we proceed any further, hear me speak."  # longer than block_size=32
    code, out, err = cli(capsys, "--out_dir", gpt_dir, "--start", prompt, "--max_new_tokens=1", "--temperature=0")
    assert code == 0
    assert f"{len(prompt)} tokens" in err and "last 32" in err and len(err.splitlines()) == 1
    model, tokenizer, _ = load(gpt_dir)
    ids = tokenizer.encode(prompt[-32:])
    with torch.no_grad():
        ids.append(int(model(torch.tensor([ids]))[0][0, -1].argmax()))
    assert out == tokenizer.decode(ids) + "\n"


class Terminal(io.StringIO):
    """An output that says it is a terminal and records what is written to it."""

    def __init__(self):
        super().__init__()
        self.written = []  # every non-empty write, in order

    def isatty(self):
        return True

    def write(self, text):
        if text:
            self.written.append(text)
        return super().write(text)


def test_stream_is_the_default_on_a_terminal_and_prints_the_same_text(gpt_dir, capsys):
    args = ["--out_dir", str(gpt_dir), "--start", "ROMEO:", "--max_new_tokens=30", "--temperature=1.0"]
    terminal, pipe = Terminal(), Terminal()
    sample.main(parse_config(sample.SampleConfig, args), out=terminal)
    sample.main(parse_config(sample.SampleConfig, args + ["--stream=False"]), out=pipe)
    assert terminal.getvalue() == pipe.getvalue()
    assert len(terminal.written) > 30 and len(pipe.written) <= 2  # a write per token, against all text at once
    assert cli(capsys, *args)[1] == pipe.getvalue()  # stdout captured by pytest is no terminal: no streaming


CHARS = list("abc")  # a char-level vocabulary of three letters, end-of-text appended as id 3
A, B, C, EOT = range(4)


def cab_checkpoint(tmp_path):
    """A char-level GPT that writes 'cab' after end-of-text and after b, mostly, else ends: eot c a b (eot | c ...)."""
    model = bigram_model("gpt", 4, {EOT: {C: 0.9}, C: {A: 0.9}, A: {B: 0.9}, B: {EOT: 0.6, C: 0.4}})
    meta = {
        "kind": "lm",
        "tokenizer": {"type": "char", "chars": CHARS},
        "vocab_size": 4,
        "special_tokens": {"eot": EOT},
    }
    return save_checkpoint(tmp_path / "bigram", model, meta)


def test_empty_start_begins_at_end_of_text_and_sampling_stops_there(tmp_path, capsys):
    out_dir = cab_checkpoint(tmp_path)
    code, out, _ = cli(capsys, "--out_dir", out_dir, "--start", "", "--temperature=0", "--max_new_tokens=20")
    assert code == 0 and out == "cab\n"  # eot -> c -> a -> b -> eot: stopped, the marker not printed
    code, out, _ = cli(
        capsys, "--out_dir", out_dir, "--start", "b", "--num_samples=20", "--max_new_tokens=20", "--temperature=1.0"
    )
    texts = samples(out)
    assert code == 0 and "b" in texts and "bcab" in texts  # each sample ends at its own end-of-text
    assert all(re.fullmatch("b(cab)*", text) for text in texts)


def test_an_empty_sample_is_said_not_printed_as_a_blank_alone(tmp_path, capsys):
    out_dir = cab_checkpoint(tmp_path)
    args = ("--out_dir", out_dir, "--start", "b", "--max_new_tokens=20")
    for stream in ("true", "false"):
        code, out, err = cli(capsys, *args, "--temperature=0", f"--stream={stream}")  # b -> eot at once
        assert code == 0 and out == "b\n" and err.startswith("note: sample 1 ended at once") and f"id {EOT}" in err
    code, out, err = cli(capsys, *args, "--num_samples=20", "--temperature=1.0")
    empty = [str(i + 1) for i, text in enumerate(samples(out)) if text == "b"]
    assert code == 0 and 0 < len(empty) < 20 and err.startswith(f"note: sample {', '.join(empty)} ended at once")
    assert cli(capsys, "--out_dir", out_dir, "--start", "c", "--temperature=0", "--max_new_tokens=20")[1:] == (
        "cab\n",
        "",
    )


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory):
    """A tiny randomly initialised GPT-2 with the real 50,257-token vocabulary, saved as Hugging Face does."""
    import transformers

    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_positions=32, n_embd=32, n_layer=2, n_head=2))
    path = tmp_path_factory.mktemp("gpt2")
    hf.save_pretrained(path)
    return path


def test_init_from_gpt2_weights_matches_hugging_face_greedy(gpt2_dir, capsys):
    import tiktoken
    import transformers

    hf = transformers.GPT2LMHeadModel.from_pretrained(gpt2_dir).eval()
    bpe = tiktoken.get_encoding("r50k_base")  # GPT-2's token ids (the offline cache holds this twin of "gpt2")
    prompt = torch.tensor([bpe.encode("Hello, my name is")])
    expected = hf.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)[0].tolist()
    assert 50256 not in expected  # no end-of-text: all 12 tokens are printed
    code, out, _ = cli(
        capsys, "--init_from", gpt2_dir, "--start", "Hello, my name is", "--temperature=0", "--max_new_tokens=12"
    )
    assert code == 0 and out == bpe.decode(expected) + "\n"


def test_streaming_never_prints_half_a_character():
    tokenizer = tokens.Tokenizer.from_meta(tokens.GPT2_META)
    # GPT-2 BPE splits each of these characters over two tokens: b"\xe2\x9c" + b"\x93", b"\xf0\x9f" + b"\x99\x82"
    text = "ok ✓🙂✓ done"
    ids = tokenizer.encode(text)
    prompt, new = ids[:2], ids[2:]
    assert any("\ufffd" in tokenizer.decode([token]) for token in new)  # some tokens hold part of a character
    steps = (torch.tensor([[token]]) for token in [*new, tokens.GPT2_META["special_tokens"]["eot"], 0])
    out = Terminal()
    tasks.lm.print_stream(steps, prompt, tokenizer, tokens.GPT2_META["special_tokens"]["eot"], out)
    assert out.getvalue() == text + "\n"  # stopped at end-of-text, which is not printed
    assert "\ufffd" not in "".join(out.written)


# -----------------------------------------------------------------------------
# Encoder-decoder


def walk(table, bos, eos, max_len):
    """Every output of the table-driven decoder up to max_len tokens: (token list ending with eos, probability)."""
    paths, done = [([bos], 1.0)], []
    for _ in range(max_len):
        grown = []
        for ids, p in paths:
            for token, q in table[ids[-1]].items():
                if token == eos:
                    done.append((ids[1:] + [token], p * q))
                else:
                    grown.append((ids + [token], p * q))
        paths = grown
    return done


def test_greedy_and_beam_search_on_a_constructed_decoder(reverse_dir, tmp_path, capsys):
    meta = tokens.load_meta(reverse_dir)
    tokenizer = tokens.Tokenizer.from_meta(meta)
    bos, eos = meta["special_tokens"]["bos"], meta["special_tokens"]["eos"]
    a, b, c = tokenizer.encode("abc")
    # greedy takes a (0.5), then c (0.3), then eos: 0.15; b then eos holds 0.36, which beam search finds
    table = {
        bos: {a: 0.5, b: 0.4, eos: 0.1},
        a: {c: 0.3, a: 0.25, b: 0.25, eos: 0.2},
        b: {eos: 0.9, c: 0.1},
        c: {eos: 1.0},
    }
    out_dir = save_checkpoint(tmp_path / "bigram", bigram_model("encoder_decoder", meta["vocab_size"], table), meta)

    greedy, token = [], bos
    while token != eos:
        token = max(table[token], key=table[token].get)
        greedy.append(token)
    # beam search ranks finished outputs by log p / ((5 + length) / 6) ** 0.6, the length counting eos
    best = max(walk(table, bos, eos, 6), key=lambda path: math.log(path[1]) / ((5 + len(path[0])) / 6) ** 0.6)[0]
    assert greedy != best

    code, out, _ = cli(capsys, "--out_dir", out_dir, "--start", "ca")
    assert code == 0 and out == f"{tokenizer.decode(greedy[:-1])}\ncorrect\n"  # "ac" is "ca" reversed
    for beam_size in (1, 3):
        code, out, _ = cli(capsys, "--out_dir", out_dir, "--start", "ca", f"--beam_size={beam_size}")
        expected = greedy if beam_size == 1 else best
        answer = tokenizer.decode(expected[:-1])
        assert code == 0 and out == f"{answer}\n" + ("correct\n" if answer == "ac" else "wrong: expected 'ac'\n")


def test_translation_is_the_greedy_argmax_loop(seq2seq_dir, capsys):
    model, tokenizer, meta = load(seq2seq_dir)
    bos, eos = meta["special_tokens"]["bos"], meta["special_tokens"]["eos"]
    src = torch.tensor([tokenizer.encode("hello42")])
    tgt = [bos]
    with torch.no_grad():
        while tgt[-1] != eos and len(tgt) <= 32:
            tgt.append(int(model(src, torch.tensor([tgt]))[0][0, -1].argmax()))
    answer = tokenizer.decode([t for t in tgt[1:] if t != eos])
    code, out, _ = cli(capsys, "--out_dir", seq2seq_dir, "--start", "hello42")
    verdict = "correct" if answer == "24olleh" else "wrong: expected '24olleh'"
    assert code == 0 and out == f"{answer}\n{verdict}\n"


# -----------------------------------------------------------------------------
# Encoder


def parse_candidates(line):
    """[(token text, probability)] from a line "[MASK] n: 'x' 0.123  'y' 0.045 ..."."""
    found = re.findall(r"""('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*") (\d\.\d+)""", line.split(": ", 1)[1])
    return [(ast.literal_eval(text), float(p)) for text, p in found]


def test_fill_mask_lists_the_likeliest_valid_tokens(encoder_dir, capsys):
    code, out, _ = cli(capsys, "--out_dir", encoder_dir, "--start", "To be or [MASK]ot to [MASK]e", "--candidates=4")
    assert code == 0
    filled, *lines = out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("[MASK] 1: ") and lines[1].startswith("[MASK] 2: ")
    model, tokenizer, meta = load(encoder_dir)
    mask = meta["special_tokens"]["mask"]
    ids = tokenizer.encode("To be or ") + [mask] + tokenizer.encode("ot to ") + [mask] + tokenizer.encode("e")
    with torch.no_grad():
        probs = model(torch.tensor([ids]))[0][0].softmax(dim=-1)
    vocabulary = set(meta["tokenizer"]["chars"])
    for line, position in zip(lines, (9, 16)):
        candidates = parse_candidates(line)
        assert len(candidates) == 4 and all(text in vocabulary for text, _ in candidates)  # no <mask>, no unknown id
        p = probs[position].clone()
        p[mask] = 0
        p /= p.sum()  # the mask token is no answer: the others' probabilities renormalised
        expected = [tokenizer.decode([i]) for i in p.topk(4).indices.tolist()]
        assert [text for text, _ in candidates] == expected
        assert [prob for _, prob in candidates] == pytest.approx(p.topk(4).values.tolist(), abs=1e-3)
    top = [parse_candidates(line)[0][0] for line in lines]
    assert filled == f"To be or {top[0]}ot to {top[1]}e"


# -----------------------------------------------------------------------------
# Attention maps


@pytest.mark.parametrize("arch,panels", [("gpt", 2), ("encoder", 2), ("encoder_decoder", 2 + 2 * 2)])
def test_attention_png_has_a_panel_per_layer_and_head(request, tmp_path, capsys, arch, panels):
    import matplotlib.image

    out_dir = request.getfixturevalue(
        {"gpt": "gpt_dir", "encoder": "encoder_dir", "encoder_decoder": "seq2seq_dir"}[arch]
    )
    start = {"gpt": "ROMEO:", "encoder": "To be or [MASK]ot", "encoder_decoder": "abc123"}[arch]
    path = tmp_path / "attention.png"
    code, _, err = cli(capsys, "--out_dir", out_dir, "--start", start, "--max_new_tokens=5", "--attention", path)
    assert code == 0 and str(path) in err
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # rows: a GPT's or encoder's layers; an encoder-decoder's encoder layers, then self and cross per decoder layer.
    # columns: the 2 heads. Each panel is square, at least 2.4 inches at 100 dpi (larger for more tick labels).
    height, width = matplotlib.image.imread(path).shape[:2]
    assert abs(height * 2 - width * panels) <= panels and width >= 240 * 2  # a pixel of rounding per panel


@pytest.mark.parametrize("length", [10, 100])
def test_attention_maps_have_colour_bars_and_token_labels(
    shakespeare_char_dir, shakespeare_path, tmp_path, capsys, monkeypatch, length
):
    from matplotlib.figure import Figure

    torch.manual_seed(0)
    model = build_model(ModelConfig(arch="gpt", vocab_size=65, block_size=128, n_layer=1, n_head=2, n_embd=32))
    out_dir = save_checkpoint(tmp_path / "long", model, tokens.load_meta(shakespeare_char_dir))
    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda self, path, **options: figures.append(self))
    prompt = shakespeare_path.read_text(encoding="utf-8")[:length]
    code, _, _ = cli(capsys, "--out_dir", out_dir, "--start", prompt, "--max_new_tokens=1", "--attention", "a.png")
    assert code == 0 and len(figures) == 1
    labels = [repr(c)[1:-1] for c in prompt]  # char-level: each token is one character, written as repr shows it
    heat_maps = [ax for ax in figures[0].axes if ax.images]
    assert len(heat_maps) == 2  # one layer, two heads
    for ax in heat_maps:
        assert ax.images[0].colorbar is not None and ax.images[0].colorbar.ax in figures[0].axes
        for axis in (ax.xaxis, ax.yaxis):
            positions = [round(p) for p in axis.get_ticklocs()]
            texts = [t.get_text() for t in axis.get_ticklabels()]
            if length <= 32:  # every token, as it is
                assert texts == labels
            else:  # every k-th token, spread over the whole axis, with its position
                step = positions[1] - positions[0]
                assert 16 <= len(texts) <= 32 and positions == list(range(0, length, step))
                assert texts == [f"{p}: {labels[p]}" for p in positions]


def test_attention_without_matplotlib_says_how_to_get_it(gpt_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as if it were not installed
    code, _, err = cli(
        capsys, "--out_dir", gpt_dir, "--start", "A", "--max_new_tokens=1", "--attention", tmp_path / "a.png"
    )
    assert code == 2 and err == "sample.py: error: --attention needs matplotlib: pip install matplotlib\n"


# -----------------------------------------------------------------------------
# Bad input


@pytest.fixture(scope="session")
def broken_dirs(tmp_path_factory):
    """Checkpoint folders that cannot be used: corrupted, and from a newer format."""
    root = tmp_path_factory.mktemp("broken")
    (root / "corrupted").mkdir()
    (root / "corrupted" / "ckpt.pt").write_bytes(b"PK\x03\x04 this is not a checkpoint")
    (root / "newer").mkdir()
    torch.save({"format_version": checkpoint.FORMAT_VERSION + 1}, root / "newer" / "ckpt.pt")
    return root


@pytest.mark.parametrize(
    "args,message",
    [
        (["--start", "ROMEO: ✓ ü"], "characters not in the 65-character vocabulary: 'ü', '✓'"),
        (["--top_k=0"], "top_k must be a positive integer"),
        (["--top_p=0"], "top_p must be in (0, 1]"),
        (["--top_p=1.5"], "top_p must be in (0, 1]"),
        (["--temperature=-0.5"], "temperature must be >= 0"),
        (["--num_samples=0"], "num_samples must be at least 1"),
        (["--beam_size=0"], "beam_size must be at least 1"),
        (["--num_samples=2", "--stream=True"], "set num_samples=1"),
        (["--top_kk=5"], "unknown key 'top_kk'; did you mean 'top_k'?"),
        (["--num_samples=two"], "--num_samples must be int"),
        (["--dtype=float8"], "dtype must be one of auto, float32, bfloat16, float16"),
        (["--start", "FILE:no/such/prompt.txt"], "prompt file no/such/prompt.txt not found"),
    ],
)
def test_bad_option_or_prompt_is_one_line_and_exit_code_2(gpt_dir, capsys, args, message):
    code, out, err = cli(capsys, "--out_dir", gpt_dir, *args)
    assert code == 2 and out == ""
    assert err.startswith("sample.py: error: ") and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize(
    "folder,name,message",
    [
        ("missing", "ckpt.pt", "no checkpoint at"),
        ("corrupted", "ckpt.pt", "is not a readable checkpoint"),
        ("newer", "ckpt.pt", "newer than this code's"),
        ("newer", "best.pt", "newer/best.pt"),
    ],
)
def test_unusable_checkpoint_is_one_line_and_exit_code_2(broken_dirs, capsys, folder, name, message):
    code, out, err = cli(capsys, "--out_dir", broken_dirs / folder, "--checkpoint", name, "--start", "a")
    assert code == 2 and out == ""
    assert err.startswith("sample.py: error: ") and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize(
    "arch,option,instead",
    [
        ("gpt", "--beam_size=4", "greedy: --temperature=0"),
        ("gpt", "--length_penalty=1.0", "--top_p"),
        ("encoder", "--beam_size=2", "--candidates"),
    ],
)
def test_beam_options_on_a_model_without_beam_search_are_refused(request, capsys, arch, option, instead):
    out_dir = request.getfixturevalue(f"{arch}_dir")
    capsys.readouterr()  # what training the checkpoint printed, if this test was the first to need it
    start = {"gpt": "ROMEO:", "encoder": "To be or [MASK]"}[arch]
    args = ("--out_dir", out_dir, "--start", start, "--max_new_tokens=1")
    code, out, err = cli(capsys, *args, option)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert option in err and "beam search applies to encoder-decoder checkpoints" in err and instead in err
    assert cli(capsys, *args, "--beam_size=1", "--length_penalty=0.6")[0] == 0  # the defaults, spelled out, are fine


@pytest.mark.parametrize(
    "arch,option,applies",
    [
        (
            "seq2seq",
            "--temperature=0.5",
            "sampling (--temperature, --top_k, --top_p, --num_samples, --chat) applies to GPT",
        ),
        ("seq2seq", "--num_samples=3", "applies to GPT checkpoints only"),
        ("seq2seq", "--candidates=3", "--candidates applies to encoder"),
        ("encoder", "--top_p=0.9", "applies to GPT checkpoints only"),
        ("gpt", "--candidates=2", "--candidates applies to encoder"),
    ],
)
def test_options_another_architecture_uses_are_refused_not_ignored(request, capsys, arch, option, applies):
    out_dir = request.getfixturevalue(f"{arch}_dir")
    capsys.readouterr()
    start = {"gpt": "ROMEO:", "encoder": "To be or [MASK]", "seq2seq": "abc"}[arch]
    code, out, err = cli(capsys, "--out_dir", out_dir, "--start", start, "--max_new_tokens=4", option)
    assert code == 2 and out == "" and err.count("\n") == 1 and option in err and applies in err


def test_bpe_checkpoint_without_tiktoken_files_is_one_line(tmp_path):
    """A GPT-2 BPE checkpoint, offline, with an empty tiktoken cache: its tokenizer cannot load; one line, exit 2."""
    model = build_model(ModelConfig(arch="gpt", vocab_size=50257, block_size=8, n_layer=1, n_head=1, n_embd=8))
    out_dir = save_checkpoint(tmp_path / "bpe", model, tokens.GPT2_META)
    (tmp_path / "empty_cache").mkdir()
    env = {k: v for k, v in os.environ.items() if k.lower() != "no_proxy"}
    with socket.socket() as refusing:
        # tiktoken downloads through this proxy, which refuses at once: offline however this machine is connected
        refusing.bind(("127.0.0.1", 0))  # bound, never listening
        proxy = f"http://127.0.0.1:{refusing.getsockname()[1]}"
        env |= {"TIKTOKEN_CACHE_DIR": str(tmp_path / "empty_cache"), "HTTPS_PROXY": proxy, "https_proxy": proxy}
        result = subprocess.run(
            [sys.executable, "sample.py", "--out_dir", out_dir, "--start", "Hi"],
            env=env,
            capture_output=True,
            text=True,
            cwd=Path(sample.__file__).parent,
            timeout=120,
        )
    assert result.returncode == 2 and result.stdout == "" and "Traceback" not in result.stderr
    assert result.stderr.startswith("sample.py: error: could not load tiktoken") and result.stderr.count("\n") == 1
    assert "TIKTOKEN_CACHE_DIR" in result.stderr


def test_unknown_gpt2_weights_offline_is_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # a hub id (no such folder here): the hub is asked, and is offline
    code, _, err = cli(capsys, "--init_from", "no-such-org/no-such-model")
    assert code == 2 and err.count("\n") == 1 and "not a local directory" in err
    # a path that is not there is named as missing, before any hub
    code, _, err = cli(capsys, "--init_from", tmp_path / "no-such-model")
    assert code == 2 and err.count("\n") == 1 and "no such file or folder" in err


def test_encoder_inputs_that_do_not_fit(encoder_dir, seq2seq_dir, capsys):
    code, _, err = cli(capsys, "--out_dir", encoder_dir, "--start", "no mask here")
    assert code == 2 and "put [MASK] in --start" in err
    code, _, err = cli(capsys, "--out_dir", encoder_dir, "--start", "[MASK]" + "x" * 40)
    assert code == 2 and "41 tokens, more than the model's block_size=32" in err
    code, _, err = cli(capsys, "--out_dir", seq2seq_dir, "--start", "abc" * 11)
    assert code == 2 and "33 tokens, more than the model's block_size=32" in err
    code, _, err = cli(capsys, "--out_dir", seq2seq_dir, "--start", "ABC")
    assert code == 2 and "'A', 'B', 'C'" in err
    code, _, err = cli(capsys, "--out_dir", seq2seq_dir, "--start", "")
    assert code == 2 and "give it a source" in err


def test_command_line_exit_code_and_no_traceback():
    result = subprocess.run(
        [sys.executable, "sample.py", "--top_p=2"], capture_output=True, text=True, cwd=Path(sample.__file__).parent
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == "sample.py: error: top_p must be in (0, 1], got 2.0\n"


def test_help_lists_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        sample.cli(["--help"])
    assert exit_info.value.code == 0
    shown = capsys.readouterr().out
    for field in fields(sample.SampleConfig):
        assert re.search(rf"^  --{field.name}=\S*\s+\S", shown, re.MULTILINE), field.name  # each with its doc


# -----------------------------------------------------------------------------
# Hugging Face folders with their tokenizer.json (Llama and Mistral)


def test_init_from_llama_folder_matches_transformers_greedy(llama_dir, tmp_path, capsys):
    import tokenizers
    import transformers

    hf = transformers.LlamaForCausalLM.from_pretrained(llama_dir).eval()
    reference = tokenizers.Tokenizer.from_file(str(llama_dir / "tokenizer.json"))

    def greedy(ids):
        out = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=1)
        new = out[0, len(ids) :].tolist()
        return new[: new.index(1)] if 1 in new else new  # eos (1) ends a sample and is not printed

    prompt = reference.encode("ROMEO:").ids  # with the template: bos (0) first, as transformers' tokenizer does
    assert prompt[0] == 0
    new = greedy(prompt)
    assert len(new) > 4  # enough tokens to tell two models apart
    args = ("--init_from", llama_dir, "--temperature=0", "--max_new_tokens=12", "--device=cpu")
    code, out, _ = cli(capsys, *args, "--start", "ROMEO:")
    assert code == 0 and out == reference.decode(prompt[1:] + new, skip_special_tokens=False) + "\n"
    # no prompt: the sample starts from bos, which is not printed
    code, out, _ = cli(capsys, *args)
    assert code == 0 and out == reference.decode(greedy([0]), skip_special_tokens=False) + "\n"
    # a tokenizer without a template: bos is config.json's bos_token_id
    plain = shutil.copytree(llama_dir, tmp_path / "plain")
    reference.post_processor = None
    reference.save(str(plain / "tokenizer.json"))
    assert cli(capsys, "--init_from", plain, *args[2:]) == (0, out, "")


def test_llama_folder_without_its_tokenizer_is_one_line(llama_dir, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(llama_dir / name, bare / name)
    code, out, err = cli(capsys, "--init_from", bare, "--start", "Hi", "--device=cpu")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert f"{bare} has no tokenizer.json" in err and "put the model's tokenizer.json" in err
    # a tokenizer with no bos, neither in its template nor in config.json: only a prompt can start a sample
    import tokenizers

    tokenizer = tokenizers.Tokenizer.from_file(str(llama_dir / "tokenizer.json"))
    tokenizer.post_processor = None
    tokenizer.save(str(bare / "tokenizer.json"))
    config = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**config, "bos_token_id": None}))
    code, out, err = cli(capsys, "--init_from", bare, "--device=cpu", "--max_new_tokens=2")
    assert code == 2 and out == "" and err.count("\n") == 1 and "give a prompt with --start" in err
    assert cli(capsys, "--init_from", bare, "--device=cpu", "--max_new_tokens=2", "--start", "Hi")[0] == 0


def test_init_from_a_train_out_dir_says_to_resume(gpt_dir, capsys):
    """A newcomer's mistake: --init_from=OUT_DIR instead of --out_dir=OUT_DIR. One line naming the right option."""
    code, out, err = cli(capsys, "--init_from", gpt_dir, "--start", "Hi", "--device=cpu")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "is not a Hugging Face model folder" in err and f"--init_from=resume --out_dir={gpt_dir}" in err


def test_a_missing_path_is_named_with_the_nearest_that_exists(gpt_dir, capsys, monkeypatch, tmp_path):
    """A mistyped checkpoint path is named as missing in every script that loads one, with the path meant."""
    monkeypatch.chdir(Path(gpt_dir).parent)
    name = Path(gpt_dir).name
    typo, meant = f"{name[:-1]}/ckpt.pt", f"{name}/ckpt.pt"
    message = f"init_from={typo}: no such file or folder; did you mean {meant}?"
    for script, args in (
        (sample.cli, []),
        (evaluation.cli, []),
        (train.cli, ["--dataset=shakespeare_char", "--device=cpu"]),
    ):
        assert script([f"--init_from={typo}", *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    # export.py reads a run's folder: its typo is answered with the folder meant
    assert export.cli([f"--out_dir={name[:-1]}", f"--dest={tmp_path / 'hf'}"]) == 2
    assert f"did you mean --out_dir={name}?" in capsys.readouterr().err
    # a run's folder given where a config file goes
    code, out, err = cli(capsys, name)
    assert code == 2 and f"{name} is a folder, not a config file: name a run's folder with --out_dir={name}" in err


def interrupted(args, started, tmp_path):
    """
    Run a script (args) in a child, send it Ctrl-C (SIGINT) once `started` ("stdout" or "stderr") shows its work has
    begun, and return (exit status, stdout, stderr). Bounded: a child that does not stop is killed, failing the test.
    """
    streams = {"stdout": tmp_path / "out.txt", "stderr": tmp_path / "err.txt"}
    with streams["stdout"].open("w") as out, streams["stderr"].open("w") as err:
        child = subprocess.Popen([sys.executable, *args], stdout=out, stderr=err, cwd=Path(sample.__file__).parent)
        try:
            deadline = time.monotonic() + 120
            while not streams[started].stat().st_size and child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            child.send_signal(signal.SIGINT)
            code = child.wait(timeout=60)
        finally:
            child.kill()
    return code, streams["stdout"].read_text(), streams["stderr"].read_text()


def test_ctrl_c_in_sample_and_eval_is_one_line_and_exit_130(gpt_dir, shakespeare_path, tmp_path):
    code, out, err = interrupted(
        ["sample.py", f"--out_dir={gpt_dir}", "--stream=True", "--max_new_tokens=1000000", "--device=cpu"],
        "stdout",
        tmp_path,
    )
    assert (code, err) == (130, "sample.py: interrupted\n") and out
    # eval.py's progress bar on stderr says it has begun: a million windows of one token each
    args = ["eval.py", f"--out_dir={gpt_dir}", f"--input={shakespeare_path}", "--stride=1", "--progress=True"]
    code, out, err = interrupted([*args, "--device=cpu"], "stderr", tmp_path)
    assert code == 130 and out == "" and "Traceback" not in err
    assert err.splitlines()[-1].endswith("eval.py: interrupted"), err


def test_a_model_loaded_on_a_cpu_holds_its_weights_column_by_column_and_keeps_its_tie(tmp_path, data_root):
    train_tiny(tmp_path, data_root, "shakespeare_char", "gpt")
    model, *_ = start.load_model("resume", out_dir=tmp_path, checkpoint="ckpt.pt", dataset="", device="cpu")
    plain = start.model_from_checkpoint(checkpoint.load_checkpoint(tmp_path / "ckpt.pt"))
    linears = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    assert len(linears) == 2 * 4 + 1  # each block's qkv, proj, fc and MLP proj, and the head
    for name in linears:
        weight = model.get_submodule(name).weight
        assert weight.stride() == (1, weight.size(0)), name
        assert torch.equal(weight, plain.get_submodule(name).weight), name  # the same values
    assert model.body.wte.weight is model.lm_head.weight  # still tied: one tensor
    head = model.lm_head.weight
    x = torch.randint(0, head.size(0), (3, 20))
    with torch.no_grad():
        torch.testing.assert_close(model(x)[0], plain(x)[0], rtol=0, atol=1e-5)
