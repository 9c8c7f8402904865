"""Datasets to token files: the dataset recipes, their builders and the command line.

    python prepare_data.py NAME [--data_dir=DIR] [--input=PATH] [--force] [options]   # or --key value
    python prepare_data.py --help          # every dataset, one line each
    python prepare_data.py NAME --help     # that dataset's options

A dataset lands in <data_dir>/<name>/ as meta.json plus token files, in the format that tokens.py defines and reads,
built in a hidden folder and renamed into place only when complete (staged_folder).
"""

import codecs
import contextlib
import difflib
import functools
import glob
import hashlib
import http.client
import itertools
import json
import os
import random
import re
import secrets
import shutil
import sys
import urllib.request
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, make_dataclass
from pathlib import Path

from tqdm import tqdm

from chat import (
    SPECIAL_TOKENS_MAP,
    TEMPLATE_FILE,
    TOKENIZER_CONFIG,
    ChatFormat,
    conversation_problem,
    folder_chat,
    with_chat_tokens,
)
from config import BOOL_WORDS, OPTIONS_USAGE, ConfigError, help_line, parse_config
from log import one_line
from synthetic import CHARS, MAX_NUMBER, QUIZ_BLOCK, distinct_sources, quiz_conversations, random_source, solve
from tokens import (
    BYTE_TOKENS,
    CHAT_SPLITS,
    DATA_DIR_ENV,
    END_OF_TEXT,
    FORMAT_VERSION,
    MIRROR_ENV,
    SEQ2SEQ_SPLITS,
    TOKENIZER_JSON,
    ConversationWriter,
    DownloadError,
    PairWriter,
    Tokenizer,
    TokenWriter,
    atomic_output,
    data_root,
    dataset_dir,
    huggingface_tokenizer,
    is_prepared,
    load_meta,
    logger,
    tiktoken_encoding,
    tokenizer_json_file,
    train_byte_level_bpe,
)

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
# pins the content: a mirror, cache or download that differs is refused, never tokenized
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"

BLOCK_BYTES = 1 << 18  # text is read, cut and encoded in pieces of about this size
BATCH_PIECES = 16  # pieces per tiktoken batch: enough work for every thread, bounded memory
BATCH_DOCS = 1024  # documents (or pairs) per batch for the Hugging Face streams
CUT_CONTEXT = 64  # characters either side of a cut that a tokenizer.json must encode alike whole and cut

# train.py forwards its data_options dict to prepare(), so there the same option is spelled as a dict entry
INPUT_OPTION = "--input=PATH (in train.py: --data_options=\"{'input': 'PATH'}\")"


def gpt2_spec():
    """meta.json's tokenizer entry for GPT-2 BPE: a new dict on each call, so no two metas share one."""
    return {"type": "tiktoken", "encoding": "gpt2"}


# A vocab is meta.json's tokenizer, vocab_size and special_tokens, as tokens.huggingface_tokenizer returns them for a
# tokenizer.json; Tokenizer.from_meta rebuilds the tokenizer from one.


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


def describe_tokenizer(spec):
    """A tokenizer spec as a person reads it, for messages: 'char-level, 65 symbols', 'tiktoken gpt2', ..."""
    if spec.get("type") == "char":
        return f"char-level, {len(spec['chars'])} symbols"
    if spec.get("type") == "huggingface":
        # the content, not the path the file came from, tells two tokenizers apart
        digest = hashlib.sha256(spec["json"].encode("utf-8")).hexdigest()
        return f"Hugging Face {TOKENIZER_JSON} with sha256 {digest[:12]}"
    return f"tiktoken {spec.get('encoding')}"


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

    @property
    def hint(self):
        """The field type config.py reads the command line's value as: bool for a yes/no option, `| None` if unset."""
        kind = bool if self.type is boolean else self.type
        return kind | None if self.default is None else kind

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


# ----------------------------------------------------------------------------- reading text


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


def decoded_blocks(path):
    """The text of a UTF-8 file in blocks of about BLOCK_BYTES; undecodable or binary content raises naming the file."""
    # incremental: a character whose bytes straddle two blocks is held back until its last byte comes
    decoder = codecs.getincrementaldecoder("utf-8")()
    # bytes before the current block, for the error message
    offset = 0
    with open(path, "rb") as f:
        while True:
            raw = f.read(BLOCK_BYTES)
            try:
                # an empty read is the end of the file: final=True turns a dangling partial character into an error
                text = decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"{path} is not UTF-8 text (undecodable byte near offset {offset + err.start}); "
                    "convert it to UTF-8 or leave it out of --input"
                ) from None
            # UTF-8 decoding accepts NUL bytes, but text never holds them: this is a binary file
            if "\x00" in text:
                raise ValueError(f"{path} looks binary (it contains NUL bytes); leave it out of --input")
            if text:
                yield text
            if not raw:
                return
            offset += len(raw)


def last_newline_cut(text):
    """The last index i > 0 where text[i] is a newline and text[i + 1] is not whitespace, or 0 if there is none:
    where GPT-2 BPE text may be cut (text_pieces)."""
    # the last character is left out: a newline there has no next character to test yet
    i = text.rfind("\n", 0, len(text) - 1)
    while i > 0:
        # a newline before whitespace may be part of a longer whitespace token; look further back
        if not text[i + 1].isspace():
            return i
        i = text.rfind("\n", 0, i)
    return 0


def checked_cut(tokenizer, text):
    r"""The cut for a tokenizer.json: just after or just before the newline that last_newline_cut finds, whichever
    leaves the ids around it unchanged (checked on CUT_CONTEXT characters either side); 0 if neither does.

    Pre-tokenizers keep tokens from crossing a newline on one side or the other: GPT-2's may join ' \n' but never
    '\nA', Llama 3's joins ':\n' but never '\nA'. A tokenizer that marks the start of every text it is given
    (sentencepiece's '▁' in Llama 2 and Mistral) fails both checks: its text is never cut, and each file's split is
    encoded whole.
    """
    i = last_newline_cut(text)
    if not i:
        return 0
    # the same window for all three encodings: its ends, which may fall inside a word, agree whole and cut
    start, end = max(0, i - CUT_CONTEXT), i + 1 + CUT_CONTEXT
    whole = tokenizer.encode(text[start:end])
    for cut in (i + 1, i):
        if tokenizer.encode(text[start:cut]) + tokenizer.encode(text[cut:end]) == whole:
            return cut
    return 0


def text_pieces(blocks, last_cut=last_newline_cut):
    """Regroup text blocks into pieces that BPE-encode exactly like the whole text.

    GPT-2 pre-tokenization always makes a newline followed by a non-space character a token of its own, and no token
    crosses it; cutting just before such a newline leaves the ids unchanged, so pieces can be encoded independently,
    in parallel. Another tokenizer passes its own last_cut(text) -> index (checked_cut).
    """
    # the text after the last cut waits for the next block, which may continue its last token
    carry = ""
    for block in blocks:
        text = carry + block
        # cut 0 (no safe place yet, e.g. one very long line): keep growing the text
        cut = last_cut(text)
        if cut:
            yield text[:cut]
        carry = text[cut:]
    if carry:
        yield carry


def scan_text(files):
    """(character count, set of characters) of the files, validating that each is UTF-8 text."""
    # a first full pass: the char vocabulary and the split point must be known before any id is
    # written, and a file that is not text should fail before the slow pass
    total, chars = 0, set()
    # disable=None: the bar shows on a terminal only, never in logs or tests
    with tqdm(desc="scanning", unit="char", unit_scale=True, disable=None) as bar:
        for path in files:
            for block in decoded_blocks(path):
                total += len(block)
                chars.update(block)
                bar.update(len(block))
    return total, chars


def corpus_items(files, split_at, last_cut):
    """("train" | "val", text) pieces of the concatenated files, and (split, None) after each non-empty file: the
    first `split_at` characters are train, the rest val, exactly as nanoGPT cuts."""
    pos = 0
    for path in files:
        # pos: characters of all files so far; start: where this file began
        start = pos
        for piece in text_pieces(decoded_blocks(path), last_cut):
            # a piece straddling split_at is cut there: val starts at exactly nanoGPT's character
            end = pos + len(piece)
            if end <= split_at:
                yield "train", piece
            elif pos >= split_at:
                yield "val", piece
            else:
                yield "train", piece[: split_at - pos]
                yield "val", piece[split_at - pos :]
            pos = end
        # the end-of-file marker joins the split the file ended in; encode_items makes it end-of-text
        if pos > start:
            yield ("train" if pos <= split_at else "val"), None


def batched(items, n):
    """Lists of n items from a stream, the last one shorter (itertools.batched needs Python 3.12)."""
    it = iter(items)
    while batch := list(itertools.islice(it, n)):
        yield batch


def bpe_batches(text):
    """`text` cut into the pieces, in the batches, that prepare() BPE-encodes in parallel (bench.py times these)."""
    # blocks as if read from a file, so the pieces match those of a real prepare() run
    blocks = (text[i : i + BLOCK_BYTES] for i in range(0, len(text), BLOCK_BYTES))
    return list(batched(text_pieces(blocks), BATCH_PIECES))


# ----------------------------------------------------------------------------- inputs and downloads


def file_sha256(path):
    """The sha256 of a file's content, as hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        # 1 MiB at a time: any file size in constant memory
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def download(url, dest, sha256, hint):
    """Fetch `url` into `dest` atomically, refusing content whose sha256 differs; failures end with `hint`."""
    # the first download creates <root>/downloads/
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        # timeout: 20 s without data is a dead connection; fail with the offline hint rather than hang
        with urllib.request.urlopen(url, timeout=20) as response, atomic_output(dest) as f:
            digest = hashlib.sha256()
            # hashed while it streams to disk; if the check below raises, atomic_output drops the file
            while block := response.read(1 << 16):
                digest.update(block)
                f.write(block)
            if digest.hexdigest() != sha256:
                raise DownloadError(f"{url} arrived with sha256 {digest.hexdigest()}, expected {sha256}; {hint}")
    except DownloadError:
        raise  # an OSError too, but already the whole story: not to be wrapped by the clause below
    except (OSError, http.client.HTTPException) as err:  # URLError, timeouts and resets are OSErrors
        raise DownloadError(f"could not download {url} ({one_line(err)}); {hint}") from None


def shakespeare_file(input_path, root):
    """tiny Shakespeare from input_path, else $NANOFORMER_DATA_MIRROR, else <root>/downloads/, else the web."""
    if input_path:
        # an explicit --input is taken as given, unhashed: the user may want another text on purpose
        path = Path(input_path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"--input {input_path} is not a file")
        return path
    hint = f"pass a local copy as {INPUT_OPTION}, or set {MIRROR_ENV} to a folder holding tinyshakespeare.txt"
    mirror = os.environ.get(MIRROR_ENV)
    if mirror:
        # the mirror may hold the file flat or in char-rnn's layout, tinyshakespeare/input.txt
        for candidate in (Path(mirror) / "tinyshakespeare.txt", Path(mirror) / "tinyshakespeare" / "input.txt"):
            if candidate.is_file():
                # other content in the mirror is an error, not a silent fallback to the web
                if file_sha256(candidate) != SHAKESPEARE_SHA256:
                    raise ValueError(
                        f"{candidate} is not tiny Shakespeare (sha256 differs from {SHAKESPEARE_SHA256}); "
                        f"replace it, or {hint}"
                    )
                return candidate
    # the download cache: fetched again when absent or damaged
    cached = root / "downloads" / "tinyshakespeare.txt"
    if not (cached.is_file() and file_sha256(cached) == SHAKESPEARE_SHA256):
        download(SHAKESPEARE_URL, cached, SHAKESPEARE_SHA256, hint)
    return cached


def load_local_dataset(files):
    """A streaming `datasets` view of local parquet/json/jsonl/arrow files: the hub's code path, offline."""
    import datasets  # imported on use: it is slow to import and only these datasets need it

    builders = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".arrow": "arrow"}
    # one format for all files: load_dataset reads a single format per call
    kinds = {builders.get(p.suffix.lower()) for p in files}
    if None in kinds or len(kinds) != 1:
        found = ", ".join(sorted({p.suffix or p.name for p in files}))
        raise ValueError(
            f"local dataset files must all be one of {', '.join(builders)}, got {found} "
            "(for plain text use the 'text' dataset)"
        )
    # streaming, as from the hub, so a large local corpus is never loaded whole; local files always land in a
    # 'train' split, and our own val split is drawn later
    return datasets.load_dataset(kinds.pop(), data_files=[str(p) for p in files], split="train", streaming=True)


def load_hub_dataset(hf_dataset, hf_config, hint):
    """The train split of a Hugging Face hub dataset, streamed; a failure raises DownloadError ending with `hint`."""
    import datasets

    # for the message only
    url = f"https://huggingface.co/datasets/{hf_dataset}"
    try:
        # streamed: OpenWebText and FineWeb-Edu are tens of GB, and only the rows read are downloaded
        return datasets.load_dataset(hf_dataset, name=hf_config, split="train", streaming=True)
    except Exception as err:  # connection, missing config or auth errors all mean: not loadable from here
        raise DownloadError(
            f"could not load {hf_dataset} ({hf_config or 'default config'}) from {url} ({one_line(err)}); {hint}"
        ) from None


def mirror_entry(name):
    """<$NANOFORMER_DATA_MIRROR>/<name>, whether or not it exists; None when no mirror is set."""
    mirror = os.environ.get(MIRROR_ENV)
    # the caller checks whether <mirror>/<name> exists, as a folder or with a suffix
    return Path(mirror) / name if mirror else None


def translation_folder(opts):
    """The translation dataset's folder name: --name, else translation_SRC_TGT."""
    # one folder per language pair unless --name says otherwise
    return opts["name"] or f"translation_{opts['src']}_{opts['tgt']}"


def shakespeare_folder(opts):
    """'shakespeare' for GPT-2 BPE, else shakespeare_<the tokenizer's model folder or file name>."""
    # another tokenizer's ids get a folder of their own, named after it: 'shakespeare' stays GPT-2's
    if opts["tokenizer"] == "gpt2":
        return "shakespeare"
    file = tokenizer_json_file(opts["tokenizer"]).resolve()
    # a model folder's name (shakespeare_TinyLlama-1.1B), or a lone file's own; two tokenizers that come out with the
    # same name are still told apart, by prepare's check of the tokenizer in the folder
    label = file.parent.name if file.name == TOKENIZER_JSON else file.stem
    return "shakespeare_" + re.sub(r"[^\w.-]", "_", label or "tokenizer")


def shakespeare_inputs(name, opts, root):
    """tiny Shakespeare's file, found or downloaded, and its sha256."""
    path = shakespeare_file(opts["input"], root)
    return [path], file_sha256(path)  # by content: the mirror, the cache and --input all count as the same text


def text_inputs(name, opts, root):
    """The files --input names (required), and their fingerprint."""
    if not opts["input"]:
        # there is no default corpus for this recipe
        raise ValueError(f"text needs {INPUT_OPTION}: a UTF-8 text file, a directory or a glob such as 'books/*.txt'")
    files = expand_input(opts["input"])
    return files, input_fingerprint(files)


def hf_lm_inputs(name, opts, root):
    """--input's files, else those of a mirror folder named after the dataset; (None, None) for the hub."""
    mirror = mirror_entry(name)
    if not opts["input"] and (mirror is None or not mirror.is_dir()):
        return None, None  # the hub; its identity is hf_dataset/hf_config
    files = expand_input(opts["input"] or str(mirror))
    return files, input_fingerprint(files)


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


# what chat.folder_chat reads from a model folder besides its tokenizer.json (config.json: its eos ids)
TEMPLATE_FILES = (TEMPLATE_FILE, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, "config.json")


def chat_inputs(name, opts, root):
    """The conversation files --input names (required), and their fingerprint."""
    if not opts["input"]:
        raise ValueError(
            f'chat needs {INPUT_OPTION}: a JSONL file of {{"messages": [...]}} lines, a directory or a glob'
        )
    files = expand_input(opts["input"])
    # a model folder's template and special tokens are inputs too (its tokenizer.json is the option's own file): a
    # changed template must rebuild the data, as a changed tokenizer does
    folder = Path(opts["tokenizer"]).expanduser()
    # gpt2 and char are names, even where a folder so named exists; a path that is no folder holds no template files
    named = opts["tokenizer"] in ("gpt2", "char")
    template = [] if named else [folder / n for n in TEMPLATE_FILES if (folder / n).is_file()]
    return files, input_fingerprint(files + template)


def shakespeare_chat_folder(opts):
    """shakespeare_chat with characters; shakespeare_chat_gpt2 with GPT-2 BPE."""
    return "shakespeare_chat" if opts["tokenizer"] == "char" else f"shakespeare_chat_{opts['tokenizer']}"


# ----------------------------------------------------------------------------- builders
#
# A builder gets (stage folder, dataset name, options, resolved local input files or None,
# check_tokenizer) and returns the dataset's meta (without the bookkeeping prepare adds).
# It calls check_tokenizer(spec) as soon as the tokenizer is known, before the slow part.


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


def encode_items(items, tokenizer, eot, num_threads, bar):
    """(split, ids) for each (split, text) item, encoded in parallel batches; a (split, None) item becomes [eot]."""
    for batch in batched(items, BATCH_PIECES):
        # end-of-file markers carry no text: only the texts go to the tokenizer, whose results keep their order
        texts = [text for _, text in batch if text is not None]
        ids = iter(tokenizer.encode_batch(texts, num_threads))
        for split, text in batch:
            if text is not None:
                yield split, next(ids)
            elif eot is not None:
                yield split, [eot]
        # progress in characters, like the total that the scan counted
        bar.update(sum(map(len, texts)))


def bpe_of_train_split(files, split_at, vocab_size):
    """The vocab of a byte-level BPE of vocab_size ids trained on the train split alone: the first split_at
    characters of the files, so that the val split stays text the tokenizer never saw."""
    # train pieces come first: takewhile stops reading at the first val piece; (split, None) marks a file's end
    train = itertools.takewhile(lambda item: item[0] == "train", corpus_items(files, split_at, last_newline_cut))
    # pieces are cut where GPT-2's pre-tokenizer splits anyway, so the pairs counted are the whole text's
    json_text, special = train_byte_level_bpe((text for _, text in train if text is not None), vocab_size)
    spec = {"type": "huggingface", "json": json_text}
    return {"tokenizer": spec, "vocab_size": vocab_size, "special_tokens": special}


def build_lm_text(stage, name, opts, files, check_tokenizer, *, tokenizer, eot_after_files):
    """train.bin/val.bin from text files, the first (1 - val_fraction) of the characters train. tokenizer: 'char',
    'bpe' (GPT-2's; with opts' vocab_size, one trained on the train split), or a tokenizer.json or its folder."""
    # vocab_size is an option of the text recipe only: get() gives None for the Shakespeare recipes
    trained = tokenizer == "bpe" and opts.get("vocab_size") is not None
    if tokenizer == "bpe" and not trained:
        vocab = gpt2_vocab()
    elif tokenizer not in ("bpe", "char"):
        # read before the scan, so a file that cannot be parsed fails at once; bos/eos from config.json beside it
        vocab = huggingface_tokenizer(tokenizer)
    # pass 1: character count and set; also rejects files that are not UTF-8 text
    total, chars = scan_text(files)
    if total == 0:
        raise ValueError(f"{opts['input'] or files[0]} holds no text; pass a non-empty --input")
    split_at = int(total * (1 - opts["val_fraction"]))  # nanoGPT's int(n * 0.9): 1,003,854 for Shakespeare
    if tokenizer == "char":
        # sorted: the same text always gets the same ids (65 for tiny Shakespeare); a char vocabulary has no
        # special tokens, so no end-of-text either
        vocab = char_vocab(sorted(chars))
    elif trained:
        # a pass of its own over the train split, before the ids can be written
        vocab = bpe_of_train_split(files, split_at, opts["vocab_size"])
    spec = vocab["tokenizer"]
    check_tokenizer(spec)
    # the same Tokenizer that training and sampling rebuild from meta.json
    encoder = Tokenizer.from_meta(vocab)
    # documents (files) end with end-of-text: GPT-2's or a trained BPE's, or a tokenizer.json's eos (none if its
    # config.json names none)
    special = vocab["special_tokens"]
    eot = special.get("eot", special.get("eos")) if eot_after_files else None
    # where pieces may be cut: GPT-2's rule is known; a tokenizer.json's is checked at each cut
    last_cut = functools.partial(checked_cut, encoder) if spec["type"] == "huggingface" else last_newline_cut
    # num_proc is not an option of the Shakespeare recipes: get() then gives None, all cores
    num_threads = opts.get("num_proc") or os.cpu_count()
    # pass 2: read again, cut into pieces, encode them in parallel batches and stream the ids into train.bin
    # and val.bin; every step is a generator, so only one batch of text and ids is in memory at a time
    with tqdm(desc=f"tokenizing {name}", total=total, unit="char", unit_scale=True, disable=None) as bar:
        items = encode_items(corpus_items(files, split_at, last_cut), encoder, eot, num_threads, bar)
        files_meta = write_lm(stage, items, vocab["vocab_size"])
    # the builder's part of meta.json; prepare() adds format_version, name and source
    return {"kind": "lm", **vocab, "files": files_meta}


def build_shakespeare(stage, name, opts, files, check_tokenizer):
    """tiny Shakespeare, character-level (shakespeare_char) or with GPT-2 BPE or a tokenizer.json, split 90/10."""
    # shakespeare_char has no --tokenizer: its characters; the option's 'gpt2' is text's 'bpe'
    tokenizer = opts.get("tokenizer", "char")
    tokenizer = "bpe" if tokenizer == "gpt2" else tokenizer
    # 90/10 fixed, as in nanoGPT's data/shakespeare_char and data/shakespeare, so losses compare; one document, so
    # no end-of-text in it
    opts = opts | {"val_fraction": 0.1}
    return build_lm_text(stage, name, opts, files, check_tokenizer, tokenizer=tokenizer, eot_after_files=False)


def build_text(stage, name, opts, files, check_tokenizer):
    """The user's text files, with the tokenizer (or a BPE trained on them) and val fraction of the options."""
    # checked before the text is read: one line naming the option, instead of a bad tokenizer after a long scan
    size = opts["vocab_size"]
    if size is not None and opts["tokenizer"] != "bpe":
        raise ValueError(
            f"{name}: --vocab_size trains a BPE tokenizer on the text, so it does not go with "
            f"--tokenizer={opts['tokenizer']}; leave one of them out"
        )
    if size is not None and size < BYTE_TOKENS + 1:
        raise ValueError(
            f"{name}: --vocab_size must be at least {BYTE_TOKENS + 1} (the {BYTE_TOKENS} byte values and "
            f"{END_OF_TEXT}), got {size}"
        )
    # each file is a document: with BPE an end-of-text (a tokenizer.json's eos) follows it, so the model learns
    # where texts end
    return build_lm_text(stage, name, opts, files, check_tokenizer, tokenizer=opts["tokenizer"], eot_after_files=True)


def encode_documents(dataset, tokenizer, period, max_tokens, num_threads, bar):
    """(split, ids) per batch of documents, each followed by end-of-text. Every period-th document, the first
    included, is val: deterministic, streaming, and never empty. Stops after the document that reaches max_tokens."""
    eot = tokenizer.special_tokens["eot"]
    # seen: documents so far, which decides each one's split; written: tokens so far, eot included
    seen = written = 0
    for batch in dataset.iter(batch_size=BATCH_DOCS):
        if "text" not in batch:
            raise ValueError(f"the input has no 'text' column (its columns: {', '.join(batch)})")
        # one batch of documents becomes two items, the ids of each split concatenated (one may be empty)
        out, before = {"train": [], "val": []}, seen
        for ids in tokenizer.encode_batch(batch["text"], num_threads):
            split = "val" if seen % period == 0 else "train"
            out[split].extend(ids)
            out[split].append(eot)
            seen, written = seen + 1, written + len(ids) + 1
            if max_tokens and written >= max_tokens:
                break
        bar.update(seen - before)
        # an empty list is fine: TokenWriter.write skips it
        yield from out.items()
        if max_tokens and written >= max_tokens:
            return


def build_hf_lm(stage, name, opts, files, check_tokenizer):
    """Documents streamed through `datasets` (hub or local files), GPT-2 BPE."""
    # checked before the encoding is loaded, as that may download it
    check_tokenizer(gpt2_spec())
    vocab = gpt2_vocab()
    tokenizer = Tokenizer.from_meta(vocab)
    if files is not None:
        dataset = load_local_dataset(files)
    else:
        hint = f"pass local parquet/json files as {INPUT_OPTION}, or set {MIRROR_ENV} to a folder holding {name}/"
        dataset = load_hub_dataset(opts["hf_dataset"], opts["hf_config"], hint)
    if opts["max_docs"]:
        # lazy: a streamed dataset reads only the documents taken
        dataset = dataset.take(opts["max_docs"])
    # val_fraction 0.0005 -> every 2000th document is val
    period = max(1, round(1 / opts["val_fraction"]))
    # total None (no --max_docs): the bar counts without an end, as the stream's length is unknown
    with tqdm(desc=f"tokenizing {name}", total=opts["max_docs"], unit="doc", unit_scale=True, disable=None) as bar:
        items = encode_documents(
            dataset, tokenizer, period, opts["max_tokens"], opts["num_proc"] or os.cpu_count(), bar
        )
        files_meta = write_lm(stage, items, tokenizer.vocab_size)
    return {"kind": "lm", **vocab, "files": files_meta}


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


def pair_split(source, val_fraction, test_fraction):
    """The split ('train', 'val' or 'test') of a pair, decided by its source text."""
    # by a hash of the source text: deterministic, streaming, and duplicates never straddle splits
    # u: uniform in [0, 1); test takes the lowest test_fraction of it, val the next val_fraction
    u = zlib.crc32(source.encode("utf-8")) / 2**32
    return "test" if u < test_fraction else "val" if u < test_fraction + val_fraction else "train"


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


def encode_pairs(pairs, tokenizer, val_fraction, test_fraction, num_threads, bar):
    """(src_ids, tgt_ids, split) for each (source, target) text pair, encoded in parallel batches."""
    for batch in batched(pairs, BATCH_DOCS):
        # sources and targets in one parallel call: the first len(batch) results are the sources
        ids = tokenizer.encode_batch([s for s, _ in batch] + [t for _, t in batch], num_threads)
        for (source, _), src_ids, tgt_ids in zip(batch, ids, ids[len(batch) :]):
            yield src_ids, tgt_ids, pair_split(source, val_fraction, test_fraction)
        bar.update(len(batch))


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


# ----------------------------------------------------------------------------- synthetic tasks
#
# What a task is (its sources, its answers, its characters) is in synthetic.py; here, how its dataset is drawn.


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


# ----------------------------------------------------------------------------- chat conversations
#
# One conversation per JSONL line, {"messages": [{"role", "content"}, ...]}, rendered by a chat template (chat.py)
# into ids and loss targets. A line that cannot be used is counted by reason and left out, and the count reported;
# a file that is mostly such lines is refused whole.

CHAT_FORMATS = (".jsonl", ".json", ".parquet", ".arrow")  # .jsonl is read here, line by line; the rest by datasets


class BadConversation(ValueError):
    """A conversation that cannot be trained on; the message is the reason, as the report counts it."""


class LeftOut:
    """The conversations of some input kept, and those left out counted by reason, with where each reason first was."""

    def __init__(self):
        self.kept, self.reasons = 0, {}  # reason -> [count, where it was first met]

    def add(self, reason, where):
        self.reasons.setdefault(reason, [0, where])[0] += 1

    def merge(self, other):
        self.kept += other.kept
        for reason, (count, where) in other.reasons.items():
            self.reasons.setdefault(reason, [0, where])[0] += count

    def bad(self):
        return sum(count for count, _ in self.reasons.values())

    def describe(self):
        """'150 too long for block_size=256 (first: a.jsonl line 17), ...', the most frequent reasons first."""
        ranked = sorted(self.reasons.items(), key=lambda item: -item[1][0])
        # four reasons keep the report one readable line; the rest are summed
        parts = [f"{count:,} {reason} (first: {where})" for reason, (count, where) in ranked[:4]]
        rest = sum(count for _, (count, _) in ranked[4:])
        return ", ".join(parts + ([f"{rest:,} for {len(ranked) - 4} other reasons"] if rest else []))

    def summary(self):
        return f"kept {self.kept:,} of {self.kept + self.bad():,} conversations; {self.describe()}"


def jsonl_records(path):
    """(where, object) of each non-blank line of a JSONL file; the object is BadConversation for a line that is not
    UTF-8 JSON."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            where = f"{path} line {number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield where, BadConversation("not UTF-8 text")
                continue
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError:
                yield where, BadConversation("not valid JSON")


def dataset_records(path):
    """(where, row) of each row of a parquet, JSON or arrow file, read through `datasets` as the hub's files are."""
    try:
        for number, row in enumerate(load_local_dataset([path]), 1):
            yield f"{path} row {number}", row
    # datasets raises its own errors, pyarrow's or json's for a file it cannot read: all mean the same here
    except Exception as err:
        raise ValueError(f"{path} could not be read through datasets ({one_line(err)})") from None


def chat_records(path):
    """(where, object or BadConversation) of each conversation of one input file."""
    suffix = path.suffix.lower()
    if suffix not in CHAT_FORMATS:
        raise ValueError(f"{path}: chat input files must be {', '.join(CHAT_FORMATS)}; leave it out of --input")
    return jsonl_records(path) if suffix == ".jsonl" else dataset_records(path)


def encode_conversation(obj, chat_format, block_size, chars=None):
    """
    (ids, targets) of a conversation as stored: rendered by chat_format and cut after its last loss target (what
    a template writes after the last end-of-turn, ChatML's newline, teaches nothing). chars: a character
    vocabulary the texts must keep to. BadConversation says why a conversation cannot be used.
    """
    if isinstance(obj, BadConversation):
        raise obj
    problem = conversation_problem(obj)
    if problem is not None:
        # counted by kind: 'message 3 has role ...' and 'message 5 has role ...' are one reason
        raise BadConversation(re.sub(r"\bmessage \d+", "a message", problem))
    if chars is not None and any(set(m["content"]) - chars for m in obj["messages"]):
        raise BadConversation(f"characters outside the {len(chars)}-character vocabulary")
    try:
        ids, targets = chat_format.render(obj["messages"])
    except ValueError as err:  # a template that refuses the conversation (roles must alternate, ...)
        raise BadConversation(one_line(err)) from None
    learned = [k for k, target in enumerate(targets) if target]
    # a target is predicted from the ids before it: the first id never is
    if not learned or learned[-1] == 0:
        raise BadConversation("no assistant token to learn")
    ids, targets = ids[: learned[-1] + 1], targets[: learned[-1] + 1]
    if len(ids) > block_size + 1:
        raise BadConversation(f"too long for block_size={block_size}")
    return ids, targets


def conversation_split(messages, val_fraction):
    """'val' or 'train' by a hash of the conversation: deterministic, and a repeated conversation never straddles."""
    text = json.dumps(messages, sort_keys=True, ensure_ascii=False)
    return "val" if zlib.crc32(text.encode("utf-8")) / 2**32 < val_fraction else "train"


def file_conversations(files, chat_format, block_size, val_fraction, chars, left_out):
    """
    (split, ids, targets) of the usable conversations of the files; the others are counted in left_out. A file
    where more than half are unusable raises ValueError: it is most likely not a conversation file.
    """
    for path in files:
        tally = LeftOut()
        for where, obj in chat_records(path):
            try:
                ids, targets = encode_conversation(obj, chat_format, block_size, chars)
            except BadConversation as err:
                tally.add(str(err), where)
                continue
            tally.kept += 1
            yield conversation_split(obj["messages"], val_fraction), ids, targets
        if 2 * tally.bad() > tally.kept + tally.bad():
            raise ValueError(
                f"{path}: {tally.bad():,} of {tally.kept + tally.bad():,} conversations cannot be used "
                f'({tally.describe()}); each line must be {{"messages": [{{"role": ..., "content": ...}}, ...]}} '
                "ending with the assistant's message"
            )
        left_out.merge(tally)


def conversation_chars(files):
    """The characters of every message of the files' usable conversations: a character vocabulary for them."""
    chars = set()
    for path in files:
        for _, obj in chat_records(path):
            if not isinstance(obj, BadConversation) and conversation_problem(obj) is None:
                chars.update(*(m["content"] for m in obj["messages"]))
    return chars


def write_conversations(stage, conversations, vocab_size):
    """Stream (split, ids, targets) into the chat files of train and val, both non-empty; returns meta's "files" and
    "conversations"."""
    with contextlib.ExitStack() as stack:
        writers = {s: ConversationWriter(stack, stage, s, vocab_size) for s in CHAT_SPLITS}
        for split, ids, targets in conversations:
            writers[split].add(ids, targets)
        counts = {s: w.finish() for s, w in writers.items()}
        # raised inside the stack, so no partial file is kept
        if not all(counts.values()):
            raise ValueError(f"a split came out empty ({counts}); give more conversations or a larger --val_fraction")
    files = {}
    for split, writer in writers.items():
        files |= {f"{split}.bin": writer.ids.count, f"{split}_targets.bin": writer.targets.count}
    return {"files": files, "conversations": counts}


def chat_tokenizer_file(value):
    """The file a chat --tokenizer path stands for: a dataset's meta.json (or its folder), else a tokenizer.json."""
    path = Path(value).expanduser()
    if path.name == "meta.json" and path.is_file():
        return path
    return path / "meta.json" if (path / "meta.json").is_file() else tokenizer_json_file(path)


def chat_meta(choice, files):
    """
    The kind, tokenizer, vocab_size, special_tokens and chat entries of chat data tokenized by --tokenizer=choice (see
    the option's help): a tokenizer without a chat template of its own gets the built-in one.
    """
    if choice == "gpt2":
        base = gpt2_vocab()
    elif choice == "char":
        chars = sorted(conversation_chars(files))
        if not chars:
            raise ValueError("the input holds no usable conversation to take characters from")
        base = char_vocab(chars)
    elif (file := chat_tokenizer_file(choice)).name == "meta.json":
        dataset = load_meta(file.parent)
        base = {key: dataset[key] for key in ("tokenizer", "vocab_size", "special_tokens", "chat") if key in dataset}
        if "chat" in base:
            return {"kind": "chat", **base}
    else:
        base = huggingface_tokenizer(choice)
        chat = folder_chat(choice) if Path(choice).expanduser().is_dir() else None
        if chat is not None:
            return {"kind": "chat", **base, "chat": chat}
    return with_chat_tokens({"kind": "lm", **base})


def build_chat(stage, name, opts, files, check_tokenizer):
    """Conversations from JSONL (or parquet, JSON, arrow) files, rendered by the tokenizer's chat template."""
    meta = chat_meta(opts["tokenizer"], files)
    check_tokenizer(meta["tokenizer"])
    chat_format = ChatFormat.from_meta(meta)
    spec = meta["tokenizer"]
    # characters outside a character vocabulary are a reason of their own, not a render error per character
    chars = set(spec["chars"]) if spec["type"] == "char" else None
    left_out = LeftOut()
    items = file_conversations(files, chat_format, opts["block_size"], opts["val_fraction"], chars, left_out)
    # the bar counts the conversations kept as they are written
    with tqdm(items, desc=f"tokenizing {name}", unit="conversation", unit_scale=True, disable=None) as bar:
        written = write_conversations(stage, bar, meta["vocab_size"])
    if left_out.reasons:
        logger.warning("%s", left_out.summary())
    return {
        **meta,
        "exact_answers": opts["exact_answers"],
        **written,
        "left_out": {reason: count for reason, (count, _) in left_out.reasons.items()},
    }


def build_shakespeare_chat(stage, name, opts, files, check_tokenizer):
    """The Shakespeare quiz (synthetic.py): conversations with exact answers, in the built-in chat template."""
    text = files[0].read_text(encoding="utf-8")
    # char: shakespeare_char's vocabulary exactly, so that its models fine-tune on these ids
    base = char_vocab(sorted(set(text))) if opts["tokenizer"] == "char" else gpt2_vocab()
    meta = with_chat_tokens({"kind": "lm", **base})
    check_tokenizer(meta["tokenizer"])
    chat_format = ChatFormat.from_meta(meta)
    drawn = quiz_conversations(text, opts["num_train"], opts["num_val"], opts["seed"])
    # every quiz conversation is usable and fits QUIZ_BLOCK by construction: encode_conversation raising is a bug
    items = (
        (split, *encode_conversation({"messages": messages}, chat_format, QUIZ_BLOCK))
        for split, conversations in drawn.items()
        for messages in conversations
    )
    return {**meta, "exact_answers": True, **write_conversations(stage, items, meta["vocab_size"])}


# ----------------------------------------------------------------------------- the datasets


@dataclass(frozen=True)
class Recipe:
    """Everything about one dataset. Adding a dataset is one entry in RECIPES plus its build function."""

    description: str  # one line, for --help and the list of datasets
    options: tuple[Option, ...]  # its command-line options, also prepare()'s keyword arguments
    build: Callable  # (stage, name, options, files, check_tokenizer) -> meta; see the comment above the builders
    # (name, options, data root) -> (local input files or None, fingerprint of the inputs); None: no inputs, the
    # dataset is generated and the options alone decide it
    inputs: Callable | None = None
    # (options) -> the output folder's name; None: --name where the recipe has that option, else the dataset's name
    folder: Callable | None = None


def hf_lm_recipe(description, hf_dataset, hf_config):
    """The recipe of a Hugging Face corpus, whose options default to dataset `hf_dataset`, config `hf_config`."""
    options = (
        input_option(
            "local parquet/json/jsonl/arrow file, directory or glob, read through datasets.load_dataset (offline)"
        ),
        Option("hf_dataset", str, hf_dataset, "Hugging Face dataset id"),
        Option("hf_config", str, hf_config, "dataset config, e.g. sample-10BT"),
        count_option("max_docs", None, "stop after this many documents (quick runs)"),
        count_option("max_tokens", None, "stop once this many tokens are written (the last document is kept whole)"),
        fraction_option("val_fraction", 0.0005, "held-out fraction of documents (every round(1/f)-th one)"),
        NUM_PROC,
    )
    return Recipe(description, options=options, build=build_hf_lm, inputs=hf_lm_inputs)


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


# one Option shared by both Shakespeare recipes: the same input, two tokenizers
SHAKESPEARE_INPUT = input_option(f"local copy of tinyshakespeare.txt (else ${MIRROR_ENV}, the download cache, the web)")

# the command line lists the datasets in this order
RECIPES: dict[str, Recipe] = {
    "shakespeare_char": Recipe(
        "tiny Shakespeare, character-level (65 symbols), 90/10 split as in nanoGPT",
        options=(SHAKESPEARE_INPUT,),
        inputs=shakespeare_inputs,
        build=build_shakespeare,
    ),
    "shakespeare": Recipe(
        "tiny Shakespeare, GPT-2 BPE (tiktoken) or a tokenizer.json, 90/10 split as in nanoGPT",
        options=(
            SHAKESPEARE_INPUT,
            tokenizer_option(
                ("gpt2",),
                "gpt2",
                "gpt2: GPT-2 BPE; else a tokenizer.json or a folder holding one (a Llama or Mistral model folder), "
                "written to shakespeare_<its folder name>",
            ),
        ),
        inputs=shakespeare_inputs,
        build=build_shakespeare,
        folder=shakespeare_folder,
    ),
    "openwebtext": hf_lm_recipe(
        "OpenWebText through Hugging Face datasets, GPT-2 BPE, streamed (--max_docs for a quick run)",
        "Skylion007/openwebtext",
        None,
    ),
    "fineweb_edu": hf_lm_recipe(
        "FineWeb-Edu sample-10BT through Hugging Face datasets, GPT-2 BPE, streamed",
        "HuggingFaceFW/fineweb-edu",
        "sample-10BT",
    ),
    "text": Recipe(
        "your own text: a file, directory or glob (--input), char-level, GPT-2 BPE, a tokenizer.json or a BPE "
        "trained on it (--vocab_size)",
        options=(
            input_option("UTF-8 text file, directory (recursive) or glob; required"),
            tokenizer_option(
                ("char", "bpe"),
                "bpe",
                "char: the corpus's characters; bpe: GPT-2 BPE (with --vocab_size, one trained on the text) with "
                "end-of-text after each file; else a tokenizer.json or a folder holding one (a model folder), with "
                "config.json's eos after each file",
            ),
            Option(
                "vocab_size",
                int,
                None,
                f"train a byte-level BPE of this many ids (at least {BYTE_TOKENS + 1}: the bytes and {END_OF_TEXT}) "
                "on the train split's text, instead of GPT-2's; kept in meta.json, as a tokenizer.json is",
                recorded_unset=False,
            ),
            Option("name", str, "text", "output folder name under data_dir", affects_output=False),
            fraction_option("val_fraction", 0.1, "the last fraction of the characters is the val split"),
            NUM_PROC,
        ),
        inputs=text_inputs,
        build=build_text,
    ),
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
    "chat": Recipe(
        'your own conversations: JSONL lines of {"messages": [{"role", "content"}, ...]} (or parquet/JSON '
        "through datasets), in a chat template, loss on the assistant's tokens",
        options=(
            input_option("a .jsonl file (or .parquet, .json, .arrow), a directory or a glob; required"),
            Option(
                "tokenizer",
                str,
                "gpt2",
                "gpt2: GPT-2 BPE; char: the conversations' characters; else a tokenizer.json, a Hugging Face "
                "model folder (its chat_template, if any) or a prepared dataset's folder or meta.json (its tokenizer, "
                "e.g. data/shakespeare_char); the built-in template where there is no other",
                choices=("gpt2", "char"),
                file=chat_tokenizer_file,
            ),
            count_option("block_size", 1024, "conversations longer than block_size + 1 tokens are left out (counted)"),
            fraction_option("val_fraction", 0.05, "held-out fraction of the conversations (by a hash of each)"),
            Option(
                "exact_answers",
                boolean,
                False,
                "true: each conversation's last reply is the one right answer, so evaluation scores exact matches",
            ),
            Option("name", str, "chat", "output folder name under data_dir", affects_output=False),
        ),
        inputs=chat_inputs,
        build=build_chat,
    ),
    "shakespeare_chat": Recipe(
        "a quiz on tiny Shakespeare, generated offline: who speaks a line, the next line, word counts, sums in "
        "words; exact answers (chat demo)",
        options=(
            SHAKESPEARE_INPUT,
            Option(
                "tokenizer",
                str,
                "char",
                "char: shakespeare_char's 65 characters (and the 4 chat markers), so its models fine-tune on it; "
                "gpt2: GPT-2 BPE, written to shakespeare_chat_gpt2",
                choices=("char", "gpt2"),
            ),
            count_option("num_train", 10000, "training conversations"),
            count_option("num_val", 500, "validation conversations (about lines and sums that train never asks)"),
            Option("seed", int, 0, "random seed; the same seed gives the same files"),
        ),
        inputs=shakespeare_inputs,
        build=build_shakespeare_chat,
        folder=shakespeare_chat_folder,
    ),
    "reverse": synthetic_recipe("reverse", "synthetic seq2seq, offline: reverse a string of digits and letters"),
    "sort": synthetic_recipe("sort", "synthetic seq2seq, offline: sort the characters of a string"),
    "num2words": synthetic_recipe(
        "num2words", "synthetic seq2seq, offline: 1234 -> one thousand two hundred thirty-four"
    ),
}
DATASETS = {name: recipe.description for name, recipe in RECIPES.items()}  # name -> description, for messages


def recipe_of(name):
    """RECIPES[name]; an unknown name raises ValueError naming the closest one and every one."""
    if name not in RECIPES:
        close = difflib.get_close_matches(name, RECIPES, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"unknown dataset {name!r}; {hint}choose one of: {', '.join(RECIPES)}")
    return RECIPES[name]


# ----------------------------------------------------------------------------- preparing


def existing_meta(folder):
    """The meta of the dataset already in `folder`, None if there is none; a foreign folder raises ValueError."""
    # an absent or empty folder is simply a new dataset
    if not folder.is_dir() or not any(folder.iterdir()):
        return None
    try:
        # a folder this script did not write (someone's files) is never replaced without --force
        return load_meta(folder)
    except (FileNotFoundError, ValueError) as err:
        raise ValueError(
            f"{folder} exists but is not a dataset this script can update ({one_line(err)}); "
            "pass --force to replace it, or choose another --data_dir"
        ) from None


@contextlib.contextmanager
def staged_folder(folder):
    """Yield a hidden folder beside `folder` that replaces it only if the block succeeds."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    # hidden (dataset_dir refuses dot names, so no dataset is called this) and random, so concurrent runs never
    # share a stage
    stage = folder.with_name(f".{folder.name}.partial-{secrets.token_hex(4)}")
    stage.mkdir()
    try:
        yield stage
        # two renames: a folder cannot replace a non-empty folder in one step, so the old one moves aside first
        old = folder.with_name(f".{folder.name}.old-{secrets.token_hex(4)}")
        if folder.exists():
            folder.rename(old)
        stage.rename(folder)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        # after a success the stage was renamed away and this does nothing; after a failure it drops the partial outputs
        shutil.rmtree(stage, ignore_errors=True)


def prepare(name, /, data_dir=None, force=False, **options):
    """Prepare dataset `name` (a key of DATASETS) and return its folder.

    Options are those of `python prepare_data.py NAME --help`, as keyword arguments (`name` is positional-only, so
    the option `name=`, the output folder, can be passed too). Outputs that are up to date (same inputs and options)
    are kept, and an existing dataset from a different tokenizer is refused, unless force=True. Raises ValueError,
    FileNotFoundError or DownloadError (an OSError) with a one-line message; nothing half-written is left behind.
    """
    recipe = recipe_of(name)
    # every option of the recipe, converted and checked, defaults filled in
    opts = resolve_options(name, recipe.options, options)
    root = data_root(data_dir)
    # <root>/<name>, or the --name folder for text, chat and translation
    folder = dataset_dir(recipe.folder(opts) if recipe.folder else opts.get("name", name), root)
    # local input files (None: the hub, or generated) and what identifies them; a download happens here
    files, fingerprint = recipe.inputs(name, opts, root) if recipe.inputs else (None, None)
    # everything the outputs depend on; JSON round trip so it compares equal to what meta.json holds
    record = {
        "dataset": name,
        "inputs": fingerprint,
        **{
            o.name: o.recorded(opts[o.name])
            for o in recipe.options
            if o.affects_output and (o.recorded_unset or opts[o.name] is not None)
        },
    }
    record = json.loads(json.dumps(record))
    # --force ignores the existing folder: nothing is kept, nothing refused
    old = None if force else existing_meta(folder)
    # same inputs and options, and the files intact: nothing to do
    if old is not None and old.get("source") == record and is_prepared(folder):
        return folder

    # replacing data of another tokenizer would leave checkpoints trained on it reading wrong ids
    def check_tokenizer(spec):
        if old is not None and old["tokenizer"] != spec:
            raise ValueError(
                f"{folder} holds data from a different tokenizer ({describe_tokenizer(old['tokenizer'])}, now "
                f"{describe_tokenizer(spec)}); pass --force to replace it, or choose another --name/--data_dir"
            )

    # the builder writes into the stage; meta.json comes last, listing what was written
    with staged_folder(folder) as stage:
        meta = {
            "format_version": FORMAT_VERSION,
            "name": folder.name,
            **recipe.build(stage, name, opts, files, check_tokenizer),
            "source": record,
        }
        # ensure_ascii=False: a char vocabulary stays readable in meta.json
        with atomic_output(stage / "meta.json") as f:
            f.write(json.dumps(meta, indent=1, ensure_ascii=False).encode("utf-8"))
    return folder


# ----------------------------------------------------------------------------- command line


# what every dataset takes besides its own options; prepare() takes them as keywords too
COMMON_OPTIONS = (
    Option("data_dir", str, None, f"the datasets' root folder (default: ${DATA_DIR_ENV} or data/ beside this script)"),
    Option("force", boolean, False, "rebuild even if up to date, and replace data from another tokenizer"),
)
OFFLINE = (
    f"Offline: --input=PATH, ${MIRROR_ENV} (a local mirror folder), $TIKTOKEN_CACHE_DIR. "
    f"Output root: --data_dir, else ${DATA_DIR_ENV}, else data/ beside this script."
)


def help_text(name=None):
    """--help: every dataset with its description; NAME --help: that dataset's options as typed, with defaults."""
    if name is None:
        usage, about = "NAME", "Prepare a dataset as token files under <data_dir>/<name>/ (NAME --help: its options)."
        lines = [help_line(dataset, recipe.description) for dataset, recipe in RECIPES.items()]
    else:
        usage, about = name, RECIPES[name].description
        # an option without a default shows its name as the value to give: --input=INPUT
        options = (*RECIPES[name].options, *COMMON_OPTIONS)
        lines = [help_line(f"--{o.name}={o.name.upper() if o.default is None else o.default}", o.help) for o in options]
    return "\n".join([f"usage: prepare_data.py {usage} {OPTIONS_USAGE}", "", about, "", *lines, "", OFFLINE])


def parse_args(argv):
    """(dataset name, prepare()'s keywords) from `NAME --key=value ...`, the options read by config.parse_config."""
    name = argv[0] if argv and not argv[0].startswith("-") else None
    recipe = recipe_of(name) if name else None  # an unknown name is refused, --help or not
    if "-h" in argv or "--help" in argv:
        print(help_text(name))
        raise SystemExit(0)
    if name is None:
        raise ConfigError(f"name a dataset first, one of: {', '.join(RECIPES)} (--help says what each is)")
    # a dataclass of the dataset's options; the words after NAME are options only, never config files
    fields = [(o.name, o.hint, o.default) for o in (*recipe.options, *COMMON_OPTIONS)]
    return name, asdict(parse_config(make_dataclass(name, fields), argv[1:], config_files=False))


def summary_line(folder):
    """The line printed after a build: what was written, the vocab size and the tokenizer."""
    meta = load_meta(folder)
    if meta["kind"] == "seq2seq":
        counts = ", ".join(f"{split} {n:,} pairs" for split, n in meta["pairs"].items())
    elif meta["kind"] == "chat":
        counts = ", ".join(
            f"{split} {n:,} conversations ({meta['files'][f'{split}.bin']:,} tokens)"
            for split, n in meta["conversations"].items()
        )
    else:
        counts = ", ".join(f"{fname} {n:,} tokens" for fname, n in meta["files"].items())
    return f"{folder}: {counts}; vocab_size {meta['vocab_size']:,} ({describe_tokenizer(meta['tokenizer'])})"


def cli(argv):
    """The command line; returns the exit status: errors print one line and give 2."""
    try:
        name, settings = parse_args(argv)
        print(summary_line(prepare(name, **settings)))
    except (ValueError, OSError) as err:  # OSError: a missing or unwritable file, a failed download
        print(f"prepare_data.py: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("prepare_data.py: error: interrupted; partial outputs were removed", file=sys.stderr)
        # 128 + SIGINT, as a shell reports Ctrl-C
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
