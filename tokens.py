"""Token files, pair and conversation files, dataset meta and the tokenizer: what training and sampling read.

A prepared dataset is a folder <data_dir>/<name>/ holding meta.json plus token files. LM datasets hold
train.bin and val.bin; seq2seq datasets hold {split}_src.bin, {split}_tgt.bin and {split}_idx.npy for the
splits train, val and test; chat datasets hold {split}.bin (the conversations' ids), {split}_targets.bin (1 where
an id is a loss target) and {split}_idx.npy for train and val. A token file is a 32-byte header (magic, format
version, bytes per token, vocab size, token count) followed by the ids as little-endian uint16 (when the
vocabulary has at most 65,536 ids) or uint32 (Llama 3's 128,256 ids, say). The recipes (recipes/) write these
folders with the writers below; train.py and sample.py read them.
"""

import array
import contextlib
import functools
import json
import logging
import os
import secrets
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import tiktoken
import tokenizers

from log import one_line

# the first 8 bytes of every token file: any other file is refused at once, never read as ids
MAGIC = b"NFTOKENS"
# raised when the layout changes, so old code refuses new files instead of misreading them
FORMAT_VERSION = 1
# magic, format version, bytes per token (2 or 4), vocab size, token count; little-endian
HEADER = struct.Struct("<8sIIQQ")
# bytes per token -> dtype of the ids; '<' fixes little-endian whatever the machine's byte order
ID_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
# seq2seq data keeps a test split apart for a final score; LM data has train and val only
SEQ2SEQ_SPLITS = ("train", "val", "test")
# chat data: exact-match scores are taken on val, so no third split is kept apart
CHAT_SPLITS = ("train", "val")
# what meta.json must list for each kind of data (meta["kind"]): (its entry, the names that entry must hold, how a
# missing one is named)
KIND_NEEDS = {
    "lm": ("files", ("train.bin", "val.bin"), "{}"),
    "seq2seq": ("pairs", SEQ2SEQ_SPLITS, "{} pairs"),
    "chat": ("conversations", CHAT_SPLITS, "{} conversations"),
}

# names the data root when no data_dir is passed (see data_root)
DATA_DIR_ENV = "NANOFORMER_DATA_DIR"
# names a folder of local copies (tinyshakespeare.txt, <dataset>/, <folder>.tsv), read
# before any download
MIRROR_ENV = "NANOFORMER_DATA_MIRROR"
# named in error messages only: where tiktoken fetches r50k_base, the encoding read for 'gpt2'
R50K_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
# a Hugging Face tokenizer's file (the `tokenizers` library's format), on its own or in a model folder
TOKENIZER_JSON = "tokenizer.json"
# the end-of-text token of GPT-2's BPE, and of the byte-level BPEs the text recipe trains (recipes/text.py)
END_OF_TEXT = "<|endoftext|>"
# GPT-2's tokenizer as a dataset's meta.json would describe it: tiktoken's gpt2 encoding, 50256 = <|endoftext|>
GPT2_META = {
    "kind": "lm",
    "tokenizer": {"type": "tiktoken", "encoding": "gpt2"},
    "vocab_size": 50257,
    "special_tokens": {"eot": 50256},
}

# warnings go through logging, so the caller (train.py, a test) decides where they show
logger = logging.getLogger("nanoformer.data")


class DownloadError(OSError):
    """A download (or hub load) failed; the message names the URL and the offline alternative. An OSError, as any
    failed I/O is, so every `except OSError` reports it like a missing file."""


# ----------------------------------------------------------------------------- token files


@contextlib.contextmanager
def atomic_output(path):
    """Yield a binary file beside `path` that replaces `path` only if the block succeeds."""
    # same folder, so os.replace stays on one file system (atomic); a random hidden name,
    # so concurrent writers never share a temporary file
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        # "x": fail rather than overwrite, should the name exist after all
        with open(tmp, "xb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())  # the data must be on disk before the name says it is complete
        # readers see the old file or the new one, never a half-written one
        os.replace(tmp, path)
    finally:
        # after a success the temporary name is gone already; after a failure this drops the partial file
        tmp.unlink(missing_ok=True)


class TokenWriter:
    """Appends token ids to an open file (write), then writes the header with the final count (finish)."""

    def __init__(self, f, vocab_size):
        # numpy integers count too: sizes often come out of numpy (len of an array, a max id + 1)
        if not isinstance(vocab_size, (int, np.integer)) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
        # ids run from 0 to vocab_size - 1, so 2**32 ids still fit uint32
        if vocab_size > 2**32:
            raise ValueError(f"vocab_size {vocab_size:,} is too large for token files: uint32 holds at most 2**32 ids")
        self.f, self.vocab_size, self.count = f, int(vocab_size), 0
        # 2 bytes an id whenever they fit (GPT-2's 50,257 do): half the disk and page cache
        self.dtype = ID_DTYPES[2] if vocab_size <= 2**16 else ID_DTYPES[4]
        f.write(bytes(HEADER.size))  # placeholder until the count is known

    def write(self, ids):
        """Append the ids of one chunk (a list, tuple or integer array) after those written before."""
        arr = np.asarray(ids)
        # an empty chunk (an empty document) adds nothing, and min() below would fail on it
        if arr.size == 0:
            return
        # floats or bools would be cast silently into wrong ids
        if arr.dtype.kind not in "iu":
            raise ValueError(f"token ids must be integers, got an array of {arr.dtype}")
        # checked before the cast, so an id that does not fit can never wrap silently
        low, high = int(arr.min()), int(arr.max())
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"token id {bad} is outside the vocabulary 0..{self.vocab_size - 1}")
        # right after the previous chunk: the file is the header, then one flat run of ids
        arr.astype(self.dtype).tofile(self.f)
        self.count += arr.size

    def finish(self):
        """Write the header with the final count over the placeholder; return the count. The caller closes the file."""
        self.f.seek(0)
        self.f.write(HEADER.pack(MAGIC, FORMAT_VERSION, self.dtype.itemsize, self.vocab_size, self.count))
        return self.count


def read_header(path):
    """(numpy dtype of the ids, vocab size, token count) from a token file's header, checked against the file: a
    ValueError naming the file and the fix for any mismatch."""
    # every error ends with the same fix: the writer is the only way to a good file
    fix = "re-create the dataset with: python prepare_data.py NAME --force"
    with open(path, "rb") as f:
        raw = f.read(HEADER.size)
        # the real size, to compare with what the header promises
        size = os.fstat(f.fileno()).st_size
    if len(raw) < HEADER.size:
        raise ValueError(f"{path} is truncated (shorter than the {HEADER.size}-byte header); {fix}")
    # 8-byte magic, uint32 version and bytes per token, uint64 vocab size and token count
    magic, version, itemsize, vocab_size, count = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ValueError(f"{path} is not a nanoformer token file (bad magic {magic!r}); {fix}")
    # a newer writer may lay the ids out differently; older or equal versions read as they are
    if version > FORMAT_VERSION:
        raise ValueError(
            f"{path} has format version {version}, newer than this code's {FORMAT_VERSION}; update nanoformer"
        )
    # uint16 cannot hold the ids of a larger vocabulary, so such a header is damaged
    if itemsize not in ID_DTYPES or (itemsize == 2 and vocab_size > 2**16):
        raise ValueError(f"{path} has a corrupt header ({itemsize} bytes per token for vocab size {vocab_size}); {fix}")
    # a file cut short (an interrupted copy, a full disk) is caught here, not read past its end during training
    if size != HEADER.size + count * itemsize:
        held = (size - HEADER.size) / itemsize
        raise ValueError(f"{path} is truncated: its header promises {count:,} tokens but it holds {held:,.1f}; {fix}")
    return ID_DTYPES[itemsize], vocab_size, count


def load_tokens(path):
    """Read-only 1-D memmap of a token file's ids, its header checked first (read_header). The pages are file-backed
    and never written, so the OS can drop them at will and long training runs do not grow in memory."""
    path = Path(path)
    dtype, _, count = read_header(path)
    # offset skips the header; shape (count,) ends the array at the last id
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER.size, shape=(count,))


# ----------------------------------------------------------------------------- seq2seq pairs


class PairWriter:
    """Streams (src, tgt) id pairs of one split into {split}_src.bin, {split}_tgt.bin and {split}_idx.npy."""

    def __init__(self, stack, folder, split, vocab_size):
        # entered on the caller's stack: both files are renamed into place only when the whole build succeeds
        self.src = TokenWriter(stack.enter_context(atomic_output(folder / f"{split}_src.bin")), vocab_size)
        self.tgt = TokenWriter(stack.enter_context(atomic_output(folder / f"{split}_tgt.bin")), vocab_size)
        self.index_path = folder / f"{split}_idx.npy"
        # row i holds where pair i starts in the src and tgt files; 16 bytes a pair stay in memory
        self.offsets = array.array("q", [0, 0])

    def add(self, src_ids, tgt_ids):
        """Append one pair: the source ids and the target ids, without bos/eos."""
        self.src.write(src_ids)
        self.tgt.write(tgt_ids)
        # where this pair ends is where the next one starts
        self.offsets.extend((self.src.count, self.tgt.count))

    def finish(self):
        """Write the index, complete both token files and return the number of pairs."""
        # the flat [s0, t0, s1, t1, ...] buffer viewed, without a copy, as (n + 1, 2) rows
        index = np.frombuffer(self.offsets, dtype=np.int64).reshape(-1, 2)
        with atomic_output(self.index_path) as f:
            np.save(f, index)
        self.src.finish()
        self.tgt.finish()
        # n pairs have n + 1 boundaries
        return len(index) - 1


class Pairs(Sequence):
    """
    The (src_ids, tgt_ids) pairs of one seq2seq split, backed by memmaps: `pairs[i]` is two read-only arrays without
    bos/eos. `src`, `tgt` (the split's ids, concatenated) and `index` (int64 (n + 1, 2): where each pair starts in
    src and tgt) are public for vectorised batching.
    """

    def __init__(self, src, tgt, index):
        self.src, self.tgt, self.index = src, tgt, index

    def __len__(self):
        return len(self.index) - 1

    def __getitem__(self, i):
        n = len(self)
        # bounds first: i % n below would wrap any i; a negative i counts from the end, as for a list
        if not -n <= i < n:
            raise IndexError(f"pair {i} is out of range for a split of {n} pairs")
        (s0, t0), (s1, t1) = self.index[i % n], self.index[i % n + 1]
        # slices of memmaps: views, nothing is read from disk until used
        return self.src[s0:s1], self.tgt[t0:t1]


def open_split(dataset_dir, split, kind, splits, suffixes):
    """(memmaps of {split}{suffix}.bin for each suffix, memmap of {split}_idx.npy, its path) of a `kind` dataset."""
    folder = Path(dataset_dir)
    if split not in splits:
        raise ValueError(f"unknown split {split!r}; {kind} splits are {', '.join(splits)}")
    path = folder / f"{split}_idx.npy"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; is {folder} a prepared {kind} dataset?")
    files = [load_tokens(folder / f"{split}{suffix}.bin") for suffix in suffixes]
    try:
        # memory-mapped like the token files: a large corpus's index need not sit in memory
        index = np.load(path, mmap_mode="r")
    except ValueError as err:
        raise ValueError(f"{path} is not a valid index ({one_line(err)}); re-create the dataset with --force") from None
    return *files, index, path


def load_pairs(dataset_dir, split):
    """The pairs of `split` ('train', 'val' or 'test') of a prepared seq2seq dataset."""
    src, tgt, index, index_path = open_split(dataset_dir, split, "seq2seq", SEQ2SEQ_SPLITS, ("_src", "_tgt"))
    # a cheap consistency check: (n + 1, 2) rows from (0, 0) to the token files' lengths, so a stale
    # index or a mismatched file fails here instead of slicing the wrong ids
    shaped = index.shape[1:] == (2,) and len(index) >= 1
    if not (shaped and tuple(index[0]) == (0, 0) and tuple(index[-1]) == (len(src), len(tgt))):
        raise ValueError(f"{index_path} does not match its token files; re-create the dataset with --force")
    return Pairs(src, tgt, index)


# ----------------------------------------------------------------------------- chat conversations


class ConversationWriter:
    """Streams the conversations of one split into its three files (the module's docstring says what each holds)."""

    def __init__(self, stack, folder, split, vocab_size):
        # entered on the caller's stack: the files are renamed into place only when the whole build succeeds
        self.ids = TokenWriter(stack.enter_context(atomic_output(folder / f"{split}.bin")), vocab_size)
        self.targets = TokenWriter(stack.enter_context(atomic_output(folder / f"{split}_targets.bin")), 2)
        self.index_path = folder / f"{split}_idx.npy"
        self.offsets = array.array("q", [0])

    def add(self, ids, targets):
        """Append one conversation: its ids and, per id, whether it is a loss target (bools or 0/1)."""
        if len(ids) != len(targets):
            raise ValueError(f"a conversation of {len(ids)} ids came with {len(targets)} target flags")
        self.ids.write(ids)
        self.targets.write(np.asarray(targets, dtype=np.uint8))
        self.offsets.append(self.ids.count)

    def finish(self):
        """Write the index, complete both token files and return the number of conversations."""
        with atomic_output(self.index_path) as f:
            np.save(f, np.frombuffer(self.offsets, dtype=np.int64))
        self.ids.finish()
        self.targets.finish()
        return len(self.offsets) - 1


class Conversations(Sequence):
    """
    The conversations of one chat split, backed by memmaps: `conversations[i]` is (ids, targets), two read-only
    arrays of one length, targets 1 where the id is a loss target. `ids`, `targets` (the whole split's, concatenated)
    and `index` (int64 (n + 1,): where each conversation starts) are public for vectorised batching.
    """

    def __init__(self, ids, targets, index):
        self.ids, self.targets, self.index = ids, targets, index

    def __len__(self):
        return len(self.index) - 1

    def __getitem__(self, i):
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"conversation {i} is out of range for a split of {n} conversations")
        start, end = self.index[i % n], self.index[i % n + 1]
        return self.ids[start:end], self.targets[start:end]


def final_reply(ids, targets):
    """
    (prompt, reply) of a conversation: reply is its last run of loss targets (the final assistant answer and the
    end-of-turn closing it), prompt every id before it (the conversation so far and the generation prompt), so
    that greedy decoding from prompt can be compared with reply.
    """
    flags = np.asarray(targets, dtype=bool)
    end = int(np.flatnonzero(flags)[-1]) + 1
    # the reply starts after the last id before it that is not a target (the generation prompt's last id)
    given = np.flatnonzero(~flags[:end])
    start = int(given[-1]) + 1 if len(given) else 0
    return ids[:start], ids[start:end]


def load_conversations(dataset_dir, split):
    """The conversations of `split` ('train' or 'val') of a prepared chat dataset."""
    ids, targets, index, index_path = open_split(dataset_dir, split, "chat", CHAT_SPLITS, ("", "_targets"))
    # cheap consistency checks, as for pairs: a stale index or a mismatched file fails here, not in a batch
    if not (index.ndim == 1 and len(index) >= 1 and index[0] == 0 and index[-1] == len(ids) == len(targets)):
        raise ValueError(f"{index_path} does not match its token files; re-create the dataset with --force")
    targets_path = Path(dataset_dir) / f"{split}_targets.bin"
    if read_header(targets_path)[1] != 2:
        raise ValueError(f"{targets_path} is not a file of target flags; re-create the dataset")
    return Conversations(ids, targets, index)


# ----------------------------------------------------------------------------- tokenizer


@functools.cache
def tiktoken_encoding(name):
    """tiktoken's encoding `name` ('gpt2' read as its twin 'r50k_base', the same ids); DownloadError if it cannot be
    loaded. Cached: one load, and at most one warning, per process."""
    if name != "gpt2":
        try:
            # tiktoken downloads an encoding's files once, then reads them from its cache (TIKTOKEN_CACHE_DIR)
            return tiktoken.get_encoding(name)
        except Exception as err:  # tiktoken raises requests, blobfile or hash errors depending on what is missing
            raise DownloadError(
                f"could not load the tiktoken encoding {name!r} ({one_line(err)}); "
                "set TIKTOKEN_CACHE_DIR to a folder holding its cached files"
            ) from None
    # tiktoken's 'gpt2' is read from GPT-2's two files (vocab.bpe, encoder.json), 'r50k_base' from one .tiktoken
    # file with the same ids, pattern and end-of-text. Caches and mirrors hold the latter: asked for 'gpt2' first,
    # every process went to the network, failed offline and warned, though nothing was lost
    try:
        return tiktoken.get_encoding("r50k_base")
    except Exception as err:
        twin_error = one_line(err)  # kept: Python deletes `err` when the except clause ends
    try:
        encoding = tiktoken.get_encoding("gpt2")
    except Exception as err:
        raise DownloadError(
            f"could not load tiktoken 'r50k_base' from {R50K_URL} ({twin_error}) nor its twin 'gpt2' "
            f"({one_line(err)}); set TIKTOKEN_CACHE_DIR to a tiktoken cache holding r50k_base"
        ) from None
    # worth a word: this process (and every one after it) tries r50k_base first, over the network where uncached
    logger.warning(
        "tiktoken could not load 'r50k_base' (%s); read GPT-2's own files instead (the same ids). A "
        "TIKTOKEN_CACHE_DIR holding r50k_base saves each process that attempt",
        twin_error,
    )
    return encoding


def parse_tokenizer_json(text, source):
    """A tokenizers.Tokenizer from a tokenizer.json's text; ValueError naming `source` (a file, or the copy in a
    dataset or checkpoint) if the library cannot read it."""
    try:
        tokenizer = tokenizers.Tokenizer.from_str(text)
    except Exception as err:  # the library raises a bare Exception for bad JSON and for unknown components alike
        raise ValueError(
            f"{source} is not a tokenizer.json the tokenizers library can read ({one_line(err)})"
        ) from None
    # '<s>' or '<|begin_of_text|>' written in a text stays text, never the special id, as with tiktoken's
    # encode_ordinary: a corpus or a prompt cannot smuggle in control tokens
    tokenizer.encode_special_tokens = True
    return tokenizer


class Tokenizer:
    """
    Text <-> ids for a dataset: a character vocabulary, a tiktoken encoding or a Hugging Face tokenizer.json, plus
    special tokens. Those beyond the base vocabulary (pad/bos/eos of seq2seq data) decode as markers such as '<eos>',
    the base's own (tiktoken's end-of-text, Llama's '<s>') as their text. encode() never produces special ids.
    """

    def __init__(self, spec, vocab_size, special_tokens):
        # exactly one of the three is set, by the spec's type
        self.chars = self.bpe = self.hf = None
        if spec.get("type") == "char":
            # char: id i is the i-th character of the list in meta.json; char_ids maps back, character -> id
            self.chars = list(spec["chars"])
            self.char_ids = {c: i for i, c in enumerate(self.chars)}
            base = len(self.chars)
        elif spec.get("type") == "tiktoken":
            # base: the ids that text itself uses (GPT-2: 50,257, end-of-text included)
            self.bpe = tiktoken_encoding(spec["encoding"])
            base = self.bpe.n_vocab
        elif spec.get("type") == "huggingface":
            # the file's text itself, not its path: a checkpoint is sampled on machines that never had the file
            self.hf = parse_tokenizer_json(spec["json"], "the tokenizer.json stored in this dataset or checkpoint")
            # every id the file defines, its added tokens (Llama 3's reserved specials) included
            base = self.hf.get_vocab_size()
        else:
            raise ValueError(f"unknown tokenizer spec {spec!r:.200}; expected type 'char', 'tiktoken' or 'huggingface'")
        # vocab_size must cover the base ids and every special id; the ids beyond base are the specials
        if vocab_size < base or any(not 0 <= i < vocab_size for i in special_tokens.values()):
            raise ValueError(
                f"vocab_size {vocab_size} and special tokens {special_tokens} do not fit a base vocabulary of {base}"
            )
        self.spec, self.vocab_size, self.special_tokens = spec, vocab_size, dict(special_tokens)
        self.base_size = base
        # only specials past the base get a marker: tiktoken and tokenizer.json decode their own specials themselves
        self.markers = {i: f"<{name}>" for name, i in special_tokens.items() if i >= base}

    @classmethod
    def from_meta(cls, meta):
        """The tokenizer a dataset was prepared with, from its meta.json contents."""
        return cls(meta["tokenizer"], meta["vocab_size"], meta["special_tokens"])

    def encode(self, text):
        """Ids of `text`; characters outside a char vocabulary raise ValueError naming them."""
        if self.bpe is not None:
            # ordinary: '<|endoftext|>' written in a text stays text, never the special id
            return self.bpe.encode_ordinary(text)
        if self.hf is not None:
            # without the template's specials (Llama's bos): the ids of the text alone, as encode_ordinary gives
            return self.hf.encode(text, add_special_tokens=False).ids
        try:
            # the fast path; the except clause below only builds the message
            return [self.char_ids[c] for c in text]
        except KeyError:
            unknown = sorted(set(text) - self.char_ids.keys())
            # at most ten shown, so a wrong file (binary, another alphabet) still gives one line
            shown = ", ".join(map(repr, unknown[:10])) + (", ..." if len(unknown) > 10 else "")
            raise ValueError(f"characters not in the {len(self.chars)}-character vocabulary: {shown}") from None

    def encode_batch(self, texts, num_threads=1):
        """encode() of each text; tiktoken runs on `num_threads` threads, a tokenizer.json on the library's own pool."""
        if self.bpe is not None:
            return self.bpe.encode_ordinary_batch(texts, num_threads=num_threads)
        if self.hf is not None:
            # the library's thread pool (sized by RAYON_NUM_THREADS) takes no thread count per call; the fast
            # variant gives the ids without the offsets nobody here reads
            return [e.ids for e in self.hf.encode_batch_fast(texts, add_special_tokens=False)]
        return [self.encode(t) for t in texts]

    def template_prefix(self):
        """The special ids a Hugging Face tokenizer's template puts before every text (Llama's bos); else []."""
        if self.hf is None:
            return []
        # any text will do: the template's ids are flagged special, and the prefix is those before the text's first
        encoding = self.hf.encode("a", add_special_tokens=True)
        mask = encoding.special_tokens_mask
        return encoding.ids[: mask.index(0)] if 0 in mask else encoding.ids

    def decode(self, ids):
        """Text of `ids` (any int sequence or array); ids beyond the vocabulary raise ValueError."""
        # a list, a numpy array or a CPU tensor of any shape becomes a flat list of Python ints
        ids = np.asarray(ids).ravel().tolist()
        parts, run = [], []  # base ids are decoded in runs: one character may span several tokens
        for i in ids:
            # ordinary ids gather in the current run
            if 0 <= i < self.base_size:
                run.append(i)
                continue
            if i not in self.markers:
                raise ValueError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
            parts += [self.decode_base(run), self.markers[i]]
            run = []
        parts.append(self.decode_base(run))
        return "".join(parts)

    def decode_base(self, ids):
        """Text of a run of base-vocabulary ids (no markers among them)."""
        if self.bpe is not None:
            # an incomplete UTF-8 character at the end decodes as U+FFFD, which sample.py's streaming waits out
            return self.bpe.decode(ids)
        if self.hf is not None:
            # the run at once, never token by token: a byte-level character spread over tokens, or metaspace's
            # '▁' that becomes a space except at the start, decodes right only in context; specials as their text
            return self.hf.decode(ids, skip_special_tokens=False)
        return "".join(self.chars[i] for i in ids)


def token_byte_lengths(meta):
    """The UTF-8 bytes of text that each id of meta's tokenizer stands for: int64 (meta["vocab_size"],).

    What bits per byte divides by: for any text, the lengths of tokenizer.encode(text) sum to
    len(text.encode()), whichever the tokenizer, so losses per byte compare across tokenizers. Raw bytes, not
    decoded text: a byte-level BPE token may hold part of a character (GPT-2 splits most CJK characters and emoji
    over several tokens), and each part counts its own bytes. Special tokens (end-of-text, pad/bos/eos, [MASK], a
    tokenizer.json's special added tokens) stand for no text and count 0. A sentencepiece-style tokenizer.json
    (Llama 2, Mistral) that puts a '▁' before every text counts that space too, so a text's sum is one more than
    its length there; for WordPiece (BERT) the spaces between words go uncounted.
    """
    spec = meta["tokenizer"]
    lengths = np.zeros(meta["vocab_size"], dtype=np.int64)
    if spec["type"] == "char":
        lengths[: len(spec["chars"])] = [len(c.encode("utf-8")) for c in spec["chars"]]
    elif spec["type"] == "tiktoken":
        encoding = tiktoken_encoding(spec["encoding"])
        specials = {encoding.encode_single_token(s) for s in encoding.special_tokens_set}
        for i in range(encoding.n_vocab):
            # some encodings (cl100k_base) leave gaps in their ids: no token, no bytes
            with contextlib.suppress(KeyError):
                lengths[i] = 0 if i in specials else len(encoding.decode_single_token_bytes(i))
    elif spec["type"] == "huggingface":
        base = huggingface_byte_lengths(spec["json"])
        lengths[: len(base)] = base
    else:
        raise ValueError(f"unknown tokenizer spec {spec!r:.200}; expected type 'char', 'tiktoken' or 'huggingface'")
    # specials appended after the base vocabulary (seq2seq pad/bos/eos, the encoder's [MASK]), and those within it
    lengths[list(meta["special_tokens"].values())] = 0
    return lengths


def huggingface_byte_lengths(text):
    """The UTF-8 bytes of text that each id of a tokenizer.json stands for (see token_byte_lengths): from its string in
    the vocabulary and the decoder that turns strings into text."""
    tokenizer = parse_tokenizer_json(text, "the tokenizer.json stored in this dataset or checkpoint")
    decoder = json.loads(text).get("decoder") or {}
    # a Sequence decoder (Llama 2's: Replace, ByteFallback, Fuse, Strip) chains others: the kinds used, flattened
    steps = decoder.get("decoders", [decoder])
    kinds = {step.get("type") for step in steps}
    # byte-level BPE (GPT-2, Llama 3, SmolLM) writes each byte as one of 256 printable characters
    byte_chars = set(tokenizers.pre_tokenizers.ByteLevel.alphabet()) if "ByteLevel" in kinds else set()
    # sentencepiece-style: '▁' is a space (Metaspace, or a Replace of it), '<0xE2>' one raw byte (ByteFallback)
    spaces = "Metaspace" in kinds or any(step.get("pattern") == {"String": "▁"} for step in steps)
    # WordPiece (BERT) marks a word's continuation with "##", which is no text
    prefix = next((step.get("prefix", "##") for step in steps if step.get("type") == "WordPiece"), "")
    pieces = {i: piece for piece, i in tokenizer.get_vocab(with_added_tokens=False).items()}
    added = tokenizer.get_added_tokens_decoder()
    lengths = []
    for i in range(tokenizer.get_vocab_size()):
        if i in added and (added[i].special or i not in pieces):
            # an added token is matched in the raw text, so it stands for its content as written
            lengths.append(0 if added[i].special else len(added[i].content.encode("utf-8")))
            continue
        piece = pieces.get(i, "")
        if byte_chars:
            lengths.append(sum(1 if c in byte_chars else len(c.encode("utf-8")) for c in piece))
        elif "ByteFallback" in kinds and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            lengths.append(1)
        else:
            piece = piece.removeprefix(prefix)
            lengths.append(len((piece.replace("▁", " ") if spaces else piece).encode("utf-8")))
    return lengths


# ----------------------------------------------------------------------------- JSON, and Hugging Face tokenizer files


def tokenizer_json_file(path):
    """The tokenizer.json that `path` names: the file itself, or the one in the folder `path`."""
    path = Path(path).expanduser()
    file = path / TOKENIZER_JSON if path.is_dir() else path
    if not file.is_file():
        problem = f"{path} has no {TOKENIZER_JSON}" if path.is_dir() else f"{path} does not exist"
        raise FileNotFoundError(
            f"{problem}; pass a {TOKENIZER_JSON} or a folder holding one (a Hugging Face model folder)"
        )
    return file


def write_json(obj, path):
    """Write obj to path as indented JSON, replacing it atomically (train.py's config.json beside the checkpoints)."""
    with atomic_output(path) as f:
        f.write((json.dumps(obj, indent=1) + "\n").encode("utf-8"))


def read_json(path, missing, fix=""):
    """The JSON in file path; one-line errors: FileNotFoundError saying `missing`, ValueError ending with `fix`."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found; {missing}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({one_line(err)}){fix}") from None


def huggingface_tokenizer(path):
    """
    meta.json's tokenizer, vocab_size and special_tokens for the tokenizer.json at `path` (or in the folder `path`):
    the spec keeps the file's text, so datasets and checkpoints stay self-contained; bos and eos from a config.json
    beside it. A file that is missing or cannot be parsed raises one line naming it.
    """
    file = tokenizer_json_file(path)
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{file} is not UTF-8 text, so not a {TOKENIZER_JSON}") from None
    vocab_size = parse_tokenizer_json(text, file).get_vocab_size()
    config = read_json(file.parent / "config.json", missing="") if (file.parent / "config.json").is_file() else {}
    if not isinstance(config, dict):
        raise ValueError(f"{file.parent / 'config.json'} is not a model config (a JSON object)")
    special = {}
    for name in ("bos", "eos"):
        value = config.get(f"{name}_token_id")
        # Llama 3.1's instruct models list several eos ids; the first is the base model's end-of-text
        if isinstance(value, list):
            value = value[0] if value else None
        if value is None:
            continue
        # refused now, while the file can be named, rather than by the Tokenizer of a later run
        if not isinstance(value, int) or not 0 <= value < vocab_size:
            raise ValueError(
                f"{file.parent / 'config.json'}: {name}_token_id {value!r} is not an id of the {vocab_size:,} in "
                f"{file}; is it the same model's tokenizer?"
            )
        special[name] = value
    return {"tokenizer": {"type": "huggingface", "json": text}, "vocab_size": vocab_size, "special_tokens": special}


# ----------------------------------------------------------------------------- dataset folders


def data_root(data_dir=None):
    """The folder holding the datasets: data_dir, else $NANOFORMER_DATA_DIR, else data/ beside this file."""
    if data_dir is not None:
        return Path(data_dir).expanduser()
    if os.environ.get(DATA_DIR_ENV):
        return Path(os.environ[DATA_DIR_ENV]).expanduser()
    return Path(__file__).resolve().parent / "data"  # beside this file, so any working directory works


def dataset_dir(name, data_dir=None):
    """Where dataset (or output folder) `name` lives: <data_root(data_dir)>/<name>."""
    # a plain name only: a path or '..' would escape data_dir, and dot names belong to prepare_data's staging folders
    if not name or name in (".", "..") or "/" in name or "\\" in name or name.startswith("."):
        raise ValueError(f"dataset folder name must be a plain name such as 'my_corpus', got {name!r}")
    return data_root(data_dir) / name


def load_meta(dataset_dir):
    """The contents of a prepared dataset's meta.json (see docs/data.md)."""
    path = Path(dataset_dir) / "meta.json"
    meta = read_json(
        path,
        missing=f"prepare the data first: python prepare_data.py {Path(dataset_dir).name}",
        fix="; re-create the dataset with --force",
    )
    # what training and sampling read; a meta.json without them is foreign or cut short
    required = ("format_version", "kind", "tokenizer", "vocab_size", "special_tokens", "files")
    if not isinstance(meta, dict) or any(key not in meta for key in required):
        raise ValueError(f"{path} lacks the keys {', '.join(required)}; re-create the dataset with --force")
    if meta["kind"] not in KIND_NEEDS:
        raise ValueError(
            f"{path} holds kind={meta['kind']!r}, not one of {', '.join(KIND_NEEDS)}: not a dataset of ours"
        )
    # chat data is read through its template, which the "chat" entry names
    if meta["kind"] == "chat" and not isinstance(meta.get("chat"), dict):
        raise ValueError(f"{path} is chat data without a 'chat' entry; re-create the dataset with --force")
    # as for token files: only a newer writer's layout is unreadable
    if meta["format_version"] > FORMAT_VERSION:
        raise ValueError(
            f"{path} has format version {meta['format_version']}, newer than this code's {FORMAT_VERSION}; "
            "update nanoformer"
        )
    return meta


def check_prepared(path):
    """
    Raise ValueError or FileNotFoundError (one line naming the file and the fix) unless `path` holds a complete,
    intact dataset: a meta.json listing what its kind needs (KIND_NEEDS), every listed file present with the token
    count it records, each split's index matching its token files and count.
    """
    path = Path(path)
    meta = load_meta(path)
    fix = "re-create the dataset with: python prepare_data.py NAME --force"
    # what its kind needs: LM training reads train.bin and val.bin, seq2seq the pairs of every split, ...
    entry, names, described = KIND_NEEDS[meta["kind"]]
    missing = [described.format(name) for name in names if name not in meta.get(entry, {})]
    if missing:
        raise ValueError(f"{path / 'meta.json'} lists no {' nor '.join(missing)}; {fix}")
    # headers only, never the ids: cheap even for billions of tokens
    for fname, count in meta["files"].items():
        if not (path / fname).is_file():
            raise FileNotFoundError(f"{path / fname} is missing (meta.json lists it); {fix}")
        held = read_header(path / fname)[2]
        if held != count:
            raise ValueError(f"{path / fname} holds {held:,} tokens but meta.json records {count:,}; {fix}")
    # the loaders check each index against its token files; here its pair or conversation count against meta.json
    for items, load in (("pairs", load_pairs), ("conversations", load_conversations)):
        for split, count in meta.get(items, {}).items():
            held = len(load(path, split))
            if held != count:
                index = path / f"{split}_idx.npy"
                raise ValueError(f"{index} holds {held:,} {items} but meta.json records {count:,}; {fix}")


def is_prepared(path):
    """Whether check_prepared(path) raises nothing."""
    try:
        check_prepared(path)
    except (OSError, ValueError):
        return False
    return True
