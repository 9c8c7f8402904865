"""Datasets to token files, the tokenizer, and the token-file reader.

    python prepare_data.py NAME [--data_dir DIR] [--input PATH] [--force] [options]
    python prepare_data.py --help          # every dataset, one line each
    python prepare_data.py NAME --help     # that dataset's options
    python prepare_data.py benchmark       # BPE tokenization throughput

A dataset lands in <data_dir>/<name>/ as meta.json plus token files. LM datasets hold
train.bin and val.bin; seq2seq datasets hold {split}_src.bin, {split}_tgt.bin and
{split}_idx.npy for the splits train, val and test. A token file is a 32-byte header
(magic, format version, bytes per token, vocab size, token count) followed by the ids as
little-endian uint16 (when the vocabulary has at most 65,536 ids) or uint32.

Each dataset is built in a hidden folder beside its final place and renamed into place
only when complete, so an interrupted run never leaves a folder that looks prepared.
"""

import argparse
import array
import codecs
import contextlib
import functools
import glob
import hashlib
import http.client
import itertools
import json
import logging
import os
import random
import secrets
import shutil
import statistics
import string
import struct
import sys
import tempfile
import time
import urllib.request
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tiktoken
from tqdm import tqdm

DATASETS = {
    "shakespeare_char": "tiny Shakespeare, character-level (65 symbols), 90/10 split as in nanoGPT",
    "shakespeare": "tiny Shakespeare, GPT-2 BPE (tiktoken), 90/10 split as in nanoGPT",
    "openwebtext": "OpenWebText through Hugging Face datasets, GPT-2 BPE, streamed (--max_docs for a quick run)",
    "fineweb_edu": "FineWeb-Edu sample-10BT through Hugging Face datasets, GPT-2 BPE, streamed",
    "text": "your own text: a file, directory or glob (--input), char-level or GPT-2 BPE",
    "translation": "translation pairs (opus_books/wmt14 or a local TSV/JSONL) for the encoder-decoder, BPE",
    "reverse": "synthetic seq2seq, offline: reverse a string of digits and letters",
    "sort": "synthetic seq2seq, offline: sort the characters of a string",
    "num2words": "synthetic seq2seq, offline: 1234 -> one thousand two hundred thirty-four",
}

MAGIC = b"NFTOKENS"
FORMAT_VERSION = 1
# magic, format version, bytes per token (2 or 4), vocab size, token count; little-endian
_HEADER = struct.Struct("<8sIIQQ")
_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}

DATA_DIR_ENV = "NANOFORMER_DATA_DIR"
MIRROR_ENV = "NANOFORMER_DATA_MIRROR"
SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
R50K_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"

_BLOCK_BYTES = 1 << 18  # text is read, cut and encoded in pieces of about this size
_BATCH_PIECES = 16  # pieces per tiktoken batch: enough work for every thread, bounded memory
_BATCH_DOCS = 1024  # documents (or pairs) per batch for the Hugging Face streams
_SYNTH_SYMBOLS = string.digits + string.ascii_lowercase  # what reverse/sort strings are made of
_SYNTH_CHARS = sorted(" -" + _SYNTH_SYMBOLS)  # one vocabulary for all synthetic tasks
_SEQ2SEQ_SPLITS = ("train", "val", "test")

# train.py forwards its data_options dict to prepare(), so there the same option is spelled as a dict entry
_INPUT_OPTION = "--input PATH (in train.py: --data_options=\"{'input': 'PATH'}\")"

_log = logging.getLogger("nanoformer.data")


class DownloadError(OSError):
    """A download (or hub load) failed; the message names the URL and the offline alternative.

    An OSError, as any failed I/O is, so every `except OSError` reports it like a missing file.
    """


def _one_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0][:200] if lines else type(err).__name__


# ----------------------------------------------------------------------------- token files


@contextlib.contextmanager
def _atomic_output(path: Path):
    # Yield a binary file beside `path` that replaces `path` only if the block succeeds.
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())  # the data must be on disk before the name says it is complete
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class _TokenWriter:
    # Appends token ids to an open file, then writes the header with the final count.

    def __init__(self, f, vocab_size: int):
        if not isinstance(vocab_size, (int, np.integer)) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
        if vocab_size > 2**32:
            raise ValueError(f"vocab_size {vocab_size:,} is too large for token files: uint32 holds at most 2**32 ids")
        self.f, self.vocab_size, self.count = f, int(vocab_size), 0
        self.dtype = _DTYPES[2] if vocab_size <= 2**16 else _DTYPES[4]
        f.write(bytes(_HEADER.size))  # placeholder until the count is known

    def write(self, ids) -> None:
        arr = np.asarray(ids)
        if arr.size == 0:
            return
        if arr.dtype.kind not in "iu":
            raise ValueError(f"token ids must be integers, got an array of {arr.dtype}")
        # checked before the cast, so an id that does not fit can never wrap silently
        low, high = int(arr.min()), int(arr.max())
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"token id {bad} is outside the vocabulary 0..{self.vocab_size - 1}")
        arr.astype(self.dtype).tofile(self.f)
        self.count += arr.size

    def finish(self) -> int:
        self.f.seek(0)
        self.f.write(_HEADER.pack(MAGIC, FORMAT_VERSION, self.dtype.itemsize, self.vocab_size, self.count))
        return self.count


def write_tokens(path, tokens, vocab_size: int) -> int:
    """Atomically write token ids to a token file and return how many were written.

    `tokens` is one sequence of ids (a numpy array, or a list/tuple of ints) or an
    iterable of such chunks, which is streamed. The dtype is uint16 when vocab_size <=
    65,536 and uint32 otherwise; an id outside 0..vocab_size-1 raises ValueError and
    leaves nothing on disk.
    """
    path = Path(path)
    single = isinstance(tokens, np.ndarray) or (
        isinstance(tokens, (list, tuple)) and (not tokens or isinstance(tokens[0], (int, np.integer)))
    )
    with _atomic_output(path) as f:
        writer = _TokenWriter(f, vocab_size)
        for chunk in [tokens] if single else tokens:
            writer.write(chunk)
        return writer.finish()


def _read_header(path: Path) -> tuple[np.dtype, int, int]:
    fix = "re-create the dataset with: python prepare_data.py NAME --force"
    with open(path, "rb") as f:
        raw = f.read(_HEADER.size)
        size = os.fstat(f.fileno()).st_size
    if len(raw) < _HEADER.size:
        raise ValueError(f"{path} is truncated (shorter than the {_HEADER.size}-byte header); {fix}")
    magic, version, itemsize, vocab_size, count = _HEADER.unpack(raw)
    if magic != MAGIC:
        raise ValueError(f"{path} is not a nanoformer token file (bad magic {magic!r}); {fix}")
    if version > FORMAT_VERSION:
        raise ValueError(
            f"{path} has format version {version}, newer than this code's {FORMAT_VERSION}; update nanoformer"
        )
    if itemsize not in _DTYPES or (itemsize == 2 and vocab_size > 2**16):
        raise ValueError(f"{path} has a corrupt header ({itemsize} bytes per token for vocab size {vocab_size}); {fix}")
    if size != _HEADER.size + count * itemsize:
        held = (size - _HEADER.size) / itemsize
        raise ValueError(f"{path} is truncated: its header promises {count:,} tokens but it holds {held:,.1f}; {fix}")
    return _DTYPES[itemsize], vocab_size, count


def load_tokens(path) -> np.memmap:
    """Read-only 1-D memmap of a token file's ids (uint16 or uint32, from its header).

    The header is validated first: wrong magic, a newer format version or a truncated file
    raise ValueError. The pages are file-backed and never written, so the OS can drop them
    at will and long training runs do not grow in memory.
    """
    path = Path(path)
    dtype, _, count = _read_header(path)
    return np.memmap(path, dtype=dtype, mode="r", offset=_HEADER.size, shape=(count,))


# ----------------------------------------------------------------------------- seq2seq pairs


class _PairWriter:
    # Streams (src, tgt) id pairs of one split into {split}_src.bin, {split}_tgt.bin, {split}_idx.npy.

    def __init__(self, stack: contextlib.ExitStack, folder: Path, split: str, vocab_size: int):
        self.src = _TokenWriter(stack.enter_context(_atomic_output(folder / f"{split}_src.bin")), vocab_size)
        self.tgt = _TokenWriter(stack.enter_context(_atomic_output(folder / f"{split}_tgt.bin")), vocab_size)
        self.index_path = folder / f"{split}_idx.npy"
        # row i holds where pair i starts in the src and tgt files; 16 bytes a pair stay in memory
        self.offsets = array.array("q", [0, 0])

    def add(self, src_ids, tgt_ids) -> None:
        self.src.write(src_ids)
        self.tgt.write(tgt_ids)
        self.offsets.extend((self.src.count, self.tgt.count))

    def finish(self) -> int:
        index = np.frombuffer(self.offsets, dtype=np.int64).reshape(-1, 2)
        with _atomic_output(self.index_path) as f:
            np.save(f, index)
        self.src.finish()
        self.tgt.finish()
        return len(index) - 1


class Pairs(Sequence):
    """The (src_ids, tgt_ids) pairs of one seq2seq split, backed by memmaps.

    `pairs[i]` returns two read-only uint16/uint32 arrays without bos/eos; `src`, `tgt`
    (all ids of the split, concatenated) and `index` (int64 (n + 1, 2): where each pair
    starts in src and tgt) are public for vectorised batching.
    """

    def __init__(self, src: np.ndarray, tgt: np.ndarray, index: np.ndarray):
        self.src, self.tgt, self.index = src, tgt, index

    def __len__(self) -> int:
        return len(self.index) - 1

    def __getitem__(self, i):
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"pair {i} is out of range for a split of {n} pairs")
        (s0, t0), (s1, t1) = self.index[i % n], self.index[i % n + 1]
        return self.src[s0:s1], self.tgt[t0:t1]


def load_pairs(dataset_dir, split: str) -> Pairs:
    """The pairs of `split` ('train', 'val' or 'test') of a prepared seq2seq dataset."""
    folder = Path(dataset_dir)
    if split not in _SEQ2SEQ_SPLITS:
        raise ValueError(f"unknown split {split!r}; seq2seq splits are {', '.join(_SEQ2SEQ_SPLITS)}")
    index_path = folder / f"{split}_idx.npy"
    if not index_path.is_file():
        raise FileNotFoundError(f"{index_path} not found; is {folder} a prepared seq2seq dataset?")
    src, tgt = load_tokens(folder / f"{split}_src.bin"), load_tokens(folder / f"{split}_tgt.bin")
    try:
        index = np.load(index_path, mmap_mode="r")
    except ValueError as err:
        raise ValueError(
            f"{index_path} is not a valid index ({_one_line(err)}); re-create the dataset with --force"
        ) from None
    if not (
        index.ndim == 2
        and index.shape[1] == 2
        and len(index) >= 1
        and tuple(index[0]) == (0, 0)
        and tuple(index[-1]) == (len(src), len(tgt))
    ):
        raise ValueError(f"{index_path} does not match its token files; re-create the dataset with --force")
    return Pairs(src, tgt, index)


# ----------------------------------------------------------------------------- tokenizer


@functools.cache
def _tiktoken_encoding(name: str) -> tiktoken.Encoding:
    # cached so the network attempt for gpt2, and the fallback warning, happen once per process
    try:
        return tiktoken.get_encoding(name)
    except Exception as err:  # tiktoken raises requests, blobfile or hash errors depending on what is missing
        if name != "gpt2":
            raise DownloadError(
                f"could not load the tiktoken encoding {name!r} ({_one_line(err)}); "
                "set TIKTOKEN_CACHE_DIR to a folder holding its cached files"
            ) from None
        gpt2_error = err
    try:
        encoding = tiktoken.get_encoding("r50k_base")
    except Exception as err:
        raise DownloadError(
            f"could not load tiktoken 'gpt2' nor its twin 'r50k_base' from {R50K_URL} "
            f"({_one_line(err)}); set TIKTOKEN_CACHE_DIR to a tiktoken cache holding r50k_base"
        ) from None
    _log.warning(
        "tiktoken could not load 'gpt2' (%s, offline?); using 'r50k_base', which has the same token ids",
        type(gpt2_error).__name__,
    )
    return encoding


class Tokenizer:
    """Text <-> ids for a dataset: a character vocabulary or a tiktoken encoding, plus special tokens.

    Special tokens beyond the base vocabulary (pad/bos/eos of seq2seq data) come after it
    and decode as markers such as '<eos>'; tiktoken's own end-of-text id decodes as
    '<|endoftext|>'. encode() never produces special ids.
    """

    def __init__(self, spec: dict, vocab_size: int, special_tokens: dict[str, int]):
        if spec.get("type") == "char":
            self._chars = list(spec["chars"])
            self._index = {c: i for i, c in enumerate(self._chars)}
            self._bpe, base = None, len(self._chars)
        elif spec.get("type") == "tiktoken":
            self._bpe = _tiktoken_encoding(spec["encoding"])
            base = self._bpe.n_vocab
        else:
            raise ValueError(f"unknown tokenizer spec {spec!r}; expected type 'char' or 'tiktoken'")
        if vocab_size < base or any(not 0 <= i < vocab_size for i in special_tokens.values()):
            raise ValueError(
                f"vocab_size {vocab_size} and special tokens {special_tokens} do not fit a base vocabulary of {base}"
            )
        self.spec, self.vocab_size, self.special_tokens = spec, vocab_size, dict(special_tokens)
        self._base = base
        self._markers = {i: f"<{name}>" for name, i in special_tokens.items() if i >= base}

    @classmethod
    def from_meta(cls, meta: dict) -> "Tokenizer":
        """The tokenizer a dataset was prepared with, from its meta.json contents."""
        return cls(meta["tokenizer"], meta["vocab_size"], meta["special_tokens"])

    def encode(self, text: str) -> list[int]:
        """Ids of `text`; characters outside a char vocabulary raise ValueError naming them."""
        if self._bpe is not None:
            return self._bpe.encode_ordinary(text)
        try:
            return [self._index[c] for c in text]
        except KeyError:
            unknown = sorted(set(text) - self._index.keys())
            shown = ", ".join(map(repr, unknown[:10])) + (", ..." if len(unknown) > 10 else "")
            raise ValueError(f"characters not in the {len(self._chars)}-character vocabulary: {shown}") from None

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        """encode() of each text; BPE runs on `num_threads` threads."""
        if self._bpe is not None:
            return self._bpe.encode_ordinary_batch(texts, num_threads=num_threads)
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        """Text of `ids` (any int sequence or array); ids beyond the vocabulary raise ValueError."""
        ids = np.asarray(ids).ravel().tolist()
        parts, run = [], []  # BPE ids are decoded in runs: one character may span several tokens
        for i in ids:
            if 0 <= i < self._base:
                run.append(i)
                continue
            if i not in self._markers:
                raise ValueError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
            parts.append(self._decode_base(run))
            parts.append(self._markers[i])
            run = []
        parts.append(self._decode_base(run))
        return "".join(parts)

    def _decode_base(self, ids: list[int]) -> str:
        if self._bpe is not None:
            return self._bpe.decode(ids)
        return "".join(self._chars[i] for i in ids)


def _gpt2_spec() -> dict:
    return {"type": "tiktoken", "encoding": "gpt2"}


def _describe(spec: dict) -> str:
    if spec.get("type") == "char":
        return f"char-level, {len(spec['chars'])} symbols"
    return f"tiktoken {spec.get('encoding')}"


# ----------------------------------------------------------------------------- reading text


def _expand_input(spec: str) -> list[Path]:
    # The files named by a path, a directory (recursively, hidden files left out) or a glob.
    path = Path(spec).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise ValueError(f"input directory {spec} holds no files")
        return files
    if any(c in spec for c in "*?["):
        files = sorted(Path(p) for p in glob.glob(os.path.expanduser(spec), recursive=True) if Path(p).is_file())
        if not files:
            raise FileNotFoundError(f"no files match the glob {spec!r}")
        return files
    raise FileNotFoundError(f"input {spec} does not exist; pass an existing file, directory or glob")


def _fingerprint(files: list[Path]) -> list:
    # What identifies local inputs cheaply: path, size and modification time.
    return [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def _decoded_blocks(path: Path) -> Iterator[str]:
    # The text of a UTF-8 file in blocks; undecodable or binary content raises naming the file.
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:
        while True:
            raw = f.read(_BLOCK_BYTES)
            try:
                text = decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"{path} is not UTF-8 text (undecodable byte near offset {offset + err.start}); "
                    "convert it to UTF-8 or leave it out of --input"
                ) from None
            if "\x00" in text:
                raise ValueError(f"{path} looks binary (it contains NUL bytes); leave it out of --input")
            if text:
                yield text
            if not raw:
                return
            offset += len(raw)


def _last_cut(text: str) -> int:
    # The last index i > 0 with text[i] == '\n' and text[i + 1] not whitespace, or 0.
    i = text.rfind("\n", 0, len(text) - 1)
    while i > 0:
        if not text[i + 1].isspace():
            return i
        i = text.rfind("\n", 0, i)
    return 0


def _pieces(blocks: Iterable[str]) -> Iterator[str]:
    # Regroup text blocks into pieces that BPE-encode exactly like the whole text.
    #
    # GPT-2 pre-tokenization always makes a newline followed by a non-space character a
    # token of its own, and no token crosses it; cutting just before such a newline therefore
    # leaves the ids unchanged, so pieces can be encoded independently, in parallel.
    carry = ""
    for block in blocks:
        text = carry + block
        cut = _last_cut(text)
        if cut:
            yield text[:cut]
        carry = text[cut:]
    if carry:
        yield carry


def _scan_text(files: list[Path]) -> tuple[int, set[str]]:
    # Character count and character set of the files, validating that each is UTF-8 text.
    total, chars = 0, set()
    with tqdm(desc="scanning", unit="char", unit_scale=True, disable=None) as bar:
        for path in files:
            for block in _decoded_blocks(path):
                total += len(block)
                chars.update(block)
                bar.update(len(block))
    return total, chars


def _corpus_items(files: list[Path], split_at: int) -> Iterator[tuple[str, str | None]]:
    # ("train" | "val", text) pieces of the concatenated files, and (split, None) after each non-empty file.
    #
    # The first `split_at` characters are train, the rest val, exactly as nanoGPT cuts.
    pos = 0
    for path in files:
        start = pos
        for piece in _pieces(_decoded_blocks(path)):
            end = pos + len(piece)
            if end <= split_at:
                yield "train", piece
            elif pos >= split_at:
                yield "val", piece
            else:
                yield "train", piece[: split_at - pos]
                yield "val", piece[split_at - pos :]
            pos = end
        if pos > start:
            yield ("train" if pos <= split_at else "val"), None


def _batched(items: Iterable, n: int) -> Iterator[list]:
    it = iter(items)
    while batch := list(itertools.islice(it, n)):
        yield batch


# ----------------------------------------------------------------------------- inputs and downloads


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _download(url: str, dest: Path, sha256: str, hint: str) -> None:
    # Fetch `url` into `dest` atomically, refusing content whose sha256 differs.
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with urllib.request.urlopen(url, timeout=20) as response, _atomic_output(dest) as f:
            digest = hashlib.sha256()
            while block := response.read(1 << 16):
                digest.update(block)
                f.write(block)
            if digest.hexdigest() != sha256:
                raise DownloadError(f"{url} arrived with sha256 {digest.hexdigest()}, expected {sha256}; {hint}")
    except DownloadError:
        raise  # an OSError too, but already the whole story: not to be wrapped by the clause below
    except (OSError, http.client.HTTPException) as err:  # URLError, timeouts and resets are OSErrors
        raise DownloadError(f"could not download {url} ({_one_line(err)}); {hint}") from None


def _shakespeare_file(input_path: str | None, data_root: Path) -> Path:
    # tiny Shakespeare from --input, else the mirror, else the download cache, else the web.
    if input_path:
        path = Path(input_path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"--input {input_path} is not a file")
        return path
    hint = f"pass a local copy as {_INPUT_OPTION}, or set {MIRROR_ENV} to a folder holding tinyshakespeare.txt"
    mirror = os.environ.get(MIRROR_ENV)
    if mirror:
        for candidate in (Path(mirror) / "tinyshakespeare.txt", Path(mirror) / "tinyshakespeare" / "input.txt"):
            if candidate.is_file():
                if _sha256(candidate) != SHAKESPEARE_SHA256:
                    raise ValueError(
                        f"{candidate} is not tiny Shakespeare (sha256 differs from {SHAKESPEARE_SHA256}); "
                        f"replace it, or {hint}"
                    )
                return candidate
    cached = data_root / "downloads" / "tinyshakespeare.txt"
    if not (cached.is_file() and _sha256(cached) == SHAKESPEARE_SHA256):
        _download(SHAKESPEARE_URL, cached, SHAKESPEARE_SHA256, hint)
    return cached


def _load_local_dataset(files: list[Path]):
    # A streaming `datasets` view of local parquet/json/jsonl/arrow files: the hub's code path, offline.
    import datasets  # imported on use: it is slow to import and only these datasets need it

    builders = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".arrow": "arrow"}
    kinds = {builders.get(p.suffix.lower()) for p in files}
    if None in kinds or len(kinds) != 1:
        found = ", ".join(sorted({p.suffix or p.name for p in files}))
        raise ValueError(
            f"local dataset files must all be one of {', '.join(builders)}, got {found} "
            "(for plain text use the 'text' dataset)"
        )
    return datasets.load_dataset(kinds.pop(), data_files=[str(p) for p in files], split="train", streaming=True)


def _load_hub_dataset(hf_dataset: str, hf_config: str | None, hint: str):
    import datasets

    url = f"https://huggingface.co/datasets/{hf_dataset}"
    try:
        return datasets.load_dataset(hf_dataset, name=hf_config, split="train", streaming=True)
    except Exception as err:  # connection, missing config or auth errors all mean: not loadable from here
        raise DownloadError(
            f"could not load {hf_dataset} ({hf_config or 'default config'}) from {url} ({_one_line(err)}); {hint}"
        ) from None


def _mirror_entry(name: str) -> Path | None:
    mirror = os.environ.get(MIRROR_ENV)
    return Path(mirror) / name if mirror else None


# ----------------------------------------------------------------------------- builders
#
# A builder gets (stage folder, dataset name, options, resolved local input files or None,
# check_tokenizer) and returns the dataset's meta (without the bookkeeping prepare adds).
# It calls check_tokenizer(spec) as soon as the tokenizer is known, before the slow part.


def _write_lm(stage: Path, items: Iterable[tuple[str, Sequence[int]]], vocab_size: int) -> dict[str, int]:
    # Stream (split, ids) items into train.bin and val.bin; both must end up non-empty.
    with contextlib.ExitStack() as stack:
        writers = {
            s: _TokenWriter(stack.enter_context(_atomic_output(stage / f"{s}.bin")), vocab_size)
            for s in ("train", "val")
        }
        for split, ids in items:
            writers[split].write(ids)
        for split, writer in writers.items():
            if writer.count == 0:
                raise ValueError(f"the {split} split came out empty: too little input for a train/val split")
        return {f"{s}.bin": w.finish() for s, w in writers.items()}


def _encode_items(
    items, tokenizer: Tokenizer, eot: int | None, num_threads: int, bar
) -> Iterator[tuple[str, list[int]]]:
    # (split, ids) for each (split, text) item in parallel batches; a (split, None) item becomes [eot].
    for batch in _batched(items, _BATCH_PIECES):
        texts = [text for _, text in batch if text is not None]
        ids = iter(tokenizer.encode_batch(texts, num_threads))
        for split, text in batch:
            if text is not None:
                yield split, next(ids)
            elif eot is not None:
                yield split, [eot]
        bar.update(sum(map(len, texts)))


def _build_lm_text(stage, name, opts, files, check_tokenizer, *, tokenizer_type: str, eot_after_files: bool):
    # train.bin/val.bin from text files: the first (1 - val_fraction) of the characters are train.
    total, chars = _scan_text(files)
    if total == 0:
        raise ValueError(f"{opts['input'] or files[0]} holds no text; pass a non-empty --input")
    if tokenizer_type == "char":
        spec, vocab_size, special = {"type": "char", "chars": sorted(chars)}, len(chars), {}
    else:
        encoding = _tiktoken_encoding("gpt2")
        spec, vocab_size, special = _gpt2_spec(), encoding.n_vocab, {"eot": encoding.eot_token}
    check_tokenizer(spec)
    tokenizer = Tokenizer(spec, vocab_size, special)
    split_at = int(total * (1 - opts["val_fraction"]))  # nanoGPT's int(n * 0.9): 1,003,854 for Shakespeare
    eot = special.get("eot") if eot_after_files else None  # documents (files) end with end-of-text
    num_threads = opts.get("num_proc") or os.cpu_count()
    with tqdm(desc=f"tokenizing {name}", total=total, unit="char", unit_scale=True, disable=None) as bar:
        items = _encode_items(_corpus_items(files, split_at), tokenizer, eot, num_threads, bar)
        files_meta = _write_lm(stage, items, vocab_size)
    return {"kind": "lm", "tokenizer": spec, "vocab_size": vocab_size, "special_tokens": special, "files": files_meta}


def _build_shakespeare_char(stage, name, opts, files, check_tokenizer):
    opts = opts | {"val_fraction": 0.1}
    return _build_lm_text(stage, name, opts, files, check_tokenizer, tokenizer_type="char", eot_after_files=False)


def _build_shakespeare(stage, name, opts, files, check_tokenizer):
    opts = opts | {"val_fraction": 0.1}
    return _build_lm_text(stage, name, opts, files, check_tokenizer, tokenizer_type="bpe", eot_after_files=False)


def _build_text(stage, name, opts, files, check_tokenizer):
    return _build_lm_text(
        stage, name, opts, files, check_tokenizer, tokenizer_type=opts["tokenizer"], eot_after_files=True
    )


def _encode_documents(dataset, tokenizer: Tokenizer, period: int, max_tokens: int | None, num_threads: int, bar):
    # (split, ids) per batch of documents, each followed by end-of-text.
    #
    # Every period-th document, the first included, is val: deterministic, streaming, and
    # never empty. Stops after the document that reaches max_tokens (kept whole).
    eot = tokenizer.special_tokens["eot"]
    seen = written = 0
    for batch in dataset.iter(batch_size=_BATCH_DOCS):
        if "text" not in batch:
            raise ValueError(f"the input has no 'text' column (its columns: {', '.join(batch)})")
        out, before = {"train": [], "val": []}, seen
        for ids in tokenizer.encode_batch(batch["text"], num_threads):
            split = "val" if seen % period == 0 else "train"
            out[split].extend(ids)
            out[split].append(eot)
            seen, written = seen + 1, written + len(ids) + 1
            if max_tokens and written >= max_tokens:
                break
        bar.update(seen - before)
        yield from out.items()
        if max_tokens and written >= max_tokens:
            return


def _build_hf_lm(stage, name, opts, files, check_tokenizer):
    # Documents streamed through `datasets` (hub or local files), GPT-2 BPE.
    spec = _gpt2_spec()
    check_tokenizer(spec)
    encoding = _tiktoken_encoding("gpt2")
    tokenizer = Tokenizer(spec, encoding.n_vocab, {"eot": encoding.eot_token})
    if files is not None:
        dataset = _load_local_dataset(files)
    else:
        hint = f"pass local parquet/json files as {_INPUT_OPTION}, or set {MIRROR_ENV} to a folder holding {name}/"
        dataset = _load_hub_dataset(opts["hf_dataset"], opts["hf_config"], hint)
    if opts["max_docs"]:
        dataset = dataset.take(opts["max_docs"])
    period = max(1, round(1 / opts["val_fraction"]))
    with tqdm(desc=f"tokenizing {name}", total=opts["max_docs"], unit="doc", unit_scale=True, disable=None) as bar:
        items = _encode_documents(
            dataset, tokenizer, period, opts["max_tokens"], opts["num_proc"] or os.cpu_count(), bar
        )
        files_meta = _write_lm(stage, items, tokenizer.vocab_size)
    return {
        "kind": "lm",
        "tokenizer": spec,
        "vocab_size": tokenizer.vocab_size,
        "special_tokens": tokenizer.special_tokens,
        "files": files_meta,
    }


def _json_pair(obj, src: str, tgt: str) -> tuple[str, str] | None:
    # (source, target) from {"src", "tgt"}, {src_lang, tgt_lang} or {"translation": {...}}; None if absent.
    if not isinstance(obj, dict):
        return None
    obj = obj.get("translation", obj)
    for a, b in (("src", "tgt"), (src, tgt)):
        if isinstance(obj.get(a), str) and isinstance(obj.get(b), str):
            return obj[a], obj[b]
    return None


def _file_pairs(path: Path, src: str, tgt: str) -> Iterator[tuple[str, str]]:
    # (source, target) texts of a TSV or JSONL file; a malformed line raises naming the line.
    jsonl = path.suffix.lower() == ".jsonl"
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                line = line.rstrip("\r\n")
                if not line.strip():
                    continue
                where = f"{path} line {number}"
                if "\x00" in line:
                    raise ValueError(f"{where}: contains NUL bytes; is this a binary file?")
                if jsonl:
                    try:
                        pair = _json_pair(json.loads(line), src, tgt)
                    except json.JSONDecodeError as err:
                        raise ValueError(f"{where}: invalid JSON ({err.msg})") from None
                    if pair is None:
                        raise ValueError(
                            f"{where}: expected an object with string 'src' and 'tgt' (or '{src}' and '{tgt}') keys"
                        )
                else:
                    pair = line.split("\t")
                    if len(pair) != 2:
                        raise ValueError(f"{where}: expected 'source<TAB>target', found {len(pair) - 1} tabs")
                if not pair[0].strip() or not pair[1].strip():
                    raise ValueError(f"{where}: empty source or target")
                yield pair[0], pair[1]
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text; convert it to UTF-8") from None


def _hub_pairs(opts, hint) -> Iterator[tuple[str, str]]:
    src, tgt = opts["src"], opts["tgt"]
    config = opts["hf_config"] or f"{src}-{tgt}"
    for row in _load_hub_dataset(opts["hf_dataset"], config, hint):
        pair = _json_pair(row, src, tgt)
        if pair is None:
            raise ValueError(
                f"{opts['hf_dataset']} rows have no {src!r}/{tgt!r} texts (keys: {', '.join(row)}); check --src/--tgt"
            )
        if pair[0].strip() and pair[1].strip():  # published corpora hold a few one-sided segments; skip them
            yield pair


def _pair_split(source: str, val_fraction: float, test_fraction: float) -> str:
    # by a hash of the source text: deterministic, streaming, and duplicates never straddle splits
    u = zlib.crc32(source.encode("utf-8")) / 2**32
    return "test" if u < test_fraction else "val" if u < test_fraction + val_fraction else "train"


def _write_pairs(stage: Path, pairs: Iterable[tuple[list[int], list[int], str]], vocab_size: int) -> dict:
    # Stream (src_ids, tgt_ids, split) into the seq2seq files; every split must end up non-empty.
    with contextlib.ExitStack() as stack:
        writers = {s: _PairWriter(stack, stage, s, vocab_size) for s in _SEQ2SEQ_SPLITS}
        for src_ids, tgt_ids, split in pairs:
            writers[split].add(src_ids, tgt_ids)
        counts = {s: w.finish() for s, w in writers.items()}
        if not all(counts.values()):
            raise ValueError(
                f"a split came out empty ({counts}); give more pairs or larger --val_fraction/--test_fraction"
            )
    files = {f"{s}_{side}.bin": getattr(w, side).count for s, w in writers.items() for side in ("src", "tgt")}
    return {"files": files, "pairs": counts}


def _encode_pairs(pairs, tokenizer: Tokenizer, val_fraction: float, test_fraction: float, num_threads: int, bar):
    # (src_ids, tgt_ids, split) for each (source, target) text pair, encoded in parallel batches.
    for batch in _batched(pairs, _BATCH_DOCS):
        ids = tokenizer.encode_batch([s for s, _ in batch] + [t for _, t in batch], num_threads)
        for (source, _), src_ids, tgt_ids in zip(batch, ids, ids[len(batch) :]):
            yield src_ids, tgt_ids, _pair_split(source, val_fraction, test_fraction)
        bar.update(len(batch))


def _build_translation(stage, name, opts, files, check_tokenizer):
    spec = _gpt2_spec()
    check_tokenizer(spec)
    base = _tiktoken_encoding("gpt2").n_vocab
    special = {"pad": base, "bos": base + 1, "eos": base + 2}  # appended after GPT-2's 50,257 ids
    tokenizer = Tokenizer(spec, base + 3, special)
    if files is not None:
        pairs = _file_pairs(files[0], opts["src"], opts["tgt"])
    else:
        hint = (
            f"pass a local .tsv/.jsonl of pairs as {_INPUT_OPTION}, or set {MIRROR_ENV} to a folder holding "
            f"{_folder_name(name, opts)}.tsv"
        )
        pairs = _hub_pairs(opts, hint)
    pairs = itertools.islice(pairs, opts["max_pairs"])
    with tqdm(desc=f"tokenizing {name}", unit="pair", unit_scale=True, disable=None) as bar:
        items = _encode_pairs(
            pairs, tokenizer, opts["val_fraction"], opts["test_fraction"], opts["num_proc"] or os.cpu_count(), bar
        )
        written = _write_pairs(stage, items, tokenizer.vocab_size)
    return {
        "kind": "seq2seq",
        "tokenizer": spec,
        "vocab_size": tokenizer.vocab_size,
        "special_tokens": special,
        "src_lang": opts["src"],
        "tgt_lang": opts["tgt"],
        **written,
    }


# ----------------------------------------------------------------------------- synthetic tasks

_ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen"
).split()
_TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
_SCALES = ("", " thousand", " million", " billion")
_MAX_NUMBER = 1000 ** len(_SCALES) - 1


def _below_thousand(n: int) -> str:
    hundreds, rest = divmod(n, 100)
    words = [f"{_ONES[hundreds]} hundred"] if hundreds else []
    if rest >= 20:
        words.append(_TENS[rest // 10] + (f"-{_ONES[rest % 10]}" if rest % 10 else ""))
    elif rest:
        words.append(_ONES[rest])
    return " ".join(words)


def _number_words(n: int) -> str:
    if n == 0:
        return "zero"
    groups = []
    for scale in _SCALES:
        n, group = divmod(n, 1000)
        if group:
            groups.append(_below_thousand(group) + scale)
    return " ".join(reversed(groups))


def solve(task: str, src_text: str) -> str:
    """The correct target of a synthetic task for a source string (sample.py grades answers with it)."""
    if task == "reverse":
        return src_text[::-1]
    if task == "sort":
        return "".join(sorted(src_text))
    if task == "num2words":
        if not (src_text.isascii() and src_text.isdigit()) or int(src_text) > _MAX_NUMBER:
            raise ValueError(
                f"num2words takes a whole number from 0 to {_MAX_NUMBER:,} written in digits, got {src_text!r}"
            )
        return _number_words(int(src_text))
    raise ValueError(f"unknown synthetic task {task!r}; choose one of: reverse, sort, num2words")


def _random_source(task: str, rng: random.Random, opts: dict) -> str:
    if task == "num2words":
        # a uniform digit count first, so small numbers are not drowned out by six-digit ones
        digits = rng.randint(1, len(str(opts["max_number"])))
        low = 0 if digits == 1 else 10 ** (digits - 1)
        return str(rng.randint(low, min(10**digits - 1, opts["max_number"])))
    length = rng.randint(opts["min_len"], opts["max_len"])
    return "".join(rng.choices(_SYNTH_SYMBOLS, k=length))


def _synthetic_splits(task: str, opts: dict) -> dict[str, list[str]]:
    # Distinct random sources for test, val and train, drawn in that order from one seed.
    #
    # Drawing the held-out splits first keeps them the same when only --num_train changes.
    sizes = {"test": opts["num_test"], "val": opts["num_val"], "train": opts["num_train"]}
    total = sum(sizes.values())
    if task == "num2words":
        if opts["max_number"] > _MAX_NUMBER:
            raise ValueError(f"--max_number must be at most {_MAX_NUMBER:,}")
        space, knob = opts["max_number"] + 1, "raise --max_number"
    else:
        if opts["min_len"] > opts["max_len"]:
            raise ValueError(f"--min_len {opts['min_len']} is larger than --max_len {opts['max_len']}")
        space = sum(len(_SYNTH_SYMBOLS) ** k for k in range(opts["min_len"], opts["max_len"] + 1))
        knob = "raise --max_len"
    if 2 * total > space:  # rejection sampling stays fast while at least half the space is free
        raise ValueError(
            f"{task} has only {space:,} distinct sources with these settings, too few for {total:,} distinct "
            f"examples (at most half of them can be used); lower --num_train/--num_val/--num_test or {knob}"
        )
    rng = random.Random(opts["seed"])
    seen: dict[str, None] = {}  # insertion-ordered set
    while len(seen) < total:
        seen.setdefault(_random_source(task, rng, opts))
    drawn, start, out = list(seen), 0, {}
    for split, n in sizes.items():
        out[split], start = drawn[start : start + n], start + n
    return out


def _build_synthetic(stage, name, opts, files, check_tokenizer):
    spec = {"type": "char", "chars": _SYNTH_CHARS}
    check_tokenizer(spec)
    base = len(_SYNTH_CHARS)
    special = {"pad": base, "bos": base + 1, "eos": base + 2}
    tokenizer = Tokenizer(spec, base + 3, special)
    splits = _synthetic_splits(name, opts)
    pairs = (
        (tokenizer.encode(s), tokenizer.encode(solve(name, s)), split)
        for split, sources in splits.items()
        for s in sources
    )
    return {
        "kind": "seq2seq",
        "task": name,
        "tokenizer": spec,
        "vocab_size": tokenizer.vocab_size,
        "special_tokens": special,
        **_write_pairs(stage, pairs, tokenizer.vocab_size),
    }


# ----------------------------------------------------------------------------- options and recipes


@dataclass(frozen=True)
class _Option:
    name: str
    type: type
    default: object
    help: str
    affects_output: bool = True  # False: left out of the record that decides whether outputs are up to date
    choices: tuple = ()


def _num_proc():
    return _Option("num_proc", int, None, "tokenizer threads (default: all cores)", affects_output=False)


def _input(help_text: str):
    # the input's identity enters the record through its fingerprint, not its spelling
    return _Option("input", str, None, help_text, affects_output=False)


def _hf_lm_options(hf_dataset: str, hf_config: str | None):
    return (
        _input("local parquet/json/jsonl/arrow file, directory or glob, read through datasets.load_dataset (offline)"),
        _Option("hf_dataset", str, hf_dataset, "Hugging Face dataset id"),
        _Option("hf_config", str, hf_config, "dataset config, e.g. sample-10BT"),
        _Option("max_docs", int, None, "stop after this many documents (quick runs)"),
        _Option("max_tokens", int, None, "stop once this many tokens are written (the last document is kept whole)"),
        _Option("val_fraction", float, 0.0005, "held-out fraction of documents (every round(1/f)-th one)"),
        _num_proc(),
    )


def _synthetic_options(task: str):
    common = (
        _Option("num_train", int, 20000, "training examples"),
        _Option("num_val", int, 1000, "validation examples"),
        _Option("num_test", int, 1000, "held-out test examples (disjoint from train and val)"),
        _Option("seed", int, 0, "random seed; the same seed gives the same files"),
    )
    if task == "num2words":
        return common + (_Option("max_number", int, 999_999, "largest number"),)
    return common + (_Option("min_len", int, 1, "shortest string"), _Option("max_len", int, 12, "longest string"))


_POSITIVE = (
    "max_docs",
    "max_tokens",
    "max_pairs",
    "num_proc",
    "num_train",
    "num_val",
    "num_test",
    "min_len",
    "max_len",
    "max_number",
)
_FRACTIONS = ("val_fraction", "test_fraction")


@dataclass(frozen=True)
class _Recipe:
    options: tuple[_Option, ...]
    inputs: Callable  # (name, options, data_root) -> (local input files or None, fingerprint of the inputs)
    build: Callable  # see the comment above the builders


def _shakespeare_inputs(name, opts, data_root):
    path = _shakespeare_file(opts["input"], data_root)
    return [path], _sha256(path)  # by content: the mirror, the cache and --input all count as the same text


def _text_inputs(name, opts, data_root):
    if not opts["input"]:
        raise ValueError(f"text needs {_INPUT_OPTION}: a UTF-8 text file, a directory or a glob such as 'books/*.txt'")
    files = _expand_input(opts["input"])
    return files, _fingerprint(files)


def _hf_lm_inputs(name, opts, data_root):
    mirror = _mirror_entry(name)
    if opts["input"]:
        files = _expand_input(opts["input"])
    elif mirror is not None and mirror.is_dir():
        files = _expand_input(str(mirror))
    else:
        return None, None  # the hub; its identity is hf_dataset/hf_config
    return files, _fingerprint(files)


def _translation_inputs(name, opts, data_root):
    if opts["input"]:
        path = Path(opts["input"]).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"--input {opts['input']} is not a file")
    else:
        mirror = _mirror_entry(_folder_name(name, opts))
        candidates = [mirror.parent / f"{mirror.name}{suffix}" for suffix in (".tsv", ".jsonl")] if mirror else []
        path = next((p for p in candidates if p.is_file()), None)
        if path is None:
            return None, None  # the hub; its identity is hf_dataset/hf_config
    if path.suffix.lower() not in (".tsv", ".jsonl"):
        raise ValueError(f"{path} must be a .tsv (source<TAB>target) or .jsonl file of translation pairs")
    return [path], _fingerprint([path])


def _synthetic_inputs(name, opts, data_root):
    return None, None  # generated: the options alone decide the output


_SHAKESPEARE_INPUT = _input(f"local copy of tinyshakespeare.txt (else ${MIRROR_ENV}, the download cache, the web)")
_TEXT_OPTIONS = (
    _input("UTF-8 text file, directory (recursive) or glob; required"),
    _Option(
        "tokenizer",
        str,
        "bpe",
        "char: the corpus's characters; bpe: GPT-2 BPE with end-of-text after each file",
        choices=("char", "bpe"),
    ),
    _Option("name", str, "text", "output folder name under data_dir", affects_output=False),
    _Option("val_fraction", float, 0.1, "the last fraction of the characters is the val split"),
    _num_proc(),
)
_TRANSLATION_OPTIONS = (
    _input(
        f"local .tsv (source<TAB>target) or .jsonl (src/tgt keys, or the language codes) instead of the hub; "
        f"${MIRROR_ENV}/<folder>.tsv|.jsonl is used when present"
    ),
    _Option("hf_dataset", str, "opus_books", "Hugging Face dataset id (opus_books, wmt14, ...)"),
    _Option("hf_config", str, None, "dataset config (default: SRC-TGT, e.g. en-fr)"),
    _Option("src", str, "en", "source language code"),
    _Option("tgt", str, "fr", "target language code"),
    _Option("name", str, None, "output folder name (default: translation_SRC_TGT)", affects_output=False),
    _Option("val_fraction", float, 0.05, "fraction of pairs held out for val (by a hash of the source)"),
    _Option("test_fraction", float, 0.05, "fraction of pairs held out for test (by a hash of the source)"),
    _Option("max_pairs", int, None, "use only the first this many pairs"),
    _num_proc(),
)
_RECIPES = {
    "shakespeare_char": _Recipe((_SHAKESPEARE_INPUT,), _shakespeare_inputs, _build_shakespeare_char),
    "shakespeare": _Recipe((_SHAKESPEARE_INPUT,), _shakespeare_inputs, _build_shakespeare),
    "openwebtext": _Recipe(_hf_lm_options("Skylion007/openwebtext", None), _hf_lm_inputs, _build_hf_lm),
    "fineweb_edu": _Recipe(_hf_lm_options("HuggingFaceFW/fineweb-edu", "sample-10BT"), _hf_lm_inputs, _build_hf_lm),
    "text": _Recipe(_TEXT_OPTIONS, _text_inputs, _build_text),
    "translation": _Recipe(_TRANSLATION_OPTIONS, _translation_inputs, _build_translation),
    "reverse": _Recipe(_synthetic_options("reverse"), _synthetic_inputs, _build_synthetic),
    "sort": _Recipe(_synthetic_options("sort"), _synthetic_inputs, _build_synthetic),
    "num2words": _Recipe(_synthetic_options("num2words"), _synthetic_inputs, _build_synthetic),
}


def _resolve_options(name: str, options: tuple[_Option, ...], given: dict) -> dict:
    known = {o.name: o for o in options}
    unknown = sorted(set(given) - known.keys())
    if unknown:
        raise ValueError(f"{name} has no option {unknown[0]!r}; its options are: {', '.join(known)}")
    resolved = {}
    for option in options:
        value = given.get(option.name, option.default)
        if value is not None:
            try:
                value = option.type(value)
            except (TypeError, ValueError):
                raise ValueError(f"{name}: --{option.name} must be {option.type.__name__}, got {value!r}") from None
            if option.choices and value not in option.choices:
                raise ValueError(f"{name}: --{option.name} must be one of {', '.join(option.choices)}, got {value!r}")
            if option.name in _POSITIVE and value < 1:
                raise ValueError(f"{name}: --{option.name} must be at least 1, got {value}")
            if option.name in _FRACTIONS and not 0 < value < 1:
                raise ValueError(f"{name}: --{option.name} must be between 0 and 1, got {value}")
        resolved[option.name] = value
    return resolved


def _folder_name(name: str, opts: dict) -> str:
    if name == "text":
        return opts["name"]
    if name == "translation":
        return opts["name"] or f"translation_{opts['src']}_{opts['tgt']}"
    return name


# ----------------------------------------------------------------------------- preparing


def _data_root(data_dir) -> Path:
    if data_dir is not None:
        return Path(data_dir).expanduser()
    if os.environ.get(DATA_DIR_ENV):
        return Path(os.environ[DATA_DIR_ENV]).expanduser()
    return Path(__file__).resolve().parent / "data"  # beside this file, so any working directory works


def dataset_dir(name: str, data_dir=None) -> Path:
    """Where dataset (or output folder) `name` lives: <data_dir>/<name>.

    data_dir defaults to $NANOFORMER_DATA_DIR, else data/ beside this file.
    """
    if not name or name in (".", "..") or "/" in name or "\\" in name or name.startswith("."):
        raise ValueError(f"dataset folder name must be a plain name such as 'my_corpus', got {name!r}")
    return _data_root(data_dir) / name


def load_meta(dataset_dir) -> dict:
    """The contents of a prepared dataset's meta.json (see README.md, section Data)."""
    path = Path(dataset_dir) / "meta.json"
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path} not found; prepare the data first: python prepare_data.py {Path(dataset_dir).name}"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({_one_line(err)}); re-create the dataset with --force") from None
    required = ("format_version", "kind", "tokenizer", "vocab_size", "special_tokens", "files")
    if not isinstance(meta, dict) or any(key not in meta for key in required):
        raise ValueError(f"{path} lacks the keys {', '.join(required)}; re-create the dataset with --force")
    if meta["format_version"] > FORMAT_VERSION:
        raise ValueError(
            f"{path} has format version {meta['format_version']}, newer than this code's {FORMAT_VERSION}; "
            "update nanoformer"
        )
    return meta


def check_prepared(path) -> None:
    """Raise ValueError or FileNotFoundError unless `path` holds a complete, intact dataset.

    Complete: meta.json, listing what its kind needs (train.bin and val.bin, or train/val/test pairs).
    Intact: every listed file present, with a valid header and the token count meta.json records, and each
    split's pair index matching its token files and pair count. The message is one line naming the file
    and the fix; a file that cannot be read at all raises its own OSError.
    """
    path = Path(path)
    meta = load_meta(path)
    fix = "re-create the dataset with: python prepare_data.py NAME --force"
    if meta["kind"] == "lm":
        missing = [f for f in ("train.bin", "val.bin") if f not in meta["files"]]
    else:
        missing = [f"{s} pairs" for s in _SEQ2SEQ_SPLITS if s not in meta.get("pairs", {})]
    if missing:
        raise ValueError(f"{path / 'meta.json'} lists no {' nor '.join(missing)}; {fix}")
    for fname, count in meta["files"].items():
        if not (path / fname).is_file():
            raise FileNotFoundError(f"{path / fname} is missing (meta.json lists it); {fix}")
        held = _read_header(path / fname)[2]
        if held != count:
            raise ValueError(f"{path / fname} holds {held:,} tokens but meta.json records {count:,}; {fix}")
    for split, count in meta.get("pairs", {}).items():
        held = len(load_pairs(path, split))
        if held != count:
            index = path / f"{split}_idx.npy"
            raise ValueError(f"{index} holds {held:,} pairs but meta.json records {count:,}; {fix}")


def is_prepared(path) -> bool:
    """True when `path` holds a complete, intact dataset, that is when check_prepared(path) raises nothing."""
    try:
        check_prepared(path)
    except (OSError, ValueError):
        return False
    return True


def _existing_meta(folder: Path) -> dict | None:
    # meta of the dataset already in `folder`, None if there is none; a foreign folder raises.
    if not folder.is_dir() or not any(folder.iterdir()):
        return None
    try:
        return load_meta(folder)
    except (FileNotFoundError, ValueError) as err:
        raise ValueError(
            f"{folder} exists but is not a dataset this script can update ({_one_line(err)}); "
            "pass --force to replace it, or choose another --data_dir"
        ) from None


@contextlib.contextmanager
def _staged_folder(folder: Path):
    # Yield a hidden folder beside `folder` that replaces it only if the block succeeds.
    folder.parent.mkdir(parents=True, exist_ok=True)
    stage = folder.with_name(f".{folder.name}.partial-{secrets.token_hex(4)}")
    stage.mkdir()
    try:
        yield stage
        old = folder.with_name(f".{folder.name}.old-{secrets.token_hex(4)}")
        if folder.exists():
            folder.rename(old)
        stage.rename(folder)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def prepare(name: str, /, data_dir=None, force: bool = False, **options) -> Path:
    """Prepare dataset `name` (a key of DATASETS) and return its folder.

    Options are those of `python prepare_data.py NAME --help`, as keyword arguments;
    `name` is positional-only, so the text/translation option `name=` (the output folder)
    can be passed too. Outputs that are up to date (same inputs and options) are kept, and
    an existing dataset from a different tokenizer is refused, unless force=True. Raises
    ValueError, FileNotFoundError or DownloadError (an OSError) with a one-line message;
    nothing half-written is left behind.
    """
    recipe = _RECIPES.get(name)
    if recipe is None:
        raise ValueError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}")
    opts = _resolve_options(name, recipe.options, options)
    data_root = _data_root(data_dir)
    folder = dataset_dir(_folder_name(name, opts), data_root)
    files, fingerprint = recipe.inputs(name, opts, data_root)
    # everything the outputs depend on; JSON round trip so it compares equal to what meta.json holds
    record = {
        "dataset": name,
        "inputs": fingerprint,
        **{o.name: opts[o.name] for o in recipe.options if o.affects_output},
    }
    record = json.loads(json.dumps(record))
    old = None if force else _existing_meta(folder)
    if old is not None and old.get("source") == record and is_prepared(folder):
        return folder

    def check_tokenizer(spec: dict) -> None:
        if old is not None and old["tokenizer"] != spec:
            raise ValueError(
                f"{folder} holds data from a different tokenizer ({_describe(old['tokenizer'])}, now "
                f"{_describe(spec)}); pass --force to replace it, or choose another --name/--data_dir"
            )

    with _staged_folder(folder) as stage:
        meta = {
            "format_version": FORMAT_VERSION,
            "name": folder.name,
            **recipe.build(stage, name, opts, files, check_tokenizer),
            "source": record,
        }
        with _atomic_output(stage / "meta.json") as f:
            f.write(json.dumps(meta, indent=1, ensure_ascii=False).encode("utf-8"))
    return folder


# ----------------------------------------------------------------------------- benchmark


def bpe_throughput(text: str, num_threads: int, repeats: int) -> list[float]:
    """GPT-2 BPE tokens per second over `text`, one measurement per repeat.

    The text is cut and batched exactly as prepare() does, so this is the tokenizer's
    share of preparing a corpus, without reading or writing files.
    """
    encoding = _tiktoken_encoding("gpt2")
    pieces = list(_pieces(text[i : i + _BLOCK_BYTES] for i in range(0, len(text), _BLOCK_BYTES)))
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        count = sum(
            len(ids)
            for batch in _batched(pieces, _BATCH_PIECES)
            for ids in encoding.encode_ordinary_batch(batch, num_threads=num_threads)
        )
        rates.append(count / (time.perf_counter() - start))
    return rates


def _run_benchmark(args) -> None:
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    data_root = _data_root(args.data_dir)
    path = Path(args.input).expanduser() if args.input else _shakespeare_file(None, data_root)
    text = path.read_text(encoding="utf-8")
    if not text:
        raise ValueError(f"{path} is empty; pass a non-empty --input")
    text *= max(1, round(args.size_mb * 1e6 / len(text)))  # repeated to a multi-megabyte corpus
    print(
        f"GPT-2 BPE on {len(text) / 1e6:.1f} MB of text ({path.name}), {args.repeats} runs each, {os.cpu_count()} cores"
    )

    def report(label: str, rates: list[float]) -> None:
        low, mid, high = min(rates) / 1e6, statistics.median(rates) / 1e6, max(rates) / 1e6
        print(f"  {label:<32} median {mid:6.2f}M tokens/s  (min {low:.2f}M, max {high:.2f}M)")

    for threads in sorted({1, os.cpu_count()}):
        report(f"encode, {threads} thread{'s' if threads > 1 else ''}", bpe_throughput(text, threads, args.repeats))
    # the whole pipeline once more: read, cut, encode on all cores, write train.bin/val.bin
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text(text, encoding="utf-8")
        rates = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            folder = prepare("text", data_dir=tmp, force=True, input=str(corpus), name="bench")
            count = sum(load_meta(folder)["files"].values())
            rates.append(count / (time.perf_counter() - start))
        report("prepare text (scan+encode+write)", rates)


# ----------------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prepare_data.py",
        description="Prepare a dataset as token files under <data_dir>/<name>/.",
        epilog=f"Offline: --input PATH, ${MIRROR_ENV} (a local mirror folder), $TIKTOKEN_CACHE_DIR. "
        f"Output root: --data_dir, else ${DATA_DIR_ENV}, else data/ beside this script.",
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--data_dir", help=f"root of the dataset folders (default: ${DATA_DIR_ENV} or data/ beside this script)"
    )
    common.add_argument(
        "--force", action="store_true", help="rebuild even if up to date, and replace data from another tokenizer"
    )
    commands = parser.add_subparsers(dest="dataset", metavar="NAME", required=True)
    for name, description in DATASETS.items():
        sub = commands.add_parser(name, parents=[common], help=description, description=description)
        for option in _RECIPES[name].options:
            default = "" if option.default is None else f" (default: {option.default})"
            sub.add_argument(
                f"--{option.name}",
                type=option.type,
                default=argparse.SUPPRESS,
                choices=option.choices or None,
                help=option.help + default,
            )
    bench = commands.add_parser(
        "benchmark", help="measure BPE tokenization throughput, 1 thread vs all cores (not a dataset)"
    )
    bench.add_argument("--input", help="UTF-8 text to tokenize (default: tiny Shakespeare)")
    bench.add_argument("--repeats", type=int, default=5, help="measurements per setting (default: 5)")
    bench.add_argument(
        "--size_mb", type=float, default=10.0, help="repeat the text to about this many MB (default: 10)"
    )
    bench.add_argument("--data_dir", help="where tiny Shakespeare's download cache lives")
    return parser


def _summary(folder: Path) -> str:
    meta = load_meta(folder)
    if meta["kind"] == "seq2seq":
        counts = ", ".join(f"{split} {n:,} pairs" for split, n in meta["pairs"].items())
    else:
        counts = ", ".join(f"{fname} {n:,} tokens" for fname, n in meta["files"].items())
    return f"{folder}: {counts}; vocab_size {meta['vocab_size']:,} ({_describe(meta['tokenizer'])})"


def main(argv=None) -> None:
    """Command-line entry point; errors print one line and exit with status 2."""
    args = _parser().parse_args(argv)
    try:
        if args.dataset == "benchmark":
            _run_benchmark(args)
            return
        options = {k: v for k, v in vars(args).items() if k not in ("dataset", "data_dir", "force")}
        folder = prepare(args.dataset, data_dir=args.data_dir, force=args.force, **options)
        print(_summary(folder))
    except (ValueError, OSError) as err:  # OSError: a missing or unwritable file, a failed download
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print("error: interrupted; partial outputs were removed", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
