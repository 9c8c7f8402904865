"""
Tiny Shakespeare, character by character, as nanoGPT's data/shakespeare_char makes it: the text's 65 characters
are the vocabulary, and its first 90% of the characters are train, the rest val. Below the recipe: where the text
comes from (--input, a mirror, the download cache or the web), which the other Shakespeare recipes read too.
"""

import hashlib
import http.client
import os
import urllib.request
from pathlib import Path

from log import one_line
from recipes.base import INPUT_OPTION, Recipe, char_vocab, file_sha256, input_option, write_lm
from tokens import MIRROR_ENV, DownloadError, atomic_output


def build(stage, name, opts, files, check_tokenizer):
    """train.bin and val.bin of the text's characters, split 90/10; returns the dataset's meta."""
    # as bytes decoded, not read as text: a '\r' in an --input file stays a character of its own
    try:
        text = files[0].read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{files[0]} is not UTF-8 text (byte {err.start}); pass tiny Shakespeare as --input") from None
    # the characters of the text, sorted, are the vocabulary: id i is chars[i] (no special tokens, no end-of-text)
    chars = sorted(set(text))
    vocab = char_vocab(chars)
    check_tokenizer(vocab["tokenizer"])
    # the first 90% of the characters are train: 1,003,854 of 1,115,394, where nanoGPT cuts
    n = int(len(text) * 0.9)
    stoi = {ch: i for i, ch in enumerate(chars)}
    splits = [("train", [stoi[c] for c in text[:n]]), ("val", [stoi[c] for c in text[n:]])]
    return {"kind": "lm", **vocab, "files": write_lm(stage, splits, len(chars))}


# ----------------------------------------------------------------------------- the text

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
# pins the content: a mirror, cache or download that differs is refused, never tokenized
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"

# one Option for every Shakespeare recipe: the same input, other tokenizers
SHAKESPEARE_INPUT = input_option(f"local copy of tinyshakespeare.txt (else ${MIRROR_ENV}, the download cache, the web)")


def shakespeare_inputs(name, opts, root):
    """tiny Shakespeare's file, found or downloaded, and its sha256."""
    path = shakespeare_file(opts["input"], root)
    return [path], file_sha256(path)  # by content: the mirror, the cache and --input all count as the same text


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


RECIPES = {
    "shakespeare_char": Recipe(
        "tiny Shakespeare, character-level (65 symbols), 90/10 split as in nanoGPT",
        options=(SHAKESPEARE_INPUT,),
        inputs=shakespeare_inputs,
        build=build,
    ),
}
