"""
tools/bench.py --parts=bpe: GPT-2 BPE's speed, encoding alone on one thread and on every core, then prepare_data.py's
whole text recipe.
"""

import os
import time
from pathlib import Path

from bench_common import summary
from prepare_data import bpe_batches, prepare, shakespeare_file
from tokens import data_root, load_meta, tiktoken_encoding


def bpe_throughput(text, num_threads, repeats):
    """
    GPT-2 BPE tokens per second over `text`, one measurement per repeat. The text is cut and batched exactly as
    prepare_data.prepare() does, so this is the tokenizer's share of preparing a corpus, without any file I/O.
    """
    # loaded (and cached) before the clock starts; only encoding is timed
    encoding = tiktoken_encoding("gpt2")
    batches = bpe_batches(text)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        # tokens produced over all batches, each batch encoded on num_threads threads
        count = sum(
            len(ids) for batch in batches for ids in encoding.encode_ordinary_batch(batch, num_threads=num_threads)
        )
        rates.append(count / (time.perf_counter() - start))
    return rates


def bench_bpe(cfg, work):
    """Rows (name, value) for GPT-2 BPE speed: encoding alone on 1 and all threads, then prepare_data.py's text."""
    try:
        path = Path(cfg.bpe_input).expanduser() if cfg.bpe_input else shakespeare_file(None, data_root())
        text = path.read_text(encoding="utf-8")
    except (OSError, ValueError) as e:  # a missing file, a failed download, a file that is not UTF-8
        raise SystemExit(f"bench.py: error: {e}") from None
    if not text:
        raise SystemExit(f"bench.py: error: {path} is empty; pass a non-empty --bpe_input")
    text *= max(1, round(cfg.bpe_size_mb * 1e6 / len(text)))  # repeated to a multi-megabyte corpus
    what = f"{len(text) / 1e6:.1f} MB of {path.name}"
    rows = []
    # a set: a one-core machine gets one row, not two alike
    for threads in sorted({1, os.cpu_count()}):
        label = f"BPE tokens/s, encode, {threads} thread{'s' if threads > 1 else ''} ({what})"
        rows.append((label, summary(bpe_throughput(text, threads, cfg.repeats), "{:,.0f}")))
    # the whole pipeline once more: read, cut, encode on all cores, write train.bin/val.bin
    # the repeated text as a file, for the text recipe's --input
    corpus = work / "corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    rates = []
    for _ in range(cfg.repeats):
        start = time.perf_counter()
        # force: every repeat rebuilds instead of finding the first one's output up to date
        folder = prepare("text", data_dir=work, force=True, input=str(corpus), name="bpe")
        # tokens written to train.bin and val.bin per second of the whole build
        rates.append(sum(load_meta(folder)["files"].values()) / (time.perf_counter() - start))
    rows.append(("BPE tokens/s, prepare_data.py text (scan + encode + write)", summary(rates, "{:,.0f}")))
    return rows
