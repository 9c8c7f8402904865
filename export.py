"""
Export a GPT checkpoint of train.py as a Hugging Face model folder, the reverse of hf.from_pretrained: the command
line of hf.py, which converts the weights and config.json, while this file adds the tokenizer and writes the folder.

    python export.py --out_dir=out-shakespeare --checkpoint=best.pt --dest=hf-shakespeare

The folder holds config.json, model.safetensors (float32) and generation_config.json, plus the tokenizer's files
(tokenizer_files), a chat model's with its template and end-of-turn: transformers' AutoTokenizer and
AutoModelForCausalLM read it with our model's logits, and its apply_chat_template and generate (and vLLM, SGLang)
chat with it as sample.py --chat does.

The layout (GPT-2's, Llama's, Qwen2's or Qwen3's) follows from the model's settings (hf.hf_layout, hf.LAYOUTS);
options that none computes (post-norm, a soft-cap, a window...) are a one-line error naming each. JSON and
safetensors are written here: transformers is not needed to export, only to load.

The way back: sample.py, eval.py and train.py take the folder as --init_from=FOLDER. config.json's "nanoformer" entry
keeps the meta of the data the model was trained on (a character vocabulary too; a tokenizer.json as the folder's
file), so they read and write text exactly as with the checkpoint.
"""

import functools
import json
import secrets
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import tokenizers
from safetensors.torch import save_file

from chat import BUILTIN_JINJA, ChatFormat
from checkpoint import load_checkpoint, move_into_place, nanogpt_meta, run_checkpoint
from config import parse_config
from hf import EXPORT_KEY, LLAMA_FAMILIES, hf_layout, to_hf
from model import ModelConfig
from start import model_from_checkpoint
from tokens import END_OF_TEXT, TOKENIZER_JSON, dataset_dir, load_meta, tiktoken_encoding

WEIGHTS = "model.safetensors"
# every name an export may write: a --dest holding only these, with our config.json, is an earlier export
EXPORT_FILES = (
    "config.json",
    "generation_config.json",
    WEIGHTS,
    TOKENIZER_JSON,
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
)
GPT2_ENCODINGS = ("gpt2", "r50k_base")  # tiktoken's names for GPT-2's BPE (the same ids)


@dataclass
class ExportConfig:
    out_dir: str = "out-shakespeare"  # the folder train.py wrote its checkpoints to
    checkpoint: str = ""  # which file of out_dir: "" the best weights (best.pt, else ckpt.pt), "ckpt.pt" the latest
    dest: str = ""  # the folder to write (required): new, empty, or an earlier export, which is replaced
    dataset: str = ""  # nanoGPT character-level checkpoints only: the prepared dataset of their characters

    def __post_init__(self):
        if not self.dest:
            raise ValueError("--dest is required: the folder to write the Hugging Face model to, e.g. --dest=hf-model")


# -----------------------------------------------------------------------------
# The tokenizer


def byte_chars():
    """
    GPT-2's printable stand-in for each byte (its bytes_to_unicode): printable Latin-1 bytes are themselves, the
    others (space, control bytes...) take the characters from U+0100 on, in order; so a space is written 'Ġ'.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    stand_ins = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(stand_ins)) for b in range(256)]


def bpe_parts(ranks, token, max_rank):
    """token (bytes) split as BPE splits it using only the merges ranked below max_rank: lowest rank first."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while True:
        pairs = [(ranks.get(a + b, max_rank), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        rank, i = min(pairs, default=(max_rank, 0))
        if rank >= max_rank:
            return parts
        parts[i : i + 2] = [parts[i] + parts[i + 1]]


@functools.cache
def gpt2_bpe(encoding):
    """
    (vocab, merges) of GPT-2's BPE in its vocab.json / merges.txt form, recovered offline from tiktoken's encoding:
    vocab maps each token's printable form to its id; merges lists the pairs in rank order.
    """
    enc = tiktoken_encoding(encoding)
    # every ordinary token's bytes by id (the rank); the last id is <|endoftext|>
    ranks = {enc.decode_single_token_bytes(i): i for i in range(enc.n_vocab) if i != enc.eot_token}
    chars = byte_chars()

    def printable(b):
        return "".join(chars[x] for x in b)

    vocab = {printable(token): rank for token, rank in ranks.items()}
    vocab[END_OF_TEXT] = enc.eot_token
    merges = []
    # tiktoken keeps only ranks: the merge that made a token is how BPE splits it with the merges before it. For
    # GPT-2 that yields two parts for all 50,000 multi-byte tokens, GPT-2's merges.txt in its own order
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1:
            left, right = bpe_parts(ranks, token, rank)
            merges.append((printable(left), printable(right)))
    return vocab, merges


def gpt2_tokenizer_files(encoding, special, block_size):
    """
    (files, settings): tokenizer.json, vocab.json and merges.txt of GPT-2's byte-level BPE by file name, the special
    tokens past its ids (a chat template's markers) added; and tokenizer_config.json's settings.
    """
    vocab, merges = gpt2_bpe(encoding)
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=merges))
    # GPT-2's pre-tokenizer regex; tiktoken's r50k pattern splits the same (same ids on tiny Shakespeare whole)
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    tokenizer.post_processor = tokenizers.processors.ByteLevel(trim_offsets=False)
    # '<|endoftext|>' in a text is the end-of-text id, as GPT-2's tokenizer has it (tiktoken's encode_ordinary and
    # our Tokenizer keep it as text)
    tokenizer.add_special_tokens([tokenizers.AddedToken(END_OF_TEXT, special=True)])
    add_markers(tokenizer, special)
    settings = {
        "tokenizer_class": "GPT2Tokenizer",  # also for a Llama-layout model, whose own default would be Llama's
        "bos_token": END_OF_TEXT,
        "eos_token": END_OF_TEXT,
        "unk_token": END_OF_TEXT,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,  # decode gives tiktoken's text back, " ." and " 's" untouched
        "model_max_length": block_size,
    }
    files = {
        TOKENIZER_JSON: tokenizer.to_str(),
        "vocab.json": json.dumps(vocab, ensure_ascii=False),
        "merges.txt": "\n".join(["#version: 0.2", *(f"{a} {b}" for a, b in merges)]),
    }
    return files, settings


def huggingface_tokenizer_files(meta, block_size):
    """
    (files, settings): the dataset's tokenizer.json as it is, unless special tokens past its ids (the built-in chat
    template's markers) are added to it; and tokenizer_config.json's settings, naming its bos and eos.
    """
    text = meta["tokenizer"]["json"]
    tokenizer = tokenizers.Tokenizer.from_str(text)
    if add_markers(tokenizer, meta["special_tokens"]):
        text = tokenizer.to_str()
    return {TOKENIZER_JSON: text}, fast_tokenizer_settings(tokenizer, meta["special_tokens"], block_size)


def char_tokenizer_files(meta, block_size):
    """
    (files, settings): tokenizer.json of a character vocabulary, id i its i-th character, each character of a text
    looked up whole (WordLevel; one outside the list as char_unk) and ids decoded joined with nothing between (Fuse),
    the special tokens past the characters added; and tokenizer_config.json's settings.
    """
    chars, special = meta["tokenizer"]["chars"], meta["special_tokens"]
    vocab = {c: i for i, c in enumerate(chars)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token=char_unk(chars)))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = tokenizers.decoders.Fuse()
    add_markers(tokenizer, special)
    return {TOKENIZER_JSON: tokenizer.to_str()}, fast_tokenizer_settings(tokenizer, special, block_size)


def char_unk(chars):
    """
    The character that one outside a character vocabulary reads as in tokenizer.json: the space (else the first
    character), so that transformers, lm-eval and vLLM take any text, where our Tokenizer refuses it. It is named in
    tokenizer.json's model only: named as tokenizer_config.json's unk_token, it would be a special token to
    transformers, and decoding with skip_special_tokens (vLLM's default) would drop it from every text.
    """
    return " " if " " in chars else chars[0]


def add_markers(tokenizer, special):
    """
    Add the special tokens past tokenizer's ids (a chat template's markers) to it (a tokenizers.Tokenizer), each at its
    id, named as our Tokenizer decodes them ('<user>'); returns their names. ValueError if an id is not the next free
    one, which the file could not hold.
    """
    markers = sorted((i, f"<{name}>") for name, i in special.items() if i >= tokenizer.get_vocab_size())
    for i, marker in markers:
        if i != tokenizer.get_vocab_size():
            raise ValueError(
                f"cannot write the special token {marker} at id {i}: the tokenizer's next free id is "
                f"{tokenizer.get_vocab_size()}"
            )
        tokenizer.add_special_tokens([tokenizers.AddedToken(marker, special=True)])
    return [marker for _, marker in markers]


def fast_tokenizer_settings(tokenizer, special, block_size):
    """tokenizer_config.json's settings for a tokenizer.json that transformers reads as it is, naming bos and eos."""
    # decode gives the text back as it was: no spaces taken from before punctuation
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    for name in ("bos", "eos"):
        # a BPE trained by prepare_data.py has one end-of-text token, which is both, as GPT-2's
        token_id = special.get(name, special.get("eot"))
        if token_id is not None:
            settings[f"{name}_token"] = tokenizer.id_to_token(token_id)
    settings["model_max_length"] = block_size
    return settings


def tokenizer_files(meta, block_size):
    """
    (files by name, note): the Hugging Face tokenizer files of the dataset's tokenizer, tokenizer_config.json with a
    chat model's template; or for another tiktoken encoding than GPT-2's none, and a note saying where it is.
    """
    spec = meta["tokenizer"]
    if spec.get("type") == "tiktoken" and spec.get("encoding") in GPT2_ENCODINGS:
        files, settings = gpt2_tokenizer_files(spec["encoding"], meta["special_tokens"], block_size)
    elif spec.get("type") == "huggingface":
        files, settings = huggingface_tokenizer_files(meta, block_size)
    elif spec.get("type") == "char":
        files, settings = char_tokenizer_files(meta, block_size)
        note = (
            f"a character the vocabulary lacks reads as {char_unk(spec['chars'])!r} in transformers, lm-eval and vLLM "
            "(sample.py and serve.py refuse the text instead); llama.cpp's converter takes BPE and SentencePiece "
            "vocabularies only, not a character one: for a GGUF, train on GPT-2's BPE (dataset=shakespeare)"
        )
        files["tokenizer_config.json"] = json.dumps({**settings, **chat_settings(meta)}, indent=2)
        return files, note
    else:  # another tiktoken encoding: prepare_data.py writes none, but a checkpoint's meta may name one
        note = (
            f"no Hugging Face tokenizer written; the vocabulary {spec} is in config.json under {EXPORT_KEY}.meta, "
            "as in the checkpoint"
        )
        return {}, note
    files["tokenizer_config.json"] = json.dumps({**settings, **chat_settings(meta)}, indent=2)
    return files, None


def chat_settings(meta):
    """
    tokenizer_config.json's chat template of a chat model's meta ({} for another): the built-in template as Jinja
    (chat.BUILTIN_JINJA), its end of turn as eos_token, where transformers' generate and the engines stop a reply; a
    Hugging Face one as it is, with the special token strings it reads (bos_token, eos_token...).
    """
    chat = meta.get("chat")
    if chat is None:
        return {}
    if chat["template"] == "builtin":
        return {"chat_template": BUILTIN_JINJA, "eos_token": "<end_of_turn>"}
    return {**chat.get("tokens", {}), "chat_template": chat["template"]}


# -----------------------------------------------------------------------------
# The folder


def export(model, meta, dest):
    """
    Write model (a GPT) as a Hugging Face model folder dest, with the tokenizer of its dataset's meta where one
    converts; returns tokenizer_files' note. ValueError for a model no layout computes or a dest that is not free.
    """
    dest = Path(dest)
    check_dest(dest)
    c = model.config
    _, tensors, config = to_hf(model)
    special = meta["special_tokens"]
    # GPT-2's BPE has one end-of-text token, which is also where a text starts; a tokenizer.json names bos and eos
    eot = special.get("eot")
    ids = {
        "bos_token_id": special.get("bos", eot),
        "eos_token_id": special.get("eos", eot),
        "pad_token_id": c.pad_token_id,
    }
    files, note = tokenizer_files(meta, c.block_size)
    generation = {k: v for k, v in ids.items() if v is not None}
    if "chat" in meta:  # a reply ends at its end-of-turn token, as sample.py --chat ends it
        end_of_turn = list(ChatFormat.from_meta(meta).end_of_turn)
        generation["eos_token_id"] = end_of_turn[0] if len(end_of_turn) == 1 else end_of_turn
    # our settings in config.json: what was exported, and the data's meta that --init_from=FOLDER reads back
    if meta["tokenizer"].get("type") == "huggingface" and files.get(TOKENIZER_JSON) == meta["tokenizer"]["json"]:
        # its text is the file; where export added the chat markers to the file, the meta keeps the dataset's own
        meta = {**meta, "tokenizer": {"type": "huggingface", "file": TOKENIZER_JSON}}
    ours = {EXPORT_KEY: {"model_config": asdict(c), "meta": meta}}
    # the weights' dtype, under transformers 5's name and transformers 4's
    config = {**config, **ids, "dtype": "float32", "torch_dtype": "float32", "use_cache": True, **ours}
    files["config.json"] = json.dumps(config, indent=2)
    files["generation_config.json"] = json.dumps(generation, indent=2)
    write_folder(tensors, files, dest)
    return note


def engine_warnings(config):
    """
    Why llama.cpp (a GGUF) or SGLang would not run a model of ModelConfig config as trained, one line each ([] where
    both would; vLLM reads all): read from llama.cpp's convert_hf_to_gguf.py and src/models/gpt2.cpp and SGLang's
    models/gpt2.py (docs/export.md).
    """
    if hf_layout(config) != "gpt2":
        return []
    c, warnings = config, []
    if c.activation != "gelu_tanh":
        how = {"gelu": "close to it (each activation off by up to 5e-4), not the same"}.get(
            c.activation, "another model"
        )
        warnings.append(
            f"llama.cpp's and SGLang's GPT-2 compute tanh GELU whatever activation_function says: there this model's "
            f"activation={c.activation!r} would run as tanh GELU, {how}; for them, train with --activation=gelu_tanh "
            "or in the Llama layout"
        )
    if c.d_ff != 4 * c.n_embd:
        warnings.append(
            f"llama.cpp's GPT-2 converter writes the MLP as 4 x n_embd = {4 * c.n_embd} wide whatever n_inner says: "
            f"a GGUF of this model (d_ff={c.d_ff}) would not load, its MLP weights having another shape; for GGUF, "
            "train with the default d_ff or in the Llama layout"
        )
    if not c.tie_embeddings:
        warnings.append(
            "SGLang's GPT-2 ties the head to the embedding: there this model's own head (tie_embeddings=False) would "
            "be dropped; for SGLang, train with tied embeddings or in the Llama layout"
        )
    return warnings


def check_dest(dest):
    """ValueError unless dest is a folder export may write: absent, empty, or an earlier export (replaced)."""
    if dest.exists() and not dest.is_dir():
        raise ValueError(f"--dest={dest} is a file; give a folder to write the model to")
    if not dest.is_dir() or not any(dest.iterdir()):
        return
    names = sorted(p.name for p in dest.iterdir())
    others = [name for name in names if name not in EXPORT_FILES]
    try:
        earlier = EXPORT_KEY in json.loads((dest / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        earlier = False
    if others or not earlier:
        shown = ", ".join((others or names)[:3]) + (", ..." if len(others or names) > 3 else "")
        raise ValueError(
            f"--dest={dest} is not empty and not an earlier export (it holds {shown}); give a new or empty folder"
        )


def write_folder(tensors, files, dest):
    """
    Write the weights (as model.safetensors) and the files into folder dest atomically: a hidden folder beside it,
    renamed into place once complete, so that a failure leaves dest as it was (absent, or the earlier export).
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    # beside dest (a rename is atomic only within one file system), named apart from another export's; made by
    # mkdir rather than tempfile.mkdtemp, whose private mode (0700) the renamed folder would keep
    tmp = dest.parent / f".{dest.name}.{secrets.token_hex(4)}.tmp"
    tmp.mkdir()
    try:
        for name, text in files.items():
            # tokenizer.json byte for byte as the dataset holds it, so that reading it back gives the same tokenizer
            # (train.py compares them); the texts made here lack their last line's end
            # newline="": no "\r\n" on Windows either
            (tmp / name).write_text(text if name == TOKENIZER_JSON else text + "\n", encoding="utf-8", newline="")
        # format "pt", as save_pretrained writes it: transformers refuses a file that names another framework
        save_file(tensors, tmp / WEIGHTS, metadata={"format": "pt"})
        # safetensors writes its file private (0600); it gets the mode the other files got from the umask
        (tmp / WEIGHTS).chmod((tmp / "config.json").stat().st_mode)
        move_into_place(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # there only when something failed before the rename


# -----------------------------------------------------------------------------
# The command line


def main(cfg, out=None):
    """Export out_dir's checkpoint to the folder cfg.dest; print what was written to out (None: stdout)."""
    out = sys.stdout if out is None else out  # looked up now, not at import: tests may replace it
    dest = Path(cfg.dest).expanduser()
    check_dest(dest)  # before the slow load: a wrong --dest fails at once
    replacing = dest.is_dir() and any(dest.iterdir())  # an earlier export, which check_dest let through
    path = run_checkpoint(cfg.out_dir, cfg.checkpoint)
    ckpt = load_checkpoint(path, map_location="cpu")
    try:
        # the layout is checked on the settings alone, before any model is built
        layout = hf_layout(ModelConfig.from_dict(ckpt["model_config"]))
        model = model_from_checkpoint(ckpt, path.parent)
    except (KeyError, TypeError, RuntimeError) as err:  # a missing entry, or weights that do not fit
        raise ValueError(f"{path} does not hold a usable model ({type(err).__name__}: {err})") from None
    # nanoGPT's character-level checkpoints take their characters from the dataset named, as in sample.py
    named = load_meta(dataset_dir(cfg.dataset)) if cfg.dataset else None
    meta = ckpt["meta"] or nanogpt_meta(ckpt, path, named, "name a prepared dataset with --dataset")
    note = export(model, meta, dest)
    architecture = {"gpt2": "GPT2LMHeadModel", **LLAMA_FAMILIES}[layout]
    kind = f"{architecture} ({'GPT-2' if layout == 'gpt2' else layout.capitalize()} layout)"
    files = ", ".join(sorted(p.name for p in dest.iterdir()))
    said = "replaced the earlier export in" if replacing else "wrote"
    print(f"{said} {dest}: {kind}, {model.num_params():,} parameters; {files}", file=out)
    if note:
        print(f"note: {note}", file=out)
    for warning in engine_warnings(model.config):
        print(f"warning: {warning}", file=out)


def cli(argv):
    """The command line; returns the exit status: 2 with a one-line message for bad input."""
    try:
        main(parse_config(ExportConfig, argv))
    except (ValueError, OSError) as err:
        print(f"export.py: error: {' '.join(str(err).splitlines())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line; the folder is written aside and renamed in whole (write_folder)
        print("export.py: interrupted; no half-written export is left", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
