"""
The synthetic seq2seq tasks, generated offline: reverse, sort and num2words. What a task is (its sources, its
answers, its characters) is in synthetic.py at the top, which the seq2seq task grades with; here, how its dataset
is drawn.
"""

import itertools
import random

from recipes.base import Option, Recipe, count_option, seq2seq_vocab, write_pairs
from synthetic import CHARS, MAX_NUMBER, distinct_sources, random_source, solve
from tokens import Tokenizer


def synthetic_recipe(task, description):
    """The recipe of a synthetic task: its options are the split sizes, the seed and the range of its sources."""
    common = (
        count_option("num_train", 20000, "training examples"),
        count_option("num_val", 1000, "validation examples"),
        count_option("num_test", 1000, "held-out test examples (disjoint from train and val)"),
        Option("seed", int, 0, "random seed; the same seed gives the same files"),
    )
    if task == "num2words":
        bounds = (count_option("max_number", 999_999, "largest number"),)
    else:
        bounds = (count_option("min_len", 1, "shortest string"), count_option("max_len", 12, "longest string"))
    return Recipe(description, options=common + bounds, build=build_synthetic)


def build_synthetic(stage, name, opts, files, check_tokenizer):
    """Source and answer pairs of a synthetic task (synthetic.py), character-level plus pad, bos and eos."""
    spec = {"type": "char", "chars": CHARS}
    check_tokenizer(spec)
    # 38 characters (digits, letters, space, hyphen), then pad, bos and eos
    vocab = seq2seq_vocab(spec, len(CHARS))
    tokenizer = Tokenizer.from_meta(vocab)
    splits = synthetic_splits(name, opts)
    pairs = (
        # lazy: each source is encoded with its solved target as write_pairs consumes them
        (tokenizer.encode(s), tokenizer.encode(solve(name, s)), split)
        for split, sources in splits.items()
        for s in sources
    )
    return {"kind": "seq2seq", "task": name, **vocab, **write_pairs(stage, pairs, tokenizer.vocab_size)}


def synthetic_splits(task, opts):
    """Distinct random sources for test, val and train ({split: sources}), drawn in that order from one seed, so that
    the held-out splits stay the same when only --num_train changes."""
    # dict order is draw order: test, val, train
    sizes = {"test": opts["num_test"], "val": opts["num_val"], "train": opts["num_train"]}
    total = sum(sizes.values())
    if task == "num2words":
        if opts["max_number"] > MAX_NUMBER:
            raise ValueError(f"--max_number must be at most {MAX_NUMBER:,}")
        knob = "raise --max_number"
    else:
        if opts["min_len"] > opts["max_len"]:
            raise ValueError(f"--min_len {opts['min_len']} is larger than --max_len {opts['max_len']}")
        knob = "raise --max_len"
    # space: how many distinct sources the settings allow
    space = distinct_sources(task, opts)
    if 2 * total > space:  # rejection sampling stays fast while at least half the space is free
        raise ValueError(
            f"{task} has only {space:,} distinct sources with these settings, too few for {total:,} distinct "
            f"examples (at most half of them can be used); lower --num_train/--num_val/--num_test or {knob}"
        )
    rng = random.Random(opts["seed"])
    seen = {}  # insertion-ordered set
    # a duplicate draw is simply skipped, which keeps test, val and train disjoint
    while len(seen) < total:
        seen.setdefault(random_source(task, rng, opts))
    # consecutive slices of the draws, in the order of sizes
    drawn = iter(seen)
    return {split: list(itertools.islice(drawn, n)) for split, n in sizes.items()}


RECIPES = {
    "reverse": synthetic_recipe("reverse", "synthetic seq2seq, offline: reverse a string of digits and letters"),
    "sort": synthetic_recipe("sort", "synthetic seq2seq, offline: sort the characters of a string"),
    "num2words": synthetic_recipe(
        "num2words", "synthetic seq2seq, offline: 1234 -> one thousand two hundred thirty-four"
    ),
}
