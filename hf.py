"""
Hugging Face weights, both ways: a GPT from a Hugging Face folder or hub id (GPT-2, Llama 1-3, Mistral,
Qwen2/Qwen2.5, Qwen3), and a GPT as the tensors and config.json of a Hugging Face folder (GPT-2, Llama, Qwen2 or
Qwen3 layout), and nanoGPT's checkpoints with GPT-2's names (load_nanogpt, for checkpoint.load_checkpoint).

    model = from_pretrained("gpt2")                        # a hub id, or a folder written by save_pretrained
    model = from_pretrained("/models/TinyLlama-1.1B", block_size=512, dropout=0.1)
    layout, tensors, config = to_hf(model)                 # what export.py writes as a folder

Each family has one name map, used to load and to export, so that the two cannot drift apart: gpt2_names (GPT-2's
and nanoGPT's names -> ours) and llama_names (our names -> the tensors each is made of, for Llama and the families
that share its names: Mistral, Qwen2, Qwen3). export.py is the command line that writes a folder; this file reads
none but config.json and the weights.
"""

import json
import math
import os
import socket
from dataclasses import fields
from pathlib import Path

import torch

import tokens
from model import GPT, ROPE_SCALING_KEYS, ModelConfig

# config.json's entry of what export.py keeps of a checkpoint (its model settings and the meta of its data)
EXPORT_KEY = "nanoformer"
# the hub's address, and how long a connection to it may take before the hub counts as unreachable
HUB, HUB_SECONDS = ("huggingface.co", 443), 3.0

# -----------------------------------------------------------------------------
# A Hugging Face folder: from the hub, its weights


def hub_unreachable():
    """
    Why the Hugging Face hub cannot be reached from here, in a few words, or "" when it can: HF_HUB_OFFLINE set, or
    no connection to it within HUB_SECONDS. Asked first, so that a machine without the network is told at once where
    huggingface_hub would retry for most of a minute, logging each try.
    """
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    try:
        socket.create_connection(HUB, timeout=HUB_SECONDS).close()
    except OSError as e:
        return f"no connection to {HUB[0]}: {e.strerror or type(e).__name__}"
    return ""


def download_from_hub(name):
    """Download config.json and the safetensors weights of a hub id; FileNotFoundError saying what to pass offline."""
    unreachable = hub_unreachable()
    try:
        if unreachable:
            raise ConnectionError(unreachable)
        from huggingface_hub import snapshot_download

        # the safetensors weights: one file, or an index and its shards
        patterns = ["config.json", "tokenizer.json", *WEIGHT_FILES[:2], "model-*.safetensors"]
        return Path(snapshot_download(name, allow_patterns=patterns))
    except Exception as e:
        raise FileNotFoundError(
            f"could not load {name!r}: it is not a local directory and the Hugging Face hub is unreachable "
            f"({unreachable or type(e).__name__}). Pass a directory holding config.json and model.safetensors "
            f"(e.g. one saved by transformers' save_pretrained)"
        ) from None


# Where save_pretrained puts the weights, tried in this order: one file, or an index whose "weight_map" names the
# shard holding each tensor (a model larger than max_shard_size)
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def read_state_dict(path):
    """The tensors of a Hugging Face model directory, from the first of WEIGHT_FILES that it has."""
    name = next((name for name in WEIGHT_FILES if (path / name).is_file()), None)
    if name is None:
        raise FileNotFoundError(f"{path} has no weights: none of {', '.join(WEIGHT_FILES)} is there")
    shards = [name]
    if name.endswith(".index.json"):
        weight_map = json.loads((path / name).read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{path / name} has no weight_map: it is not an index written by save_pretrained")
        shards = sorted(set(weight_map.values()))
        absent = [shard for shard in shards if not (path / shard).is_file()]
        if absent:
            raise FileNotFoundError(f"{path} lacks {len(absent)} of the shards {name} names, e.g. {absent[0]}")
    state = {}
    for shard in shards:
        if shard.endswith(".safetensors"):
            from safetensors.torch import load_file

            state.update(load_file(str(path / shard)))
        else:
            state.update(torch.load(path / shard, map_location="cpu", weights_only=True))
    return state


# -----------------------------------------------------------------------------
# Reading a model folder: its config.json, and the meta of the text its model reads


def folder_config(folder):
    """The config.json of a Hugging Face model folder, as a dict; a missing or malformed file raises one line."""
    path = Path(folder).expanduser() / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path.parent} has no config.json: pass a directory written by transformers' save_pretrained"
        )
    config = tokens.read_json(path, missing="")
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a model config (a JSON object)")
    return config


def pretrained_meta(folder):
    """
    The meta (kind, tokenizer, vocab_size, special_tokens) of the text a Hugging Face model folder's model reads: an
    export's (exported_meta), else its tokenizer.json's, else for a GPT-2 GPT-2's BPE; FileNotFoundError else.
    """
    folder = Path(folder).expanduser()
    config = folder_config(folder)
    model_type = config.get("model_type")
    if model_type is None:  # most likely a train.py out_dir, which holds a config.json of its own
        raise ValueError(
            f"{folder} is not a Hugging Face model folder (its config.json has no model_type); "
            f"a folder train.py wrote is read with --init_from=resume --out_dir={folder}"
        )
    # before the folder's tokenizer.json, which export.py converted from it: a character vocabulary reads from its
    # list, and GPT-2's BPE exactly as it was trained, through tiktoken
    if EXPORT_KEY in config:
        return exported_meta(folder, config[EXPORT_KEY])
    if (folder / tokens.TOKENIZER_JSON).is_file():
        return {"kind": "lm", **tokens.huggingface_tokenizer(folder)}
    if model_type == "gpt2":
        return tokens.GPT2_META
    raise FileNotFoundError(
        f"{folder} has no {tokens.TOKENIZER_JSON}, which a {model_type} model needs to read and write text: "
        f"put the model's {tokens.TOKENIZER_JSON} (from the same Hugging Face repository) in the folder"
    )


def exported_meta(folder, ours):
    """
    The meta of the data an exported model was trained on: `ours`, config.json's EXPORT_KEY entry in folder, holds
    it as the checkpoint did, except a tokenizer.json's text, which is the folder's file ({"type": "huggingface",
    "file": "tokenizer.json"}) and is read back here, byte for byte as the dataset stored it.
    """
    where = f"{folder / 'config.json'} ({EXPORT_KEY}.meta)"
    meta = ours.get("meta") if isinstance(ours, dict) else None
    if not isinstance(meta, dict) or any(key not in meta for key in ("tokenizer", "vocab_size", "special_tokens")):
        raise ValueError(f"{where} lacks the tokenizer, vocab_size or special_tokens export.py writes; export again")
    spec = meta["tokenizer"]
    if not (isinstance(spec, dict) and spec.get("type") == "huggingface" and "file" in spec):
        return meta
    # only a name within the folder: the meta names the file export.py wrote beside it
    file = folder / Path(spec["file"]).name
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{file} not found: {where} says the model reads it; copy the exported folder whole"
        ) from None
    except UnicodeDecodeError:
        raise ValueError(f"{file} is not UTF-8 text, so not a {tokens.TOKENIZER_JSON}") from None
    # a damaged file is named now, not by the Tokenizer of a later step
    tokens.parse_tokenizer_json(text, file)
    return {**meta, "tokenizer": {"type": "huggingface", "json": text}}


# -----------------------------------------------------------------------------
# Loading: a GPT from Hugging Face weights


def from_pretrained(name_or_path, **overrides):
    """
    A GPT holding weights in the Hugging Face layout, from a local directory (as save_pretrained writes it) or, when
    online, a hub id such as "gpt2". The directory holds config.json and model.safetensors, or pytorch_model.bin, or
    either sharded (read_state_dict). config.json's model_type picks the mapping, and its settings the ModelConfig
    (gpt2_model_config; llama_model_config for llama, mistral, qwen2 and qwen3), refusing what ours cannot compute.
    overrides: ModelConfig fields to change, e.g. dropout=0.1 or block_size=256 for fine-tuning; block_size may be
    shorter than the trained positions, not longer.
    """
    path, hf = read_hf_config(name_or_path)
    return PRETRAINED_LOADERS[hf["model_type"]](path, hf, overrides)


# the sizes of OpenAI's GPT-2 checkpoints on the hub (their config.json: n_layer, n_head, n_embd), so that a run from
# one can be planned offline; vocabulary and positions are GPT-2's 50,257 and 1,024
GPT2_HUB_SIZES = {
    "gpt2": {"n_layer": 12, "n_head": 12, "n_embd": 768},
    "gpt2-medium": {"n_layer": 24, "n_head": 16, "n_embd": 1024},
    "gpt2-large": {"n_layer": 36, "n_head": 20, "n_embd": 1280},
    "gpt2-xl": {"n_layer": 48, "n_head": 25, "n_embd": 1600},
}


def pretrained_config(name_or_path, **overrides):
    """
    The ModelConfig from_pretrained would build for a folder, from its config.json alone (no weights read), or for
    one of OpenAI's GPT-2 hub ids (GPT2_HUB_SIZES) without going online.
    """
    if not Path(name_or_path).is_dir() and str(name_or_path) in GPT2_HUB_SIZES:
        hf = {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024, **GPT2_HUB_SIZES[str(name_or_path)]}
        return gpt2_model_config(hf, name_or_path, overrides)
    path, hf = read_hf_config(name_or_path)
    read = gpt2_model_config if hf["model_type"] == "gpt2" else llama_model_config
    return read(hf, path, overrides)


def read_hf_config(name_or_path):
    """(path, folder_config) of a folder or hub id; ValueError unless from_pretrained reads its model_type."""
    path = Path(name_or_path)
    if not path.is_dir():
        path = download_from_hub(str(name_or_path))
    hf = folder_config(path)
    model_type = hf.get("model_type")
    if model_type not in PRETRAINED_LOADERS:
        raise ValueError(
            f"{path} holds a model_type={model_type!r} model; from_pretrained loads {', '.join(PRETRAINED_LOADERS)}"
        )
    return path, hf


def check_head(config, tied, path):
    """
    ValueError where config ties a head that folder path keeps apart (tied: its config.json's tie_word_embeddings):
    the head would be dropped (a tied head may be untied: load_checked).
    """
    if config.tie_embeddings and not tied:
        raise ValueError(
            f"{path} has a head of its own (tie_word_embeddings=false): tie_embeddings=True would drop it; "
            f"leave tie_embeddings as the folder has it"
        )


def check_block_size(config, positions, path):
    """ValueError when the (overridden) block_size is longer than the positions the checkpoint was trained with."""
    if config.block_size > positions:
        raise ValueError(
            f"block_size={config.block_size} is longer than the {positions} positions "
            f"{path} was trained with; use block_size <= {positions}"
        )


def check_names(path, kind, expected, found, source="config.json"):
    """ValueError naming the first few missing and unexpected tensors, unless `found` has just the `expected` ones."""
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{path} does not hold {kind} weights that match its {source}: missing {missing[:5]} "
            f"({len(missing)} in all), unexpected {unexpected[:5]} ({len(unexpected)} in all)"
        )


def load_checked(model, state, path):
    """
    model holding the tensors of state (our names), all checked first so that a mismatch loads nothing. A state
    without lm_head.weight (a tied head, which save_pretrained leaves out) has wte there: the tied head is a
    state_dict key of its own, and tie_embeddings=False starts it as a copy of wte.
    """
    state.setdefault("lm_head.weight", state["body.wte.weight"])
    expected = model.state_dict()
    # the names differ only when the overrides change the architecture, e.g. pos_encoding or qk_norm
    differ = sorted(set(expected) ^ set(state))
    if differ:
        raise ValueError(
            f"the overrides change which weights the model has ({', '.join(differ[:3])}), so {path} does not fit it; "
            f"override only fields that keep the weights, such as dropout or block_size"
        )
    wrong = [
        f"{k} is {tuple(v.shape)} where the model has {tuple(expected[k].shape)}"
        for k, v in state.items()
        if v.shape != expected[k].shape
    ]
    if wrong:
        raise ValueError(f"{path}: {len(wrong)} tensors do not have the shapes config.json implies, e.g. {wrong[0]}")
    model.load_state_dict(state, strict=True)
    return model


# -----------------------------------------------------------------------------
# GPT-2 (and nanoGPT, whose names are GPT-2's)


def gpt2_names(n_layer, bias, tied=True):
    """
    GPT-2's parameter names, as GPT2LMHeadModel and nanoGPT write them (without their "transformer." prefix) -> ours.
    The stacked c_attn maps onto qkv as it is: both hold q, k, v in that order. bias False: nanoGPT's bias=False.
    lm_head is listed only when untied (tie_word_embeddings false); a tied head is wte.
    """
    names = {"wte.weight": "body.wte.weight", "wpe.weight": "body.wpe.weight", "ln_f.weight": "body.norm.weight"}
    if bias:
        names["ln_f.bias"] = "body.norm.bias"
    if not tied:
        names["lm_head.weight"] = "lm_head.weight"
    for i in range(n_layer):
        for theirs, ours in [
            ("ln_1", "norm1"),
            ("attn.c_attn", "attn.qkv"),
            ("attn.c_proj", "attn.proj"),
            ("ln_2", "norm2"),
            ("mlp.c_fc", "mlp.fc"),
            ("mlp.c_proj", "mlp.proj"),
        ]:
            for p in ("weight", "bias") if bias else ("weight",):
                names[f"h.{i}.{theirs}.{p}"] = f"body.blocks.{i}.{ours}.{p}"
    return names


def conv1d_weight(hf_name):
    """Whether GPT-2 stores tensor hf_name as a Conv1D weight: (in, out), the transpose of nn.Linear's (out, in)."""
    return hf_name.endswith(".weight") and any(conv in hf_name for conv in ("c_attn", "c_proj", "c_fc"))


# GPT-2's activation_function (transformers' ACT2FN names) -> our activation. OpenAI's GPT-2 uses the tanh
# approximation ("gelu_new", also spelled "gelu_pytorch_tanh" and "gelu_fast"); "gelu" is the exact erf GELU.
GPT2_ACTIVATIONS = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu": "gelu",
    "gelu_python": "gelu",
    "relu": "relu",
    "relu2": "relu2",
}
# ours -> the name gpt2_config writes: the first of the above for each (the same map, read backwards)
GPT2_ACTIVATION_NAMES = {ours: theirs for theirs, ours in reversed(GPT2_ACTIVATIONS.items())}


def gpt2_model_config(hf, path, overrides):
    """
    The ModelConfig of GPT-2's config.json hf (in folder path), with the caller's overrides of any field. Every
    GPT2Config field that changes what GPT2LMHeadModel computes is read here or refused; scale_attn_weights and
    scale_attn_by_inverse_layer_idx are a factor on the attention scores, which load_gpt2 folds into the query
    weights; reorder_and_upcast_attn computes the same scores in float32, as we do. The dropouts act in training
    only and are not read: dropout is 0 unless overridden.
    """
    activation = GPT2_ACTIVATIONS.get(hf.get("activation_function", "gelu_new"))
    if activation is None:
        raise ValueError(
            f"{path}: activation_function={hf['activation_function']!r} is not implemented; "
            f"GPT-2 here runs {', '.join(GPT2_ACTIVATIONS)}"
        )
    if hf.get("add_cross_attention", False):
        raise ValueError(
            f"{path}: add_cross_attention=True gives each block a cross-attention to an encoder's states, which a "
            f"decoder-only GPT has not; load a GPT-2 saved without it"
        )
    config = ModelConfig(
        **{
            "arch": "gpt",
            "vocab_size": hf["vocab_size"],
            "block_size": hf["n_positions"],
            "n_layer": hf["n_layer"],
            "n_head": hf["n_head"],
            "n_embd": hf["n_embd"],
            "d_ff": hf.get("n_inner") or 4 * hf["n_embd"],
            "bias": True,
            "pos_encoding": "learned",
            "norm_position": "pre",
            "norm": "layernorm",
            "activation": activation,
            "tie_embeddings": hf.get("tie_word_embeddings", True),
            "norm_eps": hf.get("layer_norm_epsilon", 1e-5),
            **overrides,
        }
    )
    check_head(config, hf.get("tie_word_embeddings", True), path)
    check_block_size(config, hf["n_positions"], path)
    return config


def gpt2_config(c):
    """config.json's GPT-2 settings for ModelConfig c (see GPT2Config), as gpt2_model_config reads them back."""
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
        "activation_function": GPT2_ACTIVATION_NAMES[c.activation],
        "layer_norm_epsilon": c.norm_eps,
        # GPT-2 drops out where we do: the embeddings, the attention probabilities, each residual branch
        "embd_pdrop": c.dropout,
        "attn_pdrop": c.dropout,
        "resid_pdrop": c.dropout,
        "tie_word_embeddings": c.tie_embeddings,
    }


def load_gpt2(path, hf, overrides):
    """A GPT holding the GPT-2 weights in path, whose config.json is hf; see from_pretrained."""
    config = gpt2_model_config(hf, path, overrides)
    hf_state = read_state_dict(path)
    # GPT2LMHeadModel prefixes "transformer."; a bare GPT2Model does not. The attention-mask buffers are not weights.
    hf_state = {
        k.removeprefix("transformer."): v
        for k, v in hf_state.items()
        if not k.endswith((".attn.bias", ".attn.masked_bias"))
    }
    tied = hf.get("tie_word_embeddings", True)
    if tied:
        hf_state.pop("lm_head.weight", None)  # wte itself; save_pretrained leaves it out
    names = gpt2_names(config.n_layer, bias=True, tied=tied)
    # name by name, both ways: a checkpoint of another architecture fails here, not with a shape error later
    check_names(path, "GPT-2", expected=names, found=hf_state)
    # GPT-2's Conv1D weights are (in, out): transposed to nn.Linear's (out, in)
    state = {ours: hf_state[k].t() if conv1d_weight(k) else hf_state[k] for k, ours in names.items()}
    # fine-tuning with a shorter context keeps the first positions
    state["body.wpe.weight"] = state["body.wpe.weight"][: config.block_size]
    # What GPT-2's scores in layer i are multiplied by beyond our 1/sqrt(head_dim): sqrt(head_dim) without
    # scale_attn_weights (unscaled scores), 1/(i + 1) with scale_attn_by_inverse_layer_idx. Scores are linear in the
    # query, so scaling W_q and b_q (the query's rows of qkv: the first n_embd) by it computes the same function.
    unscaled = 1.0 if hf.get("scale_attn_weights", True) else math.sqrt(hf["n_embd"] // hf["n_head"])
    by_layer = hf.get("scale_attn_by_inverse_layer_idx", False)
    for i in range(config.n_layer):
        factor = unscaled / (i + 1) if by_layer else unscaled
        if factor != 1.0:
            for name in (f"body.blocks.{i}.attn.qkv.weight", f"body.blocks.{i}.attn.qkv.bias"):
                state[name] = torch.cat([state[name][: config.n_embd] * factor, state[name][config.n_embd :]])
    return load_checked(GPT(config), state, path)


def gpt2_weights(c, state):
    """
    Our state dict (of ModelConfig c) as GPT2LMHeadModel's tensors (a tied head left out, as save_pretrained).
    Grouped key/value heads (n_kv_head < n_head) become GPT-2's one key/value head per query head: each is repeated
    for its group of query heads, which computes the same attention.
    """
    hf = {}
    for theirs, ours in gpt2_names(c.n_layer, bias=True, tied=c.tie_embeddings).items():
        if ours in state:
            tensor = state[ours]
        else:  # GPT-2 always has biases: a bias=False model's are zero, which adds nothing
            tensor = torch.zeros(state[ours.removesuffix("bias") + "weight"].size(0))
        if ours.endswith(("attn.qkv.weight", "attn.qkv.bias")) and c.n_kv_head != c.n_head:
            tensor = every_head_its_own_kv(tensor, c)
        if conv1d_weight(theirs):
            tensor = tensor.t()
        hf[theirs if theirs == "lm_head.weight" else f"transformer.{theirs}"] = owned(tensor)
    return hf


def every_head_its_own_kv(qkv, c):
    """
    qkv's rows [W_q; W_k; W_v] (a weight, or a bias) with n_kv_head key and value heads of head_dim rows each, as
    [W_q; W_k'; W_v'] with n_head of each: key/value head j repeated for query heads j * g to (j + 1) * g - 1, g =
    n_head / n_kv_head, as attention reads the shared heads (Attention.attend).
    """
    D, group = c.head_dim, c.n_head // c.n_kv_head
    q, k, v = qkv.split([c.n_head * D, c.n_kv_head * D, c.n_kv_head * D])
    k, v = (t.unflatten(0, (c.n_kv_head, D)).repeat_interleave(group, dim=0).flatten(0, 1) for t in (k, v))
    return torch.cat([q, k, v])


# -----------------------------------------------------------------------------
# Llama, and the families in its layout: Mistral, Qwen2, Qwen3

# the architecture class of each family, by config.json's model_type: the loaders read all four, export writes the
# three that a rotary model picks among (hf_layout); Mistral's window is not exported
LLAMA_FAMILIES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
QWEN3_HEAD_DIM = 128  # Qwen3Config's head_dim where config.json names none (every Qwen3 folder does)


def llama_names(config):
    """
    Our names -> the tensors each is made of, as (name in LlamaModel, rows), stacked along dim 0 (the output rows)
    when more than one: one map for the four families, whose tensor names are Llama's and which differ only in which
    tensors exist. qkv: q_proj, k_proj and v_proj give the rows [W_q; W_k; W_v] of Attention.qkv. Head h is rows
    h*D:(h+1)*D in both layouts, and both rotate the channel pairs (i, i + D/2) (transformers' rotate_half), so no row
    needs permuting. LlamaForCausalLM puts its body under "model."; lm_head, listed only when untied, is outside it.
    """
    C, V, d_ff, D = config.n_embd, config.vocab_size, config.d_ff, config.head_dim
    q, kv = config.n_head * D, config.n_kv_head * D
    linears = {
        "attn.qkv": [("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)],
        "attn.proj": [("self_attn.o_proj", C)],
        "mlp.fc": [("mlp.gate_proj", d_ff)],  # SwiGLU's gate, the one under the SiLU
        "mlp.up": [("mlp.up_proj", d_ff)],
        "mlp.proj": [("mlp.down_proj", C)],
    }
    names = {"body.wte.weight": [("embed_tokens.weight", V)], "body.norm.weight": [("norm.weight", C)]}
    if not config.tie_embeddings:
        names["lm_head.weight"] = [("lm_head.weight", V)]
    for i in range(config.n_layer):
        hf_layer, ours = f"layers.{i}", f"body.blocks.{i}"
        names[f"{ours}.norm1.weight"] = [(f"{hf_layer}.input_layernorm.weight", C)]
        names[f"{ours}.norm2.weight"] = [(f"{hf_layer}.post_attention_layernorm.weight", C)]
        if config.qk_norm:
            names[f"{ours}.attn.q_norm.weight"] = [(f"{hf_layer}.self_attn.q_norm.weight", D)]
            names[f"{ours}.attn.k_norm.weight"] = [(f"{hf_layer}.self_attn.k_norm.weight", D)]
        for our_linear, hf_linears in linears.items():
            bias = config.bias or (config.qkv_bias and our_linear == "attn.qkv")
            for p in ("weight", "bias") if bias else ("weight",):
                names[f"{ours}.{our_linear}.{p}"] = [(f"{hf_layer}.{name}.{p}", rows) for name, rows in hf_linears]
    return names


def llama_rope(hf, path):
    """
    (rope_theta, rope_scaling) of a Llama-family config.json: the rotary base, and Llama 3's scaling as
    ModelConfig.rope_scaling holds it, or None. ValueError for any other scaling (linear, dynamic, yarn...), for
    rotary positions on part of each head, or for settings that differ between layers.
    """
    # transformers < 5 writes rope_theta at the top level, beside rope_scaling (null unless scaled, its kind under
    # "type" or "rope_type"); transformers 5 writes both into rope_parameters: {"rope_type": "default", "rope_theta"}
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    if any(isinstance(value, dict) for value in rope.values()):
        raise ValueError(f"{path}: rope_parameters differ between layer types ({', '.join(rope)}); ours are one")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(
            f"{path}: rope_type={rope_type!r} ({', '.join(f'{k}={v}' for k, v in rope.items())}) is not implemented; "
            f"only unscaled rotary positions (rope_type 'default') and Llama 3's scaling ('llama3') are"
        )
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"{path}: partial_rotary_factor={partial} is not implemented; ours rotates every channel")
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return theta, None
    # transformers takes max_position_embeddings for a missing original context, as here
    rope = {"original_max_position_embeddings": hf["max_position_embeddings"], **rope, "rope_type": "llama3"}
    absent = [key for key in ROPE_SCALING_KEYS if key not in rope]
    if absent:
        raise ValueError(f"{path}: rope_type 'llama3' needs {', '.join(absent)} in its rope_parameters or rope_scaling")
    return theta, {key: rope[key] for key in ROPE_SCALING_KEYS}


def qwen_window(hf, path):
    """
    The window_size of a Qwen2 or Qwen3 config.json: transformers slides a window of sliding_window positions only
    with use_sliding_window, over the layers from max_window_layers on (or those layer_types names). One window for
    every layer, or none, is ours; a mixture is a ValueError.
    """
    window = (hf.get("sliding_window") or 0) if hf.get("use_sliding_window", False) else 0
    n_layer = hf["num_hidden_layers"]
    kinds = hf.get("layer_types") or [
        "sliding_attention" if window and i >= hf.get("max_window_layers", 28) else "full_attention"
        for i in range(n_layer)
    ]
    unknown = sorted(set(kinds) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"{path}: layer_types {', '.join(unknown)} are not implemented; ours is full attention")
    windows = {window if kind == "sliding_attention" else 0 for kind in kinds}
    if len(windows) > 1:
        raise ValueError(
            f"{path}: {kinds.count('sliding_attention')} of {n_layer} layers slide a window of {window} positions and "
            f"the others attend to every position; our window_size is one for all layers"
        )
    return windows.pop()


def llama_family_options(hf, path):
    """The ModelConfig options in which Llama, Mistral, Qwen2 and Qwen3 differ: biases, qk_norm, a window."""
    model_type = hf["model_type"]
    if model_type == "qwen2":  # q, k and v always have biases (Qwen2Attention), o_proj and the MLP never
        return {"qkv_bias": True, "window_size": qwen_window(hf, path)}
    if model_type == "mistral":  # never biases (MistralAttention, MistralMLP), whatever attention_bias says
        # Mistral is Llama plus a sliding window; transformers' MistralConfig defaults it to 4096, None turns it off
        return {"bias": False, "window_size": hf.get("sliding_window", 4096) or 0}
    bias = hf.get("attention_bias", False)
    if model_type == "qwen3":
        if bias:
            raise ValueError(
                f"{path}: attention_bias=True gives Qwen3's o_proj a bias but its MLP none; our biases are on q, k, "
                "v only (qkv_bias) or on every Linear (bias)"
            )
        return {"qk_norm": True, "window_size": qwen_window(hf, path)}
    if hf.get("mlp_bias", False) != bias:
        raise ValueError(
            f"{path}: attention_bias={bias} but mlp_bias={hf.get('mlp_bias', False)}; our biases are on q, k, v only "
            f"(qkv_bias) or on every Linear (bias), so both must be equal"
        )
    return {"bias": bias, "window_size": 0}


def llama_model_config(hf, path, overrides):
    """The ModelConfig of a Llama, Mistral, Qwen2 or Qwen3 config.json hf (in folder path), with the overrides."""
    # What our model cannot compute is refused here, before any weights are read. Optional keys default as in
    # transformers' configuration classes of each family.
    sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    absent = [key for key in (*sizes, "max_position_embeddings") if hf.get(key) is None]
    if absent:
        raise ValueError(f"{path / 'config.json'} has no {', '.join(absent)}: is it a {hf['model_type']} config?")
    C, H = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):  # two names of x * sigmoid(x)
        raise ValueError(f"{path}: hidden_act={hf['hidden_act']!r} is not implemented; SwiGLU here gates with 'silu'")
    head_dim = hf.get("head_dim") or (QWEN3_HEAD_DIM if hf["model_type"] == "qwen3" else None)
    if head_dim is None and C % H:
        raise ValueError(f"{path}: hidden_size={C} does not divide among num_attention_heads={H} and no head_dim given")
    rope_theta, rope_scaling = llama_rope(hf, path)
    config = ModelConfig(
        **{
            "arch": "gpt",
            "vocab_size": hf["vocab_size"],
            "block_size": hf["max_position_embeddings"],
            "n_layer": hf["num_hidden_layers"],
            "n_head": H,
            "n_kv_head": hf.get("num_key_value_heads") or H,
            "n_embd": C,
            "head_dim": head_dim,  # None: C // H
            "d_ff": hf["intermediate_size"],
            "pos_encoding": "rope",
            "rope_theta": rope_theta,
            "rope_scaling": rope_scaling,
            "norm_position": "pre",
            "norm": "rmsnorm",
            "norm_eps": hf.get("rms_norm_eps", 1e-6),
            "activation": "swiglu",
            "tie_embeddings": hf.get("tie_word_embeddings", False),
            **llama_family_options(hf, path),
            **overrides,
        }
    )
    check_head(config, hf.get("tie_word_embeddings", False), path)
    check_block_size(config, hf["max_position_embeddings"], path)
    return config


def llama_config(c, layout):
    """
    config.json's settings for ModelConfig c in the layout "llama", "qwen2" or "qwen3" (see LlamaConfig, Qwen2Config,
    Qwen3Config), as llama_model_config reads them back.
    """
    rope = c.rope_scaling or {"rope_type": "default"}
    config = {
        "architectures": [LLAMA_FAMILIES[layout]],
        "model_type": layout,
        "vocab_size": c.vocab_size,
        "hidden_size": c.n_embd,
        "intermediate_size": c.d_ff,
        "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head,
        "num_key_value_heads": c.n_kv_head,
        "head_dim": c.head_dim,  # Qwen2Config has no such field, but Qwen2Attention reads it where config.json has it
        "hidden_act": "silu",
        "max_position_embeddings": c.block_size,
        "rms_norm_eps": c.norm_eps,
        # rope_theta at the top level and a scaling as rope_scaling for transformers 4 and llama.cpp, both in
        # rope_parameters for transformers 5
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "rope_parameters": {**rope, "rope_theta": c.rope_theta},
        "attention_dropout": c.dropout,  # these families have no other dropout; it changes nothing at inference
        "tie_word_embeddings": c.tie_embeddings,
    }
    if layout == "llama":  # one bias flag covers all our Linears: the attention's four and the MLP's three
        return {**config, "attention_bias": c.bias, "mlp_bias": c.bias}
    # Qwen2's q, k, v always have biases, Qwen3's none (attention_bias would add o_proj's); neither slides a window
    return {**config, **({"attention_bias": False} if layout == "qwen3" else {}), "use_sliding_window": False}


def load_llama(path, hf, overrides):
    """A GPT holding the weights of a Llama-family folder path, whose config.json is hf; see from_pretrained."""
    config, saved = llama_model_config(hf, path, overrides), llama_model_config(hf, path, {})
    hf_state = read_state_dict(path)
    # LlamaForCausalLM prefixes the body with "model."; a bare LlamaModel does not. rotary_emb.inv_freq (saved by
    # transformers before 4.31) is the rotary table, not a weight.
    hf_state = {k.removeprefix("model."): v for k, v in hf_state.items() if not k.endswith("rotary_emb.inv_freq")}
    if saved.tie_embeddings:
        hf_state.pop("lm_head.weight", None)  # the head is embed_tokens; save_pretrained leaves it out
    # the tensors config.json names: an override that changes them, such as qk_norm=True, is load_checked's to name;
    # a tied head untied on request starts as a copy of embed_tokens (load_checked)
    names = llama_names(saved)
    expected = [name for parts in names.values() for name, _ in parts]
    check_names(path, hf["model_type"], expected=expected, found=hf_state)
    # (a lone tensor is taken as it is: a copy of every weight would double the memory a large model needs)
    state = {
        ours: torch.cat([hf_state[name] for name, _ in parts]) if len(parts) > 1 else hf_state[parts[0][0]]
        for ours, parts in names.items()
    }
    return load_checked(GPT(config), state, path)


def llama_weights(c, state):
    """Our state dict (of ModelConfig c) as LlamaForCausalLM's tensors (a tied head left out, as save_pretrained)."""
    hf = {}
    for ours, parts in llama_names(c).items():
        # qkv is cut back into q_proj, k_proj and v_proj; every other tensor is one part, itself
        for (name, _), tensor in zip(parts, state[ours].split([rows for _, rows in parts])):
            hf[name if name == "lm_head.weight" else f"model.{name}"] = owned(tensor)
    return hf


# config.json's model_type -> the loader that maps its weights onto ours
PRETRAINED_LOADERS = {"gpt2": load_gpt2, **dict.fromkeys(LLAMA_FAMILIES, load_llama)}


# -----------------------------------------------------------------------------
# Exporting: which layout, if any, computes a model

# the layouts in ModelConfig terms, for the message that refuses a model fitting none
LAYOUTS = (
    "Exported are GPT-2's layout (pos_encoding='learned', norm='layernorm', activation 'gelu', 'gelu_tanh', 'relu' or "
    "'relu2', any n_kv_head (each head given its own), head_dim=n_embd/n_head, tied or not) and three rotary ones "
    "(pos_encoding='rope', norm='rmsnorm', activation='swiglu', any n_kv_head, head_dim and Llama 3 rope_scaling, "
    "tied or not): Llama's (bias or none), Qwen2's (qkv_bias) and Qwen3's (qk_norm, no bias); all pre-norm without "
    "logit_softcap or window_size"
)


# Export fails closed: every ModelConfig field must be one that changes nothing in a GPT's forward, one the layout
# writes (config.json or the weights' shapes and values), or one layout_checks compares with what the layout
# computes. A field in none of them (a new option, say) is refused unless it is at its default.
NO_EFFECT = {"dropout", "zero_init_proj", "share_embeddings", "n_encoder_layer", "pad_token_id"}
WRITTEN = {
    *("arch", "vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd", "d_ff", "bias", "qkv_bias"),
    *("tie_embeddings", "norm_eps"),
}
LAYOUT_WRITES = {
    # learned positions: no rotation, so the rotary settings change nothing
    "gpt2": WRITTEN | {"rope_theta", "rope_scaling"},
    "llama": WRITTEN | {"head_dim", "rope_theta", "rope_scaling", "qk_norm"},
}


def hf_layout(config):
    """
    "gpt2", "llama", "qwen2" or "qwen3": the Hugging Face layout that computes exactly what a model of this
    ModelConfig does. ValueError naming every option that stops it, in one line: each needs retraining, so all are
    named at once (and it fails closed: see NO_EFFECT).
    """
    c = config
    if c.arch != "gpt":  # nothing else matters then
        raise ValueError(
            f"cannot export arch={c.arch!r}: only a decoder-only GPT is a causal LM (GPT2LMHeadModel, LlamaForCausalLM)"
        )
    # the positions pick GPT-2 or the rotary family; within it, the attention picks: Qwen3 normalises queries and
    # keys, Qwen2 has biases on q, k and v alone, Llama on every Linear or none
    layout = {"learned": "gpt2", "rope": "llama"}.get(c.pos_encoding)
    if layout == "llama" and c.qk_norm:
        layout = "qwen3"
    elif layout == "llama" and c.qkv_bias and not c.bias:
        layout = "qwen2"
    checks = layout_checks(c, layout)
    refused = [f"{name}={getattr(c, name)!r}: {why}" for name, stops, why in checks if stops]
    known = NO_EFFECT | LAYOUT_WRITES["gpt2" if layout == "gpt2" else "llama"] | {name for name, _, _ in checks}
    refused += [
        f"{f.name}={getattr(c, f.name)!r}: an option export does not know (only its default exports)"
        for f in fields(c)
        if f.name not in known and getattr(c, f.name) != f.default
    ]
    if refused:
        raise ValueError(f"cannot export {'; '.join(refused)}. {LAYOUTS}")
    return layout


def layout_checks(c, layout):
    """(option, refused, why) for each option of ModelConfig c that the layout computes one way only."""
    checks = [
        ("norm_position", c.norm_position != "pre", "GPT-2, Llama and Qwen all normalise inside the residual branch"),
        ("pos_encoding", layout is None, "GPT-2 learns its positions and the others rotate q and k"),
        ("logit_softcap", c.logit_softcap > 0, "none of the layouts caps its logits"),
        ("window_size", c.window_size > 0, "the exported layouts attend to every earlier position"),
    ]
    if layout == "gpt2":
        checks += [
            ("norm", c.norm != "layernorm", "the GPT-2 layout that learned positions pick has LayerNorm"),
            (
                "activation",
                c.activation not in GPT2_ACTIVATION_NAMES,
                "the GPT-2 layout that learned positions pick has no gated MLP",
            ),
            ("head_dim", c.head_dim * c.n_head != c.n_embd, "GPT-2's heads split n_embd among them"),
            ("qk_norm", c.qk_norm, "GPT-2 does not normalise queries and keys (Qwen3, a rotary layout, does)"),
        ]
    elif layout is not None:
        checks += [
            ("norm", c.norm != "rmsnorm", "the rotary layouts have RMSNorm"),
            ("activation", c.activation != "swiglu", "the rotary layouts have SwiGLU"),
        ]
    if layout == "qwen3":
        checks += [
            ("bias", c.bias, "Qwen3, the layout that qk_norm picks, has no biases in its MLP"),
            ("qkv_bias", c.qkv_bias and not c.bias, "Qwen3's attention_bias would add one to o_proj as well"),
        ]
    return checks


def owned(t):
    """A float32, contiguous copy of t: safetensors refuses views sharing memory (split q, k, v; the tied head)."""
    return t.detach().to(torch.float32).clone(memory_format=torch.contiguous_format)


def to_hf(model):
    """
    (layout, tensors, config) of model (a GPT) in the Hugging Face layout that computes it (hf_layout): its weights by
    their Hugging Face names, float32 and contiguous, and config.json's settings, read back to the same model.
    """
    c = model.config
    layout = hf_layout(c)
    state = model.state_dict()
    if layout == "gpt2":
        return layout, gpt2_weights(c, state), gpt2_config(c)
    return layout, llama_weights(c, state), llama_config(c, layout)


# -----------------------------------------------------------------------------
# nanoGPT's checkpoints: GPT-2's model and names


def load_nanogpt(checkpoint, path):
    """
    A GPT holding the weights of a checkpoint dict written by nanoGPT's train.py (karpathy/nanoGPT), path naming it
    in errors. Its model_args give the sizes; its model is GPT-2's (pre-norm LayerNorm, learned positions, tied
    head) with exact GELU and nn.Linear weights (not GPT-2's transposed Conv1D), biases as model_args says. A
    compiled run's keys carry "_orig_mod.".
    """
    # nanoGPT's names are GPT-2's, and so is its model
    args = checkpoint["model_args"]
    # model_args as GPT2Config's settings: the same model, with exact GELU and (by default) the head tied
    hf = {"vocab_size": args["vocab_size"], "n_positions": args["block_size"], "activation_function": "gelu"}
    hf |= {key: args[key] for key in ("n_layer", "n_head", "n_embd")}
    config = gpt2_model_config(hf, path, {"dropout": args.get("dropout", 0.0), "bias": args.get("bias", True)})
    # the causal-mask buffers of nanoGPT on PyTorch < 2 (".attn.bias", not c_attn's) are not weights
    state = {
        k.removeprefix("_orig_mod.").removeprefix("transformer."): v
        for k, v in checkpoint["model"].items()
        if not k.endswith(".attn.bias")
    }
    state.pop("lm_head.weight", None)  # tied to wte
    names = gpt2_names(config.n_layer, config.bias)
    check_names(path, "nanoGPT", expected=names, found=state, source="model_args")
    return load_checked(GPT(config), {names[k]: v for k, v in state.items()}, path)
