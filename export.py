"""
Export a GPT checkpoint of train.py as a Hugging Face model folder, the reverse of GPT.from_pretrained:

    python export.py --out_dir=out-shakespeare --checkpoint=best.pt --dest=hf-shakespeare

The folder holds config.json, model.safetensors (float32) and generation_config.json, plus the tokenizer where
one converts: GPT-2's BPE (tokenizer.json, vocab.json, merges.txt) or the dataset's own tokenizer.json. Then
transformers.AutoModelForCausalLM.from_pretrained("hf-shakespeare") gives the same logits as our model.

Two layouts, picked by pos_encoding:
    learned -> GPT2LMHeadModel: LayerNorm, GELU (exact or tanh), every head reads its own keys, tied head.
    rope    -> LlamaForCausalLM: RMSNorm, SwiGLU, grouped-query attention, tied or untied head, biases or not.
Options that neither computes (post-norm, qk_norm, a soft-cap, a window...) are a one-line error naming each.
This file writes JSON and safetensors itself: transformers is not needed to export, only to load.
"""

import functools
import json
import secrets
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import tokenizers
import torch
from safetensors.torch import save_file

from checkpoint import load_checkpoint, model_from_checkpoint, move_into_place
from config import parse_config
from model import ModelConfig, gpt2_names
from tokens import TOKENIZER_JSON, tiktoken_encoding

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
MARKER = "nanoformer"  # config.json's key holding our own settings; it marks a folder as an export of this script
GPT2_ENCODINGS = ("gpt2", "r50k_base")  # tiktoken's names for GPT-2's BPE (the same ids)
END_OF_TEXT = "<|endoftext|>"
# the two layouts in ModelConfig terms, for the message that refuses a model fitting neither
LAYOUTS = (
    "Exported are GPT-2's layout (pos_encoding='learned', norm='layernorm', activation 'gelu' or 'gelu_tanh', "
    "n_kv_head=n_head, tie_embeddings=True) and Llama's (pos_encoding='rope', norm='rmsnorm', activation='swiglu', "
    "any n_kv_head, tied or not), both pre-norm without qk_norm, logit_softcap or window_size"
)


@dataclass
class ExportConfig:
    out_dir: str = "out-shakespeare"  # the folder train.py wrote its checkpoints to
    checkpoint: str = "ckpt.pt"  # which file of out_dir: "ckpt.pt" (the latest) or "best.pt" (the lowest val loss)
    dest: str = ""  # the folder to write (required): new, empty, or an earlier export, which is replaced

    def __post_init__(self):
        if not self.dest:
            raise ValueError("--dest is required: the folder to write the Hugging Face model to, e.g. --dest=hf-model")


# -----------------------------------------------------------------------------
# Which layout, if any, computes the model


def hf_layout(config):
    """
    "gpt2" or "llama": the Hugging Face layout that computes exactly what a model of this ModelConfig does.
    ValueError naming every option that stops it, in one line: each needs retraining, so all are named at once.
    Options that change nothing in a GPT's forward (dropout, zero_init_proj, share_embeddings, pad_token_id,
    n_encoder_layer) export as they are.
    """
    c = config
    if c.arch != "gpt":  # nothing else matters then
        raise ValueError(
            f"cannot export arch={c.arch!r}: only a decoder-only GPT is a causal LM (GPT2LMHeadModel, LlamaForCausalLM)"
        )
    # the positions pick the layout; the rest of the model must then be that layout's
    layout = {"learned": "gpt2", "rope": "llama"}.get(c.pos_encoding)
    checks = [  # (option, refused, why)
        ("norm_position", c.norm_position != "pre", "GPT-2 and Llama both normalise inside the residual branch"),
        ("pos_encoding", layout is None, "GPT-2 learns its positions and Llama rotates q and k"),
        ("qk_norm", c.qk_norm, "neither GPT-2 nor Llama normalises queries and keys"),
        ("logit_softcap", c.logit_softcap > 0, "neither GPT-2 nor Llama caps its logits"),
        ("window_size", c.window_size > 0, "GPT-2 and Llama attend to every earlier position"),
    ]
    if layout == "gpt2":
        checks += [
            ("norm", c.norm != "layernorm", "the GPT-2 layout that learned positions pick has LayerNorm"),
            (
                "activation",
                c.activation not in ("gelu", "gelu_tanh"),
                "the GPT-2 layout that learned positions pick has GELU",
            ),
            (
                "n_kv_head",
                c.n_kv_head != c.n_head,
                f"GPT-2 has no grouped-query attention: n_kv_head must be n_head={c.n_head}",
            ),
            ("tie_embeddings", not c.tie_embeddings, "GPT-2's head is its token embedding"),
        ]
    elif layout == "llama":
        checks += [
            ("norm", c.norm != "rmsnorm", "the Llama layout that rotary positions pick has RMSNorm"),
            ("activation", c.activation != "swiglu", "the Llama layout that rotary positions pick has SwiGLU"),
        ]
    refused = [f"{name}={getattr(c, name)!r}: {why}" for name, stops, why in checks if stops]
    if refused:
        raise ValueError(f"cannot export {'; '.join(refused)}. {LAYOUTS}")
    return layout


# -----------------------------------------------------------------------------
# config.json and the weights, in each layout


def gpt2_config(c):
    """config.json's GPT-2 settings for ModelConfig c (see GPT2Config)."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": c.vocab_size,  # the model's (50304 when padded), not the tokenizer's: the logits keep their size
        "n_positions": c.block_size,
        "n_ctx": c.block_size,  # what llama.cpp's converter reads; transformers reads n_positions
        "n_embd": c.n_embd,
        "n_layer": c.n_layer,
        "n_head": c.n_head,
        "n_inner": c.d_ff,
        # our "gelu" is the exact erf GELU, transformers' "gelu"; "gelu_new" is GPT-2's tanh approximation
        "activation_function": {"gelu": "gelu", "gelu_tanh": "gelu_new"}[c.activation],
        "layer_norm_epsilon": c.norm_eps,
        # GPT-2 drops out where we do: the embeddings, the attention probabilities, each residual branch
        "embd_pdrop": c.dropout,
        "attn_pdrop": c.dropout,
        "resid_pdrop": c.dropout,
        "tie_word_embeddings": True,
    }


def llama_config(c):
    """config.json's Llama settings for ModelConfig c (see LlamaConfig), as load_llama reads them back."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.n_embd,
        "intermediate_size": c.d_ff,
        "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head,
        "num_key_value_heads": c.n_kv_head,
        "head_dim": c.n_embd // c.n_head,
        "hidden_act": "silu",
        "max_position_embeddings": c.block_size,
        "rms_norm_eps": c.norm_eps,
        # rope_theta at the top level for transformers 4 and llama.cpp, rope_parameters for transformers 5
        "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        # one bias flag covers all our Linears: the attention's four and the MLP's three
        "attention_bias": c.bias,
        "mlp_bias": c.bias,
        "attention_dropout": c.dropout,  # Llama has no other dropout; it changes nothing at inference
        "tie_word_embeddings": c.tie_embeddings,
    }


def owned(t):
    """A float32, contiguous copy of t: safetensors refuses views sharing memory (split q, k, v; the tied head)."""
    return t.detach().to(torch.float32).clone(memory_format=torch.contiguous_format)


def gpt2_weights(c, state):
    """Our state dict as GPT2LMHeadModel's tensors (the tied head left out, as save_pretrained does)."""
    hf = {}
    for theirs, ours in gpt2_names(c.n_layer, bias=True).items():
        if ours in state:
            tensor = state[ours]
        else:  # GPT-2 always has biases: a bias=False model's are zero, which adds nothing
            tensor = torch.zeros(state[ours.removesuffix("bias") + "weight"].size(0))
        if theirs.endswith(".weight") and any(conv in theirs for conv in ("c_attn", "c_proj", "c_fc")):
            tensor = tensor.t()  # HF's Conv1D stores (in, out), nn.Linear (out, in)
        hf[f"transformer.{theirs}"] = tensor
    return {name: owned(t) for name, t in hf.items()}


def llama_weights(c, state):
    """Our state dict as LlamaForCausalLM's tensors (a tied head left out, as save_pretrained does)."""
    hf = {"model.embed_tokens.weight": state["body.wte.weight"], "model.norm.weight": state["body.norm.weight"]}
    if not c.tie_embeddings:
        hf["lm_head.weight"] = state["lm_head.weight"]
    kv_dim = c.n_kv_head * (c.n_embd // c.n_head)
    for i in range(c.n_layer):
        hf_layer, ours = f"model.layers.{i}", f"body.blocks.{i}"
        hf[f"{hf_layer}.input_layernorm.weight"] = state[f"{ours}.norm1.weight"]
        hf[f"{hf_layer}.post_attention_layernorm.weight"] = state[f"{ours}.norm2.weight"]
        for p in ("weight", "bias") if c.bias else ("weight",):
            # qkv's rows are [W_q (H*D); W_k; W_v (n_kv_head*D each)], head h at rows h*D:(h+1)*D in both layouts,
            # and both rotate the channel pairs (i, i + D/2) (transformers' rotate_half): no row moves
            q, k, v = state[f"{ours}.attn.qkv.{p}"].split([c.n_embd, kv_dim, kv_dim])
            hf[f"{hf_layer}.self_attn.q_proj.{p}"] = q
            hf[f"{hf_layer}.self_attn.k_proj.{p}"] = k
            hf[f"{hf_layer}.self_attn.v_proj.{p}"] = v
            hf[f"{hf_layer}.self_attn.o_proj.{p}"] = state[f"{ours}.attn.proj.{p}"]
            hf[f"{hf_layer}.mlp.gate_proj.{p}"] = state[f"{ours}.mlp.fc.{p}"]  # SwiGLU's gate, under the SiLU
            hf[f"{hf_layer}.mlp.up_proj.{p}"] = state[f"{ours}.mlp.up.{p}"]
            hf[f"{hf_layer}.mlp.down_proj.{p}"] = state[f"{ours}.mlp.proj.{p}"]
    return {name: owned(t) for name, t in hf.items()}


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


def gpt2_tokenizer_files(encoding, block_size):
    """tokenizer.json, vocab.json, merges.txt and tokenizer_config.json of GPT-2's byte-level BPE, by file name."""
    vocab, merges = gpt2_bpe(encoding)
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=merges))
    # GPT-2's pre-tokenizer regex; tiktoken's r50k pattern splits the same (same ids on tiny Shakespeare whole)
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    tokenizer.post_processor = tokenizers.processors.ByteLevel(trim_offsets=False)
    # '<|endoftext|>' in a text is the end-of-text id, as GPT-2's tokenizer has it (tiktoken's encode_ordinary and
    # our Tokenizer keep it as text)
    tokenizer.add_special_tokens([tokenizers.AddedToken(END_OF_TEXT, special=True)])
    settings = {
        "tokenizer_class": "GPT2Tokenizer",  # also for a Llama-layout model, whose own default would be Llama's
        "bos_token": END_OF_TEXT,
        "eos_token": END_OF_TEXT,
        "unk_token": END_OF_TEXT,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,  # decode gives tiktoken's text back, " ." and " 's" untouched
        "model_max_length": block_size,
    }
    return {
        TOKENIZER_JSON: tokenizer.to_str(),
        "vocab.json": json.dumps(vocab, ensure_ascii=False),
        "merges.txt": "\n".join(["#version: 0.2", *(f"{a} {b}" for a, b in merges)]),
        "tokenizer_config.json": json.dumps(settings, indent=2),
    }


def huggingface_tokenizer_files(meta, block_size):
    """The dataset's tokenizer.json as it is, and a tokenizer_config.json naming its bos and eos."""
    spec, special = meta["tokenizer"], meta["special_tokens"]
    tokenizer = tokenizers.Tokenizer.from_str(spec["json"])
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    for name in ("bos", "eos"):
        if name in special:
            settings[f"{name}_token"] = tokenizer.id_to_token(special[name])
    settings["model_max_length"] = block_size
    return {TOKENIZER_JSON: spec["json"], "tokenizer_config.json": json.dumps(settings, indent=2)}


def tokenizer_files(meta, block_size):
    """
    (files by name, note): the Hugging Face tokenizer files of the dataset's tokenizer, or none and a one-line note
    saying where the vocabulary is (a character vocabulary has no Hugging Face tokenizer).
    """
    spec = meta["tokenizer"]
    if spec.get("type") == "tiktoken" and spec.get("encoding") in GPT2_ENCODINGS:
        return gpt2_tokenizer_files(spec["encoding"], block_size), None
    if spec.get("type") == "huggingface":
        return huggingface_tokenizer_files(meta, block_size), None
    if spec.get("type") == "char":
        what = f"the {len(spec['chars'])}-character vocabulary (id i is its i-th character)"
    else:  # another tiktoken encoding: prepare_data.py writes none, but a checkpoint's meta may name one
        what = f"the vocabulary {spec}"
    return {}, f"no Hugging Face tokenizer written; {what} is in config.json under {MARKER}.meta, as in the checkpoint"


# -----------------------------------------------------------------------------
# The folder


def hf_files(model, meta):
    """
    (tensors, files, note) of the Hugging Face folder for model (a GPT) and its dataset's meta: the weights by
    their Hugging Face names, the other files' text by name, and tokenizer_files' note (or None).
    ValueError from hf_layout for a model neither layout computes.
    """
    c = model.config
    layout = hf_layout(c)
    state = model.state_dict()
    tensors = gpt2_weights(c, state) if layout == "gpt2" else llama_weights(c, state)
    special = meta["special_tokens"]
    # GPT-2's BPE has one end-of-text token, which is also where a text starts; a tokenizer.json names bos and eos
    eot = special.get("eot")
    ids = {
        "bos_token_id": special.get("bos", eot),
        "eos_token_id": special.get("eos", eot),
        "pad_token_id": c.pad_token_id,
    }
    files, note = tokenizer_files(meta, c.block_size)
    # our settings in config.json: what was exported, and the vocabulary where no tokenizer file holds it
    if meta["tokenizer"].get("type") == "huggingface":
        meta = {**meta, "tokenizer": {"type": "huggingface", "file": TOKENIZER_JSON}}  # its text is the file
    ours = {MARKER: {"model_config": asdict(c), "meta": meta}}
    config = gpt2_config(c) if layout == "gpt2" else llama_config(c)
    # the weights' dtype, under transformers 5's name and transformers 4's
    config = {**config, **ids, "dtype": "float32", "torch_dtype": "float32", "use_cache": True, **ours}
    files["config.json"] = json.dumps(config, indent=2)
    files["generation_config.json"] = json.dumps({k: v for k, v in ids.items() if v is not None}, indent=2)
    return tensors, files, note


def check_dest(dest):
    """ValueError unless dest is a folder export may write: absent, empty, or an earlier export (replaced)."""
    if dest.exists() and not dest.is_dir():
        raise ValueError(f"--dest={dest} is a file; give a folder to write the model to")
    if not dest.is_dir() or not any(dest.iterdir()):
        return
    names = sorted(p.name for p in dest.iterdir())
    others = [name for name in names if name not in EXPORT_FILES]
    try:
        earlier = MARKER in json.loads((dest / "config.json").read_text(encoding="utf-8"))
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
            (tmp / name).write_text(text + "\n", encoding="utf-8")  # each text without its last line's end
        # format "pt", as save_pretrained writes it: transformers refuses a file that names another framework
        save_file(tensors, tmp / WEIGHTS, metadata={"format": "pt"})
        # safetensors writes its file private (0600); it gets the mode the other files got from the umask
        (tmp / WEIGHTS).chmod((tmp / "config.json").stat().st_mode)
        move_into_place(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # there only when something failed before the rename


def export(model, meta, dest):
    """
    Write model (a GPT) as a Hugging Face model folder dest, with the tokenizer of its dataset's meta
    where one converts. Returns None, or the line saying why no tokenizer was written and where the vocabulary is.
    ValueError for a model neither layout computes or a dest that is not free; nothing is written then.
    """
    dest = Path(dest)
    check_dest(dest)
    tensors, files, note = hf_files(model, meta)
    write_folder(tensors, files, dest)
    return note


# -----------------------------------------------------------------------------
# The command line


def main(cfg, out=None):
    """Export out_dir's checkpoint to the folder cfg.dest; print what was written to out (None: stdout)."""
    out = sys.stdout if out is None else out  # looked up now, not at import: tests may replace it
    dest = Path(cfg.dest).expanduser()
    check_dest(dest)  # before the slow load: a wrong --dest fails at once
    path = Path(cfg.out_dir).expanduser() / cfg.checkpoint
    ckpt = load_checkpoint(path, map_location="cpu")
    try:
        # the layout is checked on the settings alone, before any model is built
        layout = hf_layout(ModelConfig.from_dict(ckpt["model_config"]))
        model, meta = model_from_checkpoint(ckpt), ckpt["meta"]
    except (KeyError, TypeError, RuntimeError) as err:  # a missing entry, or weights that do not fit
        raise ValueError(f"{path} does not hold a usable model ({type(err).__name__}: {err})") from None
    note = export(model, meta, dest)
    kind = {"gpt2": "GPT2LMHeadModel (GPT-2 layout)", "llama": "LlamaForCausalLM (Llama layout)"}[layout]
    files = ", ".join(sorted(p.name for p in dest.iterdir()))
    print(f"wrote {dest}: {kind}, {model.num_params():,} parameters; {files}", file=out)
    if note:
        print(f"note: {note}", file=out)


def cli(argv):
    """The command line; returns the exit status: 2 with a one-line message for bad input."""
    try:
        main(parse_config(ExportConfig, argv))
    except (ValueError, OSError) as err:
        print(f"error: {' '.join(str(err).splitlines())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
