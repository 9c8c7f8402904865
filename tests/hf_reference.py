"""
transformers as the reference: what the parity tests of test_model.py, test_hf_families.py and test_export.py share.
A tiny Llama's settings, weights large enough to show a mix-up, and the two comparisons: logits, greedy tokens.
"""

import torch
import transformers  # a dev dependency (requirements-dev.txt): the reference; missing, the suite fails

from generate import generate

VOCAB = 101
# a tiny Llama; the tests vary the rest. max_position_embeddings becomes our block_size. No eos, so that
# transformers' generate never stops early; eager attention applies a sliding window in every transformers version.
TINY_LLAMA = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 80,  # 2.5x: not our default 4x
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
    "bos_token_id": None,
    "eos_token_id": None,
    "attn_implementation": "eager",
}


def with_large_weights(model, seed=0):
    """
    model (ours or transformers') with N(0, 0.2) weights and biases, N(1, 0.2) norm gains, in eval mode: the 0.02
    init leaves logits so flat that a mix-up (gate and up swapped, q and k norms swapped, the wrong GELU, theta or
    eps, a frequency left unscaled) hides within the tolerance.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(("norm" in name and name.endswith("weight")) + 0.2 * torch.randn(p.shape, generator=g))
    return model.eval()


def load_transformers(folder):
    """A folder as transformers loads it, in float32, after checking that every tensor found its place."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    return model.eval()


def max_logit_difference(ours, theirs, x):
    with torch.no_grad():
        return (ours(x)[0] - theirs(x).logits).abs().max().item()


def assert_same_greedy_tokens(ours, theirs, prompt, new_tokens=14):
    """transformers' greedy continuation is ours, with and without our KV cache."""
    expected = theirs.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
    )
    assert expected.shape == (prompt.size(0), prompt.size(1) + new_tokens)  # no early stop on an eos
    assert torch.equal(generate(ours, prompt, new_tokens, temperature=0), expected)
    assert torch.equal(generate(ours, prompt, new_tokens, temperature=0, use_cache=False), expected)
