"""
What a recipe file is made of, and what the recipes share: a Recipe and its Options, the vocabularies, the input
files, and the writers of LM and seq2seq token files (in the format tokens.py defines and reads).
"""

import contextlib
import glob
import hashlib
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from config import BOOL_WORDS
from log import one_line
from tokens import (
    MIRROR_ENV,
    SEQ2SEQ_SPLITS,
    PairWriter,
    TokenWriter,
    atomic_output,
    tiktoken_encoding,
    tokenizer_json_file,
)

# train.py forwards its data_options dict to prepare(), so there the same option is spelled as a dict entry
INPUT_OPTION = "--input=PATH (in train.py: --data_options=\"{'input': 'PATH'}\")"


@dataclass(frozen=True)
class Recipe:
    """Everything about one dataset: a file in recipes/ lists its own in a dict RECIPES, {dataset name: Recipe}."""

    description: str  # one line, for --help and the list of datasets
    options: tuple  # its Options: the command line's --NAME VALUE, prepare()'s keyword arguments
    # (stage folder, dataset name, options, the local input files or None, check_tokenizer) -> the dataset's meta,
    # without the bookkeeping prepare() adds; it calls check_tokenizer(spec) as soon as the tokenizer is known, before
    # the slow part, and writes its token files into the stage folder
    build: Callable
    # (name, options, data root) -> (local input files or None, fingerprint of the inputs); None: no inputs, the
    # dataset is generated and the options alone decide it
    inputs: Callable | None = None
    # (options) -> the output folder's name; None: --name where the recipe has that option, else the dataset's name
    folder: Callable | None = None


# ----------------------------------------------------------------------------- options


@dataclass(frozen=True)
class Option:
    """One option of a dataset: `--NAME VALUE` on the command line, NAME=VALUE as a keyword of prepare()."""

    name: str
    type: type  # the given value is converted with this: int, float, str or boolean
    default: object  # None: not set; the builder decides what that means
    help: str
    affects_output: bool = True  # False: left out of the record that decides whether outputs are up to date
    # False: left out of that record while not set (None), so that datasets built before the option existed stay
    # up to date; for options added later
    recorded_unset: bool = True
    choices: tuple = ()  # the allowed values; (): any value of the type
    at_least: int | None = None  # the smallest allowed value; None: no bound
    fraction: bool = False  # True: the value must lie strictly between 0 and 1
    file: Callable | None = None  # (value) -> file: a value outside choices names this file, recorded by its hash

    def resolve(self, dataset, value):
        """`value` converted to the option's type and checked; a bad one raises ValueError naming the option."""
        # None is 'not set': kept, so the builder applies the default that fits (all cores, no limit)
        if value is None:
            return None
        try:
            # converted here too: prepare()'s keywords (train.py's data_options) may arrive as strings
            value = self.type(value)
        except (TypeError, ValueError):
            raise ValueError(f"{dataset}: --{self.name} must be {self.type.__name__}, got {value!r}") from None
        if self.choices and value not in self.choices:
            if self.file is None:
                raise ValueError(f"{dataset}: --{self.name} must be one of {', '.join(self.choices)}, got {value!r}")
            try:
                # checked now, before any download or scan: the file must exist (its content is read by the builder)
                self.file(value)
            except OSError as err:
                names = self.choices[0] if len(self.choices) == 1 else f"one of {', '.join(self.choices)}"
                raise ValueError(f"{dataset}: --{self.name} must be {names} or a path: {one_line(err)}") from None
        if self.at_least is not None and value < self.at_least:
            raise ValueError(f"{dataset}: --{self.name} must be at least {self.at_least}, got {value}")
        if self.fraction and not 0 < value < 1:
            raise ValueError(f"{dataset}: --{self.name} must be between 0 and 1, got {value}")
        return value

    def recorded(self, value):
        """What the up-to-date record keeps of a resolved value: the value, or for a file its sha256."""
        if self.file is None or value is None or value in self.choices:
            return value
        # by content, not by path: the same path may hold another file tomorrow, and a copy elsewhere is the same
        return {"sha256": file_sha256(self.file(value))}


def boolean(value):
    """A yes/no option's value: a bool, or one of the words true, false, 1, 0 (any case), as the other scripts take."""
    if isinstance(value, bool):
        return value
    if str(value).lower() not in BOOL_WORDS:
        raise ValueError(f"expected true or false, got {value!r}")
    return BOOL_WORDS[str(value).lower()]


def count_option(name, default, help_text):
    """An integer option that must be at least 1: a count of examples, documents, pairs or tokens."""
    return Option(name, int, default, help_text, at_least=1)


def fraction_option(name, default, help_text):
    """A float option strictly between 0 and 1: the share of the data a held-out split gets."""
    return Option(name, float, default, help_text, fraction=True)


# the tokenizer's thread count, every core when not set; threads change the speed, never the ids, so another thread
# count does not rebuild
NUM_PROC = Option("num_proc", int, None, "tokenizer threads (default: all cores)", affects_output=False, at_least=1)


def tokenizer_option(names, default, help_text):
    """The tokenizer: one of `names`, or else a tokenizer.json or a folder holding one (a Hugging Face model folder)."""
    return Option("tokenizer", str, default, help_text, choices=names, file=tokenizer_json_file)


def input_option(help_text):
    """--input: local files to read instead of the recipe's usual source (required where there is none)."""
    # the input's identity enters the record through its fingerprint, not its spelling
    return Option("input", str, None, help_text, affects_output=False)


def resolve_options(name, options, given):
    """Every option of dataset `name`: its value in `given`, converted and checked, else its default."""
    # an unknown option is an error, not ignored: a typo would otherwise build with the default
    known = {o.name: o for o in options}
    unknown = sorted(set(given) - known.keys())
    if unknown:
        raise ValueError(f"{name} has no option {unknown[0]!r}; its options are: {', '.join(known)}")
    # every option of the recipe gets a value: the given one, checked, else its default (possibly None)
    return {o.name: o.resolve(name, given.get(o.name, o.default)) for o in options}


# ----------------------------------------------------------------------------- vocabularies
#
# A vocab is meta.json's tokenizer, vocab_size and special_tokens, as tokens.huggingface_tokenizer returns them for a
# tokenizer.json; Tokenizer.from_meta rebuilds the tokenizer from one.


def gpt2_spec():
    """meta.json's tokenizer entry for GPT-2 BPE: a new dict on each call, so no two metas share one."""
    return {"type": "tiktoken", "encoding": "gpt2"}


def gpt2_vocab():
    """GPT-2 BPE's vocab: 50,257 ids, the last (50256) being <|endoftext|>."""
    encoding = tiktoken_encoding("gpt2")
    return {"tokenizer": gpt2_spec(), "vocab_size": encoding.n_vocab, "special_tokens": {"eot": encoding.eot_token}}


def char_vocab(chars):
    """The vocab of a list of characters: id i is chars[i]; a character vocabulary has no special tokens."""
    return {"tokenizer": {"type": "char", "chars": chars}, "vocab_size": len(chars), "special_tokens": {}}


def seq2seq_vocab(spec, base):
    """The vocab of seq2seq data: the `base` ids of tokenizer `spec`, then pad, bos and eos."""
    special = {"pad": base, "bos": base + 1, "eos": base + 2}
    return {"tokenizer": spec, "vocab_size": base + 3, "special_tokens": special}


# ----------------------------------------------------------------------------- input files


def file_sha256(path):
    """The sha256 of a file's content, as hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        # 1 MiB at a time: any file size in constant memory
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def expand_input(spec):
    """The files named by a path, a directory (recursively, hidden files left out) or a glob."""
    path = Path(spec).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            # hidden files and folders (.git, .DS_Store) are never corpus text
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise ValueError(f"input directory {spec} holds no files")
        return files
    # only a spec with glob characters is a glob; any other missing path is a typo
    if any(c in spec for c in "*?["):
        files = sorted(Path(p) for p in glob.glob(os.path.expanduser(spec), recursive=True) if Path(p).is_file())
        if not files:
            raise FileNotFoundError(f"no files match the glob {spec!r}")
        return files
    raise FileNotFoundError(f"input {spec} does not exist; pass an existing file, directory or glob")


def input_fingerprint(files):
    """What identifies local input files cheaply: [path, size, modification time] for each."""
    # no hashing: the up-to-date check should take milliseconds, not a read of every input byte
    return [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def mirror_entry(name):
    """<$NANOFORMER_DATA_MIRROR>/<name>, whether or not it exists; None when no mirror is set."""
    mirror = os.environ.get(MIRROR_ENV)
    # the caller checks whether <mirror>/<name> exists, as a folder or with a suffix
    return Path(mirror) / name if mirror else None


# ----------------------------------------------------------------------------- writing


def batched(items, n):
    """Lists of n items from a stream, the last one shorter (itertools.batched needs Python 3.12)."""
    it = iter(items)
    while batch := list(itertools.islice(it, n)):
        yield batch


def write_lm(stage, items, vocab_size):
    """Stream (split, ids) items into train.bin and val.bin; both must end up non-empty. Returns their token counts."""
    with contextlib.ExitStack() as stack:
        # both files open at once, as items of the two splits may interleave; each is renamed into place
        # only when the stack closes without an error
        writers = {
            s: TokenWriter(stack.enter_context(atomic_output(stage / f"{s}.bin")), vocab_size) for s in ("train", "val")
        }
        for split, ids in items:
            writers[split].write(ids)
        for split, writer in writers.items():
            # raised inside the stack, so neither partial file is kept
            if writer.count == 0:
                raise ValueError(f"the {split} split came out empty: too little input for a train/val split")
        # headers written before the stack closes; meta.json records {'train.bin': count, 'val.bin': count}
        return {f"{s}.bin": w.finish() for s, w in writers.items()}


def write_pairs(stage, pairs, vocab_size):
    """Stream (src_ids, tgt_ids, split) into the seq2seq files, every split non-empty; returns meta.json's "files"
    (token counts) and "pairs" (pairs per split)."""
    with contextlib.ExitStack() as stack:
        # all splits open at once: pairs arrive in any order; nothing is renamed into place unless all succeed
        writers = {s: PairWriter(stack, stage, s, vocab_size) for s in SEQ2SEQ_SPLITS}
        for src_ids, tgt_ids, split in pairs:
            writers[split].add(src_ids, tgt_ids)
        counts = {s: w.finish() for s, w in writers.items()}
        # raised inside the stack, so no partial file is kept
        if not all(counts.values()):
            raise ValueError(
                f"a split came out empty ({counts}); give more pairs or larger --val_fraction/--test_fraction"
            )
    # token counts per file, which check_prepared compares with the headers; pairs per split likewise
    files = {f"{s}_{side}.bin": getattr(w, side).count for s, w in writers.items() for side in ("src", "tgt")}
    return {"files": files, "pairs": counts}
