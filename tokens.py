"""Token files, pair files, dataset meta and the tokenizer: what training and sampling read.

A prepared dataset is a folder <data_dir>/<name>/ holding meta.json plus token files. LM datasets hold
train.bin and val.bin; seq2seq datasets hold {split}_src.bin, {split}_tgt.bin and {split}_idx.npy for the
splits train, val and test. A token file is a 32-byte header (magic, format version, bytes per token, vocab
size, token count) followed by the ids as little-endian uint16 (when the vocabulary has at most 65,536 ids)
or uint32. prepare_data.py writes these folders with the writers below; train.py and sample.py read them.
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

MAGIC = b"NFTOKENS"
FORMAT_VERSION = 1
# magic, format version, bytes per token (2 or 4), vocab size, token count; little-endian
_HEADER = struct.Struct("<8sIIQQ")
_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
SEQ2SEQ_SPLITS = ("train", "val", "test")

DATA_DIR_ENV = "NANOFORMER_DATA_DIR"
R50K_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"

_log = logging.getLogger("nanoformer.data")


class DownloadError(OSError):
    """A download (or hub load) failed; the message names the URL and the offline alternative.

    An OSError, as any failed I/O is, so every `except OSError` reports it like a missing file.
    """


def one_line(err: BaseException) -> str:
    """The first line of an error's message (at most 200 characters), for one-line error reports."""
    lines = str(err).strip().splitlines()
    return lines[0][:200] if lines else type(err).__name__


# ----------------------------------------------------------------------------- token files


@contextlib.contextmanager
def atomic_output(path: Path):
    """Yield a binary file beside `path` that replaces `path` only if the block succeeds."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())  # the data must be on disk before the name says it is complete
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class TokenWriter:
    """Appends token ids to an open file (write), then writes the header with the final count (finish)."""

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
    with atomic_output(path) as f:
        writer = TokenWriter(f, vocab_size)
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


class PairWriter:
    """Streams (src, tgt) id pairs of one split into {split}_src.bin, {split}_tgt.bin and {split}_idx.npy."""

    def __init__(self, stack: contextlib.ExitStack, folder: Path, split: str, vocab_size: int):
        self.src = TokenWriter(stack.enter_context(atomic_output(folder / f"{split}_src.bin")), vocab_size)
        self.tgt = TokenWriter(stack.enter_context(atomic_output(folder / f"{split}_tgt.bin")), vocab_size)
        self.index_path = folder / f"{split}_idx.npy"
        # row i holds where pair i starts in the src and tgt files; 16 bytes a pair stay in memory
        self.offsets = array.array("q", [0, 0])

    def add(self, src_ids, tgt_ids) -> None:
        self.src.write(src_ids)
        self.tgt.write(tgt_ids)
        self.offsets.extend((self.src.count, self.tgt.count))

    def finish(self) -> int:
        index = np.frombuffer(self.offsets, dtype=np.int64).reshape(-1, 2)
        with atomic_output(self.index_path) as f:
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
    if split not in SEQ2SEQ_SPLITS:
        raise ValueError(f"unknown split {split!r}; seq2seq splits are {', '.join(SEQ2SEQ_SPLITS)}")
    index_path = folder / f"{split}_idx.npy"
    if not index_path.is_file():
        raise FileNotFoundError(f"{index_path} not found; is {folder} a prepared seq2seq dataset?")
    src, tgt = load_tokens(folder / f"{split}_src.bin"), load_tokens(folder / f"{split}_tgt.bin")
    try:
        index = np.load(index_path, mmap_mode="r")
    except ValueError as err:
        raise ValueError(
            f"{index_path} is not a valid index ({one_line(err)}); re-create the dataset with --force"
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
def tiktoken_encoding(name: str) -> tiktoken.Encoding:
    """tiktoken's encoding `name`; 'gpt2' falls back to its twin 'r50k_base' (same ids) with one warning.

    Raises DownloadError when neither can be loaded. Cached, so the network attempt for gpt2 and the
    fallback warning happen once per process.
    """
    try:
        return tiktoken.get_encoding(name)
    except Exception as err:  # tiktoken raises requests, blobfile or hash errors depending on what is missing
        if name != "gpt2":
            raise DownloadError(
                f"could not load the tiktoken encoding {name!r} ({one_line(err)}); "
                "set TIKTOKEN_CACHE_DIR to a folder holding its cached files"
            ) from None
        gpt2_error = err
    try:
        encoding = tiktoken.get_encoding("r50k_base")
    except Exception as err:
        raise DownloadError(
            f"could not load tiktoken 'gpt2' nor its twin 'r50k_base' from {R50K_URL} "
            f"({one_line(err)}); set TIKTOKEN_CACHE_DIR to a tiktoken cache holding r50k_base"
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
            self._bpe = tiktoken_encoding(spec["encoding"])
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


# ----------------------------------------------------------------------------- dataset folders


def data_root(data_dir=None) -> Path:
    """The folder holding the datasets: data_dir, else $NANOFORMER_DATA_DIR, else data/ beside this file."""
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
    return data_root(data_dir) / name


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
        raise ValueError(f"{path} is not valid JSON ({one_line(err)}); re-create the dataset with --force") from None
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
        missing = [f"{s} pairs" for s in SEQ2SEQ_SPLITS if s not in meta.get("pairs", {})]
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
