"""
The families people fine-tune into chat models, against transformers as the reference: Llama 3 (scaled rotary
frequencies), Qwen2 and Qwen2.5 (biases on q, k and v), Qwen3 (qk_norm, a head_dim apart from hidden_size / heads),
Mistral, and every GPT2Config field that changes GPT-2's function (an untied head, the attention scalings, n_inner,
the activations). Random tiny models saved by save_pretrained load with hf.from_pretrained to transformers' logits
(within 1e-4) and greedy tokens; our models with those options export (export.export) to folders that transformers
loads to our logits and greedy tokens, and from_pretrained reads back to the same model. Then what cannot be
computed, refused in one line each, and head_dim in the model itself (cross-attention, the encoder, the FLOP count).
Last, GPT-2, Llama and Mistral weights read by from_pretrained from every file layout a folder may hold.
"""

import json
import math
import re
from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F
import transformers  # a dev dependency (requirements-dev.txt): the reference; missing, the suite fails
from hf_reference import (
    TINY_LLAMA,
    VOCAB,
    assert_same_greedy_tokens,
    load_transformers,
    max_logit_difference,
    with_large_weights,
)

import export
import hf
from generate import generate
from hf import from_pretrained
from model import GPT, Attention, ModelConfig, build_model, llama3_frequencies, rope_tables

# Llama 3.1's scaling with an original context of 32 positions instead of 8192, so that a tiny model meets all three
# of its cases: with head_dim 16 and theta 10000 the wavelengths are 6.3, 20, 63, 200... positions, so the first
# channel pair turns more than high_freq_factor (4) times within 32 positions (kept), the second between 1 and 4
# times (blended) and the rest fewer than once (slowed by factor)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
CHAR_META = {
    "kind": "lm",
    "tokenizer": {"type": "char", "chars": [chr(i) for i in range(32, 32 + VOCAB)]},
    "vocab_size": VOCAB,
    "special_tokens": {},
}


def ids(*shape, seed=0):
    return torch.randint(1, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def saved_folder(path, config_class, changes, config_json=None):
    """A random tiny transformers model of config_class with large weights, saved to path; config_json patches it."""
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**TINY_LLAMA, **changes})
    model = with_large_weights(transformers.AutoModelForCausalLM.from_config(config))
    model.save_pretrained(path)
    if config_json is not None:
        written = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(config_json(written)))
    return model


def transformers4_rope(config):
    """config.json as transformers 4 wrote Llama 3.1's: rope_theta at the top level, the scaling as rope_scaling."""
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    return {**config, "rope_scaling": rope}


# -----------------------------------------------------------------------------
# Their folders load to their logits and greedy tokens

FOLDERS = {  # name: (transformers config class, config changes, config.json patch, what our ModelConfig holds)
    "llama3-gqa-untied": (
        "LlamaConfig",
        {"num_key_value_heads": 2, "head_dim": 16, "rope_parameters": LLAMA3_ROPE},
        None,
        {"rope_scaling": {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}, "head_dim": 16},
    ),
    "llama3-tied-transformers4": (
        "LlamaConfig",
        {"tie_word_embeddings": True, "head_dim": 16, "rope_parameters": {**LLAMA3_ROPE, "factor": 8.0}},
        transformers4_rope,
        {"rope_scaling": {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"} | {"factor": 8.0}},
    ),
    "qwen2-gqa-tied": (
        "Qwen2Config",
        {"num_key_value_heads": 2, "tie_word_embeddings": True, "rope_parameters": {"rope_theta": 1e6}},
        None,
        {"qkv_bias": True, "bias": False, "rope_theta": 1e6, "window_size": 0},
    ),
    "qwen2-mha-untied-window-off": (  # Qwen2.5's config.json: a window named, use_sliding_window false
        "Qwen2Config",
        {"num_key_value_heads": 4, "rms_norm_eps": 1e-3, "sliding_window": 4, "max_window_layers": 1},
        None,
        {"qkv_bias": True, "n_kv_head": 4, "window_size": 0, "norm_eps": 1e-3},
    ),
    "qwen3-wider-heads-tied": (  # Qwen3-0.6B's proportions: 16 heads of 128 over 1024 channels
        "Qwen3Config",
        {"num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": True},
        None,
        {"qk_norm": True, "head_dim": 16, "bias": False, "qkv_bias": False},
    ),
    "qwen3-narrower-heads-untied-mqa": (
        "Qwen3Config",
        {"num_key_value_heads": 1, "head_dim": 6, "rms_norm_eps": 1e-3, "rope_parameters": {"rope_theta": 500.0}},
        None,
        {"qk_norm": True, "head_dim": 6, "n_kv_head": 1, "tie_embeddings": False},
    ),
    "mistral-wider-heads-window": (  # Mistral-Nemo's kind: head_dim 128 over 5120 channels and 32 heads
        "MistralConfig",
        {"num_key_value_heads": 2, "head_dim": 16, "sliding_window": 8},
        None,
        {"head_dim": 16, "window_size": 8, "bias": False},
    ),
    "mistral-bias-flags-it-ignores": (  # MistralAttention and MistralMLP have no biases whatever config.json says
        "MistralConfig",
        {"num_key_value_heads": 4, "sliding_window": None},
        lambda c: {**c, "attention_bias": True, "mlp_bias": True},
        {"bias": False, "qkv_bias": False, "window_size": 0},
    ),
    "llama-swish-pretraining_tp": (  # "swish" is "silu"; pretraining_tp slices the same products
        "LlamaConfig",
        {"pretraining_tp": 2},
        lambda c: {**c, "hidden_act": "swish"},
        {"activation": "swiglu", "bias": False},
    ),
}


@pytest.mark.parametrize("case", FOLDERS)
def test_a_saved_folder_loads_to_transformers_logits_and_greedy_tokens(tmp_path, case):
    config_class, changes, patch, expected = FOLDERS[case]
    theirs = saved_folder(tmp_path, config_class, changes, patch)
    ours = hf.from_pretrained(tmp_path).eval()
    assert {key: getattr(ours.config, key) for key in expected} == expected
    x = ids(2, 64)  # every position of the block: the scaled frequencies reach their largest angles
    assert max_logit_difference(ours, theirs, x) < 1e-4
    assert_same_greedy_tokens(ours, theirs, x[:, :5])


@pytest.mark.parametrize("case", ["qwen2-gqa-tied", "llama3-gqa-untied"])
def test_a_tied_head_unties_on_request_and_a_head_of_its_own_is_never_dropped(tmp_path, case):
    """As GPT-2's: a tied folder read with tie_embeddings=False, a head of its own with tie_embeddings=True."""
    config_class, changes, patch, _ = FOLDERS[case]
    theirs = saved_folder(tmp_path, config_class, changes, patch)
    if theirs.config.tie_word_embeddings:
        ours = hf.from_pretrained(tmp_path, tie_embeddings=False).eval()
        assert ours.lm_head.weight is not ours.body.wte.weight
        assert torch.equal(ours.lm_head.weight, ours.body.wte.weight)  # a copy to fine-tune apart
        assert max_logit_difference(ours, theirs, ids(2, 64)) < 1e-4
    else:
        with pytest.raises(ValueError, match="tie_embeddings=True would drop it"):
            hf.from_pretrained(tmp_path, tie_embeddings=True)


def test_llama3_scaling_shows_in_the_logits(tmp_path):
    """Read unscaled, a Llama 3 folder's logits are far off, so the 1e-4 above would catch a scaling left out."""
    config_class, changes, _, _ = FOLDERS["llama3-gqa-untied"]
    theirs = saved_folder(tmp_path, config_class, changes)
    assert max_logit_difference(hf.from_pretrained(tmp_path, rope_scaling=None).eval(), theirs, ids(2, 64)) > 0.1


def test_llama3_frequencies_at_llama_3_1_size_are_transformers():
    """Llama 3.1 8B's own rope settings (head_dim 128, theta 500000, factor 8 over 8192 positions)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    rope["original_max_position_embeddings"] = 8192
    config = transformers.LlamaConfig(
        hidden_size=4096, num_attention_heads=32, rope_parameters={**rope, "rope_theta": 500000.0}
    )
    expected, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config)
    assert attention_factor == 1.0
    inv_freq = 500000.0 ** (-torch.arange(0, 128, 2, dtype=torch.float32) / 128)
    got = llama3_frequencies(inv_freq, **{k: v for k, v in rope.items() if k != "rope_type"})
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    # kept, blended and slowed frequencies are all among Llama 3.1's 64
    kept, slowed = (got == inv_freq).sum().item(), torch.isclose(got, inv_freq / 8, rtol=1e-7).sum().item()
    assert kept > 0 and slowed > 0 and kept + slowed < 64


def test_qwen2_window_over_every_layer_is_our_window_size(tmp_path):
    """use_sliding_window with max_window_layers 0 slides the window in every layer: our window_size."""
    changes = {"num_key_value_heads": 2, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0}
    theirs = saved_folder(tmp_path, "Qwen2Config", changes)
    ours = hf.from_pretrained(tmp_path).eval()
    assert ours.config.window_size == 4
    x = ids(2, 24)
    assert max_logit_difference(ours, theirs, x) < 1e-4
    assert_same_greedy_tokens(ours, theirs, x[:, :5], new_tokens=16)
    assert max_logit_difference(hf.from_pretrained(tmp_path, window_size=0).eval(), theirs, x) > 0.1


# -----------------------------------------------------------------------------
# GPT-2's config fields: each that changes what GPT2LMHeadModel computes is computed here, or refused

TINY_GPT2 = {  # three layers, so that scale_attn_by_inverse_layer_idx divides by 1, 2 and 3
    "vocab_size": VOCAB,
    "n_positions": 64,
    "n_embd": 32,
    "n_layer": 3,
    "n_head": 4,
    "bos_token_id": None,
    "eos_token_id": None,
    "attn_implementation": "eager",  # the only one that reorders and upcasts
}
GPT2_FIELDS = {  # name: (GPT2Config changes, the field that, left at its default, must give other logits)
    "untied-head": ({"tie_word_embeddings": False}, "tie_word_embeddings"),
    "unscaled-scores": ({"scale_attn_weights": False}, "scale_attn_weights"),
    "scores-by-inverse-layer": ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    "reorder-and-upcast": ({"reorder_and_upcast_attn": True, "scale_attn_by_inverse_layer_idx": True}, None),
    "n_inner-relu": ({"n_inner": 40, "activation_function": "relu"}, "activation_function"),
    "relu2": ({"activation_function": "relu2"}, "activation_function"),
    "gelu-exact": ({"activation_function": "gelu"}, "activation_function"),
    "gelu_python": ({"activation_function": "gelu_python"}, "activation_function"),
    "gelu_pytorch_tanh": ({"activation_function": "gelu_pytorch_tanh"}, None),  # the default's function
    "gelu_fast": ({"activation_function": "gelu_fast"}, None),
    "all-at-once": (
        {
            "tie_word_embeddings": False,
            "scale_attn_weights": False,
            "scale_attn_by_inverse_layer_idx": True,
            "n_inner": 24,
            "layer_norm_epsilon": 1e-2,
            "activation_function": "gelu",
        },
        None,
    ),
}


# float32 logits of three layers land within 3e-7 of transformers'; exact and tanh GELU differ by 7e-5 in these
GPT2_TOLERANCE = 5e-6


def saved_gpt2(path, changes):
    """A random tiny GPT-2 with GPT2Config changes and large weights, saved to path."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(**{**TINY_GPT2, **changes})
    model = with_large_weights(transformers.GPT2LMHeadModel(config))
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("case", GPT2_FIELDS)
def test_gpt2_config_fields_load_to_transformers_logits(tmp_path, case):
    changes, field = GPT2_FIELDS[case]
    theirs = saved_gpt2(tmp_path, changes)
    ours = hf.from_pretrained(tmp_path).eval()
    x = ids(2, 64)
    assert max_logit_difference(ours, theirs, x) < GPT2_TOLERANCE
    assert_same_greedy_tokens(ours, theirs, x[:, :5])
    if field is not None:  # read at its default, the field shows past 10x the tolerance: ignoring it would fail
        config = json.loads((tmp_path / "config.json").read_text())
        del config[field]
        (tmp_path / "config.json").write_text(json.dumps(config))
        assert max_logit_difference(hf.from_pretrained(tmp_path).eval(), theirs, x) > 10 * GPT2_TOLERANCE


def test_a_tied_gpt2_unties_on_request_into_a_head_of_its_own(tmp_path):
    theirs = saved_gpt2(tmp_path, {})
    ours = hf.from_pretrained(tmp_path, tie_embeddings=False).eval()
    assert ours.lm_head.weight is not ours.body.wte.weight
    assert torch.equal(ours.lm_head.weight, ours.body.wte.weight)  # a copy to fine-tune apart
    assert max_logit_difference(ours, theirs, ids(2, 64)) < GPT2_TOLERANCE


@pytest.mark.parametrize(
    ("changes", "overrides", "message"),
    [
        ({"activation_function": "quick_gelu"}, {}, "activation_function='quick_gelu' is not implemented"),
        ({"add_cross_attention": True}, {}, "add_cross_attention=True gives each block a cross-attention"),
        ({"tie_word_embeddings": False}, {"tie_embeddings": True}, "tie_embeddings=True would drop it"),
    ],
)
def test_a_gpt2_we_cannot_compute_is_a_one_line_error(tmp_path, changes, overrides, message):
    saved_gpt2(tmp_path, changes)
    with pytest.raises(ValueError) as err:
        hf.from_pretrained(tmp_path, **overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


# -----------------------------------------------------------------------------
# Our models export in the layout their options pick

LLAMA = {"pos_encoding": "rope", "norm": "rmsnorm", "activation": "swiglu"}
SCALING = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
EXPORTS = {  # name: (ModelConfig changes, the architecture transformers loads)
    "qkv_bias-is-qwen2": ({**LLAMA, "qkv_bias": True, "n_kv_head": 2, "tie_embeddings": False}, "Qwen2ForCausalLM"),
    "qkv_bias-head_dim-is-qwen2": ({**LLAMA, "qkv_bias": True, "head_dim": 12}, "Qwen2ForCausalLM"),
    "qk_norm-is-qwen3": ({**LLAMA, "qk_norm": True, "head_dim": 12, "n_kv_head": 1}, "Qwen3ForCausalLM"),
    "rope_scaling-is-llama": (
        {**LLAMA, "rope_scaling": SCALING, "head_dim": 16, "bias": True},
        "LlamaForCausalLM",
    ),
    "qk_norm-rope_scaling-is-qwen3": (
        {**LLAMA, "qk_norm": True, "rope_scaling": SCALING, "tie_embeddings": False},
        "Qwen3ForCausalLM",
    ),
    "qkv_bias-learned-is-gpt2": ({"qkv_bias": True, "activation": "gelu_tanh"}, "GPT2LMHeadModel"),
}


@pytest.mark.parametrize("case", EXPORTS)
def test_an_export_gives_transformers_our_logits_and_loads_back(tmp_path, case):
    changes, architecture = EXPORTS[case]
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, block_size=64, n_layer=2, n_head=4, n_embd=32, d_ff=48, **changes)
    ours = with_large_weights(GPT(config))
    export.export(ours, CHAR_META, tmp_path / "hf")
    theirs = load_transformers(tmp_path / "hf")
    assert type(theirs).__name__ == architecture
    x = ids(2, 64)
    assert max_logit_difference(ours, theirs, x) < 1e-4
    assert_same_greedy_tokens(ours, theirs, x[:, :5], new_tokens=8)
    back = hf.from_pretrained(tmp_path / "hf").eval()
    if architecture != "GPT2LMHeadModel":  # GPT-2 has every bias: a model with fewer comes back with zero ones
        assert asdict(back.config) == asdict(config)
    with torch.no_grad():
        torch.testing.assert_close(back(x)[0], ours(x)[0], atol=1e-5, rtol=1e-5)


REFUSED_EXPORTS = [  # ModelConfig changes, the option the message must name
    ({**LLAMA, "qk_norm": True, "bias": True}, "bias=True"),  # Qwen3 has no MLP biases
    ({**LLAMA, "qk_norm": True, "qkv_bias": True}, "qkv_bias=True"),  # Qwen3's attention_bias includes o_proj
    ({"qk_norm": True}, "qk_norm=True"),  # GPT-2 does not normalise queries and keys
    ({"head_dim": 16}, "head_dim=16"),  # GPT-2's heads split n_embd
]


@pytest.mark.parametrize(("changes", "option"), REFUSED_EXPORTS, ids=[option for _, option in REFUSED_EXPORTS])
def test_an_option_no_layout_computes_is_named_in_one_line(changes, option):
    config = ModelConfig(vocab_size=VOCAB, block_size=64, n_layer=2, n_head=4, n_embd=32, **changes)
    with pytest.raises(ValueError) as err:
        hf.hf_layout(config)
    message = str(err.value)
    assert message.startswith("cannot export ") and f"{option}:" in message and "\n" not in message


# -----------------------------------------------------------------------------
# What we cannot compute is refused in one line


def without_layer_types(config):
    """config.json without layer_types, as Qwen2.5's own folders have it: max_window_layers decides."""
    config.pop("layer_types", None)
    return config


REFUSED_FOLDERS = [  # config class, changes, config.json patch, the message
    (
        "LlamaConfig",
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}},
        None,
        "rope_type='yarn'",
    ),
    (
        "LlamaConfig",
        {},
        lambda c: {**c, "rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}},
        "rope_type 'llama3' needs low_freq_factor, high_freq_factor",
    ),
    (
        "LlamaConfig",
        {},
        lambda c: {**c, "partial_rotary_factor": 0.5},
        "partial_rotary_factor=0.5 is not implemented",
    ),
    (
        "LlamaConfig",
        {},
        lambda c: {**c, "rope_parameters": {"full_attention": c["rope_parameters"]}},
        "rope_parameters differ between layer types",
    ),
    (
        "LlamaConfig",
        {"attention_bias": True},
        None,
        "attention_bias=True but mlp_bias=False",
    ),
    (
        "Qwen2Config",
        {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
        without_layer_types,
        "1 of 2 layers slide a window of 4 positions",
    ),
    (
        "Qwen2Config",
        {"use_sliding_window": True, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
        None,
        "1 of 2 layers slide a window of 4 positions",
    ),
    (
        "Qwen3Config",
        {"attention_bias": True},
        None,
        "attention_bias=True gives Qwen3's o_proj a bias",
    ),
    (
        "Qwen3Config",
        {},
        lambda c: {**c, "layer_types": ["full_attention", "linear_attention"]},
        "layer_types linear_attention are not implemented",
    ),
]


@pytest.mark.parametrize(("config_class", "changes", "patch", "message"), REFUSED_FOLDERS)
def test_a_folder_we_cannot_compute_is_a_one_line_error(tmp_path, config_class, changes, patch, message):
    saved_folder(tmp_path, config_class, changes, patch)
    with pytest.raises(ValueError) as err:
        hf.from_pretrained(tmp_path)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"rope_scaling": {**SCALING, "rope_type": "yarn"}}, "rope_scaling rope_type='yarn' is not implemented"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling must have exactly the keys"),
        ({"rope_scaling": {**SCALING, "low_freq_factor": 4.0}}, "low_freq_factor < high_freq_factor"),
        ({"rope_scaling": {**SCALING, "factor": 0}}, "must be positive"),
        ({"rope_scaling": SCALING, "pos_encoding": "learned"}, "needs pos_encoding='rope'"),
        ({"head_dim": 0}, "head_dim must be a positive integer"),
        ({"head_dim": 7}, "needs an even head_dim, got 7"),
        ({"n_embd": 30, "head_dim": None}, "n_embd=30 must be divisible by n_head=4"),
    ],
)
def test_bad_new_settings_are_one_line_errors(changes, message):
    settings = {"vocab_size": VOCAB, "block_size": 64, "n_layer": 2, "n_head": 4, "n_embd": 32, **LLAMA, **changes}
    with pytest.raises(ValueError) as err:
        ModelConfig(**settings)
    assert message in str(err.value) and "\n" not in str(err.value)


# -----------------------------------------------------------------------------
# head_dim and qkv_bias in the model itself: every architecture, cross-attention, the FLOP count


def reference_attention(attn, x, context, head_dim):
    """
    Cross-attention (no mask) of attn in float64 with explicit loops over heads, queries and keys: q of H * head_dim
    channels from x, k and v from the context, each head its own head_dim channels, the merged heads through proj.
    """
    x, context = x.double(), context.double()
    q = F.linear(x, attn.q.weight.double(), attn.q.bias.double())
    k, v = F.linear(context, attn.kv.weight.double(), attn.kv.bias.double()).chunk(2, dim=-1)
    B, T, S, H = x.size(0), x.size(1), context.size(1), attn.n_head
    out = torch.zeros(B, T, H * head_dim, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            cols = slice(h * head_dim, (h + 1) * head_dim)
            for t in range(T):
                scores = [q[b, t, cols] @ k[b, s, cols] / math.sqrt(head_dim) for s in range(S)]
                probs = torch.stack(scores).softmax(0)
                out[b, t, cols] = sum(p * v[b, s, cols] for p, s in zip(probs, range(S)))
    return F.linear(out, attn.proj.weight.double())  # qkv_bias: proj has no bias


def test_cross_attention_with_head_dim_apart_against_float64_loop():
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, block_size=16, n_layer=1, n_head=4, n_embd=32, head_dim=12, qkv_bias=True)
    attn = with_large_weights(Attention(config, cross=True))
    assert (attn.q.weight.shape, attn.proj.weight.shape, attn.proj.bias) == ((48, 32), (32, 48), None)
    x, context = torch.randn(2, 5, 32), torch.randn(2, 7, 32)
    expected = reference_attention(attn, x, context, head_dim=12).float()
    for need_weights in (False, True):
        torch.testing.assert_close(attn(x, context, need_weights=need_weights)[0], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("arch", "shapes"), [("gpt", [(2, 12)]), ("encoder", [(2, 12)]), ("encoder_decoder", [(3, 4), (3, 14)])]
)
def test_training_flops_with_head_dim_apart_match_a_flop_counter(arch, shapes):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    config = ModelConfig(
        arch=arch, vocab_size=VOCAB, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, d_ff=48, head_dim=12
    )
    model = build_model(config)
    inputs = [ids(*shape, seed=i) for i, shape in enumerate(shapes)]
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(*inputs, ids(*shapes[-1], seed=9))[1].backward()
    assert model.training_flops(*inputs) == counter.get_total_flops()


def test_kv_cache_of_an_encoder_decoder_with_head_dim_apart_matches_the_full_forward():
    config = ModelConfig(
        arch="encoder_decoder",
        vocab_size=VOCAB,
        block_size=16,
        n_layer=2,
        n_head=4,
        n_embd=32,
        head_dim=6,
        qkv_bias=True,
        qk_norm=True,
        pos_encoding="rope",
        rope_scaling={**SCALING, "original_max_position_embeddings": 8},
    )
    model = with_large_weights(build_model(config))
    src, tgt = ids(2, 9), ids(2, 12, seed=1)
    memory, src_mask = model.encode(src)
    full = model.decode(tgt, memory, src_mask)
    cache = model.new_cache()
    steps = [model.decode(tgt[:, t : t + 1], memory, src_mask, cache=cache) for t in range(12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-4, rtol=1e-4)


def test_default_settings_keep_the_state_dict_names_and_shapes():
    """head_dim None, qkv_bias False, rope_scaling None: the weights of every checkpoint from before them."""
    config = ModelConfig(vocab_size=VOCAB, block_size=16, n_layer=1, n_head=4, n_embd=32, **LLAMA)
    assert config.head_dim == 8
    state = GPT(config).state_dict()
    assert state["body.blocks.0.attn.qkv.weight"].shape == (96, 32) and "body.blocks.0.attn.qkv.bias" not in state
    unscaled = rope_tables(16, 8, config.rope_theta)
    torch.testing.assert_close(GPT(config).body.rope_cos, unscaled[0], rtol=0, atol=0)


# -----------------------------------------------------------------------------
# The hub, from a machine without the network


@pytest.mark.parametrize("offline", ["no connection", "HF_HUB_OFFLINE"])
def test_an_unreachable_hub_is_one_line_at_once_without_asking_it(offline, monkeypatch):
    """
    A hub id on a machine that cannot reach the hub fails in one line before huggingface_hub is asked (it retries for
    most of a minute, a log line each try): its connection refused here, or HF_HUB_OFFLINE set.
    """
    import huggingface_hub

    def refused(*args, **kwargs):
        raise TimeoutError(110, "Connection timed out")

    def asked(*args, **kwargs):
        raise AssertionError("huggingface_hub was asked")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", asked)
    if offline == "HF_HUB_OFFLINE":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        reason = "HF_HUB_OFFLINE is set"
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr(hf.socket, "create_connection", refused)
        reason = "no connection to huggingface.co: Connection timed out"
    with pytest.raises(FileNotFoundError) as error:
        hf.download_from_hub("gpt2")
    assert str(error.value).count("\n") == 0 and f"the Hugging Face hub is unreachable ({reason})" in str(error.value)


# -----------------------------------------------------------------------------
# GPT-2 weights from Hugging Face (moved from test_model.py: from_pretrained is hf.py's)


def test_parity_with_hugging_face_gpt2(tmp_path):
    import transformers  # a dev dependency (requirements-dev.txt)

    torch.manual_seed(0)
    hf_config = transformers.GPT2Config(vocab_size=97, n_positions=32, n_embd=48, n_layer=3, n_head=4)
    hf = transformers.GPT2LMHeadModel(hf_config).eval()
    with torch.no_grad():
        for p in hf.parameters():  # larger than the 0.02 init, so every weight (and bias) shows in the logits
            p.normal_(0, 0.2)
    x = torch.randint(0, 97, (2, 20))
    for safe in (True, False):  # model.safetensors and pytorch_model.bin
        hf.save_pretrained(tmp_path / str(safe), safe_serialization=safe)
        ours = from_pretrained(tmp_path / str(safe)).eval()
        torch.testing.assert_close(ours(x)[0], hf(x).logits, atol=1e-4, rtol=1e-4)
    hf_tokens = hf.generate(x[:, :5], max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(generate(ours, x[:, :5], 12, temperature=0), hf_tokens)


def test_from_pretrained_offline_names_what_to_pass(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="local directory"):
        from_pretrained("no-such-model-here")


def test_from_pretrained_rejects_a_longer_block_size(tmp_path):
    import transformers

    hf_config = transformers.GPT2Config(vocab_size=50, n_positions=8, n_embd=16, n_layer=1, n_head=2)
    transformers.GPT2LMHeadModel(hf_config).save_pretrained(tmp_path)
    assert from_pretrained(tmp_path, block_size=4).config.block_size == 4
    with pytest.raises(ValueError, match="block_size=16 is longer than the 8 positions"):
        from_pretrained(tmp_path, block_size=16)


# -----------------------------------------------------------------------------
# Llama and Mistral weights from Hugging Face


def hf_ids(*shape, seed=0):
    return torch.randint(1, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def save_hf(hf, folder, layout):
    """Write hf into folder as transformers does, in one of the file layouts from_pretrained reads."""
    if layout == "safetensors":
        hf.save_pretrained(folder)
    elif layout == "sharded safetensors":
        hf.save_pretrained(folder, max_shard_size="20KB")
        assert len(list(folder.glob("model-*.safetensors"))) > 1
    else:  # transformers 5 writes safetensors even when asked for pytorch_model.bin: write those files by hand
        hf.config.save_pretrained(folder)
        state = hf.state_dict()  # a tied model's lm_head.weight is in it, as in the .bin files of old transformers
        if layout == "bin":
            torch.save(state, folder / "pytorch_model.bin")
        else:  # "sharded bin": two shards and the index naming the shard of each tensor
            names = sorted(state)
            shards = {f"pytorch_model-0000{i + 1}-of-00002.bin": names[i::2] for i in range(2)}
            for file, keys in shards.items():
                torch.save({k: state[k] for k in keys}, folder / file)
            index = {"metadata": {}, "weight_map": {k: file for file, keys in shards.items() for k in keys}}
            (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))


def to_transformers4_layout(folder):
    """Rewrite config.json as transformers 4 wrote it: rope_theta at the top level, rope_scaling null."""
    config = json.loads((folder / "config.json").read_text())
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    config["rope_scaling"] = None
    (folder / "config.json").write_text(json.dumps(config))


LLAMA_CASES = {  # config changes, file layout, config.json as transformers 4 wrote it
    "gqa-untied": ({"num_key_value_heads": 2, "rope_theta": 500.0, "rms_norm_eps": 1e-3}, "safetensors", False),
    "mha-tied": (
        {"hidden_size": 48, "intermediate_size": 72, "tie_word_embeddings": True, "rope_theta": 1000.0},
        "sharded safetensors",
        False,
    ),
    "mqa-bias": (
        {"num_key_value_heads": 1, "attention_bias": True, "mlp_bias": True, "rms_norm_eps": 1e-2},
        "bin",
        True,
    ),
    "gqa-tied": ({"num_key_value_heads": 2, "tie_word_embeddings": True, "rope_theta": 100.0}, "sharded bin", True),
}


@pytest.mark.parametrize("case", LLAMA_CASES)
def test_parity_with_hugging_face_llama(tmp_path, case):
    import transformers

    changes, layout, transformers4 = LLAMA_CASES[case]
    torch.manual_seed(0)
    hf = with_large_weights(transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY_LLAMA, **changes})))
    save_hf(hf, tmp_path, layout)
    if transformers4:
        to_transformers4_layout(tmp_path)
    ours = from_pretrained(tmp_path).eval()
    c = hf.config
    assert (ours.config.n_kv_head, ours.config.d_ff, ours.config.bias) == (
        c.num_key_value_heads,
        c.intermediate_size,
        c.attention_bias,
    )
    assert ours.config.rope_theta == c.rope_parameters["rope_theta"] and ours.config.norm_eps == c.rms_norm_eps
    assert (ours.lm_head.weight is ours.body.wte.weight) == c.tie_word_embeddings
    x = hf_ids(2, 24)
    assert max_logit_difference(ours, hf, x) < 1e-4
    assert_same_greedy_tokens(ours, hf, x[:, :5])


def test_parity_with_hugging_face_mistral_sliding_window(tmp_path):
    import transformers

    torch.manual_seed(0)
    config = transformers.MistralConfig(**{**TINY_LLAMA, "num_key_value_heads": 2, "sliding_window": 4})
    hf = with_large_weights(transformers.MistralForCausalLM(config))
    hf.save_pretrained(tmp_path)
    ours = from_pretrained(tmp_path).eval()
    assert ours.config.window_size == 4
    x = hf_ids(2, 24)  # 24 positions, 20 of them past the window's first fill
    assert max_logit_difference(ours, hf, x) < 1e-4
    assert_same_greedy_tokens(ours, hf, x[:, :5], new_tokens=16)
    # the window shows in these logits: without it they are far off, so the check above would catch a lost window
    unwindowed = from_pretrained(tmp_path, window_size=0).eval()
    with torch.no_grad():
        assert (unwindowed(x)[0] - hf(x).logits).abs().max() > 0.1


@pytest.mark.parametrize(
    "config_class,changes,error",
    [
        ("LlamaConfig", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type='linear'"),
        ("LlamaConfig", {"hidden_act": "gelu"}, "hidden_act='gelu' is not implemented"),
        ("LlamaConfig", {"attention_bias": True}, "attention_bias=True but mlp_bias=False"),
        ("BertConfig", {}, "model_type='bert' model; from_pretrained loads gpt2, llama, mistral"),
    ],
)
def test_llama_configs_our_model_cannot_compute_are_one_line_errors(tmp_path, config_class, changes, error):
    """A complete folder whose config.json (as transformers writes it) asks for what the model does not implement."""
    import transformers

    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA)).save_pretrained(tmp_path)
    config = getattr(transformers, config_class)
    (config(**TINY_LLAMA, **changes) if config_class == "LlamaConfig" else config()).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=re.escape(error)) as e:
        from_pretrained(tmp_path)
    assert "\n" not in str(e.value)


def test_old_llama_rope_scaling_is_a_one_line_error(tmp_path):
    import transformers

    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA)).save_pretrained(tmp_path)
    to_transformers4_layout(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_scaling": {"type": "dynamic", "factor": 2.0}}))
    with pytest.raises(ValueError, match="rope_type='dynamic' .* is not implemented") as e:
        from_pretrained(tmp_path)
    assert "\n" not in str(e.value)


def test_llama_folders_that_do_not_fit_are_one_line_errors(tmp_path):
    import transformers

    def fails(error_type, match, folder, **overrides):
        with pytest.raises(error_type, match=match) as e:
            from_pretrained(folder, **overrides)
        assert "\n" not in str(e.value)

    def folder(name, layout="safetensors", **config_changes):
        """A saved tiny Llama whose config.json then gets config_changes."""
        path = tmp_path / name
        save_hf(transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA)), path, layout)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, **config_changes}))
        return path

    (tmp_path / "empty").mkdir()
    fails(FileNotFoundError, "has no config.json", tmp_path / "empty")
    no_weights = folder("no-weights")
    (no_weights / "model.safetensors").unlink()
    fails(FileNotFoundError, "has no weights: none of model.safetensors, model.safetensors.index.json", no_weights)
    sharded = folder("sharded", layout="sharded safetensors")
    sorted(sharded.glob("model-*.safetensors"))[1].unlink()
    fails(FileNotFoundError, "lacks 1 of the shards model.safetensors.index.json names", sharded)
    fails(ValueError, r"missing \['layers.2.input_layernorm.weight'", folder("deeper", num_hidden_layers=3))
    fails(ValueError, r"missing \[\] \(0 in all\), unexpected \['layers.1.", folder("shallower", num_hidden_layers=1))
    fails(
        ValueError, r"mlp.fc.weight is \(80, 32\) where the model has \(96, 32\)", folder("wider", intermediate_size=96)
    )
    fine = folder("fine")
    fails(ValueError, "overrides change which weights the model has", fine, qk_norm=True)
    fails(ValueError, "block_size=65 is longer than the 64 positions", fine, block_size=65)
    assert from_pretrained(fine, block_size=16).config.block_size == 16


@pytest.mark.parametrize("layout", ["sharded safetensors", "bin", "sharded bin"])
def test_gpt2_weights_from_bin_and_sharded_files(tmp_path, layout):
    """The file layouts of the Llama tests hold GPT-2 too (transformers 5 no longer writes pytorch_model.bin itself)."""
    import transformers

    torch.manual_seed(0)
    hf_config = transformers.GPT2Config(vocab_size=97, n_positions=32, n_embd=48, n_layer=2, n_head=4)
    hf = with_large_weights(transformers.GPT2LMHeadModel(hf_config))
    save_hf(hf, tmp_path, layout)
    x = hf_ids(2, 20) % 97
    with torch.no_grad():
        assert (from_pretrained(tmp_path)(x)[0] - hf(x).logits).abs().max() < 1e-4
