"""Token files, tokenizers (tokens.py), every dataset (prepare_data.py) and the synthetic datasets (synthetic.py).

Each is checked against independent references: the raw text, tiktoken itself (r50k_base: the same
ids as gpt2, and loadable offline), struct-parsed headers and explicit loops, never this module's own output.
"""

import functools
import io
import json
import logging
import os
import random
import shutil
import struct
import subprocess
import sys
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import tiktoken
import tokenizers

import prepare_data
import synthetic
import tokens
from recipes import RECIPES, prepare
from recipes.shakespeare_char import SHAKESPEARE_URL
from recipes.text import checked_cut, text_pieces
from synthetic import solve
from tokens import (
    DownloadError,
    Tokenizer,
    TokenWriter,
    check_prepared,
    dataset_dir,
    is_prepared,
    load_meta,
    load_pairs,
    load_tokens,
    tiktoken_encoding,
)

EOT = 50256
TRAIN_CHARS = 1_003_854  # nanoGPT's int(0.9 * 1,115,394)


@pytest.fixture(scope="module")
def r50k():
    return tiktoken.get_encoding("r50k_base")


@pytest.fixture(scope="module")
def text(shakespeare_path):
    return shakespeare_path.read_text(encoding="utf-8")


def leftovers(folder):
    """Hidden temporary files or staging folders left in `folder`."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def header(path):
    return struct.unpack("<8sIIQQ", path.read_bytes()[:32])


# ----------------------------------------------------------------------------- Shakespeare


def test_shakespeare_char_matches_nanogpt(shakespeare_char_dir, text):
    meta = load_meta(shakespeare_char_dir)
    chars = sorted(set(text))
    assert len(text) == 1_115_394 and len(chars) == 65
    assert meta["kind"] == "lm" and meta["vocab_size"] == 65 and meta["special_tokens"] == {}
    assert meta["tokenizer"] == {"type": "char", "chars": chars}
    train, val = load_tokens(shakespeare_char_dir / "train.bin"), load_tokens(shakespeare_char_dir / "val.bin")
    assert (len(train), len(val)) == (TRAIN_CHARS, 111_540)
    assert isinstance(train, np.memmap) and train.dtype == np.uint16
    index = {c: i for i, c in enumerate(chars)}
    np.testing.assert_array_equal(np.concatenate([train, val]), [index[c] for c in text])


def test_char_tokenizer_round_trip(shakespeare_char_dir, text):
    tok = Tokenizer.from_meta(load_meta(shakespeare_char_dir))
    assert tok.vocab_size == 65 and tok.special_tokens == {}
    assert tok.decode(load_tokens(shakespeare_char_dir / "val.bin")) == text[TRAIN_CHARS:]
    chars = sorted(set(text))
    assert tok.encode("ROMEO: Hi!") == [chars.index(c) for c in "ROMEO: Hi!"]
    with pytest.raises(ValueError, match="'é'.*'€'|'€'.*'é'"):
        tok.encode("café costs 3€")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([65])


def random_blocks(text, rng):
    """text cut into blocks of 1 to 400 characters at random places, as a file is read in blocks."""
    blocks, i = [], 0
    while i < len(text):
        size = rng.randint(1, 400)
        blocks.append(text[i : i + size])
        i += size
    return blocks


def test_shakespeare_bpe_matches_tiktoken(tmp_path, text, r50k):
    folder = prepare("shakespeare", data_dir=tmp_path)
    meta = load_meta(folder)
    assert meta["tokenizer"] == {"type": "tiktoken", "encoding": "gpt2"}
    assert meta["vocab_size"] == 50257 and meta["special_tokens"] == {"eot": EOT}
    train, val = load_tokens(folder / "train.bin"), load_tokens(folder / "val.bin")
    assert train.tolist() == r50k.encode_ordinary(text[:TRAIN_CHARS])  # several pieces, encoded in parallel
    assert val.tolist() == r50k.encode_ordinary(text[TRAIN_CHARS:])
    assert (len(train), len(val)) == (301_966, 36_059)  # nanoGPT's published counts
    tok = Tokenizer.from_meta(meta)
    assert tok.decode(val) == text[TRAIN_CHARS:]
    assert tok.decode(tok.encode("Hello, world")) == "Hello, world"


def test_bpe_pieces_encode_like_the_whole_text(r50k):
    # whitespace next to newlines is where cutting text changes GPT-2 tokens
    rng = random.Random(0)
    parts = [
        "hello",
        " world",
        "'s",
        "\n",
        "\n\n",
        " \n",
        "\r\n",
        "\t\n",
        "  ",
        "42",
        " é",
        "日本",
        "?!",
        "\n'll",
        "\n x",
    ]
    text = "".join(rng.choice(parts) for _ in range(20_000))
    pieces = list(text_pieces(random_blocks(text, rng)))
    assert len(pieces) > 50 and "".join(pieces) == text
    assert [t for piece in pieces for t in r50k.encode_ordinary(piece)] == r50k.encode_ordinary(text)


def test_gpt2_is_read_as_r50k_base_and_warns_only_without_it(monkeypatch, caplog):
    """
    With r50k_base at hand (the offline cache holds it), 'gpt2' is read from it: tiktoken's own 'gpt2', whose files
    no such cache holds, is never asked for, so nothing goes to the network and nothing is printed. Only a
    machine without r50k_base hears of it, once per process, and gets the same ids from GPT-2's own files.
    """
    real, asked = tiktoken.get_encoding, []

    def offline(name):
        asked.append(name)
        if name == "gpt2":
            raise ConnectionError("no network")
        return real(name)

    def gpt2_files_only(name):
        asked.append(name)
        if name == "r50k_base":
            raise ConnectionError("no network")
        return real("r50k_base")  # the same ids as GPT-2's own files give

    spec, reference = {"type": "tiktoken", "encoding": "gpt2"}, real("r50k_base").encode_ordinary("Hello world")
    tiktoken_encoding.cache_clear()
    try:
        monkeypatch.setattr(tiktoken, "get_encoding", offline)
        with caplog.at_level(logging.WARNING, logger="nanoformer.data"):
            assert Tokenizer(spec, 50257, {}).encode("Hello world") == reference
        assert asked == ["r50k_base"] and caplog.records == []

        monkeypatch.setattr(tiktoken, "get_encoding", gpt2_files_only)
        tiktoken_encoding.cache_clear()
        asked.clear()
        with caplog.at_level(logging.WARNING, logger="nanoformer.data"):
            first = Tokenizer(spec, 50257, {})
            second = Tokenizer(spec, 50257, {})
        assert first.encode("Hello world") == second.encode("Hello world") == reference
        assert asked == ["r50k_base", "gpt2"]  # once: the encoding is cached for the process
        assert len(caplog.records) == 1 and "TIKTOKEN_CACHE_DIR holding r50k_base" in caplog.records[0].getMessage()

        monkeypatch.setattr(tiktoken, "get_encoding", lambda name: offline("gpt2"))
        tiktoken_encoding.cache_clear()
        with pytest.raises(DownloadError, match="TIKTOKEN_CACHE_DIR"):
            Tokenizer(spec, 50257, {})
    finally:
        tiktoken_encoding.cache_clear()


# ----------------------------------------------------------------------------- token files


def write_tokens(path, chunks, vocab_size):
    """A token file written as prepare_data.py writes one (TokenWriter in atomic_output); returns the ids written."""
    with tokens.atomic_output(path) as f:
        writer = TokenWriter(f, vocab_size)
        for chunk in chunks:
            writer.write(chunk)
        return writer.finish()


def test_header_and_dtypes(tmp_path):
    small = tmp_path / "small.bin"
    assert write_tokens(small, [np.arange(65)], vocab_size=65) == 65
    assert header(small) == (b"NFTOKENS", 1, 2, 65, 65)
    assert np.frombuffer(small.read_bytes()[32:], "<u2").tolist() == list(range(65))

    edge = tmp_path / "edge.bin"  # 65,536 ids still fit uint16
    write_tokens(edge, [[0, 65535]], vocab_size=65536)
    assert header(edge)[2] == 2 and load_tokens(edge).tolist() == [0, 65535]

    big = tmp_path / "big.bin"  # a made-up 70,000-id vocabulary: uint32, nothing wraps
    ids = [0, 65535, 65536, 69999]
    assert write_tokens(big, (np.array(ids[:2]), np.array(ids[2:])), vocab_size=70000) == 4
    assert header(big) == (b"NFTOKENS", 1, 4, 70000, 4)
    tokens = load_tokens(big)
    assert tokens.dtype == np.uint32 and tokens.tolist() == ids
    with pytest.raises(ValueError):
        tokens[0] = 1  # read-only
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize(
    "tokens, vocab_size, message",
    [
        ([70000], 65536, "outside the vocabulary"),
        ([-1], 10, "outside the vocabulary"),
        ([1.5], 10, "must be integers"),
        ([1], 2**32 + 1, "too large"),
    ],
)
def test_write_tokens_refuses_ids_that_do_not_fit(tmp_path, tokens, vocab_size, message):
    with pytest.raises(ValueError, match=message):
        write_tokens(tmp_path / "x.bin", [tokens], vocab_size)
    assert list(tmp_path.iterdir()) == []


def test_load_tokens_rejects_damaged_files(tmp_path):
    good = tmp_path / "good.bin"
    write_tokens(good, [np.arange(100)], vocab_size=100)
    raw = good.read_bytes()
    cases = {
        "bad magic": b"NOTTOKEN" + raw[8:],
        "newer": raw[:8] + struct.pack("<I", 2) + raw[12:],
        "truncated: its header promises 100": raw[:-3],
        "shorter than the 32-byte header": raw[:10],
    }
    for message, content in cases.items():
        path = tmp_path / "bad.bin"
        path.write_bytes(content)
        with pytest.raises(ValueError, match=message):
            load_tokens(path)


def test_interrupted_write_leaves_nothing(tmp_path):
    def chunks():
        yield np.arange(10)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_tokens(tmp_path / "x.bin", chunks(), vocab_size=100)
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- preparing


def small_corpus(folder):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "corpus.txt"
    path.write_text("To be, or not to be: that is the question.\n" * 50, encoding="utf-8")
    return path


def test_interrupted_prepare_keeps_the_old_dataset(tmp_path, monkeypatch):
    corpus = small_corpus(tmp_path / "in")
    data = tmp_path / "data"
    folder = prepare("text", data_dir=data, input=str(corpus), tokenizer="char", name="corpus")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}

    def interrupted(self, texts, num_threads=1):
        raise KeyboardInterrupt

    monkeypatch.setattr(Tokenizer, "encode_batch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare("text", data_dir=data, force=True, input=str(corpus), tokenizer="char", name="corpus")
    with pytest.raises(KeyboardInterrupt):
        prepare("text", data_dir=data, input=str(corpus), tokenizer="char", name="fresh")
    assert is_prepared(folder) and {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert sorted(p.name for p in data.iterdir()) == ["corpus"]  # no staging folder, no half-built "fresh"


def test_idempotent_unless_forced_or_changed(tmp_path):
    options = {"num_train": 200, "num_val": 20, "num_test": 20}
    folder = prepare("reverse", data_dir=tmp_path, **options)

    def identity():
        return {p.name: (p.stat().st_ino, p.read_bytes()) for p in folder.iterdir()}

    first = identity()
    assert prepare("reverse", data_dir=tmp_path, **options) == folder and identity() == first  # untouched
    prepare("reverse", data_dir=tmp_path, force=True, **options)
    forced = identity()
    assert all(forced[n][0] != first[n][0] and forced[n][1] == first[n][1] for n in first)  # rewritten, same bytes
    prepare("reverse", data_dir=tmp_path, seed=1, **options)
    assert identity()["train_src.bin"][1] != first["train_src.bin"][1]  # a changed option rebuilds
    (folder / "val_idx.npy").unlink()
    assert not is_prepared(folder)
    prepare("reverse", data_dir=tmp_path, seed=1, **options)  # a damaged dataset is rebuilt
    assert is_prepared(folder)


def test_check_prepared_names_the_damaged_file(tmp_path):
    good = prepare("text", data_dir=tmp_path, input=str(small_corpus(tmp_path / "in")), tokenizer="char", name="good")
    check_prepared(good)  # raises nothing
    assert is_prepared(good)
    count = load_meta(good)["files"]["train.bin"]
    names = ("truncated", "missing", "miscounted", "unlisted", "foreign")
    damaged = {name: shutil.copytree(good, tmp_path / name) for name in names}
    train = damaged["truncated"] / "train.bin"
    train.write_bytes(train.read_bytes()[:-3])  # a token and a half short
    (damaged["missing"] / "val.bin").unlink()
    meta = load_meta(damaged["miscounted"])
    meta["files"]["train.bin"] += 1
    (damaged["miscounted"] / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    for name, change in (("unlisted", {"files": {"train.bin": count}}), ("foreign", {"kind": "images"})):
        (damaged[name] / "meta.json").write_text(json.dumps({**load_meta(good), **change}), encoding="utf-8")
    fix = r"; re-create the dataset with: python prepare_data.py NAME --force$"
    cases = {
        "truncated": (
            ValueError,
            rf"truncated/train.bin is truncated: its header promises {count:,} tokens but it "
            rf"holds {count - 1.5:,.1f}{fix}",
        ),
        "missing": (FileNotFoundError, rf"missing/val.bin is missing \(meta.json lists it\){fix}"),
        "miscounted": (
            ValueError,
            rf"miscounted/train.bin holds {count:,} tokens but meta.json records {count + 1:,}{fix}",
        ),
        "unlisted": (ValueError, rf"unlisted/meta.json lists no val.bin{fix}"),
        "foreign": (ValueError, r"foreign/meta.json holds kind='images', not one of lm, seq2seq, chat: not a dataset"),
    }
    for name, (error, message) in cases.items():
        with pytest.raises(error, match=message):
            check_prepared(damaged[name])
        assert not is_prepared(damaged[name])


def test_refuses_data_from_another_tokenizer_unless_forced(tmp_path):
    corpus = small_corpus(tmp_path / "in")
    folder = prepare("text", data_dir=tmp_path, input=str(corpus), tokenizer="char", name="corpus")
    with pytest.raises(ValueError, match="different tokenizer.*--force"):
        prepare("text", data_dir=tmp_path, input=str(corpus), tokenizer="bpe", name="corpus")
    corpus.write_text("A new character set: XYZ\n" * 50, encoding="utf-8")
    with pytest.raises(ValueError, match="different tokenizer"):
        prepare("text", data_dir=tmp_path, input=str(corpus), tokenizer="char", name="corpus")
    assert load_meta(folder)["tokenizer"]["chars"] == sorted(set("To be, or not to be: that is the question.\n"))
    prepare("text", data_dir=tmp_path, input=str(corpus), tokenizer="bpe", name="corpus", force=True)
    assert load_meta(folder)["tokenizer"] == {"type": "tiktoken", "encoding": "gpt2"}


def test_refuses_to_replace_a_foreign_folder(tmp_path):
    foreign = tmp_path / "reverse" / "notes.txt"
    foreign.parent.mkdir()
    foreign.write_text("mine")
    with pytest.raises(ValueError, match="--force"):
        prepare("reverse", data_dir=tmp_path, num_train=100, num_val=10, num_test=10)
    assert foreign.read_text() == "mine"
    prepare("reverse", data_dir=tmp_path, num_train=100, num_val=10, num_test=10, force=True)
    assert not foreign.exists() and is_prepared(foreign.parent)


def test_text_directory_and_glob_bpe_with_end_of_text(tmp_path, r50k):
    docs = {
        "a.txt": "First document.\nIt has two lines.\n",
        "sub/b.txt": "Second one, é and 日本.\n\n",
        "sub/c.txt": "Third.\r\nEnd",
    }
    for name, content in docs.items():
        (tmp_path / "in" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "in" / name).write_bytes(content.encode("utf-8"))
    (tmp_path / "in" / ".hidden").write_bytes(b"\x00\x01 not text")  # hidden files are left out
    expected = "".join(content + "<|endoftext|>" for content in docs.values())
    for spec in (tmp_path / "in", tmp_path / "in" / "**" / "*.txt"):
        folder = prepare("text", data_dir=tmp_path / "data", input=str(spec), val_fraction=0.3, force=True)
        ids = np.concatenate([load_tokens(folder / "train.bin"), load_tokens(folder / "val.bin")]).tolist()
        assert r50k.decode(ids) == expected and ids.count(EOT) == len(docs)
        assert load_meta(folder)["special_tokens"] == {"eot": EOT}
    folder = prepare("text", data_dir=tmp_path / "data", input=str(tmp_path / "in"), tokenizer="char", name="chars")
    tok = Tokenizer.from_meta(load_meta(folder))
    whole = "".join(docs.values())
    assert tok.decode(load_tokens(folder / "train.bin")) == whole[: int(len(whole) * 0.9)]
    assert tok.decode(load_tokens(folder / "val.bin")) == whole[int(len(whole) * 0.9) :]


def test_text_char_vocabulary_beyond_uint16(tmp_path):
    # 70,000 distinct characters (surrogates excluded): ids above 65,535 must come back intact
    chars = [chr(c) for c in range(0x100, 0x100 + 72_048) if not 0xD800 <= c <= 0xDFFF]
    corpus = tmp_path / "wide.txt"
    corpus.write_text("".join(chars) * 2, encoding="utf-8")
    folder = prepare("text", data_dir=tmp_path, input=str(corpus), tokenizer="char", name="wide")
    meta = load_meta(folder)
    assert meta["vocab_size"] == len(chars) == 70_000
    train = load_tokens(folder / "train.bin")
    assert train.dtype == np.uint32 and header(folder / "train.bin")[2] == 4 and int(train.max()) == 69_999
    tok = Tokenizer.from_meta(meta)
    assert tok.decode(train) + tok.decode(load_tokens(folder / "val.bin")) == "".join(chars) * 2


def test_bad_text_inputs(tmp_path):
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "empty.txt").write_text("")
    (inputs / "binary.dat").write_bytes(b"GIF89a\x00\x00\x01")
    (inputs / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    data = tmp_path / "data"
    cases = [
        ({}, ValueError, "needs --input"),
        ({"input": str(inputs / "missing.txt")}, FileNotFoundError, "does not exist"),
        ({"input": str(inputs / "*.md")}, FileNotFoundError, "no files match"),
        ({"input": str(inputs / "empty.txt")}, ValueError, "holds no text"),
        ({"input": str(inputs / "binary.dat")}, ValueError, "binary.dat looks binary"),
        ({"input": str(inputs / "latin1.txt")}, ValueError, "latin1.txt is not UTF-8"),
        ({"input": str(inputs / "empty.txt"), "tokenizer": "words"}, ValueError, "must be one of char, bpe"),
        ({"input": str(inputs / "empty.txt"), "val_fraction": 1.5}, ValueError, "between 0 and 1"),
        ({"input": str(inputs / "empty.txt"), "colour": "red"}, ValueError, "no option 'colour'"),
        ({"input": str(inputs / "empty.txt"), "name": "../escape"}, ValueError, "plain name"),
    ]
    for options, error, message in cases:
        with pytest.raises(error, match=message):
            prepare("text", data_dir=data, **options)
    assert not data.exists() or list(data.iterdir()) == []


def test_unknown_dataset_names_the_valid_ones(capsys):
    with pytest.raises(ValueError, match="choose one of: " + ", ".join(RECIPES)):
        prepare("shakespear")
    assert prepare_data.cli(["shakespear"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean 'shakespeare'?" in err and all(name in err for name in RECIPES)


def test_help_lists_every_dataset(capsys):
    with pytest.raises(SystemExit) as exit_info:
        prepare_data.cli(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and "benchmark" not in out  # no BPE throughput mode (issue 53 removed it)
    assert all(name in out and recipe.description[:40] in out for name, recipe in RECIPES.items())


def test_cli_error_is_one_line_and_exit_2(tmp_path):
    script = Path(prepare_data.__file__)
    result = subprocess.run(
        [sys.executable, str(script), "text", "--input", str(tmp_path / "nope.txt"), "--data_dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert (
        result.stderr.startswith("prepare_data.py: error: input")
        and result.stderr.count("\n") == 1
        and "Traceback" not in result.stderr
    )


def test_cli_prepares_and_reports(tmp_path, capsys):
    argv = ["sort", "--data_dir", str(tmp_path), "--num_train", "50", "--num_val", "5", "--num_test", "5", "--force"]
    assert prepare_data.cli(argv) == 0
    assert "train 50 pairs, val 5 pairs, test 5 pairs" in capsys.readouterr().out
    assert len(load_pairs(tmp_path / "sort", "train")) == 50


def test_dataset_dir_and_meta_locations(tmp_path, monkeypatch):
    monkeypatch.delenv("NANOFORMER_DATA_DIR", raising=False)
    assert dataset_dir("shakespeare_char") == Path(prepare_data.__file__).resolve().parent / "data" / "shakespeare_char"
    monkeypatch.setenv("NANOFORMER_DATA_DIR", str(tmp_path))
    assert dataset_dir("shakespeare_char") == tmp_path / "shakespeare_char"
    assert dataset_dir("x", data_dir=tmp_path / "other") == tmp_path / "other" / "x"
    with pytest.raises(FileNotFoundError, match="python prepare_data.py shakespeare_char"):
        load_meta(dataset_dir("shakespeare_char"))
    assert not is_prepared(tmp_path / "shakespeare_char")


# ----------------------------------------------------------------------------- downloads


def test_shakespeare_download_cache_and_checksums(tmp_path, monkeypatch, shakespeare_path):
    monkeypatch.setenv("NANOFORMER_DATA_MIRROR", str(tmp_path / "empty_mirror"))
    served = []

    def serve(content):
        def urlopen(url, timeout):
            served.append(url)
            if content is None:
                raise urllib.error.URLError("Name or service not known")
            return io.BytesIO(content)

        return urlopen

    monkeypatch.setattr(urllib.request, "urlopen", serve(None))
    with pytest.raises(DownloadError) as failed:
        prepare("shakespeare_char", data_dir=tmp_path / "data")
    message = str(failed.value)
    assert SHAKESPEARE_URL in message and "--input" in message and "NANOFORMER_DATA_MIRROR" in message
    assert isinstance(failed.value, OSError)  # so that `except OSError` reports it, in every script
    monkeypatch.setattr(urllib.request, "urlopen", serve(b"not shakespeare"))
    with pytest.raises(DownloadError) as failed:
        prepare("shakespeare_char", data_dir=tmp_path / "data")
    # a DownloadError is an OSError too, yet its message is not wrapped in "could not download" a second time
    assert str(failed.value).startswith(f"{SHAKESPEARE_URL} arrived with sha256")
    assert not (tmp_path / "data" / "downloads").exists() or list((tmp_path / "data" / "downloads").iterdir()) == []

    monkeypatch.setattr(urllib.request, "urlopen", serve(shakespeare_path.read_bytes()))
    folder = prepare("shakespeare_char", data_dir=tmp_path / "data")
    assert (tmp_path / "data" / "downloads" / "tinyshakespeare.txt").read_bytes() == shakespeare_path.read_bytes()
    assert load_meta(folder)["files"] == {"train.bin": TRAIN_CHARS, "val.bin": 111_540}
    monkeypatch.setattr(urllib.request, "urlopen", serve(None))
    served.clear()
    prepare("shakespeare_char", data_dir=tmp_path / "data", force=True)  # from the cache, no network
    assert served == []

    bad_mirror = tmp_path / "bad_mirror"
    bad_mirror.mkdir()
    (bad_mirror / "tinyshakespeare.txt").write_text("something else")
    monkeypatch.setenv("NANOFORMER_DATA_MIRROR", str(bad_mirror))
    with pytest.raises(ValueError, match="not tiny Shakespeare"):
        prepare("shakespeare_char", data_dir=tmp_path / "data2")


def test_download_hint_spells_the_option_for_both_scripts(tmp_path, monkeypatch):
    monkeypatch.delenv("NANOFORMER_DATA_MIRROR", raising=False)

    def unreachable(url, timeout):
        raise urllib.error.URLError("Network is unreachable")

    monkeypatch.setattr(urllib.request, "urlopen", unreachable)
    with pytest.raises(DownloadError) as failed:
        prepare("shakespeare_char", data_dir=tmp_path)
    # prepare_data.py takes --input; train.py forwards its data_options dict to prepare() instead
    assert "--input=PATH" in str(failed.value) and "--data_options=\"{'input': 'PATH'}\"" in str(failed.value)


def offline_hub(monkeypatch):
    import datasets

    def load_dataset(path, *args, **kwargs):
        if path in ("json", "parquet", "arrow"):
            raise AssertionError("local loads are not expected here")
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)


@pytest.mark.parametrize(
    "name, options, url",
    [
        ("fineweb_edu", {}, "https://huggingface.co/datasets/HuggingFaceFW/fineweb-edu"),
        ("openwebtext", {"hf_dataset": "my/owt"}, "https://huggingface.co/datasets/my/owt"),
        ("translation", {"src": "en", "tgt": "de"}, "https://huggingface.co/datasets/opus_books"),
    ],
)
def test_hub_failure_is_one_clear_error(tmp_path, monkeypatch, capsys, name, options, url):
    offline_hub(monkeypatch)
    monkeypatch.setenv("NANOFORMER_DATA_MIRROR", str(tmp_path / "empty_mirror"))
    with pytest.raises(DownloadError) as failed:
        prepare(name, data_dir=tmp_path, **options)
    assert url in str(failed.value) and "--input" in str(failed.value) and "NANOFORMER_DATA_MIRROR" in str(failed.value)
    assert "--data_options=\"{'input': 'PATH'}\"" in str(failed.value)
    if name == "translation":
        assert "translation_en_de.tsv" in str(failed.value)  # the mirror file it would have used
    code = prepare_data.cli([name, "--data_dir", str(tmp_path)] + [f"--{k}={v}" for k, v in options.items()])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("prepare_data.py: error: could not load") and err.count("\n") == 1
    assert leftovers(tmp_path) == []


# ----------------------------------------------------------------------------- the datasets library path


def documents(n):
    rng = random.Random(n)
    return [
        f"Document {i}. "
        + " ".join(rng.choice(["alpha", "beta", "gamma", "δέλτα", "\n"]) for _ in range(rng.randint(1, 40)))
        for i in range(n)
    ]


def expected_split(docs, r50k, period):
    train, val = [], []
    for i, doc in enumerate(docs):
        (val if i % period == 0 else train).extend(r50k.encode_ordinary(doc) + [EOT])
    return train, val


def test_datasets_path_offline_jsonl_parquet_and_mirror(tmp_path, monkeypatch, r50k):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = documents(2500)  # more than one 1024-document batch
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    folder = prepare("openwebtext", data_dir=tmp_path / "data", input=str(jsonl), val_fraction=0.2)
    train, val = expected_split(docs, r50k, period=5)
    assert load_tokens(folder / "train.bin").tolist() == train and load_tokens(folder / "val.bin").tolist() == val

    mirror = tmp_path / "mirror" / "fineweb_edu"
    mirror.mkdir(parents=True)
    pq.write_table(pa.table({"text": docs[:1500]}), mirror / "part-0.parquet")
    pq.write_table(pa.table({"text": docs[1500:]}), mirror / "part-1.parquet")
    monkeypatch.setenv("NANOFORMER_DATA_MIRROR", str(tmp_path / "mirror"))
    folder = prepare("fineweb_edu", data_dir=tmp_path / "data", max_docs=30, val_fraction=0.1)
    train, val = expected_split(docs[:30], r50k, period=10)
    assert load_tokens(folder / "train.bin").tolist() == train and load_tokens(folder / "val.bin").tolist() == val

    cap = len(r50k.encode_ordinary(docs[0])) + len(r50k.encode_ordinary(docs[1])) + 3  # reached inside document 2
    folder = prepare("fineweb_edu", data_dir=tmp_path / "data", max_tokens=cap, val_fraction=0.5, force=True)
    train, val = expected_split(docs[:3], r50k, period=2)
    assert load_tokens(folder / "train.bin").tolist() == train and load_tokens(folder / "val.bin").tolist() == val

    no_text = tmp_path / "no_text.jsonl"
    no_text.write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match="no 'text' column"):
        prepare("openwebtext", data_dir=tmp_path / "data", input=str(no_text), force=True)
    with pytest.raises(ValueError, match="parquet"):
        prepare("openwebtext", data_dir=tmp_path / "data", input=str(small_corpus(tmp_path / "txt")), force=True)


# ----------------------------------------------------------------------------- seq2seq


UNITS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen "
    "eighteen nineteen"
).split()
TENS = {"twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80, "ninety": 90}
SCALES = {"thousand": 1000, "million": 10**6, "billion": 10**9}


def words_to_number(words):
    """An independent reader of English number words, to check num2words targets against."""
    total = current = 0
    for word in words.split(" "):
        if word == "hundred":
            current *= 100
        elif word in SCALES:
            total, current = total + current * SCALES[word], 0
        else:
            current += sum(UNITS.index(part) if part in UNITS else TENS[part] for part in word.split("-"))
    return total + current


def test_solve_knows_the_answers():
    assert solve("reverse", "abc123") == "321cba" and solve("sort", "b3a1") == "13ab"
    known = {
        0: "zero",
        7: "seven",
        15: "fifteen",
        20: "twenty",
        40: "forty",
        99: "ninety-nine",
        100: "one hundred",
        101: "one hundred one",
        1234: "one thousand two hundred thirty-four",
        20_000: "twenty thousand",
        999_999: "nine hundred ninety-nine thousand nine hundred ninety-nine",
        1_000_000: "one million",
    }
    assert {n: solve("num2words", str(n)) for n in known} == known
    for bad in ("12a", "-3", ""):
        with pytest.raises(ValueError, match="num2words takes"):
            solve("num2words", bad)
    with pytest.raises(ValueError, match="reverse, sort, num2words"):
        solve("rot13", "abc")


def test_distinct_sources_counts_what_random_source_draws():
    # settings small enough that a few thousand draws reach every source
    rng = random.Random(0)
    for task, opts, every in [
        ("num2words", {"max_number": 99}, {str(n) for n in range(100)}),
        ("reverse", {"min_len": 1, "max_len": 1}, set(synthetic.SYMBOLS)),
    ]:
        assert synthetic.distinct_sources(task, opts) == len(every)
        assert {synthetic.random_source(task, rng, opts) for _ in range(5000)} == every


@pytest.mark.parametrize("task", ["reverse", "sort", "num2words"])
def test_synthetic_task_is_deterministic_disjoint_and_correct(tmp_path, task):
    options = {"num_train": 400, "num_val": 40, "num_test": 40, "seed": 3}
    folder = prepare(task, data_dir=tmp_path / "a", **options)
    again = prepare(task, data_dir=tmp_path / "b", **options)
    assert all((again / p.name).read_bytes() == p.read_bytes() for p in folder.glob("*_*"))
    meta = load_meta(folder)
    assert meta["kind"] == "seq2seq" and meta["task"] == task and meta["vocab_size"] == 41
    assert meta["special_tokens"] == {"pad": 38, "bos": 39, "eos": 40}
    tok = Tokenizer.from_meta(meta)
    sources = {}
    for split in ("train", "val", "test"):
        pairs = load_pairs(folder, split)
        assert len(pairs) == options[f"num_{split}"]
        sources[split] = []
        for src_ids, tgt_ids in pairs:
            assert max(src_ids.max(), tgt_ids.max()) < 38  # no pad/bos/eos stored
            src, tgt = tok.decode(src_ids), tok.decode(tgt_ids)
            sources[split].append(src)
            if task == "reverse":
                assert 1 <= len(src) <= 12 and tgt == src[::-1]
            elif task == "sort":
                assert 1 <= len(src) <= 12 and tgt == "".join(sorted(src))
            else:
                assert src == str(int(src)) and int(src) <= 999_999 and words_to_number(tgt) == int(src)
    assert sum(map(len, sources.values())) == len(set().union(*map(set, sources.values())))  # distinct, disjoint
    reseeded = prepare(task, data_dir=tmp_path / "c", **options | {"seed": 4})
    assert (reseeded / "train_src.bin").read_bytes() != (folder / "train_src.bin").read_bytes()
    bigger = prepare(task, data_dir=tmp_path / "d", **options | {"num_train": 500})
    assert (bigger / "test_src.bin").read_bytes() == (folder / "test_src.bin").read_bytes()  # held-out set is stable


def test_synthetic_bad_options(tmp_path):
    with pytest.raises(ValueError, match="distinct sources"):
        prepare("reverse", data_dir=tmp_path, max_len=1, num_train=100)
    with pytest.raises(ValueError, match="--min_len 5 is larger than --max_len 3"):
        prepare("sort", data_dir=tmp_path, min_len=5, max_len=3)
    with pytest.raises(ValueError, match="--num_val must be at least 1"):
        prepare("num2words", data_dir=tmp_path, num_val=0)
    with pytest.raises(ValueError, match="--seed must be int"):
        prepare("num2words", data_dir=tmp_path, seed="abc")
    assert list(tmp_path.iterdir()) == []


def test_load_pairs_api(tmp_path, shakespeare_char_dir):
    folder = prepare("reverse", data_dir=tmp_path, num_train=30, num_val=5, num_test=5)
    pairs = load_pairs(folder, "val")
    src, tgt = pairs[-1]
    assert len(pairs) == 5 and isinstance(pairs.src, np.memmap) and src.dtype == np.uint16
    np.testing.assert_array_equal(src[::-1], tgt)
    assert [s.tolist() for s, _ in pairs] == [pairs[i][0].tolist() for i in range(5)]
    with pytest.raises(IndexError):
        pairs[5]
    with pytest.raises(ValueError, match="unknown split"):
        load_pairs(folder, "dev")
    with pytest.raises(FileNotFoundError, match="seq2seq"):
        load_pairs(shakespeare_char_dir, "train")


PAIRS = [(f"The cat number {i} sleeps.", f"Le chat numéro {i} dort.") for i in range(300)] + [
    ("Hello.", "Bonjour."),
    ("Hello.", "Salut."),
]


def test_translation_from_tsv_and_jsonl(tmp_path, monkeypatch, r50k):
    tsv = tmp_path / "pairs.tsv"
    tsv.write_text("".join(f"{s}\t{t}\n" for s, t in PAIRS) + "\n", encoding="utf-8")
    folder = prepare("translation", data_dir=tmp_path / "data", input=str(tsv))
    assert folder.name == "translation_en_fr"
    meta = load_meta(folder)
    assert meta["kind"] == "seq2seq" and meta["vocab_size"] == 50260
    assert meta["special_tokens"] == {"pad": 50257, "bos": 50258, "eos": 50259}
    decoded, split_of = [], {}
    for split in ("train", "val", "test"):
        pairs = load_pairs(folder, split)
        assert len(pairs) > 0
        for src_ids, tgt_ids in pairs:
            src, tgt = r50k.decode(src_ids.tolist()), r50k.decode(tgt_ids.tolist())
            decoded.append((src, tgt))
            assert split_of.setdefault(src, split) == split  # a repeated source never straddles splits
    assert Counter(decoded) == Counter(PAIRS)

    variants = (
        [{"src": s, "tgt": t} for s, t in PAIRS],
        [{"en": s, "fr": t} for s, t in PAIRS],
        [{"translation": {"en": s, "fr": t}} for s, t in PAIRS],
    )
    for i, rows in enumerate(variants):
        jsonl = tmp_path / f"pairs{i}.jsonl"
        jsonl.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        other = prepare("translation", data_dir=tmp_path / "data", input=str(jsonl), name=f"jsonl{i}")
        assert all((other / p.name).read_bytes() == p.read_bytes() for p in folder.glob("*_*"))

    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (mirror / "translation_en_fr.tsv").write_bytes(tsv.read_bytes())
    monkeypatch.setenv("NANOFORMER_DATA_MIRROR", str(mirror))
    offline_hub(monkeypatch)
    from_mirror = prepare("translation", data_dir=tmp_path / "mirrored")
    assert all((from_mirror / p.name).read_bytes() == p.read_bytes() for p in folder.glob("*_*"))


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("a.tsv", "one\tun\ntwo\tdeux\nthree trois\n", "a.tsv line 3: expected 'source<TAB>target', found 0 tabs"),
        ("b.tsv", "one\tun\tuno\n", "b.tsv line 1: expected 'source<TAB>target', found 2 tabs"),
        ("c.tsv", "one\tun\n\ntwo\t \n", "c.tsv line 3: empty source or target"),
        ("d.jsonl", '{"src": "a", "tgt": "b"}\n{"src": "a", \n', "d.jsonl line 2: invalid JSON"),
        (
            "e.jsonl",
            '{"source": "a", "target": "b"}\n',
            "e.jsonl line 1: expected an object with string 'src' and 'tgt'",
        ),
        ("f.csv", "one,un\n", "must be a .tsv"),
    ],
)
def test_translation_malformed_input_names_the_line(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        prepare("translation", data_dir=tmp_path / "data", input=str(path))
    assert not (tmp_path / "data").exists() or list((tmp_path / "data").iterdir()) == []


def test_translation_missing_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a file"):
        prepare("translation", data_dir=tmp_path, input=str(tmp_path / "missing.tsv"))


# ----------------------------------------------------------------------------- Hugging Face tokenizers
# The references are the `tokenizers` library itself, on the tokenizer.json files the tests train here.

# Llama 3's pre-tokenizer pattern: unlike GPT-2's, it joins punctuation to the newlines after it (':\n')
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def trained_bpe(style, text):
    """A 300-id BPE trained on the start of text: 'llama3' (Llama 3's split, then bytes) or 'metaspace' (Llama 2 and
    Mistral's sentencepiece style, '▁' marking spaces and the start of every text)."""
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers

    if style == "metaspace":
        bpe = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
        bpe.pre_tokenizer = pre_tokenizers.Metaspace()
        bpe.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"])
    else:
        bpe = tokenizers.Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        bpe.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([text[:20_000]], trainer)
    return bpe


def as_tokenizer(reference):
    return Tokenizer({"type": "huggingface", "json": reference.to_str()}, reference.get_vocab_size(), {})


def library_ids(reference, text):
    return reference.encode(text, add_special_tokens=False).ids


def test_tokenizer_json_matches_the_tokenizers_library(llama_dir, text):
    reference = tokenizers.Tokenizer.from_file(str(llama_dir / "tokenizer.json"))
    meta = tokens.huggingface_tokenizer(llama_dir)
    assert meta["tokenizer"] == {"type": "huggingface", "json": (llama_dir / "tokenizer.json").read_text("utf-8")}
    assert meta["vocab_size"] == reference.get_vocab_size() == 300
    assert meta["special_tokens"] == {"bos": 0, "eos": 1}  # config.json's bos_token_id and eos_token_id
    tok = Tokenizer.from_meta(meta)
    sample_text = text[:5000] + "\ncafé, 日本 🙂\ttabs\r\n"
    ids = tok.encode(sample_text)
    assert ids == library_ids(reference, sample_text)
    assert tok.encode_batch([sample_text, "ROMEO:"]) == [ids, library_ids(reference, "ROMEO:")]
    assert tok.decode(ids) == reference.decode(ids) == sample_text
    # byte-level BPE spreads 日 over several tokens: decoded one by one, they come out as U+FFFD
    assert "".join(tok.decode([i]) for i in ids) != sample_text
    assert tok.template_prefix() == [0]  # the template's bos, which sample.py puts before a prompt
    # written in a text, a special token stays text, as '<|endoftext|>' does with tiktoken's encode_ordinary
    assert 0 not in tok.encode("<s>") and tok.decode(tok.encode("<s>")) == "<s>"
    assert tok.decode([0, *ids[:3], 1]) == reference.decode([0, *ids[:3], 1], skip_special_tokens=False)


@pytest.mark.parametrize("style", ["llama3", "metaspace"])
def test_tokenizer_json_styles_round_trip(text, style):
    reference = trained_bpe(style, text)
    tok = as_tokenizer(reference)
    # characters beyond the training text are bytes to a byte-level BPE, unknown (<unk>) to this metaspace one
    part = text[:3000] + ("" if style == "metaspace" else "\ncafé, 日本 🙂")
    ids = tok.encode(part)
    assert ids == library_ids(reference, part) and tok.vocab_size == reference.get_vocab_size()
    assert tok.decode(ids) == reference.decode(ids) == part
    # decoded one by one, metaspace's words would lose their spaces ('▁' is a space only inside a text), and
    # byte-level characters spread over several tokens would come out as U+FFFD
    assert "".join(tok.decode([i]) for i in ids) != part


@pytest.mark.parametrize("style", ["byte-level", "llama3", "metaspace"])
def test_tokenizer_json_pieces_encode_like_the_whole_text(llama_dir, text, style):
    if style == "byte-level":
        reference = tokenizers.Tokenizer.from_file(str(llama_dir / "tokenizer.json"))
    else:
        reference = trained_bpe(style, text)
    tok = as_tokenizer(reference)
    # where GPT-2 and Llama 3 join whitespace or punctuation to a newline, on one side of it or the other
    parts = ["hello", " world", "\n", "\n\n", " \n", ":\n", "!\n\n", "\r\n", "\t\n", "  ", "42", "ROMEO", "\n x", "'ll"]
    rng = random.Random(0)
    whole = "".join(rng.choice(parts) for _ in range(20_000))
    pieces = list(text_pieces(random_blocks(whole, rng), functools.partial(checked_cut, tok)))
    assert "".join(pieces) == whole
    assert [t for piece in pieces for t in tok.encode(piece)] == library_ids(reference, whole)
    # metaspace marks the start of every text it is given, so no cut keeps the ids: the text stays whole
    assert len(pieces) == 1 if style == "metaspace" else len(pieces) > 50


def test_shakespeare_with_a_tokenizer_folder_matches_the_tokenizers_library(tmp_path, text, llama_dir):
    reference = tokenizers.Tokenizer.from_file(str(llama_dir / "tokenizer.json"))
    folder = prepare("shakespeare", data_dir=tmp_path, tokenizer=str(llama_dir))
    assert folder.name == f"shakespeare_{llama_dir.name}"  # never GPT-2's shakespeare/
    meta = load_meta(folder)
    assert meta["tokenizer"] == {"type": "huggingface", "json": (llama_dir / "tokenizer.json").read_text("utf-8")}
    assert meta["vocab_size"] == 300 and meta["special_tokens"] == {"bos": 0, "eos": 1}
    train, val = load_tokens(folder / "train.bin"), load_tokens(folder / "val.bin")
    assert train.tolist() == library_ids(reference, text[:TRAIN_CHARS])  # several pieces, cut where checked
    assert val.tolist() == library_ids(reference, text[TRAIN_CHARS:])
    assert Tokenizer.from_meta(meta).decode(val) == text[TRAIN_CHARS:]


def test_text_with_a_tokenizer_json_ends_each_file_with_eos(tmp_path, llama_dir):
    reference = tokenizers.Tokenizer.from_file(str(llama_dir / "tokenizer.json"))
    docs = {"a.txt": "First document.\nIt has two lines.\n", "b.txt": "Second one, é and 日本.\n\nEnd"}
    for name, content in docs.items():
        (tmp_path / "in" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "in" / name).write_text(content, encoding="utf-8")
    # the tokenizer.json itself, not its folder: bos and eos still come from the config.json beside it
    tokenizer = llama_dir / "tokenizer.json"
    folder = prepare("text", data_dir=tmp_path / "data", input=str(tmp_path / "in"), tokenizer=str(tokenizer))
    a, b = docs.values()
    split_at = int((len(a) + len(b)) * 0.9) - len(a)  # where val starts within b
    assert 0 < split_at < len(b)
    assert load_tokens(folder / "train.bin").tolist() == library_ids(reference, a) + [1] + library_ids(
        reference, b[:split_at]
    )
    assert load_tokens(folder / "val.bin").tolist() == library_ids(reference, b[split_at:]) + [1]


def test_text_with_a_tokenizer_json_of_more_than_65536_ids(tmp_path):
    # Llama 3 has 128,256 ids: a 70,000-word vocabulary stands in for it, and ids above 65,535 must come back intact
    from tokenizers import models, pre_tokenizers

    words = tokenizers.Tokenizer(models.WordLevel({f"w{i}": i for i in range(70_000)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.save(str(tmp_path / "tokenizer.json"))
    corpus = tmp_path / "words.txt"
    content = " ".join(f"w{i}" for i in range(65_000, 70_000))
    corpus.write_text(content, encoding="utf-8")
    folder = prepare("text", data_dir=tmp_path / "data", input=str(corpus), tokenizer=str(tmp_path), name="wide")
    assert load_meta(folder)["vocab_size"] == 70_000
    train, val = load_tokens(folder / "train.bin"), load_tokens(folder / "val.bin")
    assert train.dtype == np.uint32 and header(folder / "train.bin")[2] == 4 and int(train.max()) > 65_535
    split_at = int(len(content) * 0.9)
    assert train.tolist() == library_ids(words, content[:split_at])
    assert val.tolist() == library_ids(words, content[split_at:]) and val.max() == 69_999


def test_a_changed_tokenizer_json_is_never_reused_silently(tmp_path, llama_dir, text):
    corpus = small_corpus(tmp_path / "in")
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(llama_dir / "tokenizer.json", model / "tokenizer.json")  # no config.json: no bos, no eos
    options = {"data_dir": tmp_path / "data", "input": str(corpus), "name": "corpus"}
    folder = prepare("text", tokenizer=str(model), **options)
    assert load_meta(folder)["special_tokens"] == {}
    first = (folder / "train.bin").stat().st_ino
    # up to date, however the same file is named: kept, not rebuilt
    for same in (model, model / "tokenizer.json"):
        assert prepare("text", tokenizer=str(same), **options) == folder
        assert (folder / "train.bin").stat().st_ino == first
    # another tokenizer at the same path: its content differs, so the data is refused, not reused
    trained_bpe("llama3", text).save(str(model / "tokenizer.json"))
    with pytest.raises(ValueError, match="different tokenizer .*Hugging Face tokenizer.json.*--force"):
        prepare("text", tokenizer=str(model), **options)
    prepare("text", tokenizer=str(model), force=True, **options)
    assert load_meta(folder)["tokenizer"]["json"] == (model / "tokenizer.json").read_text("utf-8")


def test_tokenizer_json_errors_are_one_line(tmp_path, llama_dir, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text('{"version": "1.0", "model": ', encoding="utf-8")
    corpus = small_corpus(tmp_path / "in")
    data = tmp_path / "data"
    cases = [
        (bad, f"{bad / 'tokenizer.json'} is not a tokenizer.json the tokenizers library can read"),
        (tmp_path / "in", f"--tokenizer must be one of char, bpe or a path: {tmp_path / 'in'} has no tokenizer.json"),
        (tmp_path / "nope", f"{tmp_path / 'nope'} does not exist"),
    ]
    for tokenizer, message in cases:
        argv = ["text", "--input", str(corpus), "--tokenizer", str(tokenizer), "--data_dir", str(data)]
        assert prepare_data.cli(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert not data.exists() or list(data.iterdir()) == []
    wrong = shutil.copytree(llama_dir, tmp_path / "wrong")
    config = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**config, "bos_token_id": 300}))
    with pytest.raises(ValueError, match="bos_token_id 300 is not an id of the 300 in"):
        tokens.huggingface_tokenizer(wrong)
    with pytest.raises(ValueError, match="tokenizer.json stored in this dataset or checkpoint is not"):
        Tokenizer({"type": "huggingface", "json": "{"}, 10, {})


# ----------------------------------------------------------------------------- a BPE trained on the text

# what a trained byte-level BPE must round-trip: characters the training text never held, control characters,
# the end-of-text token written as text, and whitespace of every kind
UNSEEN = "café naïve 日本語の文 🤖🙂 ẞ ﬁ \x00\x07\x7f\u200b\r\n\t  <|endoftext|> end\n"


def bpe_corpus(folder):
    """Two files; the val split (the last 10% of the characters) is the only place 'zyzzyva' occurs."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a.txt").write_text("To be, or not to be: that is the question.\n" * 40, encoding="utf-8")
    (folder / "b.txt").write_text(
        "Whether 'tis nobler in the mind to suffer\n" * 30 + " zyzzyva" * 60, encoding="utf-8"
    )
    return folder


def test_text_trains_a_byte_level_bpe_on_the_train_split(tmp_path):
    corpus = bpe_corpus(tmp_path / "in")
    folder = prepare("text", data_dir=tmp_path / "data", input=str(corpus), vocab_size=300, name="own")
    meta = load_meta(folder)
    spec = meta["tokenizer"]
    assert spec["type"] == "huggingface" and meta["vocab_size"] == 300 and meta["special_tokens"] == {"eot": 0}
    reference = tokenizers.Tokenizer.from_str(spec["json"])
    assert reference.get_vocab_size() == 300 and reference.id_to_token(0) == "<|endoftext|>"
    # the val split's word was never seen: it is no token, while the train split's words are
    vocab = reference.get_vocab()
    assert "Ġzyzzyva" not in vocab and "zyzzyva" not in vocab and "Ġquestion" in vocab
    # ids round-trip any text exactly, and '<|endoftext|>' written in a text stays text
    tok = Tokenizer.from_meta(meta)
    ids = tok.encode(UNSEEN)
    assert tok.decode(ids) == UNSEEN and 0 not in ids and max(ids) < 300
    reference.encode_special_tokens = True  # as ours: the text '<|endoftext|>' is not the special id
    assert ids == reference.encode(UNSEEN, add_special_tokens=False).ids
    # the files' text comes back whole from train.bin and val.bin, each file ending with end-of-text
    files = sorted(corpus.iterdir())
    whole = "".join(path.read_text(encoding="utf-8") + "<|endoftext|>" for path in files)
    written = np.concatenate([load_tokens(folder / "train.bin"), load_tokens(folder / "val.bin")])
    assert tok.decode(written) == whole and written.tolist().count(0) == len(files)
    # bits per byte divides by the bytes each id stands for: a text's ids sum to its UTF-8 length
    assert tokens.token_byte_lengths(meta)[ids].sum() == len(UNSEEN.encode("utf-8"))
    # an unset vocab_size is left out of the record, so text datasets prepared before the option stay up to date
    assert meta["source"]["vocab_size"] == 300
    plain = prepare("text", data_dir=tmp_path / "data", input=str(corpus), name="gpt2")
    assert "vocab_size" not in load_meta(plain)["source"]


def test_trained_bpe_is_deterministic_and_both_spellings_work(tmp_path):
    """The same text gives the same tokenizer in another process with one thread; --key=value and --key value."""
    corpus = bpe_corpus(tmp_path / "in")
    first = prepare("text", data_dir=tmp_path / "a", input=str(corpus), vocab_size=280, name="own")
    argv = ["text", f"--input={corpus}", "--vocab_size", "280", "--name=own", "--data_dir", str(tmp_path / "b")]
    result = subprocess.run(
        [sys.executable, str(Path(prepare_data.__file__)), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "RAYON_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr
    second = load_meta(tmp_path / "b" / "own")
    assert second["tokenizer"] == load_meta(first)["tokenizer"] and second["vocab_size"] == 280


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--vocab_size=200"], "text: --vocab_size must be at least 257 (the 256 byte values and <|endoftext|>)"),
        (
            ["--vocab_size=300", "--tokenizer=char"],
            "--vocab_size trains a BPE tokenizer on the text, so it does not go",
        ),
        (["--vocab_size=100000"], "the training text holds pairs for only"),
    ],
)
def test_trained_bpe_mistakes_are_one_line(tmp_path, capsys, options, message):
    corpus = bpe_corpus(tmp_path / "in")
    data = tmp_path / "data"
    assert prepare_data.cli(["text", f"--input={corpus}", f"--data_dir={data}", *options]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("prepare_data.py: error: ") and message in err, err
    assert not data.exists() or list(data.iterdir()) == []


# ----------------------------------------------------------------------------- the command lines


def test_prepare_data_help_spells_options_as_the_other_scripts_do(capsys):
    with pytest.raises(SystemExit):
        prepare_data.cli(["text", "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: prepare_data.py text [--key=value | --key value ...]")
    # --key=value with the default (or the value's name), as train.py --help writes them
    for shown in ("--input=INPUT", "--tokenizer=bpe", "--vocab_size=VOCAB_SIZE", "--val_fraction=0.1", "--data_dir="):
        assert f"\n  {shown}" in out, shown
    assert "--input INPUT" not in out  # argparse's own spelling


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "name a dataset first, one of: shakespeare_char, shakespeare, "),
        (["--data_dir=x", "sort"], "name a dataset first"),
        (["sort", "--num_trian=5"], "unknown key 'num_trian'; did you mean 'num_train'?"),
        (["sort", "--num_train=many"], "--num_train must be int, got 'many'"),
        (["sort", "--num_train"], "--num_train needs a value"),
        (["sort", "--force=maybe"], "--force takes true or false"),
        (["text", "books.txt"], "unexpected argument 'books.txt'; options are written --key=value"),
    ],
)
def test_prepare_data_command_line_mistakes_are_one_line(capsys, argv, message):
    # each is refused while reading the command line, before anything is prepared
    assert prepare_data.cli(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("prepare_data.py: error: ") and err.count("\n") == 1 and message in err, err


def test_prepare_data_takes_both_spellings(tmp_path, capsys):
    spaced = ["sort", "--data_dir", str(tmp_path / "a"), "--num_train", "50", "--num_val", "5", "--num_test", "5"]
    joined = ["sort", f"--data_dir={tmp_path / 'b'}", "--num_train=50", "--num_val=5", "--num_test=5"]
    assert prepare_data.cli(spaced) == 0 and prepare_data.cli(joined) == 0
    # bool words, and a bare --force: rebuilt, the same files
    assert prepare_data.cli([*spaced, "--force", "TRUE"]) == 0 and prepare_data.cli([*joined, "--force"]) == 0
    assert load_meta(tmp_path / "a" / "sort")["pairs"] == load_meta(tmp_path / "b" / "sort")["pairs"]
    assert (tmp_path / "a" / "sort" / "train_src.bin").read_bytes() == (
        tmp_path / "b" / "sort" / "train_src.bin"
    ).read_bytes()


def test_a_dict_option_merges_into_the_config_files_dict(tmp_path, capsys):
    from config import parse_config
    from train import TrainConfig

    config = tmp_path / "run.py"
    config.write_text("dataset = 'text'\ndata_options = {'input': 'a.txt', 'tokenizer': 'char'}\n", encoding="utf-8")
    cfg = parse_config(TrainConfig, [str(config), "--data_options={'input': 'b.txt', 'val_fraction': 0.2}"])
    assert cfg.data_options == {"input": "b.txt", "tokenizer": "char", "val_fraction": 0.2}
    # the other spelling, and a second option merging into the first
    cfg = parse_config(TrainConfig, [str(config), "--data_options", "{'name': 'x'}", "--data_options={'input': 'c'}"])
    assert cfg.data_options == {"input": "c", "tokenizer": "char", "name": "x"}
    # without a config file's dict, the option is the dict
    assert parse_config(TrainConfig, ["--data_options={'input': 'b.txt'}"]).data_options == {"input": "b.txt"}
    with pytest.raises(SystemExit):
        parse_config(TrainConfig, ["--help"])
    assert "a dict option on the command line is merged into the config files' dict" in capsys.readouterr().out
