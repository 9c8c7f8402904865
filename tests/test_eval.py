"""eval.py and tokens.token_byte_lengths: every number against an explicit reference loop computed here, the
command line end to end on tiny trained checkpoints, and each kind of bad input as one line with exit status 2."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

import eval as evaluation
import prepare_data
import tokens
import train
from checkpoint import load_checkpoint
from hf import from_pretrained, pretrained_meta
from start import model_from_checkpoint
from tasks.lm import lm_loss, window_starts
from tasks.masked_lm import MaskedLM, mask_tokens

# train.py's settings for a real checkpoint in a second or two: 2 layers, 32 wide, 32 positions
TINY = dict(
    n_layer=2,
    n_head=2,
    n_embd=32,
    block_size=32,
    batch_size=8,
    gradient_accumulation_steps=1,
    eval_iters=1,
    eval_interval=1000,
    log_interval=1000,
    device="cpu",
    dtype="float32",
    compile=False,
    tensorboard=False,
    learning_rate=1e-2,
    min_lr=1e-3,
    warmup_iters=0,
)
# a text that is not all ASCII, so that its bytes and its characters differ
MULTILINGUAL = "Hello, café naïve — 日本語の文 🙂 end.\n\nKing: ﬁne ＡＢＣ ẞ ok"


def train_tiny(out_dir, data_dir, dataset, arch, max_iters, **overrides):
    """A real checkpoint of train.py after max_iters steps of a 2-layer, 32-wide model."""
    cfg = train.TrainConfig(
        **{**TINY, **overrides},
        out_dir=str(out_dir),
        data_dir=str(data_dir),
        dataset=dataset,
        arch=arch,
        max_iters=max_iters,
        lr_decay_iters=max_iters,
    )
    train.main(cfg)
    return out_dir


@pytest.fixture(scope="module")
def gpt_dir(shakespeare_char_dir, tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("gpt"), shakespeare_char_dir.parent, "shakespeare_char", "gpt", 30)


@pytest.fixture(scope="module")
def encoder_dir(shakespeare_char_dir, tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("mlm"), shakespeare_char_dir.parent, "shakespeare_char", "encoder", 5)


@pytest.fixture(scope="module")
def reverse_dir(tmp_path_factory):
    """The synthetic 'reverse' task, small: 20 test pairs of 1 to 4 characters."""
    return prepare_data.prepare(
        "reverse", data_dir=tmp_path_factory.mktemp("data"), num_train=300, num_val=20, num_test=20, max_len=4
    )


@pytest.fixture(scope="module")
def seq2seq_dir(reverse_dir, tmp_path_factory):
    # enough steps that some outputs are right and some wrong
    return train_tiny(
        tmp_path_factory.mktemp("seq2seq"),
        reverse_dir.parent,
        "reverse",
        "encoder_decoder",
        300,
        eval_accuracy_examples=0,
        batch_size=32,
    )


def load(out_dir):
    ckpt = load_checkpoint(Path(out_dir) / "best.pt")
    return model_from_checkpoint(ckpt), tokens.Tokenizer.from_meta(ckpt["meta"]), ckpt["meta"]


def run(capsys, *args):
    """eval.py's command line in this process: (exit status, stdout, stderr)."""
    code = evaluation.cli([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *args):
    code, out, err = run(capsys, *args, "--json")
    assert code == 0, err
    return json.loads(out)


# -----------------------------------------------------------------------------
# Bytes per token


def byte_level_bpe(text):
    """A GPT-2-style byte-level BPE of 300 ids trained on text, with <s> and </s> and one plain added token."""
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator([text], trainer)
    tokenizer.add_tokens(["thou art"])  # matched in the raw text: it stands for its 8 bytes
    return tokenizer


def sentencepiece_style():
    """Llama 2's layout: '▁' for spaces (prepended to every text), <0xNN> byte fallback, a Sequence decoder."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab |= {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in "▁abcdefghijklmnopqrstuvwxyzHK,.:":
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he")]
    vocab |= {a + b: len(vocab) + i for i, (a, b) in enumerate(merges)}
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tokenizer


def hf_meta(tokenizer, special):
    vocab_size = tokenizer.get_vocab_size()
    return {
        "tokenizer": {"type": "huggingface", "json": tokenizer.to_str()},
        "vocab_size": vocab_size,
        "special_tokens": special,
    }


def assert_sums_to_utf8_bytes(meta, texts, extra=0):
    """The byte lengths of each text's ids add up to its UTF-8 length (plus extra); special tokens count 0."""
    lengths, tokenizer = tokens.token_byte_lengths(meta), tokens.Tokenizer.from_meta(meta)
    assert lengths.shape == (meta["vocab_size"],) and lengths.dtype == np.int64
    for text in texts:
        assert lengths[tokenizer.encode(text)].sum() == len(text.encode("utf-8")) + extra, text[:40]
    assert not lengths[list(meta["special_tokens"].values())].any()
    return lengths, tokenizer


def test_token_byte_lengths_sum_to_the_utf8_bytes_of_real_texts(shakespeare_path, shakespeare_char_dir):
    shakespeare = shakespeare_path.read_text(encoding="utf-8")
    texts = [MULTILINGUAL, shakespeare[:30_000], "thou art here", " \n  x"]
    # GPT-2's BPE with its end-of-text and a seq2seq dataset's pad after it
    gpt2 = {**tokens.GPT2_META, "vocab_size": 50258, "special_tokens": {"eot": 50256, "pad": 50257}}
    lengths, tokenizer = assert_sums_to_utf8_bytes(gpt2, texts)
    # a byte-level token may hold part of a character, and counts its own bytes: '🙂' is 4 bytes in 2 tokens
    assert lengths[tokenizer.encode("🙂")].tolist() == [2, 2]

    # a tokenizer.json of byte-level BPE, with special <s> and </s> and a plain added token
    byte_level = byte_level_bpe(shakespeare[:20_000])
    lengths, tokenizer = assert_sums_to_utf8_bytes(hf_meta(byte_level, {"bos": 0}), texts)
    assert lengths[tokenizer.encode("日")].tolist() == [1, 1, 1]
    assert lengths[byte_level.token_to_id("</s>")] == 0 and lengths[byte_level.token_to_id("thou art")] == 8
    # every token that decodes to whole characters on its own stands for those characters' bytes
    for i in range(byte_level.get_vocab_size()):
        text = byte_level.decode([i], skip_special_tokens=True)
        if "\ufffd" not in text:
            assert lengths[i] == len(text.encode("utf-8")), (i, text)

    # sentencepiece-style: byte-fallback pieces are one byte each; the '▁' put before every text adds one
    texts = ["the cat, café 日本 🙂.", "x", "Hark: the end"]
    lengths, _ = assert_sums_to_utf8_bytes(hf_meta(sentencepiece_style(), {"bos": 1, "eos": 2}), texts, extra=1)
    assert lengths[3 + 0xE6] == 1 and lengths[:3].tolist() == [0, 0, 0]

    # characters: the shakespeare_char vocabulary, and one of characters of 1 to 4 bytes with a [MASK] after it
    assert tokens.token_byte_lengths(tokens.load_meta(shakespeare_char_dir)).tolist() == [1] * 65
    chars = sorted(set(MULTILINGUAL))
    wide = {"tokenizer": {"type": "char", "chars": chars}, "vocab_size": len(chars) + 1}
    assert_sums_to_utf8_bytes({**wide, "special_tokens": {"mask": len(chars)}}, [MULTILINGUAL, "ok"])


# -----------------------------------------------------------------------------
# Language models


def reference_nats(model, ids, block_size, stride):
    """float64 loss of each token after the first, predicted one at a time from the context its window gives it."""
    nats = []
    for j in range(1, len(ids)):
        # window 0 scores targets 1..block_size; window k those after k * stride + block_size - stride
        start = 0 if j <= block_size else math.ceil((j - block_size) / stride) * stride
        logits = model(torch.tensor([ids[start:j]]))[0][0, -1].double()
        nats.append(-logits.log_softmax(dim=-1)[ids[j]].item())
    return nats


def test_lm_loss_and_bits_per_byte_equal_a_float64_loop(gpt_dir):
    model, _, meta = load(gpt_dir)
    # the model's 65 ids read as other characters, some of 2 to 4 bytes, so that bytes are not tokens
    chars = list(meta["tokenizer"]["chars"])
    chars[chars.index("X")], chars[chars.index("Z")], chars[chars.index("Q")] = "é", "—", "🙂"
    wide = {**meta, "tokenizer": {"type": "char", "chars": chars}}
    text = "First Citizen:\nBefore we proceed any further, hear me é — speak 🙂.\n\nAll:\nSpeak, speak. é!" * 2
    ids = tokens.Tokenizer.from_meta(wide).encode(text)
    lengths = tokens.token_byte_lengths(wide)
    block = model.config.block_size
    for stride, batch_size in ((block, 1), (block, 3), (5, 4), (block // 2, 16)):
        counts = lm_loss(model, np.array(ids), lengths, block_size=block, stride=stride, batch_size=batch_size)
        nats = reference_nats(model, ids, block, stride)
        assert counts["tokens"] == len(ids) - 1  # every token but the first, once
        assert counts["bytes"] == len(text.encode("utf-8")) - 1  # the first character is one byte
        assert counts["nats"] == pytest.approx(math.fsum(nats), rel=1e-5)
        assert counts["windows"] == len(window_starts(len(ids), block, stride))
        bits_per_byte = math.fsum(nats) / math.log(2) / sum(len(c.encode("utf-8")) for c in text[1:])
        assert counts["nats"] / math.log(2) / counts["bytes"] == pytest.approx(bits_per_byte, rel=1e-5)


def test_progress_shows_off_a_terminal_as_lines_and_can_be_turned_off(gpt_dir, capsys, monkeypatch):
    """
    Run where stderr is no terminal (a log, a job's output, here pytest's capture), an evaluation still says how far
    it is: a line each log.PROGRESS_SECONDS (0 here: every batch), ending at the count of windows; --progress=false
    says nothing.
    """
    import log

    monkeypatch.setattr(log, "PROGRESS_SECONDS", 0.0)
    code, _, err = run(capsys, "--out_dir", gpt_dir, "--limit=20", "--batch_size=7")
    lines = err.splitlines()
    assert code == 0 and len(lines) >= 3 and "\r" not in err
    assert lines[0].lstrip().startswith("0%") and lines[-1].lstrip().startswith("100%") and "20/20" in lines[-1]
    code, _, err = run(capsys, "--out_dir", gpt_dir, "--limit=20", "--progress=false")
    assert code == 0 and err == ""


def test_cli_on_a_split_and_on_a_file(gpt_dir, shakespeare_char_dir, capsys, tmp_path):
    model, _, meta = load(gpt_dir)
    # the run's data_dir is found in its config.json; --limit: the first 20 windows of the val split
    code, out, err = run(capsys, "--out_dir", gpt_dir, "--limit=20")
    assert code == 0, err
    lines = dict(line.split(maxsplit=1) for line in out.splitlines())
    assert lines["data"] == "shakespeare_char val" and lines["tokens"] == "640" and lines["stride"] == "32"
    result = run_json(capsys, "--out_dir", gpt_dir, "--limit=20", "--batch_size=7")
    val = tokens.load_tokens(shakespeare_char_dir / "val.bin")
    nats = math.fsum(reference_nats(model, val[: 20 * 32 + 1].astype(np.int64).tolist(), 32, 32))
    assert result["loss"] == pytest.approx(nats / 640, rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(nats / 640), rel=1e-5)
    assert result["bits_per_byte"] == pytest.approx(nats / 640 / math.log(2), rel=1e-5)  # one byte a character
    assert f"{result['loss']:.4f}" in out

    text = "KING RICHARD III:\nNow is the winter of our discontent\nMade glorious summer by this sun of York.\n"
    (tmp_path / "york.txt").write_text(text, encoding="utf-8")
    result = run_json(capsys, "--out_dir", gpt_dir, "--input", tmp_path / "york.txt", "--stride=8")
    ids = tokens.Tokenizer.from_meta(meta).encode(text)
    nats = math.fsum(reference_nats(model, ids, 32, 8))
    assert result["tokens"] == result["bytes"] == len(text) - 1 and result["data"] == str(tmp_path / "york.txt")
    assert result["loss"] == pytest.approx(nats / (len(text) - 1), rel=1e-5)


def test_hugging_face_weights_score_every_byte_of_a_file(llama_dir, capsys, tmp_path):
    """A Llama folder with a byte-level tokenizer.json: bos goes first, so every token and byte of the text counts."""
    model = from_pretrained(llama_dir).eval()
    tokenizer = tokens.Tokenizer.from_meta(pretrained_meta(llama_dir))
    text = MULTILINGUAL * 3
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    result = run_json(capsys, "--init_from", llama_dir, "--input", tmp_path / "text.txt")
    ids = [0, *tokenizer.encode(text)]  # <s>, the template's prefix, then the text
    nats = math.fsum(reference_nats(model, ids, 64, 64))
    assert (result["tokens"], result["bytes"]) == (len(ids) - 1, len(text.encode("utf-8"))) and result["windows"] > 1
    assert result["bits_per_byte"] == pytest.approx(nats / math.log(2) / len(text.encode("utf-8")), rel=1e-5)
    assert "come without a dataset" in bad(capsys, "--init_from", llama_dir, "--split=val")


def test_encoder_masked_loss_is_deterministic_and_equals_a_float64_loop(encoder_dir, capsys, tmp_path):
    model, tokenizer, meta = load(encoder_dir)
    text = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 3
    (tmp_path / "hamlet.txt").write_text(text, encoding="utf-8")
    args = ("--out_dir", encoder_dir, "--input", tmp_path / "hamlet.txt", "--mask_prob=0.3")
    result = run_json(capsys, *args)
    # the same masks whatever the batching
    assert run_json(capsys, *args, "--batch_size=1")["masked_loss"] == pytest.approx(result["masked_loss"], rel=1e-6)
    assert run_json(capsys, *args, "--seed=7")["masked_loss"] != result["masked_loss"]
    assert "perplexity" not in result and "bits_per_byte" not in result
    # each window of 32 masked by its own generator, seeded by seed + its index, as in training
    ids = torch.tensor(tokenizer.encode(text))
    mask = meta["special_tokens"]["mask"]
    task = MaskedLM(meta, mask_prob=0.3, data_vocab=mask)
    nats = []
    for k, start in enumerate(range(0, len(ids), 32)):
        inputs, targets = mask_tokens(ids[None, start : start + 32], task, torch.Generator().manual_seed(1337 + k))
        logp = model(inputs)[0][0].double().log_softmax(dim=-1)
        for position in (targets[0] != -100).nonzero()[:, 0].tolist():
            nats.append(-logp[position, targets[0, position]].item())
    assert result["masked_tokens"] == len(nats) > 0 and result["windows"] == math.ceil(len(ids) / 32)
    assert result["masked_loss"] == pytest.approx(math.fsum(nats) / len(nats), rel=1e-5)


# -----------------------------------------------------------------------------
# Sequence to sequence


def reference_beam_search(model, src, max_len, bos, eos, beam_size, length_penalty):
    """
    Beam search as a plain loop over hypotheses, float64 log-probabilities of the uncached forward: each step extends
    every live hypothesis by every token and ranks the extensions; one ending at eos finishes if it ranks among the
    first beam_size, and the beam_size best others go on. The best finished hypothesis, or one that ran out of steps,
    by log p / ((5 + tokens with eos) / 6) ** length_penalty, wins. It stops once the best finished beats every live
    hypothesis's log p over the largest penalty: log p only falls as a hypothesis grows, so none could win later.
    """

    def normalised(log_p, hyp):
        return log_p / ((5 + len(hyp)) / 6) ** length_penalty

    largest = max(((5 + n) / 6) ** length_penalty for n in (1, max_len))
    live, finished = [(0.0, [])], []
    for _ in range(max_len):
        extensions = []
        for log_p, hyp in live:
            logits = model(src, torch.tensor([[bos, *hyp]]))[0][0, -1]
            extensions += [(log_p + lp, [*hyp, t]) for t, lp in enumerate(logits.double().log_softmax(dim=-1).tolist())]
        extensions.sort(key=lambda e: e[0], reverse=True)
        live = []
        for rank, (log_p, hyp) in enumerate(extensions):
            if hyp[-1] == eos and rank < beam_size:
                finished.append((normalised(log_p, hyp), hyp))
            elif hyp[-1] != eos and len(live) < beam_size:
                live.append((log_p, hyp))
        if finished and max(finished)[0] >= max(log_p for log_p, _ in live) / largest:
            break
    else:  # out of steps: the live hypotheses compete with the finished ones
        finished += [(normalised(log_p, hyp), hyp) for log_p, hyp in live]
    return max(finished)[1]


def reference_seq2seq(model, pairs, special, block_size, beam_size, length_penalty):
    """(exact matches, matching reference tokens, reference tokens, nats, targets) one pair at a time: greedy as an
    argmax loop without a cache, beam search as reference_beam_search."""
    bos, eos = special["bos"], special["eos"]
    exact = correct = total = targets = 0
    nats = []
    for src, tgt in pairs:
        src = torch.tensor([src.tolist()])
        reference = [*tgt.tolist(), eos]
        logp = model(src, torch.tensor([[bos, *tgt.tolist()]]))[0][0].double().log_softmax(dim=-1)
        nats += [-logp[i, t].item() for i, t in enumerate(reference)]
        targets += len(reference)
        if beam_size > 1:
            output = reference_beam_search(model, src, block_size, bos, eos, beam_size, length_penalty)
        else:
            output = [bos]
            while len(output) <= block_size and output[-1] != eos:
                output.append(model(src, torch.tensor([output]))[0][0, -1].argmax().item())
            output = output[1:]
        output = output[: output.index(eos) + 1] if eos in output else output
        exact += output == reference
        correct += sum(o == r for o, r in zip(output, reference))
        total += len(reference)
    return exact, correct, total, math.fsum(nats), targets


# length_penalty 20 favours long hypotheses so much that the totals change (0 exact of 20 and 21 tokens right, against
# 8 and 42 at 0.6): a penalty lost between the command line and the decoder shows
@pytest.mark.parametrize(("beam_size", "length_penalty"), [(1, 0.6), (3, 0.6), (3, 20.0)])
def test_seq2seq_exact_match_and_token_accuracy_equal_a_loop_over_pairs(
    seq2seq_dir, reverse_dir, capsys, beam_size, length_penalty
):
    model, _, meta = load(seq2seq_dir)
    pairs = tokens.load_pairs(reverse_dir, "test")
    args = [f"--beam_size={beam_size}", f"--length_penalty={length_penalty}", "--batch_size=6"]
    result = run_json(capsys, "--out_dir", seq2seq_dir, "--split=test", *args)
    special = meta["special_tokens"]
    exact, correct, total, nats, targets = reference_seq2seq(model, pairs, special, 32, beam_size, length_penalty)
    assert (result["data"], result["pairs"], result["left_out"]) == ("reverse test", 20, 0)
    assert 0 < correct < total  # some tokens right, some wrong: both branches of the comparison are seen
    assert result["exact_match"] == exact / 20
    assert result["token_accuracy"] == correct / total
    assert result["loss"] == pytest.approx(nats / targets, rel=1e-5)


# -----------------------------------------------------------------------------
# Bad input: one line on stderr, exit status 2, no traceback


def bad(capsys, *args):
    code, out, err = run(capsys, *args)
    assert code == 2 and not out and err.count("\n") == 1 and err.startswith("eval.py: error: "), (code, out, err)
    return err


def test_wrong_architecture_missing_split_and_other_mistakes(gpt_dir, encoder_dir, seq2seq_dir, capsys, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("To be, or not to be", encoding="utf-8")
    assert "this checkpoint's arch is encoder_decoder" in bad(capsys, "--out_dir", seq2seq_dir, "--task=masked_lm")
    assert "this checkpoint's arch is encoder" in bad(capsys, "--out_dir", encoder_dir, "--task=lm")
    assert "this checkpoint's arch is gpt" in bad(capsys, "--out_dir", gpt_dir, "--task=seq2seq")
    assert "--task=seq2seq" in bad(capsys, "--out_dir", seq2seq_dir, "--task=lm")
    assert "its splits are train and val, not test" in bad(capsys, "--out_dir", gpt_dir, "--split=test")
    assert "prepare the data first: python prepare_data.py shakespeare_char" in bad(
        capsys, "--out_dir", gpt_dir, "--data_dir", tmp_path
    )
    assert "no checkpoint at" in bad(capsys, "--out_dir", tmp_path / "missing")
    empty = tmp_path / "empty.txt"
    empty.write_text("", encoding="utf-8")
    assert "is empty" in bad(capsys, "--out_dir", gpt_dir, "--input", empty)
    empty.write_text("a", encoding="utf-8")
    assert "has 1 token(s): at least 2 are needed" in bad(capsys, "--out_dir", gpt_dir, "--input", empty)
    empty.write_bytes(b"\xff\xfe binary")
    assert "is not UTF-8 text" in bad(capsys, "--out_dir", gpt_dir, "--input", empty)
    assert "not found" in bad(capsys, "--out_dir", gpt_dir, "--input", tmp_path / "nope.txt")
    assert "not both" in bad(capsys, "--out_dir", gpt_dir, "--input", text, "--split=val")
    assert "seq2seq, not to task=lm" in bad(capsys, "--out_dir", gpt_dir, "--beam_size=4")
    assert "--stride applies to task=lm, not to task=masked_lm" in bad(capsys, "--out_dir", encoder_dir, "--stride=8")
    assert "at most the model's block_size=32" in bad(capsys, "--out_dir", gpt_dir, "--stride=64")
    assert "give --split, not --input" in bad(capsys, "--out_dir", seq2seq_dir, "--input", text)
    assert "unknown key 'splt'" in bad(capsys, "--splt=val")
    assert "split must be one of" in bad(capsys, "--split=dev")
