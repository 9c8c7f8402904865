"""
Translation pairs for the encoder-decoder: a local TSV or JSONL file, or a Hugging Face dataset (opus_books, wmt14)
streamed; GPT-2 BPE plus pad, bos and eos. Each pair goes to train, val or test by a hash of its source text.
"""

import itertools
import json
import os
import zlib
from pathlib import Path

from tqdm import tqdm

from recipes.base import (
    INPUT_OPTION,
    NUM_PROC,
    Option,
    Recipe,
    batched,
    count_option,
    fraction_option,
    gpt2_spec,
    input_fingerprint,
    input_option,
    mirror_entry,
    seq2seq_vocab,
    write_pairs,
)
from recipes.hub import BATCH_DOCS, load_hub_dataset
from tokens import MIRROR_ENV, Tokenizer, tiktoken_encoding


def translation_folder(opts):
    """The translation dataset's folder name: --name, else translation_SRC_TGT."""
    # one folder per language pair unless --name says otherwise
    return opts["name"] or f"translation_{opts['src']}_{opts['tgt']}"


def translation_inputs(name, opts, root):
    """--input's file, else <mirror>/<folder>.tsv or .jsonl; (None, None) for the hub."""
    if opts["input"]:
        path = Path(opts["input"]).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"--input {opts['input']} is not a file")
    else:
        # no --input: <mirror>/<folder>.tsv or .jsonl, else the hub
        mirror = mirror_entry(translation_folder(opts))
        candidates = [mirror.parent / f"{mirror.name}{suffix}" for suffix in (".tsv", ".jsonl")] if mirror else []
        path = next((p for p in candidates if p.is_file()), None)
        if path is None:
            return None, None  # the hub; its identity is hf_dataset/hf_config
    if path.suffix.lower() not in (".tsv", ".jsonl"):
        raise ValueError(f"{path} must be a .tsv (source<TAB>target) or .jsonl file of translation pairs")
    return [path], input_fingerprint([path])


def build_translation(stage, name, opts, files, check_tokenizer):
    """Translation pairs (a local file or the hub), GPT-2 BPE plus pad, bos and eos."""
    spec = gpt2_spec()
    check_tokenizer(spec)
    # pad, bos and eos appended after GPT-2's 50,257 ids
    vocab = seq2seq_vocab(spec, tiktoken_encoding("gpt2").n_vocab)
    tokenizer = Tokenizer.from_meta(vocab)
    if files is not None:
        pairs = file_pairs(files[0], opts["src"], opts["tgt"])
    else:
        hint = (
            f"pass a local .tsv/.jsonl of pairs as {INPUT_OPTION}, or set {MIRROR_ENV} to a folder holding "
            f"{translation_folder(opts)}.tsv"
        )
        pairs = hub_pairs(opts, hint)
    # max_pairs None: islice keeps them all
    pairs = itertools.islice(pairs, opts["max_pairs"])
    # no total: the number of pairs streamed is not known ahead
    with tqdm(desc=f"tokenizing {name}", unit="pair", unit_scale=True, disable=None) as bar:
        items = encode_pairs(
            pairs, tokenizer, opts["val_fraction"], opts["test_fraction"], opts["num_proc"] or os.cpu_count(), bar
        )
        written = write_pairs(stage, items, tokenizer.vocab_size)
    return {"kind": "seq2seq", **vocab, "src_lang": opts["src"], "tgt_lang": opts["tgt"], **written}


def encode_pairs(pairs, tokenizer, val_fraction, test_fraction, num_threads, bar):
    """(src_ids, tgt_ids, split) for each (source, target) text pair, encoded in parallel batches."""
    for batch in batched(pairs, BATCH_DOCS):
        # sources and targets in one parallel call: the first len(batch) results are the sources
        ids = tokenizer.encode_batch([s for s, _ in batch] + [t for _, t in batch], num_threads)
        for (source, _), src_ids, tgt_ids in zip(batch, ids, ids[len(batch) :]):
            yield src_ids, tgt_ids, pair_split(source, val_fraction, test_fraction)
        bar.update(len(batch))


def pair_split(source, val_fraction, test_fraction):
    """The split ('train', 'val' or 'test') of a pair, decided by its source text."""
    # by a hash of the source text: deterministic, streaming, and duplicates never straddle splits
    # u: uniform in [0, 1); test takes the lowest test_fraction of it, val the next val_fraction
    u = zlib.crc32(source.encode("utf-8")) / 2**32
    return "test" if u < test_fraction else "val" if u < test_fraction + val_fraction else "train"


def file_pairs(path, src, tgt):
    """(source, target) texts of a TSV or JSONL file; a malformed line raises naming the line."""
    # decoded lazily, line by line: a bad byte surfaces inside the loop, and the except clause at the end
    # catches it for the whole file
    jsonl = path.suffix.lower() == ".jsonl"
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                # only the line ending: spaces and tabs inside a text are content
                line = line.rstrip("\r\n")
                if not line.strip():
                    continue
                where = f"{path} line {number}"
                if "\x00" in line:
                    raise ValueError(f"{where}: contains NUL bytes; is this a binary file?")
                if jsonl:
                    try:
                        pair = json_pair(json.loads(line), src, tgt)
                    except json.JSONDecodeError as err:
                        raise ValueError(f"{where}: invalid JSON ({err.msg})") from None
                    if pair is None:
                        raise ValueError(
                            f"{where}: expected an object with string 'src' and 'tgt' (or '{src}' and '{tgt}') keys"
                        )
                else:
                    # exactly one tab: a text holding a tab could not be told from a third column
                    pair = line.split("\t")
                    if len(pair) != 2:
                        raise ValueError(f"{where}: expected 'source<TAB>target', found {len(pair) - 1} tabs")
                if not pair[0].strip() or not pair[1].strip():
                    raise ValueError(f"{where}: empty source or target")
                yield pair[0], pair[1]
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text; convert it to UTF-8") from None


def json_pair(obj, src, tgt):
    """(source, target) from {"src", "tgt"}, {src_lang, tgt_lang} or {"translation": {...}}; None if absent."""
    if not isinstance(obj, dict):
        return None
    # Hugging Face translation datasets nest the pair: {'translation': {'en': ..., 'fr': ...}}
    obj = obj.get("translation", obj)
    # our own src/tgt keys first, then the language codes
    for a, b in (("src", "tgt"), (src, tgt)):
        if isinstance(obj.get(a), str) and isinstance(obj.get(b), str):
            return obj[a], obj[b]
    return None


def hub_pairs(opts, hint):
    """(source, target) texts of a hub translation dataset, streamed; one-sided rows are skipped."""
    src, tgt = opts["src"], opts["tgt"]
    # hub translation datasets name their configs by language pair (opus_books: en-fr)
    config = opts["hf_config"] or f"{src}-{tgt}"
    for row in load_hub_dataset(opts["hf_dataset"], config, hint):
        pair = json_pair(row, src, tgt)
        if pair is None:
            raise ValueError(
                f"{opts['hf_dataset']} rows have no {src!r}/{tgt!r} texts (keys: {', '.join(row)}); check --src/--tgt"
            )
        if pair[0].strip() and pair[1].strip():  # published corpora hold a few one-sided segments; skip them
            yield pair


RECIPES = {
    "translation": Recipe(
        "translation pairs (opus_books/wmt14 or a local TSV/JSONL) for the encoder-decoder, BPE",
        options=(
            input_option(
                f"local .tsv (source<TAB>target) or .jsonl (src/tgt keys, or the language codes) instead of the hub; "
                f"${MIRROR_ENV}/<folder>.tsv|.jsonl is used when present"
            ),
            Option("hf_dataset", str, "opus_books", "Hugging Face dataset id (opus_books, wmt14, ...)"),
            Option("hf_config", str, None, "dataset config (default: SRC-TGT, e.g. en-fr)"),
            Option("src", str, "en", "source language code"),
            Option("tgt", str, "fr", "target language code"),
            Option("name", str, None, "output folder name (default: translation_SRC_TGT)", affects_output=False),
            fraction_option("val_fraction", 0.05, "fraction of pairs held out for val (by a hash of the source)"),
            fraction_option("test_fraction", 0.05, "fraction of pairs held out for test (by a hash of the source)"),
            count_option("max_pairs", None, "use only the first this many pairs"),
            NUM_PROC,
        ),
        inputs=translation_inputs,
        build=build_translation,
        folder=translation_folder,
    ),
}
