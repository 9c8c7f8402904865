"""
The Transformer, read top to bottom: the config, norms and positions, attention (its mask and KV cache), the MLP
and the block, the Stack of blocks every model is built on, what the models share (initialisation, the head and the
loss with its chunk's size, parameter and FLOP counts), then the three models: GPT (decoder-only), Encoder
(BERT-style masked LM) and EncoderDecoder (the 2017 paper's). Generating from them is in generate.py; Hugging Face
and nanoGPT weights in hf.py.

Shape letters used in comments:
    B batch, T target (query) length, S source (key) length, H heads, D head dim,
    C channels (n_embd), V vocabulary, K beams. Keys and values have n_kv_head heads (H unless grouped-query).
"""

import math
import sys
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100  # targets with this value add nothing to the loss (padding, unmasked MLM positions)


ARCHS = ("gpt", "encoder", "encoder_decoder")
CHOICES = {
    "arch": ARCHS,
    "pos_encoding": ("learned", "sinusoidal", "rope"),
    "norm_position": ("pre", "post"),
    "norm": ("layernorm", "rmsnorm"),
    "activation": ("gelu", "gelu_tanh", "relu", "relu2", "swiglu"),
}
# rope_scaling's keys, as Llama 3.1's config.json names them: rope_type "llama3" (the only scaling implemented), how
# much slower the low frequencies turn, the band of frequencies blended between slowed and kept, and the context the
# model was first trained with (see llama3_frequencies)
ROPE_SCALING_KEYS = ("rope_type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass
class ModelSettings:
    """
    A model's shape and options: what a user chooses. train.py's TrainConfig takes these fields as its own, with
    these defaults; ModelConfig adds what the data decides.
    """

    arch: str = "gpt"  # "gpt" decoder-only LM, "encoder" masked LM (BERT-style), "encoder_decoder" (Vaswani et al.)
    block_size: int = 1024  # longest sequence (tokens per LM window, longest source or target of a pair)
    n_layer: int = 12  # blocks in the GPT, the encoder-only model, or the decoder of an encoder-decoder
    n_encoder_layer: int | None = None  # encoder blocks of an encoder-decoder; None: same as n_layer
    n_head: int = 12  # attention heads; n_embd must divide evenly among them unless head_dim is given
    n_kv_head: int | None = None  # key/value heads, shared by groups of query heads (1: multi-query); None: n_head
    n_embd: int = 768  # channels of the residual stream, C
    head_dim: int | None = None  # channels of each attention head, D; None: n_embd // n_head (Qwen3 sets its own)
    d_ff: int | None = None  # hidden width of the MLP; None: 4 * n_embd, for swiglu too (Llama's 8/3 is not applied)
    dropout: float = 0.0  # on embeddings, attention and residual branches; 0 to pretrain, 0.1+ to fine-tune
    bias: bool = False  # bias in Linears and norms (GPT-2 has them); without is a bit faster and as good
    qkv_bias: bool = False  # bias on the query, key and value projections only (Qwen2); bias=True implies it
    pos_encoding: str = "learned"  # "learned" (GPT-2), "sinusoidal" (the 2017 paper), "rope" (rotary)
    norm_position: str = "pre"  # "pre": norm inside each residual branch (GPT-2); "post": after the add (2017 paper)
    norm: str = "layernorm"  # "layernorm" or "rmsnorm"
    activation: str = "gelu"  # MLP: "gelu", "gelu_tanh" (GPT-2's), "relu" (2017 paper), "relu2" (squared), "swiglu"
    qk_norm: bool = False  # RMS-normalise each head's queries and keys (a learnable gain over D) before rotary
    logit_softcap: float = 0.0  # output logits become cap * tanh(logits / cap), within (-cap, cap) (Gemma 2); 0: off
    zero_init_proj: bool = False  # projections into the residual stream start at zero instead of GPT-2's scaled init
    tie_embeddings: bool = True  # output projection shares the (target) token embedding matrix
    share_embeddings: bool = False  # encoder_decoder: source and target share one embedding (one joint vocabulary)
    norm_eps: float = 1e-5  # epsilon of the norms
    rope_theta: float = 10000.0  # rotary base; larger values rotate slower
    rope_scaling: dict | None = None  # Llama 3's rotary scaling, a dict of ROPE_SCALING_KEYS; None: unscaled
    window_size: int = 0  # sliding window: attend to keys fewer than this many positions away (causal: earlier); 0: off


@dataclass
class ModelConfig(ModelSettings):
    """ModelSettings and what the data decides, checked, with None settings resolved: all a model is built from."""

    vocab_size: int = 50304  # GPT-2's 50257 rounded up to a multiple of 64 for faster matmuls
    pad_token_id: int | None = None  # positions holding this token are never attended to; None: no padding

    def __post_init__(self):
        for name, choices in CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {', '.join(choices)}")
        if self.n_encoder_layer is None:
            self.n_encoder_layer = self.n_layer
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.d_ff is None:
            self.d_ff = 4 * self.n_embd
        sizes = ("vocab_size", "block_size", "n_layer", "n_encoder_layer", "n_head", "n_kv_head", "n_embd", "d_ff")
        for name in sizes:
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.head_dim is None:
            if self.n_embd % self.n_head:
                raise ValueError(
                    f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}, or head_dim given explicitly"
                )
            self.head_dim = self.n_embd // self.n_head
        if not isinstance(self.head_dim, int) or self.head_dim < 1:
            raise ValueError(f"head_dim must be a positive integer or None (n_embd // n_head), got {self.head_dim!r}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_kv_head={self.n_kv_head} must divide n_head={self.n_head} into equal groups")
        if self.pos_encoding == "rope" and self.head_dim % 2:
            raise ValueError(f"pos_encoding='rope' needs an even head_dim, got {self.head_dim}")
        if self.rope_scaling is not None:
            self.check_rope_scaling()
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if not isinstance(self.window_size, int) or self.window_size < 0:
            raise ValueError(f"window_size must be a non-negative integer (0 = off), got {self.window_size!r}")
        if self.logit_softcap < 0:
            raise ValueError(f"logit_softcap must be >= 0 (0 = off), got {self.logit_softcap}")
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"pad_token_id={self.pad_token_id} must be in [0, vocab_size={self.vocab_size})")

    def check_rope_scaling(self):
        """ValueError unless rope_scaling is Llama 3's, complete, on a rotary model."""
        scaling = self.rope_scaling
        if not isinstance(scaling, dict) or scaling.get("rope_type") != "llama3":
            kind = scaling.get("rope_type") if isinstance(scaling, dict) else scaling
            raise ValueError(f"rope_scaling rope_type={kind!r} is not implemented; only 'llama3' (or None) is")
        if set(scaling) != set(ROPE_SCALING_KEYS):
            raise ValueError(f"rope_scaling must have exactly the keys {', '.join(ROPE_SCALING_KEYS)}, got {scaling}")
        if self.pos_encoding != "rope":
            raise ValueError(
                f"rope_scaling scales rotary positions: it needs pos_encoding='rope', not {self.pos_encoding!r}"
            )
        numbers = [scaling[k] for k in ROPE_SCALING_KEYS[1:]]
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in numbers):
            raise ValueError(f"rope_scaling's factors and original_max_position_embeddings must be positive: {scaling}")
        if scaling["low_freq_factor"] >= scaling["high_freq_factor"]:
            raise ValueError(f"rope_scaling needs low_freq_factor < high_freq_factor, got {scaling}")

    @classmethod
    def from_dict(cls, d):
        """Build from a dict such as a checkpoint's `dataclasses.asdict(config)`, rejecting unknown keys."""
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown model config keys: {', '.join(sorted(unknown))}")
        return cls(**d)

    def kv_cache_bytes(self, dtype):
        """
        Bytes of the KV cache (KVCache) that sampling one sequence of block_size positions fills: keys and values of
        every layer's self-attention (with a sliding window, the window - 1 kept positions and the newest one), and
        an encoder-decoder's cross-attention over a block_size source; an encoder samples nothing.
        """
        if self.arch == "encoder":
            return 0
        positions = self.block_size if not self.window_size else min(self.block_size, self.window_size)
        positions += self.block_size if self.arch == "encoder_decoder" else 0
        return self.n_layer * 2 * self.n_kv_head * self.head_dim * positions * dtype.itemsize


# the names of the settings a user picks (TrainConfig's model settings); the vocabulary and padding id are the data's
MODEL_KEYS = tuple(f.name for f in fields(ModelSettings))


# -----------------------------------------------------------------------------
# Norms and positions


def make_norm(config):
    """A LayerNorm or RMSNorm over the C channels, as config.norm says."""
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.n_embd, eps=config.norm_eps)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)


def sinusoid_table(length, dim, theta=10000.0):
    """The 2017 paper's fixed positions: sin on even channels, cos on odd, wavelengths from 2*pi to theta*2*pi."""
    pos = torch.arange(length, dtype=torch.float32)[:, None]
    inv_freq = theta ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(pos * inv_freq)
    table[:, 1::2] = torch.cos(pos * inv_freq[: dim // 2])
    return table  # (T, C)


def rope_tables(length, head_dim, theta, scaling=None):
    """
    cos and sin of the rotary angles, each (T, D/2): channel pair i of position t turns by t * theta^(-2i/D), or
    with scaling (ModelConfig.rope_scaling, Llama 3's) by t times that frequency as llama3_frequencies scales it.
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # (D/2,) radians per position
    if scaling is not None:
        inv_freq = llama3_frequencies(inv_freq, **{k: v for k, v in scaling.items() if k != "rope_type"})
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def llama3_frequencies(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings):
    """
    Llama 3.1's rotary frequencies for a context longer than the one it was first trained with (original, L).
    A frequency that turns more than high_freq_factor times within L (it has seen every angle) is kept; one that
    turns fewer than low_freq_factor times is divided by factor, so that the longer context spans the angles the
    shorter one did; between the two the result is blended linearly in the number of turns.
    """
    turns = original_max_position_embeddings * inv_freq / (2 * math.pi)  # full turns within L: L / wavelength
    # 1 where kept, 0 where slowed, linear between
    kept = ((turns - low_freq_factor) / (high_freq_factor - low_freq_factor)).clamp(0.0, 1.0)
    return (1 - kept) * inv_freq / factor + kept * inv_freq


def apply_rope(x, cos, sin):
    """
    Rotate channel pairs (i, i + D/2) of x (B, H, T, D) by the angles of its positions; cos, sin: (1, T, D/2), or
    (B, 1, T, D/2) when each row has positions of its own.
    """
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


# -----------------------------------------------------------------------------
# Attention


def attention_mask(q_len, k_len, causal, key_mask=None, window=0, device=None, positions=None):
    """
    The one mask helper: bool, True = may attend, shaped (B or 1, 1, Tq, Tk); None when every key is allowed.
    key_mask: (B, Tk) bool, True at real (non-padding) keys. window: keys fewer than this many positions from
    the query, 0 for all of them.
    Queries and keys are aligned to the lower right: the Tq queries are the last Tq of the Tk positions,
    so queries that continue a KV cache still see every earlier position (SDPA's is_causal would not).
    positions: (B, Tq), each row's own query positions instead, for a batch whose rows sit at different places in
    a KV cache (serve.py's): key k is position k of every row, and a row's keys past its query are not read.
    """
    mask = None
    if (causal and q_len > 1) or window or positions is not None:
        if positions is None:
            positions = torch.arange(k_len - q_len, k_len, device=device)  # (Tq,)
        distance = positions[..., None] - torch.arange(k_len, device=device)  # (Tq, Tk) or (B, Tq, Tk): how far back
        mask = torch.ones_like(distance, dtype=torch.bool)
        if causal:
            mask &= distance >= 0
        if window:
            mask &= distance.abs() < window
        mask = mask.view(-1, 1, q_len, k_len)  # (B or 1, 1, Tq, Tk)
    if key_mask is not None:
        keys = key_mask[:, None, None, :]  # (B, 1, 1, Tk)
        mask = keys if mask is None else mask & keys
        # A padded query may have no key left (all padding within its window, or before it): its softmax would be
        # 0/0 = NaN, which the next layer's 0 * NaN spreads to real positions. Such a row reads every key instead;
        # its output is padding's, read by no real position and no loss.
        mask = mask | ~mask.any(dim=-1, keepdim=True)
    return mask


MIN_CACHE = 256  # positions a KV cache first allocates (when block_size allows)


class KVCache:
    """
    Keys and values of one attention layer while decoding a few tokens at a time.
    Self-attention appends each step's new positions to buffers that grow as needed;
    cross-attention stores the projected encoder output once and reuses it.
    With grouped-query attention H below is n_kv_head: the cache holds the shared heads only.
    With a sliding window (window > 0) it keeps just the last window - 1 positions, all that a later query can
    still see, so its size stays fixed however long the decoding goes on.
    """

    def __init__(self, capacity, window=0):
        self.capacity = capacity  # the most positions the buffers will hold (the model's block_size)
        self.window = window
        self.k = self.v = None  # (B, H, up to capacity, D) for self-attention, (B, H, S, D) for cross-attention
        self.length = 0  # positions seen so far: the position of the next one

    def append(self, k, v):
        """
        Store k, v (B, H, T, D) after the cached positions; return the keys and values the new queries attend
        over: all positions so far, or with a window the kept ones and the new ones.
        """
        start, self.length = self.length, self.length + k.size(2)
        if self.window:
            if self.k is not None:
                k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)  # (B, H, kept + T, D)
            drop = max(0, k.size(2) - (self.window - 1))  # positions that no later query can see
            self.k, self.v = k[:, :, drop:], v[:, :, drop:]
            return k, v
        held = 0 if self.k is None else self.k.size(2)
        if self.length > held:
            # The buffers grow by doubling (from MIN_CACHE positions) up to capacity, so that memory follows the
            # positions decoded, not block_size: a model trained on 32k positions sampled for 500 tokens holds 1k.
            size = min(self.capacity, max(self.length, 2 * held, MIN_CACHE))
            grown = [t.new_empty((*t.shape[:2], size, t.shape[3])) for t in (k, v)]
            if held:  # the positions so far move over: one copy per doubling, a few in all
                grown[0][:, :, :start], grown[1][:, :, :start] = self.k[:, :, :start], self.v[:, :, :start]
            self.k, self.v = grown
        self.k[:, :, start : self.length] = k
        self.v[:, :, start : self.length] = v
        return self.k[:, :, : self.length], self.v[:, :, : self.length]

    def reorder(self, index):
        """Keep the batch rows in `index` (beam search moves each beam's history to its surviving children)."""
        if self.k is not None:
            self.k, self.v = self.k.index_select(0, index), self.v.index_select(0, index)


class Attention(nn.Module):
    """
    Multi-head scaled dot-product attention for all three uses, in two steps: project, then attend.
    Self-attention (attn(x)) projects queries, keys and values from x, causally if built with causal=True;
    cross-attention (built with cross=True, called as attn(x, context)) projects queries from x and keys and values
    from the context, the encoder's output. Both then attend alike.
    Grouped-query attention (n_kv_head < n_head) gives keys and values fewer heads, each one read by a group of
    n_head / n_kv_head consecutive query heads: fewer weights, and a KV cache smaller by that factor.
    """

    def __init__(self, config, causal=False, cross=False):
        super().__init__()
        self.n_head, self.n_kv_head, self.causal, self.dropout = config.n_head, config.n_kv_head, causal, config.dropout
        self.cross = cross
        self.window = 0 if cross else config.window_size  # cross-attention reads the whole context
        self.head_dim = config.head_dim  # D
        self.q_dim = config.n_head * self.head_dim  # H * D: C unless head_dim is set apart (Qwen3)
        self.kv_dim = config.n_kv_head * self.head_dim  # q_dim when n_kv_head == n_head
        C = config.n_embd
        qkv_bias = config.bias or config.qkv_bias  # Qwen2 has biases on q, k and v but not on proj
        if cross:  # queries and keys come from two sequences: a Linear for each
            self.q = nn.Linear(C, self.q_dim, bias=qkv_bias)
            self.kv = nn.Linear(C, 2 * self.kv_dim, bias=qkv_bias)  # rows W_k, W_v
        else:  # rows W_q (q_dim), W_k and W_v (kv_dim each) stacked in one Linear: one matmul, and GPT-2's c_attn
            self.qkv = nn.Linear(C, self.q_dim + 2 * self.kv_dim, bias=qkv_bias)
        self.proj = nn.Linear(self.q_dim, C, bias=config.bias)
        self.proj.residual = True  # scaled (or zeroed) at init, see TransformerModel.init_weights
        # qk_norm: RMSNorm over each head's D channels, one gain per channel shared by the heads, which keeps the
        # scores q . k bounded however large the projections grow
        if config.qk_norm:
            self.q_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps)
        else:  # no parameters: the state_dict is the same as before the option existed
            self.q_norm = self.k_norm = nn.Identity()

    def forward(self, x, context=None, key_mask=None, rope=None, cache=None, need_weights=False, positions=None):
        """
        x: (B, T, C). context: (B, S, C) for cross-attention, else None. key_mask: (B, S) bool, True at real keys.
        rope: (cos, sin) tables for the new positions (self-attention). cache: a KVCache or None. positions: (B, T)
        where each row's new positions sit in the cache, when rows differ (see attention_mask); None: after the
        cached ones. Returns (y (B, T, C), attention probabilities (B, H, T, S) if need_weights else None).
        """
        if self.cross:
            q, k, v = self.project_cross(x, context, cache)
        else:
            q, k, v = self.project_self(x, rope, cache)
        y, weights = self.attend(q, k, v, key_mask, need_weights, positions)  # (B, H, T, D)
        # Merge heads: put the H heads' D channels side by side again, then mix them with the output projection
        B, T, _ = x.shape
        y = y.transpose(1, 2).contiguous().view(B, T, self.q_dim)  # (B, T, H * D)
        return self.proj(y), weights  # (B, T, C)

    def project_self(self, x, rope, cache):
        """
        Self-attention's q (B, H, T, D) and k, v (B, n_kv_head, S, D) from x (B, T, C) in one matmul; S is T, or with
        a cache the cached positions and these T.
        """
        q, k, v = map(self.split_heads, self.qkv(x).split([self.q_dim, self.kv_dim, self.kv_dim], dim=2))
        # qk_norm normalises each head's q and k over D before anything else (rotary positions, caching)
        q, k = self.q_norm(q), self.k_norm(k)
        # keys are turned before caching, so that a cached key keeps its own position
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:  # the new positions join the earlier ones, and the queries attend over all of them
            k, v = cache.append(k, v)  # (B, n_kv_head, cached + T, D)
        return q, k, v

    def project_cross(self, x, context, cache):
        """
        Cross-attention's q (B, H, T, D) from x (B, T, C), k and v (B, n_kv_head, S, D) from the context (B, S, C).
        No rotary positions: queries and keys lie in different sequences. With a cache the context, the same at
        every decoding step, is projected at the first step only.
        """
        q = self.q_norm(self.split_heads(self.q(x)))
        if cache is not None and cache.k is not None:
            return q, cache.k, cache.v  # projected (and normalised) at the first step
        k, v = map(self.split_heads, self.kv(context).split(self.kv_dim, dim=2))
        k = self.k_norm(k)
        if cache is not None:
            cache.k, cache.v = k, v
        return q, k, v

    def split_heads(self, t):
        """(B, L, n * D) -> (B, n, L, D): each of the n heads (query or key/value) gets its own D channels."""
        B, L, _ = t.shape
        return t.view(B, L, -1, self.head_dim).transpose(1, 2)

    def attend(self, q, k, v, key_mask, need_weights, positions=None):
        """
        softmax(q k^T / sqrt(D)) v over the keys attention_mask allows: q (B, H, T, D), k and v (B, n_kv_head, S, D).
        Returns (y (B, H, T, D), probabilities (B, H, T, S) if need_weights else None).
        """
        T, S = q.size(2), k.size(2)
        dropout = self.dropout if self.training else 0.0
        # nothing cached, no padding, every row at the same positions: SDPA's own (upper-left) triangle is right and
        # allows the flash kernel
        is_causal = self.causal and S == T and key_mask is None and positions is None
        is_causal = is_causal and not self.window and not need_weights
        # else (B|1, 1, T, S) or None; a window needs an explicit mask, which rules out the flash kernel on GPUs
        mask = None
        if not is_causal:
            mask = attention_mask(
                T, S, causal=self.causal, key_mask=key_mask, window=self.window, device=q.device, positions=positions
            )
        # Grouped-query attention: query head h reads key/value head h // (n_head / n_kv_head). SDPA reads the shared
        # heads in place (enable_gqa) in CPU's kernel, masked or not, and on GPUs in the flash kernel (bfloat16, no
        # mask, D <= 256). GPUs' other kernels do not take grouped heads, so SDPA would fall back to its math kernel,
        # which holds every (T, S) score: for those, and for the spelled-out product below, the heads are repeated.
        in_place = q.device.type == "cpu" or (mask is None and q.dtype == torch.bfloat16 and self.head_dim <= 256)
        if self.n_kv_head != self.n_head and (need_weights or not in_place):
            k, v = (t.repeat_interleave(self.n_head // self.n_kv_head, dim=1) for t in (k, v))  # (B, H, S, D) each
        if not need_weights:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal, enable_gqa=k.size(1) < q.size(1)
            )
            return y, None
        # the same computation spelled out, so that the probabilities can be returned
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)  # (B, H, T, S)
        if mask is not None:
            scores = scores.masked_fill(mask.logical_not(), float("-inf"))
        weights = scores.softmax(dim=-1)
        return F.dropout(weights, dropout, self.training) @ v, weights


# -----------------------------------------------------------------------------
# MLP and block


class ReLUSquared(nn.Module):
    """relu(x)^2: as cheap as ReLU, and in the Primer paper (So et al. 2021) it trained language models faster."""

    def forward(self, x):
        return F.relu(x).square()


def make_activation(name):
    """The MLP's nonlinearity, by ModelConfig.activation name; "swiglu" gives its gate's SiLU."""
    if name == "relu":  # in place: nothing else needs the Linear's output, so no second buffer to allocate and fill
        return nn.ReLU(inplace=True)
    if name == "relu2":
        return ReLUSquared()
    if name == "swiglu":
        return nn.SiLU()
    return nn.GELU(approximate="tanh" if name == "gelu_tanh" else "none")


class MLP(nn.Module):
    """
    The position-wise feed-forward network: C -> d_ff, nonlinearity, d_ff -> C, the same at every position.
    swiglu (Shazeer 2020, Llama) gates it: proj(silu(fc(x)) * up(x)), with a third C x d_ff matrix `up`.
    """

    def __init__(self, config):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, config.d_ff, bias=config.bias)  # swiglu: the gate
        self.up = nn.Linear(config.n_embd, config.d_ff, bias=config.bias) if config.activation == "swiglu" else None
        self.act = make_activation(config.activation)
        self.proj = nn.Linear(config.d_ff, config.n_embd, bias=config.bias)
        self.proj.residual = True  # scaled (or zeroed) at init, see TransformerModel.init_weights

    def forward(self, x):
        h = self.act(self.fc(x))  # (B, T, C) -> (B, T, d_ff)
        if self.up is not None:
            h = h * self.up(x)  # swiglu: the SiLU of the gate scales each channel of a second projection
        return self.proj(h)  # (B, T, d_ff) -> (B, T, C)


class Block(nn.Module):
    """
    One layer: self-attention, cross-attention over a context (decoder blocks built with cross=True), MLP.
    Each is a residual branch with its own norm; norm_position decides whether the norm sits inside the branch
    (pre-norm, GPT-2) or after the residual add (post-norm, the 2017 paper). The vertical line is the residual
    stream x; the cross-attention's queries come from it, its keys and values from the context:

        pre-norm                                        post-norm

        x                                               x
        |---> norm1 -> self-attn -> dropout -------.    |---> self-attn -> dropout ---------.
        |                                          |    |                                   |
        (+) <--------------------------------------'    (+) <-------------------------------'
        |                                               norm1
        |---> norm_cross -> cross-attn -> dropout -.    |---> cross-attn -> dropout --------.
        |                   ^ context              |    |     ^ context                     |
        (+) <--------------------------------------'    (+) <-------------------------------'
        |                                               norm_cross
        |---> norm2 -> MLP -> dropout -------------.    |---> MLP -> dropout ---------------.
        |                                          |    |                                   |
        (+) <--------------------------------------'    (+) <-------------------------------'
        |                                               norm2
        out                                             out

    Pre-norm leaves the residual stream itself unnormalised, so a pre-norm Stack ends with one more norm.
    """

    def __init__(self, config, causal, cross):
        super().__init__()
        self.pre_norm = config.norm_position == "pre"
        self.norm1, self.attn = make_norm(config), Attention(config, causal=causal)
        if cross:
            self.norm_cross, self.cross_attn = make_norm(config), Attention(config, cross=True)
        self.norm2, self.mlp = make_norm(config), MLP(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(
        self,
        x,
        *,
        key_mask=None,
        rope=None,
        context=None,
        context_mask=None,
        cache=None,
        need_weights=False,
        positions=None,
    ):
        """
        x: (B, T, C). key_mask: (B, T) bool, True at real positions. rope: (cos, sin) tables or None.
        context: (B, S, C) encoder output to cross-attend to, with context_mask (B, S) or None.
        cache: (self-attention KVCache, cross-attention KVCache or None) or None. positions: see Attention.forward.
        Returns (x (B, T, C), maps): maps["self"] (B, H, T, keys) and, given a context, maps["cross"] (B, H, T, S),
        each None unless need_weights.
        """
        self_cache, cross_cache = cache if cache is not None else (None, None)
        # self-attention over x: causal in GPT and decoder blocks, bidirectional in encoder blocks
        h = self.branch_input(x, self.norm1)
        out, self_map = self.attn(
            h, key_mask=key_mask, rope=rope, cache=self_cache, need_weights=need_weights, positions=positions
        )
        x = self.add(x, out, self.norm1)
        maps = {"self": self_map}

        if context is not None:  # cross-attention: every target position may read every real source position
            h = self.branch_input(x, self.norm_cross)
            out, maps["cross"] = self.cross_attn(
                h, context, key_mask=context_mask, cache=cross_cache, need_weights=need_weights
            )
            x = self.add(x, out, self.norm_cross)

        # the MLP, on each position by itself
        h = self.branch_input(x, self.norm2)
        x = self.add(x, self.mlp(h), self.norm2)
        return x, maps

    def branch_input(self, x, norm):
        """What a sublayer reads: norm(x) in a pre-norm block, x itself in a post-norm one."""
        return norm(x) if self.pre_norm else x

    def add(self, x, out, norm):
        """The residual add of a sublayer's output. pre: x + out, GPT-2 style. post: norm(x + out), the 2017 paper."""
        return x + self.drop(out) if self.pre_norm else norm(x + self.drop(out))


# -----------------------------------------------------------------------------
# The body shared by every model: embeddings, positions, blocks, final norm


class Stack(nn.Module):
    """Token embedding + positions, a stack of blocks, and (pre-norm only) a final norm."""

    def __init__(self, config, n_layer, causal, cross, wte=None):
        super().__init__()
        self.config = config
        self.wte = wte if wte is not None else nn.Embedding(config.vocab_size, config.n_embd)
        if config.pos_encoding == "learned":
            self.wpe = nn.Embedding(config.block_size, config.n_embd)
        else:  # fixed tables, computed from the config (not saved in checkpoints)
            for name, table in self.position_tables().items():
                self.register_buffer(name, table, persistent=False)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, causal=causal, cross=cross) for _ in range(n_layer))
        # Post-norm blocks end with a norm already; pre-norm stacks need one before the head (GPT-2's ln_f).
        self.norm = make_norm(config) if config.norm_position == "pre" else nn.Identity()
        # activation checkpointing (set_activation_checkpointing): keep only each block's input for the backward
        self.checkpoint_blocks = False

    def position_tables(self):
        """The fixed position tables by buffer name: sinusoidal "pe" (T, C), or rotary "rope_cos" and "rope_sin"."""
        c = self.config
        if c.pos_encoding == "sinusoidal":
            return {"pe": sinusoid_table(c.block_size, c.n_embd)}
        if c.pos_encoding == "rope":
            cos, sin = rope_tables(c.block_size, c.head_dim, c.rope_theta, c.rope_scaling)
            return {"rope_cos": cos, "rope_sin": sin}
        return {}

    def forward(
        self, idx, key_mask=None, context=None, context_mask=None, cache=None, need_weights=False, positions=None
    ):
        """
        idx: (B, T) token ids; key_mask: (B, T) bool, True at real tokens, or None.
        context, context_mask: the encoder output (B, S, C) and its key mask (B, S), for cross-attending blocks.
        cache: a list with one (KVCache, KVCache or None) per block. Returns (x (B, T, C), one dict of maps per block).
        positions: (B, T), where each row's tokens sit, for a batch whose rows are at different places in a cache
        built for it (serve.py's, whose append stores each row's keys at its positions; each below block_size);
        None: after the cached positions, the same in every row.
        """
        T = idx.size(1)
        if positions is None:
            start = cache[0][0].length if cache is not None else 0  # position of idx[:, 0]: after the cached ones
            if start + T > self.config.block_size:
                raise ValueError(
                    f"sequence of length {start + T} is longer than block_size={self.config.block_size}: "
                    f"crop it to the last {self.config.block_size} tokens or train with a larger block_size"
                )
        # the rows of the position tables to read: (T,) the same for every row, or (B, T)
        at = slice(start, start + T) if positions is None else positions
        x = self.wte(idx)  # (B, T, C)
        rope = None  # rotary positions are applied inside attention, to q and k, instead of added here
        if self.config.pos_encoding == "learned":
            x = x + self.wpe.weight[at]
        elif self.config.pos_encoding == "sinusoidal":
            # the paper scales embeddings by sqrt(C) so they are not drowned by the unit-amplitude sinusoids
            x = x * math.sqrt(self.config.n_embd) + self.pe[at].to(x.dtype)
        else:
            # (1, T, D/2) or (B, 1, T, D/2) each: broadcast over the heads
            rope = (self.rope_cos[at].unsqueeze(-3), self.rope_sin[at].unsqueeze(-3))
        x = self.drop(x)
        maps = []
        # recomputed blocks only where a backward will come: in training, with gradients on
        recompute = self.checkpoint_blocks and self.training and torch.is_grad_enabled()
        for i, block in enumerate(self.blocks):
            inputs = dict(
                key_mask=key_mask,
                rope=rope,
                context=context,
                context_mask=context_mask,
                cache=cache[i] if cache is not None else None,
                need_weights=need_weights,
                positions=positions,
            )
            if recompute:
                # the block's forward runs again in the backward, with the same dropout masks (the RNG state is
                # saved), instead of keeping its intermediate activations: memory for one more forward's compute
                x, block_maps = checkpoint(block, x, use_reentrant=False, **inputs)
            else:
                x, block_maps = block(x, **inputs)
            maps.append(block_maps)
        return self.norm(x), maps


# -----------------------------------------------------------------------------
# Shared model machinery: init, head and loss, counting

# float32 logits the loss computes at a time (see TransformerModel.head_and_loss), unless a model's loss_chunk_bytes
# says otherwise. On CPUs glibc serves allocations below its 32 MiB mmap threshold from a heap it reuses, instead of
# mapping and zeroing fresh pages every step (docs/performance.md, "What moved the numbers"). It is also the smallest
# chunk a GPU's sizing gives (compiling.loss_chunk_budget). On a GPU train.py sizes the chunk from a trial step
# (compiling.sized_loss_chunk): a micro-batch's whole logits mostly fit, and then no chunk is computed twice.
LOSS_CHUNK_BYTES = 16 * 2**20
ACCELERATOR_LOSS_CHUNK_BYTES = 2**30


def loss_chunk_cap(total_bytes):
    """
    The largest loss chunk on a GPU of total_bytes: an eighth of the card. GPT-2 124M's micro-batches of 12 and 24 x
    1024 positions (2.3 and 4.6 GiB of float32 logits) stay one chunk on an 80 GB card, where computing the loss once
    instead of twice for most chunks took 8% off a step (docs/performance.md#gpus); eager autograd's three copies of
    a chunk (the head's output, its float32 cast, the log-probabilities) then take at most 3/8 of the card, not the
    3/4 that a quarter of the free memory let them take.
    """
    return total_bytes // 8


def default_inits_discarded():
    """
    A context in which PyTorch's modules draw their default initialisation from a copy of the random generator,
    thrown away after it: init_weights overwrites every such value, and its own draws then start from the seed as
    they would on the meta device, where nothing is drawn. So build_model(config) after torch.manual_seed(s) is
    the same model as one built on the meta device and initialised later with the same seed.
    """
    return torch.random.fork_rng(devices=[])


def init_normal(param, std):
    """
    nn.init.normal_(param, 0, std), also for a parameter sharded over processes (a DTensor, under FSDP): that one is
    drawn whole on the CPU, as an unsharded model's would be, and each process keeps its own part, so a sharded
    model starts with the same weights as an unsharded one. Every process must draw with the same seed.
    """
    # a DTensor exists only once FSDP has imported its module: a model in one process never pays for the import
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is None or not isinstance(param, dtensor.DTensor):
        return nn.init.normal_(param, 0.0, std)
    whole = torch.empty(param.shape).normal_(0.0, std)
    # src_data_rank=None: each process slices its own copy; nothing is sent
    part = dtensor.distribute_tensor(whole.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    part = part.to_local()
    with torch.no_grad():
        param.to_local().copy_(part)


class TransformerModel(nn.Module):
    """What the three models share: GPT-2 initialisation, the head and loss, parameter and FLOP counts."""

    # float32 logits the loss computes at a time; None: LOSS_CHUNK_BYTES on a CPU, ACCELERATOR_LOSS_CHUNK_BYTES on
    # other devices. train.py sizes it on a GPU from a trial step, plan.py takes the planned GPU's cap
    loss_chunk_bytes = None

    @torch.no_grad()
    def init_weights(self):
        """
        Give every parameter its initial value and compute the position tables. The constructors call it; a model
        built on the meta device (no memory, for models too large to build in one place) calls it after to_empty:
            with torch.device("meta"):
                model = build_model(config)
            model.to_empty(device="cuda")
            model.init_weights()
        Given the same random seed, that is the same model as one built in memory (build_model), also when FSDP
        has sharded the parameters over several processes in between (see init_normal).
        """
        # GPT-2: N(0, 0.02) everywhere; projections that write into the residual stream are scaled by
        # 1/sqrt(2 * n_layer) so the stream's variance does not grow with depth. zero_init_proj starts them at 0
        # (modded-nanogpt): every block begins as the identity, and their gradients are not zero, so they still learn.
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        # Tied before anything is drawn (to_empty unties them): the shared matrix is initialised once, as the
        # embedding it is, and the head's Linear leaves it alone below
        embedding = self.decoder.wte if isinstance(self, EncoderDecoder) else self.body.wte
        if self.config.tie_embeddings:
            self.lm_head.weight = embedding.weight
        for module in self.modules():
            if isinstance(module, Stack):
                for name, table in module.position_tables().items():
                    getattr(module, name).copy_(table)  # computed on the CPU, copied to wherever the buffer lives
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                module.reset_parameters()  # gains 1, biases 0
            elif isinstance(module, nn.Linear) and module.weight is not embedding.weight:
                if getattr(module, "residual", False) and self.config.zero_init_proj:
                    nn.init.zeros_(module.weight)
                else:
                    init_normal(module.weight, residual_std if getattr(module, "residual", False) else 0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                init_normal(module.weight, 0.02)

    def key_mask(self, idx):
        """(B, T) bool, True at real tokens; None when the model has no pad_token_id."""
        return None if self.config.pad_token_id is None else idx != self.config.pad_token_id

    def head_and_loss(self, x, targets, label_smoothing, reduction, return_logits):
        """
        The head over x (B, T, C) and, given targets (B, T), the cross-entropy in float32, computed a chunk of
        positions at a time so that the float32 logits are never whole (loss_chunk_bytes). In training every chunk's
        head and loss but the last run again in the backward instead of keeping their float32 log-probabilities, so
        that those of one chunk at most are held at a time; a micro-batch that fits one chunk is computed once.
        reduction: "mean" over the targets that are not IGNORE_INDEX, or "sum". Returns (logits (B, T, V) or None if
        not return_logits, loss).
        """
        if targets is None:
            return (self.head(x) if return_logits else None), None
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        # positions per chunk: as many as fit their float32 logits (4 bytes each of V) in the budget
        budget = self.loss_chunk_bytes
        if budget is None:
            budget = LOSS_CHUNK_BYTES if x.device.type == "cpu" else ACCELERATOR_LOSS_CHUNK_BYTES
        rows = max(1, budget // (4 * self.config.vocab_size))
        # Autograd would keep every chunk's float32 log-probabilities for the backward: B * T * V * 4 bytes in all
        # (2.5 GB for gpt2.py). Every chunk but the last runs again in the backward instead, from its inputs. The last
        # one's are the first the backward needs: recomputing them would cost time and lower no peak.
        x_chunks, target_chunks = x.flatten(0, 1).split(rows), targets.flatten().split(rows)
        loss, chunks = torch.zeros((), device=x.device), []
        # batch and time flattened into one axis of B * T positions, cut into chunks of `rows`
        for i, (x_chunk, target_chunk) in enumerate(zip(x_chunks, target_chunks)):
            inputs = (x_chunk, target_chunk, label_smoothing, return_logits)
            if torch.is_grad_enabled() and i < len(x_chunks) - 1:
                # no dropout nor any other randomness in the head: no generator state to save and restore
                chunk_loss, logits = checkpoint(self.chunk_loss, *inputs, use_reentrant=False, preserve_rng_state=False)
            else:
                chunk_loss, logits = self.chunk_loss(*inputs)
            # summed here and divided once at the end, so that chunks of any size weigh the same per target
            loss = loss + chunk_loss
            if return_logits:
                chunks.append(logits)
        if reduction == "mean":
            loss = loss / (targets != IGNORE_INDEX).sum()  # NaN when every target is ignored, as F.cross_entropy
        return (torch.cat(chunks).view(*targets.shape, -1) if return_logits else None), loss

    def chunk_loss(self, x, targets, label_smoothing, return_logits):
        """
        One chunk of head_and_loss: x (N, C), targets (N,). Returns (the float32 cross-entropy summed over the targets
        that are not IGNORE_INDEX, the logits (N, V) in the model's dtype if return_logits else None).
        """
        projected = self.unembed(x)  # (N, V), in the model's dtype
        logits = self.softcap(projected).float()
        loss = F.cross_entropy(
            logits, targets, ignore_index=IGNORE_INDEX, label_smoothing=label_smoothing, reduction="sum"
        )
        return loss, (logits.to(projected.dtype) if return_logits else None)

    def head(self, x):
        """Hidden states (..., C) -> logits (..., V), in the model's dtype."""
        projected = self.unembed(x)
        return self.softcap(projected).to(projected.dtype)

    def unembed(self, x):
        """
        Hidden states (..., C) -> the output projection's logits (..., V), before any soft-cap. Encoder adds BERT's
        transform before the projection.
        """
        return self.lm_head(x)

    def softcap(self, logits):
        """
        cap * tanh(logits / cap) with config.logit_softcap as the cap (Gemma 2): every logit stays within (-cap, cap)
        in training, evaluation and sampling alike. Computed in float32 (the result is float32), so that bfloat16
        logits are rounded once, not after each of the three operations. The logits unchanged when the cap is 0.
        """
        cap = self.config.logit_softcap
        return cap * torch.tanh(logits.float() / cap) if cap else logits

    def num_params(self):
        """Parameters, each shared tensor counted once (parameters() yields a tied weight once)."""
        return sum(p.numel() for p in self.parameters())

    def training_flops(self, *inputs):
        """
        FLOPs of one forward and backward pass over a batch, from the shapes of the inputs forward() takes: (B, T) idx,
        or (B, S) src and (B, T) tgt. Matmuls only, 2 FLOPs per multiply-add, times 3 for forward and backward (which
        multiplies twice, for the gradients of both operands): each weight on the tokens it multiplies, attention over
        the real lengths: T * T (query, key) pairs even when causal, as the dense kernels compute them, but with a
        sliding window only the pairs inside it (about T * W). Model FLOPs utilisation: this per second over
        peak_flops(device).
        """
        c = self.config
        C = c.n_embd
        Q = c.n_head * c.head_dim  # width of the queries: C unless head_dim is set apart
        KV = c.n_kv_head * c.head_dim  # width of the keys and of the values: Q unless grouped-query
        mlp = (3 if c.activation == "swiglu" else 2) * C * c.d_ff  # swiglu's gate adds a third C x d_ff matrix

        def pairs(T, causal):
            """(query, key) pairs that self-attention over T positions scores."""
            if not c.window_size:
                return T * T
            # keys 1 .. W - 1 positions back from query t: min(t, W - 1) of them, summed over t in closed form
            reach = min(c.window_size - 1, T)
            back = reach * (reach - 1) // 2 + (T - reach) * reach
            # each query's own position, the earlier keys in reach, and when not causal as many later ones
            return T + (1 if causal else 2) * back

        def stack(B, T, n_layer, causal):
            """Multiply-adds of self-attention blocks over (B, T) tokens."""
            # per token: the q and out projections (C x Q each), k and v (C x KV each), the MLP's matrices;
            # per (query, key) pair: one score q . k and one term of the weighted sum of v, Q each (every query head)
            return n_layer * B * (T * (2 * C * Q + 2 * C * KV + mlp) + 2 * pairs(T, causal) * Q)

        if c.arch == "encoder_decoder":
            src, tgt = inputs
            (B, S), T = src.shape, tgt.size(1)
            # cross-attention: q and out on the targets, k and v on the source, scores and weighted sum over T * S
            cross = c.n_layer * B * (2 * T * C * Q + 2 * S * C * KV + 2 * T * S * Q)
            macs = stack(B, S, c.n_encoder_layer, causal=False) + stack(B, T, c.n_layer, causal=True) + cross
        else:
            (idx,) = inputs
            B, T = idx.shape
            macs = stack(B, T, c.n_layer, causal=c.arch == "gpt")
            macs += B * T * C * C if c.arch == "encoder" else 0  # BERT's transform
        macs += B * T * C * c.vocab_size  # the head, once even when tied to the embedding (a lookup costs nothing)
        return 6.0 * macs  # 2 FLOPs per multiply-add, times 3 for forward and backward

    def set_activation_checkpointing(self, enabled=True):
        """
        Recompute each block's activations in the backward instead of storing them (Chen et al. 2016): the memory
        for activations falls from all of every block's intermediates to the blocks' inputs, for about one more
        forward pass of compute per step. Gradients are unchanged.
        """
        for module in self.modules():
            if isinstance(module, Stack):
                module.checkpoint_blocks = enabled
        return self

    def block_matrices(self):
        """The 2-D weights inside the blocks (attention qkv/proj, cross-attention q/kv/proj, MLP fc/up/proj): Muon's."""
        return [p for m in self.modules() if isinstance(m, Block) for p in m.parameters() if p.dim() == 2]

    def new_cache(self):
        """An empty KV cache for incremental decoding: one (self, cross) pair of KVCaches per decoder block."""
        cross = self.config.arch == "encoder_decoder"
        size = self.config.block_size
        window = self.config.window_size
        return [(KVCache(size, window), KVCache(size) if cross else None) for _ in range(self.config.n_layer)]


# -----------------------------------------------------------------------------
# The three models


class GPT(TransformerModel):
    """Decoder-only causal language model."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        with default_inits_discarded():
            self.body = Stack(config, n_layer=config.n_layer, causal=True, cross=False)
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.init_weights()

    def forward(self, idx, targets=None, *, label_smoothing=0.0, reduction="mean", return_logits=True):
        """
        idx, targets: (B, T). Returns (logits (B, T, V), cross-entropy or None without targets).
        label_smoothing and reduction as in F.cross_entropy: "mean" over the targets that are not IGNORE_INDEX, or
        "sum". return_logits=False gives None for the logits, so that training never holds the whole (B, T, V).
        """
        x, _ = self.body(idx)
        return self.head_and_loss(
            x, targets, label_smoothing=label_smoothing, reduction=reduction, return_logits=return_logits
        )

    def attention_maps(self, idx):
        """Attention probabilities of every layer for one forward pass: a list of {"self": (B, H, T, T)}."""
        return self.body(idx, need_weights=True)[1]

    def grow_vocabulary(self, vocab_size):
        """
        The token embedding (and the head, if untied) grown in place to vocab_size rows, for data whose chat tokens
        lie beyond the model's vocabulary. Each new row is the mean of the existing rows (Hewitt 2021): a new id's
        logit starts as the average of the others', so the distribution over the old ids barely moves and no new
        token starts out likely; the rows then differ by training. The old rows and their logits are unchanged.
        """
        wte, head = self.body.wte, self.lm_head
        added = vocab_size - wte.num_embeddings

        def grown(weight):
            mean = weight.detach().float().mean(0, keepdim=True).to(weight.dtype)
            return nn.Parameter(torch.cat([weight.detach(), mean.expand(added, -1)]), weight.requires_grad)

        tied = head.weight is wte.weight
        wte.weight = grown(wte.weight)
        head.weight = wte.weight if tied else grown(head.weight)
        wte.num_embeddings = head.out_features = vocab_size
        # the one config object the model and its stack share: its vocabulary is now vocab_size ids
        self.config.vocab_size = vocab_size
        return self


class Encoder(TransformerModel):
    """Encoder-only masked language model (BERT-style): bidirectional attention, a head over every position."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        with default_inits_discarded():
            self.body = Stack(config, n_layer=config.n_layer, causal=False, cross=False)
            # BERT's prediction head: a dense layer and a norm before the projection to the vocabulary. A single
            # Linear has nothing to gate, so a swiglu model uses GELU here (BERT's); the others as they are.
            self.transform = nn.Sequential(
                nn.Linear(config.n_embd, config.n_embd, bias=config.bias),
                make_activation("gelu" if config.activation == "swiglu" else config.activation),
                make_norm(config),
            )
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.init_weights()

    def forward(self, idx, targets=None, *, label_smoothing=0.0, reduction="mean", return_logits=True):
        """
        idx: (B, T) with masked positions; targets: the original ids there, IGNORE_INDEX elsewhere.
        Returns (logits, loss) as GPT.forward does.
        """
        x, _ = self.body(idx, key_mask=self.key_mask(idx))
        return self.head_and_loss(
            x, targets, label_smoothing=label_smoothing, reduction=reduction, return_logits=return_logits
        )

    def unembed(self, x):
        """BERT's transform, then the projection: (..., C) -> (..., V), before any soft-cap."""
        return self.lm_head(self.transform(x))

    def attention_maps(self, idx):
        """A list of {"self": (B, H, T, T)}, one per layer."""
        return self.body(idx, key_mask=self.key_mask(idx), need_weights=True)[1]


class EncoderDecoder(TransformerModel):
    """The original Transformer: a bidirectional encoder over the source, a causal decoder that cross-attends to it."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        with default_inits_discarded():
            self.encoder = Stack(config, n_layer=config.n_encoder_layer, causal=False, cross=False)
            shared = self.encoder.wte if config.share_embeddings else None
            self.decoder = Stack(config, n_layer=config.n_layer, causal=True, cross=True, wte=shared)
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.init_weights()

    def encode(self, src):
        """src: (B, S). Returns (memory (B, S, C), source key mask (B, S) or None)."""
        src_mask = self.key_mask(src)
        return self.encoder(src, key_mask=src_mask)[0], src_mask

    def decode(self, tgt, memory, src_mask, cache=None):
        """tgt: (B, T) decoder input (right-padded; the causal mask keeps real positions off the padding)."""
        x, _ = self.decoder(tgt, context=memory, context_mask=src_mask, cache=cache)
        return self.head(x)  # (B, T, V)

    def forward(self, src, tgt, targets=None, *, label_smoothing=0.0, reduction="mean", return_logits=True):
        """
        src: (B, S) source ids, tgt: (B, T) target ids starting with BOS, targets: tgt shifted left.
        Returns (logits, loss) as GPT.forward does.
        """
        memory, src_mask = self.encode(src)
        x, _ = self.decoder(tgt, context=memory, context_mask=src_mask)
        return self.head_and_loss(
            x, targets, label_smoothing=label_smoothing, reduction=reduction, return_logits=return_logits
        )

    def attention_maps(self, src, tgt):
        """{"encoder": [{"self"}...], "decoder": [{"self", "cross"}...]}, each map (B, H, Tq, Tk)."""
        src_mask = self.key_mask(src)
        memory, enc_maps = self.encoder(src, key_mask=src_mask, need_weights=True)
        dec_maps = self.decoder(tgt, context=memory, context_mask=src_mask, need_weights=True)[1]
        return {"encoder": enc_maps, "decoder": dec_maps}


MODELS = {"gpt": GPT, "encoder": Encoder, "encoder_decoder": EncoderDecoder}


def build_model(config):
    """The model class that config.arch names, freshly initialised."""
    return MODELS[config.arch](config)
