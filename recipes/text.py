"""
Your own text (a file, a directory or a glob) as an LM dataset: character-level, GPT-2 BPE, a tokenizer.json, or a
byte-level BPE trained on it (--vocab_size). The text is read twice, in blocks, never whole: a scan for its
characters and length, then pieces cut where the tokenizer would cut anyway, encoded in parallel batches and
streamed into train.bin and val.bin. The Shakespeare recipe with a BPE goes through here too.
"""

import codecs
import functools
import itertools
import os

import tokenizers
from tqdm import tqdm

from recipes.base import (
    INPUT_OPTION,
    NUM_PROC,
    Option,
    Recipe,
    batched,
    char_vocab,
    expand_input,
    fraction_option,
    gpt2_vocab,
    input_fingerprint,
    input_option,
    tokenizer_option,
    write_lm,
)
from tokens import END_OF_TEXT, Tokenizer, huggingface_tokenizer

BLOCK_BYTES = 1 << 18  # text is read, cut and encoded in pieces of about this size
BATCH_PIECES = 16  # pieces per tiktoken batch: enough work for every thread, bounded memory
CUT_CONTEXT = 64  # characters either side of a cut that a tokenizer.json must encode alike whole and cut
# a byte-level BPE starts from one token for each byte value, so that any text encodes
BYTE_TOKENS = 256


def text_inputs(name, opts, root):
    """The files --input names (required), and their fingerprint."""
    if not opts["input"]:
        # there is no default corpus for this recipe
        raise ValueError(f"text needs {INPUT_OPTION}: a UTF-8 text file, a directory or a glob such as 'books/*.txt'")
    files = expand_input(opts["input"])
    return files, input_fingerprint(files)


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


def build_lm_text(stage, name, opts, files, check_tokenizer, *, tokenizer, eot_after_files):
    """train.bin/val.bin from text files, the first (1 - val_fraction) of the characters train. tokenizer: 'char',
    'bpe' (GPT-2's; with opts' vocab_size, one trained on the train split), or a tokenizer.json or its folder."""
    # vocab_size is an option of the text recipe only: get() gives None for the Shakespeare recipe
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
    # num_proc is not an option of the Shakespeare recipe: get() then gives None, all cores
    num_threads = opts.get("num_proc") or os.cpu_count()
    # pass 2: read again, cut into pieces, encode them in parallel batches and stream the ids into train.bin
    # and val.bin; every step is a generator, so only one batch of text and ids is in memory at a time
    with tqdm(desc=f"tokenizing {name}", total=total, unit="char", unit_scale=True, disable=None) as bar:
        items = encode_items(corpus_items(files, split_at, last_cut), encoder, eot, num_threads, bar)
        files_meta = write_lm(stage, items, vocab["vocab_size"])
    # the builder's part of meta.json; prepare() adds format_version, name and source
    return {"kind": "lm", **vocab, "files": files_meta}


def bpe_of_train_split(files, split_at, vocab_size):
    """The vocab of a byte-level BPE of vocab_size ids trained on the train split alone: the first split_at
    characters of the files, so that the val split stays text the tokenizer never saw."""
    # train pieces come first: takewhile stops reading at the first val piece; (split, None) marks a file's end
    train = itertools.takewhile(lambda item: item[0] == "train", corpus_items(files, split_at, last_newline_cut))
    # pieces are cut where GPT-2's pre-tokenizer splits anyway, so the pairs counted are the whole text's
    json_text, special = train_byte_level_bpe((text for _, text in train if text is not None), vocab_size)
    spec = {"type": "huggingface", "json": json_text}
    return {"tokenizer": spec, "vocab_size": vocab_size, "special_tokens": special}


def train_byte_level_bpe(texts, vocab_size):
    """
    (tokenizer.json text, special_tokens) of a byte-level BPE of vocab_size ids trained on texts (an iterable of
    strings), as GPT-2's is made: GPT-2's pre-tokenizer splits words, numbers, punctuation and spaces, whose UTF-8
    bytes are then merged. Id 0 is END_OF_TEXT (special_tokens' "eot"), ids 1-256 the byte values, so that any
    text encodes and decodes exactly; the rest are merges, most frequent first. ValueError when the texts hold too
    few distinct pairs for vocab_size ids.
    """
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    # add_prefix_space=False: a text's first word is encoded as written, as tiktoken's GPT-2 does
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        # every byte, seen in the texts or not: a character the training text lacks still encodes, as its bytes
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        # its progress goes to stdout even when that is a pipe (blank lines in a log; a panic once the pipe closes)
        show_progress=False,
    )
    # no randomness: ties between equally frequent pairs are broken by their ids, which follow the sorted alphabet
    bpe.train_from_iterator(texts, trainer)
    if bpe.get_vocab_size() != vocab_size:
        raise ValueError(
            f"the training text holds pairs for only {bpe.get_vocab_size():,} ids, fewer than vocab_size "
            f"{vocab_size:,}: give more text or a smaller vocab_size"
        )
    return bpe.to_str(), {"eot": bpe.token_to_id(END_OF_TEXT)}


# ----------------------------------------------------------------------------- reading and cutting text


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


RECIPES = {
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
}
