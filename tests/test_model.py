"""Invariants of model.py and generate.py on tiny models: each test checks one property a bug would break."""

import collections
import contextlib
import copy
import itertools
import math
import re
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from generate import beam_search, generate, sample_next, translate
from model import (
    ARCHS,
    GPT,
    IGNORE_INDEX,
    MLP,
    Attention,
    Block,
    EncoderDecoder,
    KVCache,
    ModelConfig,
    build_model,
    rope_tables,
)
from optim import configure_optimizers

POS = ("learned", "sinusoidal", "rope")
V = 37  # a vocabulary no power of two, so shape mix-ups show
PAD, BOS, EOS = 0, 1, 2


def tiny(**overrides):
    """A 2-layer, 32-wide model, with biases (GPT-2's), so that the references cover them too."""
    settings = {"vocab_size": V, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32, "bias": True}
    return ModelConfig(**{**settings, **overrides})


def tokens(*shape, seed=0):
    return torch.randint(3, V, shape, generator=torch.Generator().manual_seed(seed))


def logits_of(model, x, y=None):
    """Logits of any architecture; the encoder-decoder reads x as the source and y as the target."""
    if isinstance(model, EncoderDecoder):
        return model(x, x if y is None else y)[0]
    return model(x)[0]


# Every architecture, position encoding and norm position; the causal models once more with a window as long as the
# block, which lets every earlier key through as no window does, but makes attention build its causal mask with
# attention_mask instead of leaving the triangle to SDPA's is_causal: a look-ahead in either shows.
OVERFIT_CASES = [(*case, 0) for case in itertools.product(ARCHS, POS, ("pre", "post"))]
OVERFIT_CASES += [("gpt", "learned", "pre", 16), ("encoder_decoder", "learned", "pre", 16)]


@pytest.mark.parametrize("arch,pos,norm_position,window_size", OVERFIT_CASES)
def test_shapes_and_overfit_one_batch_except_what_the_context_leaves_open(arch, pos, norm_position, window_size):
    """
    80 AdamW steps on one batch take the loss from about ln V to near 0 at the positions the inputs determine.
    The causal models' rows come in pairs that differ in one target only, at position open_at, which their context
    (the same in both) does not show: there no causal model can go below ln 2, since for targets a != b after one
    context -(ln q_a + ln q_b) / 2 >= ln 2 as q_a + q_b <= 1. A model that sees position t + 1 copies it: about 0.
    """
    torch.manual_seed(0)
    config = tiny(arch=arch, pos_encoding=pos, norm_position=norm_position, pad_token_id=PAD, window_size=window_size)
    model = build_model(config)
    x = tokens(4, 12).repeat_interleave(2, dim=0)  # rows 2i and 2i + 1 the same
    open_at = 5  # the target position whose pairs differ
    if arch == "gpt":
        x[1::2, open_at + 1] = (x[0::2, open_at + 1] + 1 - 3) % (V - 3) + 3  # another token than the pair's other row
        inputs, targets = (x[:, :-1],), x[:, 1:]
    elif arch == "encoder":  # mask a fixed third of the positions, predict the originals there
        masked = (torch.arange(12) % 3 == 0).expand_as(x)
        inputs, targets = (x.masked_fill(masked, BOS),), x.masked_fill(~masked, IGNORE_INDEX)
    else:  # learn to reverse the source, all but the one target that the pairs' sources share
        targets = x.flip(1)
        targets[1::2, open_at] = (targets[0::2, open_at] + 1 - 3) % (V - 3) + 3
        inputs = (x, torch.cat([torch.full((8, 1), BOS), targets[:, :-1]], dim=1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(80):
        logits, loss = model(*inputs, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert logits.shape == (*targets.shape, V)
    assert losses[0] > 3.0  # about ln(37) = 3.6 at init
    if arch == "encoder":
        assert losses[-1] < 1.0, f"loss went {losses[0]:.2f} -> {losses[-1]:.2f}"
        return
    per_position = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(0)  # (T,)
    determined = torch.cat([per_position[:open_at], per_position[open_at + 1 :]])
    assert determined.mean() < 1.0, f"loss went {losses[0]:.2f} -> {determined.mean():.2f} where determined"
    # ln 2 = 0.693 is a bound in exact arithmetic, 1e-4 below it float32 rounding: causal models reach 0.70 to 0.98
    assert per_position[open_at] > math.log(2) - 1e-4, f"{per_position[open_at]:.4f} where the context leaves 2 open"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("logit_softcap", [0.0, 3.0])
def test_chunked_loss_and_gradients_equal_cross_entropy_of_the_full_logits(arch, logit_softcap, monkeypatch):
    """Against a float64 copy of the model: its whole (B, T, V) logits, one cross-entropy, one backward."""
    monkeypatch.setattr("model.LOSS_CHUNK_BYTES", 4 * V * 5)  # 5 positions of float32 logits per chunk
    torch.manual_seed(0)
    model = build_model(
        tiny(arch=arch, tie_embeddings=arch != "encoder", pad_token_id=PAD, logit_softcap=logit_softcap)
    )
    reference = copy.deepcopy(model).double()
    inputs = (tokens(2, 9, seed=1), tokens(2, 7)) if arch == "encoder_decoder" else (tokens(2, 7),)
    targets = tokens(2, 7, seed=2)
    targets[0, 2:5] = targets[1, 6] = IGNORE_INDEX
    chunk_rows = []
    model.lm_head.register_forward_hook(lambda module, args, out: chunk_rows.append(args[0].shape[:-1].numel()))
    for label_smoothing, reduction in itertools.product((0.0, 0.1), ("mean", "sum")):
        reference.zero_grad()
        logits = reference(*inputs)[0]
        expected = F.cross_entropy(
            logits.flatten(0, 1),
            targets.flatten(),
            ignore_index=IGNORE_INDEX,
            label_smoothing=label_smoothing,
            reduction=reduction,
        )
        expected.backward()
        for return_logits in (True, False):
            model.zero_grad()
            chunk_rows.clear()
            got_logits, loss = model(
                *inputs, targets, label_smoothing=label_smoothing, reduction=reduction, return_logits=return_logits
            )
            assert chunk_rows == [5, 5, 4]  # the 14 positions in three chunks
            loss.backward()
            assert chunk_rows[3:] == [5, 5]  # the first two chunks' head once more in the backward, not the last
            if return_logits:
                torch.testing.assert_close(got_logits.double(), logits.detach(), rtol=1e-5, atol=1e-6)
            else:
                assert got_logits is None
            torch.testing.assert_close(loss.double(), expected.detach(), rtol=1e-6, atol=0)
            for p, want in zip(model.parameters(), reference.parameters()):
                torch.testing.assert_close(p.grad.double(), want.grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="reduction"):
        model(*inputs, targets, reduction="none")


@pytest.mark.parametrize("arch", ARCHS)
def test_a_model_s_loss_chunk_budget_replaces_the_device_s(arch, monkeypatch):
    """
    loss_chunk_bytes, which train.py sets from a GPU's free memory: a budget that holds the micro-batch's 28
    positions runs the head once, with nothing recomputed in the backward; one of 5 positions cuts as the device's
    budget of that size does (checked against the full logits above). Both give the same loss and gradients.
    """
    monkeypatch.setattr("model.LOSS_CHUNK_BYTES", 4 * V * 5)  # the CPU's budget: 5 positions of float32 logits
    torch.manual_seed(0)
    model = build_model(tiny(arch=arch, pad_token_id=PAD))
    x = tokens(2, 14)
    inputs = (tokens(2, 9, seed=1), x) if arch == "encoder_decoder" else (x,)
    targets = tokens(2, 14, seed=2)
    chunk_rows = []
    model.lm_head.register_forward_hook(lambda module, args, out: chunk_rows.append(args[0].shape[:-1].numel()))

    def step(budget):
        model.loss_chunk_bytes, chunk_rows[:] = budget, []
        model.zero_grad()
        loss = model(*inputs, targets, reduction="sum", return_logits=False)[1]
        loss.backward()
        return loss, [p.grad.clone() for p in model.parameters()], chunk_rows[:]

    whole, cut, default = step(4 * V * 28), step(4 * V * 5), step(None)
    assert whole[2] == [28]  # once, in the forward
    assert cut[2] == default[2] == [5, 5, 5, 5, 5, 3] + [5] * 5  # six chunks, all but the last again in the backward
    for other in (cut, default):
        torch.testing.assert_close(other[0], whole[0], rtol=1e-6, atol=0)
        for got, want in zip(other[1], whole[1]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("logit_softcap", [0.0, 3.0])
def test_training_keeps_one_chunk_of_logits_at_most(arch, logit_softcap, monkeypatch):
    """
    The bytes of the (..., V) tensors autograd saves for the backward of a training forward: the whole loss in one
    chunk keeps its float32 log-probabilities (which shows the hook sees them); cut into six chunks, it keeps one
    chunk's worth at most (the last's, which the backward needs first).
    """
    model = build_model(tiny(arch=arch, pad_token_id=PAD, logit_softcap=logit_softcap))
    x = tokens(2, 14)
    inputs = (tokens(2, 9, seed=1), x) if arch == "encoder_decoder" else (x,)
    targets = tokens(2, 14, seed=2)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def saved_bytes():
        saved = {}  # by storage, so that views of one buffer count once

        def pack(t):
            storage = t.untyped_storage()
            if t.dim() and t.size(-1) == V and storage.data_ptr() not in weights:  # not the head's weight, transposed
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(*inputs, targets, return_logits=False)[1]
        loss.backward()
        return sum(saved.values())

    assert saved_bytes() >= 28 * V * 4  # one chunk: all 28 positions' float32 log-probabilities, at least
    monkeypatch.setattr("model.LOSS_CHUNK_BYTES", 4 * V * 5)  # 5 positions per chunk: 6 chunks
    # one chunk's worth: 5 positions' float32 log-probabilities, and the soft-cap's tanh of them
    assert saved_bytes() <= (2 if logit_softcap else 1) * 5 * V * 4


@pytest.mark.parametrize("pos", POS)
@pytest.mark.parametrize("arch", ["gpt", "encoder_decoder"])
def test_causal_models_do_not_look_ahead(arch, pos):
    model = build_model(tiny(arch=arch, pos_encoding=pos)).eval()
    x = tokens(2, 10)
    for t in range(9):
        changed = x.clone()
        changed[:, t + 1] = (x[:, t + 1] + 1 - 3) % (V - 3) + 3
        if arch == "gpt":
            before, after = model(x)[0], model(changed)[0]
        else:  # change the decoder's input, keep the source
            before, after = model(x, x)[0], model(x, changed)[0]
        torch.testing.assert_close(before[:, : t + 1], after[:, : t + 1])
        assert not torch.allclose(before[:, t + 1], after[:, t + 1])


def test_encoder_sees_both_directions():
    model = build_model(tiny(arch="encoder")).eval()
    x = tokens(2, 10)
    changed = x.clone()
    changed[:, -1] = (x[:, -1] + 1 - 3) % (V - 3) + 3
    assert not torch.allclose(logits_of(model, x)[:, 0], logits_of(model, changed)[:, 0])


@pytest.mark.parametrize("pos", POS)
def test_padding_does_not_change_real_positions(pos):
    torch.manual_seed(0)
    short, long = tokens(1, 6, seed=1), tokens(1, 10, seed=2)
    batch = torch.cat([F.pad(short, (0, 4), value=PAD), long])  # row 0 padded with 4 PADs
    encoder = build_model(tiny(arch="encoder", pos_encoding=pos, pad_token_id=PAD)).eval()
    torch.testing.assert_close(logits_of(encoder, batch)[0, :6], logits_of(encoder, short)[0])
    torch.testing.assert_close(logits_of(encoder, batch)[1], logits_of(encoder, long)[0])

    seq2seq = build_model(tiny(arch="encoder_decoder", pos_encoding=pos, pad_token_id=PAD)).eval()
    tgt = tokens(2, 5, seed=3)
    torch.testing.assert_close(logits_of(seq2seq, batch, tgt)[0], logits_of(seq2seq, short, tgt[:1])[0])
    # a target padded on the right leaves the real target positions alone too
    padded_tgt = F.pad(tgt, (0, 3), value=PAD)
    torch.testing.assert_close(logits_of(seq2seq, batch, padded_tgt)[:, :5], logits_of(seq2seq, batch, tgt))


@pytest.mark.parametrize("pos", POS)
def test_kv_cache_matches_full_forward_gpt(pos):
    model = build_model(tiny(pos_encoding=pos)).eval()
    x = tokens(2, 16)
    full = model(x)[0]
    cache = model.new_cache()
    steps = [model.lm_head(model.body(x[:, :5], cache=cache)[0])]  # a 5-token prefill, then one at a time
    steps += [model.lm_head(model.body(x[:, t : t + 1], cache=cache)[0]) for t in range(5, 16)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pos", POS)
def test_kv_cache_matches_full_forward_encoder_decoder(pos):
    model = build_model(tiny(arch="encoder_decoder", pos_encoding=pos, pad_token_id=PAD)).eval()
    src, tgt = F.pad(tokens(2, 9), (0, 3), value=PAD), tokens(2, 12, seed=1)
    memory, src_mask = model.encode(src)
    full = model.decode(tgt, memory, src_mask)
    cache = model.new_cache()
    steps = [model.decode(tgt[:, t : t + 1], memory, src_mask, cache=cache) for t in range(12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pos", POS)
def test_cached_and_uncached_generation_agree_past_block_size(pos):
    model = build_model(tiny(pos_encoding=pos)).eval()
    prompt = tokens(3, 5)
    runs = [
        generate(model, prompt, 40, temperature=1.0, top_k=10, generator=torch.Generator().manual_seed(7), use_cache=c)
        for c in (True, False)
    ]
    assert runs[0].shape == (3, 45)
    assert torch.equal(runs[0], runs[1])


def test_context_keep_block_size_is_crop_every_step():
    """With context_keep=block_size the window is nanoGPT's: always the last block_size tokens."""
    model = build_model(tiny()).eval()
    idx = tokens(2, 4)
    expected = idx
    for _ in range(30):  # the reference: an explicit crop-and-argmax loop
        logits = model(expected[:, -16:])[0][:, -1]
        expected = torch.cat([expected, logits.argmax(-1, keepdim=True)], dim=1)
    for use_cache in (True, False):
        got = generate(model, idx, 30, temperature=0, context_keep=16, use_cache=use_cache)
        assert torch.equal(got, expected)


def test_generation_stops_at_stop_token():
    model = build_model(tiny()).eval()
    prompt = tokens(2, 3)
    full = generate(model, prompt, 20, temperature=0)  # the reference: the same decoding without a stop token
    stop = full[0, 3].item()
    out = generate(model, prompt, 20, temperature=0, stop_token=stop)
    cuts = []
    for row in range(2):  # each row follows the reference up to its first stop token, then holds it
        new = full[row, 3:].tolist()
        cut = new.index(stop) + 1 if stop in new else len(new)
        assert out[row, 3 : 3 + cut].tolist() == new[:cut]
        assert (out[row, 3 + cut :] == stop).all()
        cuts.append(cut)
    assert out.size(1) == 3 + max(cuts)  # decoding ends once every row has stopped


def stacked_qkv(attn):
    """The rows [W_q; W_k; W_v] of an attention and their biases, in float64: its qkv, or a cross-attention's q, kv."""
    linears = (attn.q, attn.kv) if attn.cross else (attn.qkv,)
    return torch.cat([m.weight for m in linears]).double(), torch.cat([m.bias for m in linears]).double()


def reference_attention(attn, x, allowed, context=None):
    """
    float64 loop over heads and queries: softmax over the keys that allowed(batch, query, key) lets through,
    weighted sum of their values. Keys and values come from the context, or from x without one.
    """
    C, H = x.size(-1), attn.n_head
    w, b = stacked_qkv(attn)
    kv_in = x if context is None else context
    q = x.double() @ w[:C].T + b[:C]
    k = kv_in.double() @ w[C : 2 * C].T + b[C : 2 * C]
    v = kv_in.double() @ w[2 * C :].T + b[2 * C :]
    D = C // H
    out = torch.zeros(x.shape, dtype=torch.float64)
    for bi in range(x.size(0)):
        for h in range(H):
            cols = slice(h * D, (h + 1) * D)
            for t in range(x.size(1)):
                keys = [s for s in range(kv_in.size(1)) if allowed(bi, t, s)]
                scores = torch.stack([q[bi, t, cols] @ k[bi, s, cols] for s in keys]) / math.sqrt(D)
                probs = scores.softmax(0)
                out[bi, t, cols] = sum(p * v[bi, s, cols] for p, s in zip(probs, keys))
    return out @ attn.proj.weight.double().T + attn.proj.bias.double()


def test_attention_against_float64_loop():
    torch.manual_seed(0)
    config = tiny()
    x, context = torch.randn(2, 5, 32), torch.randn(2, 7, 32)
    key_mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    causal, bidirectional = Attention(config, causal=True).eval(), Attention(config, causal=False).eval()
    cross = Attention(config, cross=True).eval()
    cases = [
        (causal, None, None, lambda b, t, s: s <= t),
        (bidirectional, None, key_mask[:, :5], lambda b, t, s: key_mask[b, s].item()),
        (cross, context, key_mask, lambda b, t, s: key_mask[b, s].item()),
    ]
    for attn, ctx, km, allowed in cases:
        expected = reference_attention(attn, x, allowed, context=ctx).float()
        fast, no_weights = attn(x, ctx, key_mask=km)
        slow, weights = attn(x, ctx, key_mask=km, need_weights=True)
        assert no_weights is None
        torch.testing.assert_close(fast, expected, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(slow, expected, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]))
        for b, t, s in itertools.product(range(2), range(5), range(weights.size(-1))):
            if not allowed(b, t, s):
                assert (weights[b, :, t, s] == 0).all()


@pytest.mark.parametrize(
    "activation, reference",
    [
        ("relu", F.relu),
        ("gelu", F.gelu),
        ("gelu_tanh", lambda h: F.gelu(h, approximate="tanh")),
        ("relu2", lambda h: F.relu(h) ** 2),
    ],
)
def test_mlp_output_and_gradients_against_float64(activation, reference):
    """The in-place ReLU must leave autograd intact: values and all three gradients match a float64 formula."""
    mlp = MLP(tiny(activation=activation, bias=True))
    x = torch.randn(3, 5, 32, requires_grad=True)
    mlp(x).square().sum().backward()
    w1, b1, w2, b2 = (p.detach().double().requires_grad_() for p in (*mlp.fc.parameters(), *mlp.proj.parameters()))
    x64 = x.detach().double().requires_grad_()
    y = reference(x64 @ w1.T + b1) @ w2.T + b2
    y.square().sum().backward()
    torch.testing.assert_close(mlp(x).double(), y, rtol=1e-5, atol=1e-5)
    for got, want in [(x.grad, x64.grad), (mlp.fc.weight.grad, w1.grad), (mlp.proj.weight.grad, w2.grad)]:
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_swiglu_mlp_output_and_gradients_against_float64():
    """down(silu(gate(x)) * up(x)) with fc as the gate: values and the gradients of x and all three matrices."""
    torch.manual_seed(0)
    mlp = MLP(tiny(activation="swiglu", bias=True, d_ff=48))
    x = torch.randn(3, 5, 32, requires_grad=True)
    mlp(x).square().sum().backward()
    linears = (mlp.fc, mlp.up, mlp.proj)
    (wg, bg), (wu, bu), (wd, bd) = ([p.detach().double().requires_grad_() for p in (m.weight, m.bias)] for m in linears)
    x64 = x.detach().double().requires_grad_()
    gate = x64 @ wg.T + bg
    y = (gate * torch.sigmoid(gate) * (x64 @ wu.T + bu)) @ wd.T + bd
    y.square().sum().backward()
    torch.testing.assert_close(mlp(x).double(), y, rtol=1e-5, atol=1e-5)
    pairs = [(x.grad, x64.grad), *((m.weight.grad, w.grad) for m, w in zip(linears, (wg, wu, wd)))]
    for got, want in pairs:
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_cached_queries_shorter_than_keys_see_all_earlier_positions():
    """3 cached positions, then 2 new queries: the causal triangle must be aligned to the lower right."""
    torch.manual_seed(0)
    attn = Attention(tiny(), causal=True).eval()
    x = torch.randn(1, 5, 32)
    cache = KVCache(16)
    attn(x[:, :3], cache=cache)
    out, weights = attn(x[:, 3:], cache=cache, need_weights=True)
    assert weights.shape == (1, 2, 2, 5)
    assert (weights[0, :, 0, 4] == 0).all() and (weights[0, :, 0, :4] > 0).all()  # query at 3 sees 0..3
    torch.testing.assert_close(out, reference_attention(attn, x, lambda b, t, s: s <= t).float()[:, 3:])


def test_attention_maps_per_layer():
    model = build_model(tiny(arch="encoder_decoder", pad_token_id=PAD)).eval()
    src, tgt = F.pad(tokens(2, 6), (0, 2), value=PAD), tokens(2, 5, seed=1)
    maps = model.attention_maps(src, tgt)
    assert len(maps["encoder"]) == 2 and len(maps["decoder"]) == 2
    assert maps["decoder"][0]["cross"].shape == (2, 2, 5, 8)
    assert (maps["decoder"][1]["cross"][..., 6:] == 0).all()  # padded source positions get no attention
    assert (maps["decoder"][0]["self"].triu(1) == 0).all()
    gpt_maps = build_model(tiny()).attention_maps(tokens(1, 7))
    assert gpt_maps[1]["self"].shape == (1, 2, 7, 7)


# -----------------------------------------------------------------------------
# Dropout: on the embeddings, the attention probabilities and every residual branch (ModelSettings.dropout), in
# training only. Each test finds it by what dropout does to the numbers there, against values computed here in
# float64: a fraction p of them zeroed, the others divided by 1 - p; in eval mode (p = 0) all of them unchanged.

P_DROP = 0.25  # not 0.5, where dividing the kept values by p instead of 1 - p, or dropping 1 - p of them, would pass


def assert_dropped(got, before, p, where):
    """
    got: `before` (float64, computed by the test) after a dropout of probability p. Each element must be 0 or
    before / (1 - p); the zeroed fraction must be p within 5 binomial standard deviations (a false alarm about once in
    3.5 million draws; the seeds are fixed anyway), so p = 0 allows none.
    """
    kept = got.abs() > 1e-9  # kept values here are above 1e-6; dropped ones 0 or, solved for, below 1e-13
    # rtol 1e-9: float64 sums, and attention's probabilities solved back out of its output
    torch.testing.assert_close(got, kept * before / (1 - p), rtol=1e-9, atol=1e-12, msg=lambda m: f"{where}: {m}")
    dropped = 1 - kept.double().mean().item()
    assert abs(dropped - p) <= 5 * math.sqrt(p * (1 - p) / got.numel()), f"{where}: {dropped:.3f} dropped, p = {p}"


Call = collections.namedtuple("Call", "args kwargs out")


@contextlib.contextmanager
def calls_recorded(model):
    """Within: {module: Call(args, kwargs, output)} of each module's last call (the output's first item if a tuple)."""
    seen = {}

    def hook(module, args, kwargs, out):
        seen[module] = Call(args, kwargs, out[0] if isinstance(out, tuple) else out)

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in model.modules()]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def stacks_and_inputs(model, x, y):
    """The model's Stacks, each with the token ids it embeds: a GPT's or encoder's x; an encoder-decoder's x, y."""
    if isinstance(model, EncoderDecoder):
        return [(model.encoder, x), (model.decoder, y)]
    return [(model.body, x)]


def dropout_model(arch, **overrides):
    """A float64 model with dropout P_DROP, padding, learned positions, noisy weights (attention far from uniform)."""
    config = tiny(arch=arch, dropout=P_DROP, pad_token_id=PAD, **overrides)
    return perturbed(build_model(config)).double()


def padded_batch():
    """(x, y): 4 rows of 12 tokens; x's last two are padding, which the encoders' and cross-attention's keys skip."""
    return F.pad(tokens(4, 10), (0, 2), value=PAD), tokens(4, 12, seed=1)


@pytest.mark.parametrize("arch", ARCHS)
def test_dropout_on_the_embeddings(arch):
    """What the first block reads is token + position embedding (GPT-2's wte[idx] + wpe[t]) through dropout."""
    model = dropout_model(arch)
    x, y = padded_batch()
    for training, p in ((True, P_DROP), (False, 0.0)):
        torch.manual_seed(0)
        with calls_recorded(model.train(training)) as seen:
            logits_of(model, x, y)
        for stack, idx in stacks_and_inputs(model, x, y):
            embedded = stack.wte.weight[idx] + stack.wpe.weight[: idx.size(1)]  # (B, T, C)
            first_block_input = seen[stack.blocks[0]].args[0]
            assert_dropped(first_block_input, embedded.detach(), p, f"embeddings, training={training}")


def attention_probabilities(attn, args, kwargs):
    """
    float64 softmax(q k^T / sqrt(D)) (B, H, T, S) of a call attn(*args, **kwargs), from its own weights (no rope, no
    qk_norm): over the keys the call's key_mask lets through, and for causal attention those at or before the query.
    """
    x = args[0]
    context = args[1] if attn.cross else x
    C, H, D = x.size(-1), attn.n_head, attn.head_dim
    w, b = stacked_qkv(attn)
    q = (x @ w[:C].T + b[:C]).unflatten(-1, (H, D)).transpose(1, 2)  # (B, H, T, D)
    k = (context @ w[C : 2 * C].T + b[C : 2 * C]).unflatten(-1, (H, D)).transpose(1, 2)  # (B, H, S, D)
    T, S = q.size(2), k.size(2)
    allowed = torch.ones(x.size(0), 1, T, S, dtype=torch.bool)
    if kwargs.get("key_mask") is not None:
        allowed &= kwargs["key_mask"][:, None, None, :]
    if attn.causal:
        allowed &= torch.ones(T, S, dtype=torch.bool).tril()
    scores = (q @ k.transpose(-2, -1) / math.sqrt(D)).masked_fill(~allowed, float("-inf"))
    return scores.softmax(-1), allowed.expand_as(scores)


def probabilities_read_out(attn, args, proj_input):
    """
    The probabilities P that attention multiplied its values v (B, H, S, D) by, solved for from its output P v, the
    output projection's input (B, T, H * D): P = (P v) v^T (v v^T)^-1, which needs S <= D (v v^T invertible).
    """
    context = args[1] if attn.cross else args[0]
    C, H, D = context.size(-1), attn.n_head, attn.head_dim
    w, b = stacked_qkv(attn)
    v = (context @ w[2 * C :].T + b[2 * C :]).unflatten(-1, (H, D)).transpose(1, 2)  # (B, H, S, D)
    assert v.size(2) <= D
    out = proj_input.unflatten(-1, (H, D)).transpose(1, 2)  # (B, H, T, D)
    return out @ v.transpose(-2, -1) @ torch.linalg.inv(v @ v.transpose(-2, -1))  # (B, H, T, S)


@pytest.mark.parametrize("arch", ARCHS)
def test_dropout_on_the_attention_probabilities(arch):
    """
    Self-attention (causal in GPT and decoder blocks, with padding in encoder blocks) and cross-attention: the
    probabilities each attention multiplied its values by are its float64 softmax through dropout. The fused kernel
    (SDPA's dropout_p) hides them, so they are solved for from the output. attention_maps returns them undropped
    while the output it computes alongside has them dropped.
    """
    model = dropout_model(arch)
    x, y = padded_batch()
    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    assert sum(a.cross for a in attentions) == (2 if arch == "encoder_decoder" else 0)
    for training, p in ((True, P_DROP), (False, 0.0)):
        for maps_too in (False, True):  # SDPA, then attend's spelled-out product that returns the maps
            torch.manual_seed(0)
            with calls_recorded(model.train(training)) as seen:
                if not maps_too:
                    logits_of(model, x, y)
                else:
                    maps = model.attention_maps(*((x, y) if arch == "encoder_decoder" else (x,)))
                    if arch == "encoder_decoder":
                        maps = maps["encoder"] + maps["decoder"]
            returned = [m[k] for m in maps for k in ("self", "cross") if k in m] if maps_too else []
            for i, attn in enumerate(attentions):
                where = f"{'cross' if attn.cross else 'self'}-attention {i}, training={training}, maps={maps_too}"
                expected, allowed = attention_probabilities(attn, seen[attn].args, seen[attn].kwargs)
                got = probabilities_read_out(attn, seen[attn].args, seen[attn.proj].args[0])
                assert (got[~allowed].abs() < 1e-9).all(), where  # nothing read from masked keys
                assert_dropped(got[allowed], expected[allowed], p, where)
                if maps_too:  # the maps in the order of the attentions: encoder blocks, then decoder blocks
                    torch.testing.assert_close(returned[i], expected, rtol=1e-9, atol=1e-12, msg=where)


def residual_adds(block, seen):
    """
    [(sublayer output, what the residual add put into the stream)] for each sublayer of a Block's recorded call:
    self-attention, cross-attention if any, MLP. Pre-norm reads the stream at the next norm's input (the block's
    output after the last); post-norm's add goes into its own norm, after the previous one's output.
    """
    cross = hasattr(block, "cross_attn")
    sublayers = [block.attn, block.cross_attn, block.mlp] if cross else [block.attn, block.mlp]
    norms = [block.norm1, block.norm_cross, block.norm2] if cross else [block.norm1, block.norm2]
    norm_in = [seen[n].args[0] for n in norms]
    if block.pre_norm:
        before, after = norm_in, norm_in[1:] + [seen[block].out]
    else:
        before, after = [seen[block].args[0]] + [seen[n].out for n in norms[:-1]], norm_in
    return [(seen[s].out, a - b) for s, a, b in zip(sublayers, after, before)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("norm_position", ["pre", "post"])
def test_dropout_on_every_residual_branch(arch, norm_position):
    """Self-attention's, cross-attention's and the MLP's outputs go through dropout before their residual add."""
    model = dropout_model(arch, norm_position=norm_position)
    x, y = padded_batch()
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for training, p in ((True, P_DROP), (False, 0.0)):
        torch.manual_seed(0)
        with calls_recorded(model.train(training)) as seen:
            logits_of(model, x, y)
        adds = [add for block in blocks for add in residual_adds(block, seen)]
        assert len(adds) == {"gpt": 4, "encoder": 4, "encoder_decoder": 10}[arch]
        for i, (out, added) in enumerate(adds):
            assert_dropped(added, out, p, f"residual branch {i}, training={training}")


@pytest.mark.parametrize("arch", ARCHS)
def test_no_dropout_in_eval_mode(arch):
    """Evaluated, a model with dropout computes what the same weights without dropout do, the same at every call."""
    model = dropout_model(arch).eval()
    without = build_model(replace(model.config, dropout=0.0)).double().eval()
    without.load_state_dict(model.state_dict())
    x, y = padded_batch()
    expected = logits_of(without, x, y)
    for _ in range(2):
        torch.testing.assert_close(logits_of(model, x, y), expected, rtol=0, atol=0)  # the same arithmetic
    assert not torch.allclose(logits_of(model.train(), x, y), expected)  # which training does change


def test_gpt2_small_parameter_count():
    with torch.device("meta"):
        model = GPT(ModelConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768, bias=True))
    assert model.num_params() == 124_439_808  # the Hugging Face count, lm_head tied to wte


def test_transformer_base_parameter_count():
    """6+6 layers, d=512, 8 heads, d_ff=2048, 37000 shared tokens: Table 3 of Vaswani et al. says 65M."""
    config = ModelConfig(
        arch="encoder_decoder",
        vocab_size=37000,
        block_size=256,
        n_layer=6,
        n_head=8,
        n_embd=512,
        d_ff=2048,
        pos_encoding="sinusoidal",
        norm_position="post",
        activation="relu",
        share_embeddings=True,
        bias=True,
    )
    with torch.device("meta"):
        model = EncoderDecoder(config)
    d, f = 512, 2048
    attention, ffn, norm = 4 * (d * d + d), 2 * d * f + f + d, 2 * d
    encoder_layer = attention + ffn + 2 * norm
    decoder_layer = 2 * attention + ffn + 3 * norm
    expected = 37000 * d + 6 * encoder_layer + 6 * decoder_layer  # one embedding for source, target and output
    assert model.num_params() == expected == 63_082_496


@pytest.mark.parametrize(
    "arch,overrides,shapes",
    [
        ("gpt", {}, [(2, 12)]),
        ("gpt", {"tie_embeddings": False, "norm_position": "post", "pos_encoding": "rope"}, [(3, 5)]),
        ("encoder", {"pad_token_id": PAD}, [(2, 12)]),
        ("encoder", {"tie_embeddings": False, "norm_position": "post"}, [(3, 5)]),
        ("encoder_decoder", {"pad_token_id": PAD}, [(2, 12), (2, 5)]),
        (
            "encoder_decoder",
            {"n_encoder_layer": 3, "tie_embeddings": False, "norm_position": "post"},
            [(3, 4), (3, 14)],
        ),
        ("gpt", {"n_head": 4, "n_kv_head": 1, "activation": "swiglu"}, [(2, 12)]),
        ("encoder", {"n_head": 4, "n_kv_head": 2, "activation": "swiglu"}, [(2, 12)]),
        ("encoder_decoder", {"n_head": 4, "n_kv_head": 2, "activation": "swiglu"}, [(3, 4), (3, 14)]),
    ],
)
def test_training_flops_match_a_flop_counter(arch, overrides, shapes):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model = build_model(tiny(arch=arch, d_ff=48, **overrides))
    inputs = [tokens(*shape, seed=i) for i, shape in enumerate(shapes)]
    # the math backend spells attention out as matmuls: the counter does not see CPU's fused kernel
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(*inputs, tokens(*shapes[-1], seed=9))[1].backward()
    # both count the same matmuls and agree exactly today; 1% still catches a missing transform or cross-attention
    assert model.training_flops(*inputs) == pytest.approx(counter.get_total_flops(), rel=0.01)


@pytest.mark.parametrize(
    "arch,window,shapes",
    [
        ("gpt", 3, [(2, 12)]),
        ("gpt", 16, [(3, 12)]),  # a window longer than the sequence: causal pairs only, T (T + 1) / 2
        ("encoder", 4, [(2, 12)]),
        ("encoder", 1, [(2, 7)]),  # each position by itself
        ("encoder_decoder", 3, [(2, 12), (2, 5)]),  # the encoder both ways, the decoder causal, cross-attention whole
    ],
)
def test_training_flops_count_the_pairs_a_sliding_window_attends(arch, window, shapes):
    """
    The flop counter's count (its math kernel scores every (query, key) pair) less 2 * C multiply-adds, times 6, for
    each pair the window leaves out, counted by a loop over the pairs.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model = build_model(tiny(arch=arch, d_ff=48, window_size=window, pad_token_id=PAD))
    inputs = [tokens(*shape, seed=i) for i, shape in enumerate(shapes)]
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(*inputs, tokens(*shapes[-1], seed=9))[1].backward()

    def left_out(T, causal):
        """(query, key) pairs of T positions that the dense kernel scores and the window does not allow."""
        allowed = sum(1 for t in range(T) for s in range(T) if (s <= t or not causal) and abs(t - s) < window)
        return T * T - allowed

    B, C, L = shapes[0][0], 32, 2
    if arch == "encoder_decoder":
        (_, S), (_, T) = shapes
        unseen = L * (left_out(S, causal=False) + left_out(T, causal=True))
    else:
        unseen = L * left_out(shapes[0][1], causal=arch == "gpt")
    assert unseen > 0
    assert model.training_flops(*inputs) == counter.get_total_flops() - 6 * B * unseen * 2 * C


def test_optimizer_groups():
    model = build_model(tiny(arch="encoder_decoder"))
    optimizers, summary = configure_optimizers(
        model, weight_decay=0.1, learning_rate=1e-3, betas=(0.9, 0.95), device_type="cpu"
    )
    assert list(optimizers) == ["adamw"]
    decay, no_decay = optimizers["adamw"].param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert {id(p) for p in decay["params"] + no_decay["params"]} == {id(p) for p in model.parameters()}
    assert "weight decay" in summary


# the 2-D weights inside the blocks, by name: attention qkv and proj, cross-attention q, kv and proj, MLP fc, up, proj
BLOCK_MATRIX = re.compile(r"(body|encoder|decoder)\.blocks\.\d+\.(attn|cross_attn|mlp)\.(qkv|q|kv|proj|fc|up)\.weight")


@pytest.mark.parametrize("arch", ["gpt", "encoder", "encoder_decoder"])
def test_muon_gets_exactly_the_block_matrices(arch):
    """Every trainable parameter is in exactly one optimizer; Muon's are the blocks' matrices, checked by name."""
    model = build_model(tiny(arch=arch, activation="swiglu", qk_norm=True, bias=True, tie_embeddings=False))
    optimizers, summary = configure_optimizers(model, 0.1, 1e-3, (0.9, 0.95), "cpu", optimizer="muon", muon_lr=0.02)
    assert list(optimizers) == ["adamw", "muon"] and summary.startswith("Muon: ")
    names = {id(p): name for name, p in model.named_parameters()}
    held = [names[id(p)] for opt in optimizers.values() for group in opt.param_groups for p in group["params"]]
    assert sorted(held) == sorted(names.values())  # each parameter once, none left out
    muon = {names[id(p)] for p in optimizers["muon"].param_groups[0]["params"]}
    assert muon == {name for name in names.values() if BLOCK_MATRIX.fullmatch(name)}
    assert any("up" in name for name in muon) and (arch != "encoder_decoder" or any("cross" in n for n in muon))
    assert (
        optimizers["muon"].param_groups[0]["lr"] == 0.02 and optimizers["muon"].param_groups[0]["weight_decay"] == 0.1
    )
    decay, no_decay = optimizers["adamw"].param_groups
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])


def test_sampling_filters():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).repeat(2000, 1)
    assert torch.equal(sample_next(logits, temperature=0), torch.zeros(2000, 1, dtype=torch.long))
    g = torch.Generator().manual_seed(0)
    assert set(sample_next(logits, top_k=2, generator=g).flatten().tolist()) == {0, 1}
    probs = logits[0].softmax(0)  # nucleus of 0.8: the likeliest tokens until their mass reaches 0.8
    nucleus = [i for i in range(6) if probs[:i].sum() < 0.8]
    assert set(sample_next(logits, top_p=0.8, generator=g).flatten().tolist()) == set(nucleus)
    model = build_model(tiny())
    for bad, name in (
        ({"temperature": -1}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ):
        with pytest.raises(ValueError, match=name):
            generate(model, tokens(1, 2), 1, **bad)


def test_beam_size_one_equals_greedy():
    model = build_model(tiny(arch="encoder_decoder", pad_token_id=PAD)).eval()
    src = tokens(3, 8)
    greedy = translate(model, src, 10, BOS, EOS)
    assert torch.equal(beam_search(model, src, 10, BOS, EOS, beam_size=1), greedy)


class TableDecoder(EncoderDecoder):
    """A decoder whose next-token probabilities depend only on the previous token, from a fixed table."""

    TABLE = {
        BOS: {3: 0.5, 4: 0.4, EOS: 0.1},
        3: {5: 0.3, 3: 0.25, 4: 0.25, EOS: 0.2},
        4: {EOS: 0.9, 5: 0.1},
        5: {EOS: 1.0},
    }

    def decode(self, tgt, memory, src_mask, cache=None):
        probs = torch.full((*tgt.shape, V), 1e-9)
        for (b, t), token in zip(itertools.product(range(tgt.size(0)), range(tgt.size(1))), tgt.flatten().tolist()):
            for nxt, p in self.TABLE.get(token, {EOS: 1.0}).items():
                probs[b, t, nxt] = p
        return probs.log()


def test_beam_search_finds_the_likelier_sequence():
    model = TableDecoder(tiny(arch="encoder_decoder")).eval()
    src = tokens(1, 4)
    assert translate(model, src, 5, BOS, EOS).tolist() == [[3, 5, EOS]]  # greedy: 0.5 * 0.3 * 1.0 = 0.15
    assert beam_search(model, src, 5, BOS, EOS, beam_size=2).tolist() == [[4, EOS]]  # 0.4 * 0.9 = 0.36


class ShortEndingDecoder(TableDecoder):
    """
    At the second step "4 eos" (p=0.12) ranks third, below a beam of 2, so it must not finish: with it and "3 eos"
    (0.15) two hypotheses would have finished before the best, "3 5 eos" (0.297), could.
    """

    TABLE = {
        BOS: {3: 0.5, 4: 0.4, EOS: 0.06, 7: 0.04},
        3: {5: 0.6, EOS: 0.3, 7: 0.1},
        5: {EOS: 0.99, 7: 0.01},
        4: {EOS: 0.3, 6: 0.27, 7: 0.23, 8: 0.2},
    }


def test_beam_search_does_not_end_with_hypotheses_ranked_below_the_beam():
    model = ShortEndingDecoder(tiny(arch="encoder_decoder")).eval()
    src = tokens(1, 4)
    assert translate(model, src, 5, BOS, EOS).tolist() == [[3, 5, EOS]]  # greedy: 0.5 * 0.6 * 0.99 = 0.297
    assert beam_search(model, src, 5, BOS, EOS, beam_size=2).tolist() == [[3, 5, EOS]]


class DroppedEndingDecoder(TableDecoder):
    """ "eos" (p=0.1) is the likeliest hypothesis, but ranks third at the first step; all others are below 0.1."""

    TABLE = {
        BOS: {3: 0.5, 4: 0.4, EOS: 0.1},
        3: {EOS: 0.19, 5: 0.18, 6: 0.17, 7: 0.16, 8: 0.15, 9: 0.15},
        4: {5: 0.2, 6: 0.2, 7: 0.2, 8: 0.2, 9: 0.2},
    }


def test_beam_search_drops_endings_ranked_below_the_beam():
    """Fairseq's and Hugging Face's rule: an ending must rank among the beam_size best to finish."""
    model = DroppedEndingDecoder(tiny(arch="encoder_decoder")).eval()
    got = beam_search(model, tokens(1, 4), 5, BOS, EOS, beam_size=2, length_penalty=0.0)
    assert got.tolist() == [[3, EOS]]  # p=0.095, the likeliest ending that ranked inside the beam


class LongLiveBeamDecoder(TableDecoder):
    """The best, "3 3 3 3 3", is less likely than the endings "eos" and "4 eos", but longer."""

    TABLE = {BOS: {EOS: 0.36, 4: 0.34, 3: 0.30}, 4: {EOS: 1.0}, 3: {3: 0.99, EOS: 0.01}}


class ShortLiveBeamDecoder(TableDecoder):
    """The best is "3 eos": with length_penalty < 0 a live beam does best by ending at the very next step."""

    TABLE = {BOS: {EOS: 0.45, 3: 0.55}, 3: {EOS: 0.95, 3: 0.05}}


@pytest.mark.parametrize(
    "decoder,length_penalty,max_new_tokens,best",
    [
        # "3 3 3 3 3": log(0.3 * 0.99^4) / (10/6)^0.6 = -0.916 beats "4 eos": log(0.34) / (7/6)^0.6 = -0.984, but after
        # two steps "3 3" bounded by its next length, log(0.3 * 0.99) / (8/6)^0.6 = -1.022, would not
        (LongLiveBeamDecoder, 0.6, 5, [3, 3, 3, 3, 3]),
        # "3 eos": log(0.55 * 0.95) * (7/6)^0.5 = -0.701 beats "eos": log(0.45) = -0.799, but after one step "3" bounded
        # by the longest length, log(0.55) * (13/6)^0.5 = -0.880, would not
        (ShortLiveBeamDecoder, -0.5, 8, [3, EOS]),
    ],
)
def test_beam_search_goes_on_while_a_live_beam_can_still_win(decoder, length_penalty, max_new_tokens, best):
    model = decoder(tiny(arch="encoder_decoder")).eval()
    got = beam_search(model, tokens(1, 4), max_new_tokens, BOS, EOS, beam_size=2, length_penalty=length_penalty)
    assert got.tolist() == [best]


def sequence_log_probs(model, src, hyps):
    """log p(hyp | src) of equally long target sequences by teacher forcing through the plain forward, in float64."""
    tgt = torch.tensor([[BOS] + hyp[:-1] for hyp in hyps])
    logprobs = model(src.expand(len(hyps), -1), tgt)[0].double().log_softmax(dim=-1)
    return logprobs.gather(-1, torch.tensor(hyps)[..., None]).sum(dim=(1, 2)).tolist()


@pytest.mark.parametrize("length_penalty", [0.6, 0.0, -0.5])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("window_size", [0, 2])  # 2: the beams' windowed KV caches are reordered too
def test_wide_beam_search_returns_the_best_of_all_sequences(seed, length_penalty, window_size):
    """Every target of up to L tokens is scored; a beam that holds every extension of every prefix finds the best."""
    vocab, L = 5, 4
    torch.manual_seed(seed)
    config = ModelConfig(
        arch="encoder_decoder", vocab_size=vocab, block_size=8, n_layer=1, n_head=2, n_embd=16, pad_token_id=PAD
    )
    model = build_model(replace(config, window_size=window_size)).eval()
    with torch.no_grad():
        for p in model.parameters():  # far from uniform, so that no two sequences score nearly alike
            p.normal_(0, 0.7)
    src = torch.tensor([[3, 4, 3, 4], [4, 4, 3, PAD]])
    words = [t for t in range(vocab) if t != EOS]
    by_length = [[[*w, EOS] for w in itertools.product(words, repeat=n - 1)] for n in range(1, L + 1)]
    by_length.append([list(w) for w in itertools.product(words, repeat=L)])  # ran out of steps before eos
    width = vocab * len(words) ** (L - 1)
    got = beam_search(model, src, L, BOS, EOS, beam_size=width, length_penalty=length_penalty)
    for b in range(2):
        scores = {}
        for hyps in by_length:
            lp = ((5 + len(hyps[0])) / 6) ** length_penalty
            scores.update((tuple(h), s / lp) for h, s in zip(hyps, sequence_log_probs(model, src[b : b + 1], hyps)))
        best, second = sorted(scores, key=scores.get, reverse=True)[:2]
        assert scores[best] - scores[second] > 1e-4  # a clear winner, whatever the float32 rounding
        row = got[b].tolist()
        assert tuple(row[: row.index(EOS) + 1] if EOS in row else row) == best


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"arch": "rnn"}, "arch"),
        ({"n_embd": 30, "n_head": 4}, "n_embd"),
        ({"n_layer": 0}, "n_layer"),
        ({"dropout": 1.5}, "dropout"),
        ({"pos_encoding": "alibi"}, "pos_encoding"),
        ({"norm": "batchnorm"}, "norm"),
        ({"pad_token_id": 37}, "pad_token_id"),
        ({"n_embd": 30, "n_head": 10, "pos_encoding": "rope"}, "rope"),
        ({"activation": "swish"}, "activation"),
        ({"norm_position": "middle"}, "norm_position"),
        ({"n_head": 4, "n_kv_head": 3}, "n_kv_head"),
        ({"n_kv_head": 0}, "n_kv_head"),
        ({"logit_softcap": -1.0}, "logit_softcap"),
        ({"window_size": -1}, "window_size"),
    ],
)
def test_bad_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny(**overrides)


def test_sequence_longer_than_block_size():
    for arch in ARCHS:
        with pytest.raises(ValueError, match="block_size=16"):
            logits_of(build_model(tiny(arch=arch)), tokens(1, 17))


def test_config_round_trip_rejects_unknown_keys():
    from dataclasses import asdict

    config = tiny(arch="encoder_decoder", n_encoder_layer=3)
    assert ModelConfig.from_dict(asdict(config)) == config
    with pytest.raises(ValueError, match="n_layers"):
        ModelConfig.from_dict({**asdict(config), "n_layers": 2})


def test_generation_draws_only_below_vocab_size():
    """A tokenizer smaller than the padded embedding (GPT-2's 50257 of 50304): the extra ids are never drawn."""
    model = build_model(tiny()).eval()
    with torch.no_grad():
        model.lm_head.weight[20:] += 5.0  # make the ids a tokenizer could not decode the likeliest ones
    out = generate(model, tokens(4, 3), 30, temperature=1.0, generator=torch.Generator().manual_seed(0), vocab_size=20)
    assert out[:, 3:].max() < 20
    assert generate(model, tokens(4, 3), 5, temperature=1.0)[:, 3:].max() >= 20  # without the limit they dominate


class LongBeamDecoder(TableDecoder):
    """One hypothesis ends at once with p=0.1; the live ones never end but stay far likelier."""

    TABLE = {
        BOS: {3: 0.85, EOS: 0.10, 4: 0.05},
        3: {3: 0.98, 4: 0.0199, EOS: 0.0001},
        4: {4: 0.98, 3: 0.0199, EOS: 0.0001},
    }


def test_beam_search_out_of_steps_keeps_better_live_beams():
    model = LongBeamDecoder(tiny(arch="encoder_decoder")).eval()
    # finished "eos": log 0.1 = -2.30; live "3 3 3 3": log(0.85 * 0.98^3) = -0.22, better even after normalising
    assert beam_search(model, tokens(1, 4), 4, BOS, EOS, beam_size=2).tolist() == [[3, 3, 3, 3]]


def test_generate_rejects_an_empty_prompt():
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(build_model(tiny()), torch.zeros(1, 0, dtype=torch.long), 3)


# -----------------------------------------------------------------------------
# Options: grouped-query attention, qk_norm, relu2 / swiglu, logit_softcap, zero_init_proj, sliding window

# every new option alone, then all of them together (relu2 and swiglu exclude each other)
OPTIONS = [
    {"n_head": 4, "n_kv_head": 2},
    {"n_head": 4, "n_kv_head": 1},
    {"qk_norm": True},
    {"activation": "relu2"},
    {"activation": "swiglu"},
    {"logit_softcap": 3.0},
    {"zero_init_proj": True},
    {"window_size": 3},
    {"tie_embeddings": False},
    {
        "n_head": 4,
        "n_kv_head": 2,
        "qk_norm": True,
        "activation": "swiglu",
        "logit_softcap": 3.0,
        "zero_init_proj": True,
        "window_size": 4,
    },
]


def perturbed(model, seed=0):
    """The model with noise on every parameter: zero-initialised projections and unit norm gains would hide bugs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def mha_state_from_gqa(state, config):
    """
    The state dict of an n_kv_head == n_head model that computes what the grouped-query model holding `state` does:
    each query head h gets its own copy of the rows (weight and bias) of key/value head h // (n_head / n_kv_head).
    """
    C, H, G = config.n_embd, config.n_head, config.n_kv_head
    D, group = C // H, H // G

    def repeat(w):  # key/value rows -> one copy per query head
        return torch.cat([w[(h // group) * D : (h // group + 1) * D] for h in range(H)])

    out = {}
    for name, t in state.items():
        if name.endswith(("qkv.weight", "qkv.bias")):
            q, k, v = t.split([C, G * D, G * D])
            t = torch.cat([q, repeat(k), repeat(v)])
        elif name.endswith(("kv.weight", "kv.bias")):  # a cross-attention's keys and values
            t = torch.cat([repeat(w) for w in t.split([G * D, G * D])])
        out[name] = t
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("n_kv_head", [1, 2])
def test_grouped_query_attention_equals_mha_with_repeated_key_value_heads(arch, n_kv_head):
    """Self- and cross-attention, with padding: the GQA model and its MHA twin give the same logits."""
    torch.manual_seed(0)
    options = {"arch": arch, "n_head": 4, "pad_token_id": PAD, "pos_encoding": "rope", "qk_norm": True}
    gqa = perturbed(build_model(tiny(n_kv_head=n_kv_head, **options))).eval()
    mha = build_model(tiny(**options)).eval()
    assert gqa.num_params() < mha.num_params()
    mha.load_state_dict(mha_state_from_gqa(gqa.state_dict(), gqa.config))
    x, y = F.pad(tokens(2, 9), (0, 3), value=PAD), tokens(2, 7, seed=1)  # row 0's last three are padding
    x[1, 4:] = PAD
    torch.testing.assert_close(logits_of(gqa, x, y), logits_of(mha, x, y), atol=1e-5, rtol=1e-5)


def test_kv_cache_holds_only_the_key_value_heads():
    for arch in ("gpt", "encoder_decoder"):
        model = build_model(tiny(arch=arch, n_head=4, n_kv_head=1)).eval()
        cache = model.new_cache()
        if arch == "gpt":
            model.body(tokens(2, 5), cache=cache)
        else:
            model.decode(tokens(2, 5), *model.encode(tokens(2, 7)), cache=cache)
            assert cache[0][1].k.shape == cache[0][1].v.shape == (2, 1, 7, 8)  # cross-attention: (B, 1, S, D)
        assert cache[0][0].k.shape == cache[0][0].v.shape == (2, 1, 16, 8)  # (B, n_kv_head, block_size, D)


def test_grouped_query_attention_hands_sdpa_the_shared_heads(monkeypatch):
    """
    On a CPU every SDPA call gets the n_kv_head key/value heads with enable_gqa (no copies): training with padding
    or a window, the encoder, cross-attention, KV-cached generation. Off the CPU only GPUs' flash kernel takes them
    (bfloat16, no mask); masked or float32 attention gets repeated heads, as the other kernels need.
    """
    calls, sdpa = [], F.scaled_dot_product_attention

    def spy(q, k, v, **options):
        calls.append((q.size(1), k.size(1), v.size(1), options["enable_gqa"]))
        return sdpa(q, k, v, **options)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    x = F.pad(tokens(2, 7), (0, 2), value=PAD)
    for arch, options in [
        ("gpt", {}),
        ("gpt", {"pad_token_id": PAD}),
        ("gpt", {"window_size": 3}),
        ("encoder", {"pad_token_id": PAD}),
        ("encoder_decoder", {"pad_token_id": PAD}),
    ]:
        model = build_model(tiny(arch=arch, n_head=4, n_kv_head=2, **options))
        model(*((x, x) if arch == "encoder_decoder" else (x,)), x)[1].backward()
        if arch == "gpt":
            generate(model.eval(), x[:, :3], 4)  # a 3-token prompt, then one position at a time
        elif arch == "encoder_decoder":
            translate(model.eval(), x, 4, bos_id=BOS, eos_id=EOS)
    assert len(calls) > 40 and set(calls) == {(4, 2, 2, True)}

    calls.clear()
    attn = Attention(tiny(n_head=4, n_kv_head=2), causal=True).to("meta")
    q, kv = torch.empty(2, 4, 6, 8, device="meta"), torch.empty(2, 2, 6, 8, device="meta")
    padded = torch.ones(2, 6, dtype=torch.bool, device="meta")
    attn.attend(q.bfloat16(), kv.bfloat16(), kv.bfloat16(), key_mask=None, need_weights=False)
    attn.attend(q.bfloat16(), kv.bfloat16(), kv.bfloat16(), key_mask=padded, need_weights=False)
    attn.attend(q, kv, kv, key_mask=None, need_weights=False)
    assert calls == [(4, 2, 2, True), (4, 4, 4, False), (4, 4, 4, False)]


@pytest.mark.parametrize("options", OPTIONS)
def test_kv_cache_and_generation_with_each_option(options):
    """GPT: cached logits = the full forward's, cached sampling = uncached; encoder-decoder: greedy = an argmax loop."""
    model = perturbed(build_model(tiny(pos_encoding="rope", **options))).eval()
    x = tokens(2, 16)
    cache = model.new_cache()
    steps = [model.head(model.body(x[:, :5], cache=cache)[0])]
    steps += [model.head(model.body(x[:, t : t + 1], cache=cache)[0]) for t in range(5, 16)]
    torch.testing.assert_close(torch.cat(steps, dim=1), model(x)[0], atol=1e-5, rtol=1e-5)
    runs = [
        generate(model, x[:, :5], 30, temperature=1.0, generator=torch.Generator().manual_seed(7), use_cache=c)
        for c in (True, False)
    ]
    assert torch.equal(runs[0], runs[1])

    seq2seq = perturbed(build_model(tiny(arch="encoder_decoder", pad_token_id=PAD, **options))).eval()
    src = F.pad(tokens(2, 6), (0, 3), value=PAD)
    expected = torch.full((2, 1), BOS)
    for _ in range(12):  # the reference: the whole target recomputed at every step, nothing cached
        expected = torch.cat([expected, seq2seq(src, expected)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    got = translate(seq2seq, src, 12, bos_id=BOS, eos_id=-1)  # an eos that never comes: all 12 steps
    assert torch.equal(got, expected[:, 1:])


def reference_attention_options(attn, x, allowed, context=None, rope_theta=None):
    """
    float64 loop like reference_attention, with the options spelled out: q and k of each head divided by their
    root mean square over D and multiplied by the norms' gains, then (self-attention with rope_theta) turned by
    the rotary angles; query head h reads key/value head h // (n_head / n_kv_head).
    """
    C, H, G = x.size(-1), attn.n_head, attn.n_kv_head
    D = C // H
    w, b = stacked_qkv(attn)
    kv_in = x if context is None else context
    q = (x.double() @ w[:C].T + b[:C]).unflatten(-1, (H, D))  # (B, T, H, D)
    k = (kv_in.double() @ w[C : C + G * D].T + b[C : C + G * D]).unflatten(-1, (G, D))
    v = (kv_in.double() @ w[C + G * D :].T + b[C + G * D :]).unflatten(-1, (G, D))
    eps = attn.q_norm.eps
    q = q / (q.square().mean(-1, keepdim=True) + eps).sqrt() * attn.q_norm.weight.double()
    k = k / (k.square().mean(-1, keepdim=True) + eps).sqrt() * attn.k_norm.weight.double()
    if rope_theta is not None:

        def turn(t):  # channel pair (i, i + D/2) at position p turns by p * theta^(-2i/D)
            angle = torch.arange(t.size(1), dtype=torch.float64)[:, None] * rope_theta ** (
                -torch.arange(0, D, 2, dtype=torch.float64) / D
            )
            cos, sin = angle.cos()[:, None], angle.sin()[:, None]  # (T, 1, D/2)
            a, c = t[..., : D // 2], t[..., D // 2 :]
            return torch.cat([a * cos - c * sin, a * sin + c * cos], dim=-1)

        q, k = turn(q), turn(k)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for bi in range(x.size(0)):
        for h in range(H):
            for t in range(x.size(1)):
                keys = [s for s in range(kv_in.size(1)) if allowed(bi, t, s)]
                scores = torch.stack([q[bi, t, h] @ k[bi, s, h // (H // G)] for s in keys]) / math.sqrt(D)
                out[bi, t, h * D : (h + 1) * D] = sum(
                    p * v[bi, s, h // (H // G)] for p, s in zip(scores.softmax(0), keys)
                )
    return out @ attn.proj.weight.double().T + attn.proj.bias.double()


def test_qk_norm_and_grouped_query_attention_against_float64_loop():
    """Norm before rotary: with unequal gains per channel the other order gives other scores."""
    torch.manual_seed(0)
    config = tiny(n_head=4, n_kv_head=2, qk_norm=True, pos_encoding="rope")
    causal, cross = Attention(config, causal=True).eval(), Attention(config, cross=True).eval()
    for attn in (causal, cross):
        with torch.no_grad():  # gains of 1 would hide a norm applied in the wrong place
            attn.q_norm.weight.uniform_(0.5, 2.0)
            attn.k_norm.weight.uniform_(0.5, 2.0)
            for linear in (attn.q, attn.kv) if attn.cross else (attn.qkv,):
                linear.weight.mul_(20)  # large projections: without the norm, the scores would be far larger
    x, context = torch.randn(2, 5, 32), torch.randn(2, 7, 32)
    key_mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    rope = rope_tables(5, 8, config.rope_theta)
    cases = [
        (causal, None, None, rope, lambda b, t, s: s <= t),
        (cross, context, key_mask, None, lambda b, t, s: key_mask[b, s].item()),
    ]
    for attn, ctx, km, tables, allowed in cases:
        theta = None if tables is None else config.rope_theta
        expected = reference_attention_options(attn, x, allowed, context=ctx, rope_theta=theta).float()
        for need_weights in (False, True):
            got = attn(x, ctx, key_mask=km, rope=tables, need_weights=need_weights)[0]
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_sliding_window_attention_against_float64_loop():
    """Causal: itself and the window - 1 keys before it; bidirectional: keys fewer than window positions away."""
    torch.manual_seed(0)
    window = 3
    config = tiny(n_head=4, n_kv_head=2, qk_norm=True, pos_encoding="rope", window_size=window)
    causal, bidirectional = Attention(config, causal=True).eval(), Attention(config, causal=False).eval()
    x = torch.randn(2, 9, 32)
    key_mask = torch.tensor([[True] * 9, [True] * 7 + [False] * 2])  # every query keeps a real key in its window
    rope = rope_tables(9, 8, config.rope_theta)
    cases = [
        (causal, None, lambda b, t, s: 0 <= t - s < window),
        (bidirectional, key_mask, lambda b, t, s: abs(t - s) < window and key_mask[b, s].item()),
    ]
    for attn, km, allowed in cases:
        expected = reference_attention_options(attn, x, allowed, rope_theta=config.rope_theta).float()
        for need_weights in (False, True):
            got, weights = attn(x, key_mask=km, rope=rope, need_weights=need_weights)
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        distance = torch.arange(9)[:, None] - torch.arange(9)[None, :]
        outside = distance.abs() >= window if km is not None else (distance < 0) | (distance >= window)
        assert (weights[:, :, outside] == 0).all() and (weights[0, :, ~outside] > 0).all()


@pytest.mark.parametrize("arch", ["gpt", "encoder_decoder"])
def test_sliding_window_cache_keeps_window_minus_one_positions_past_the_window(arch):
    """Decoding 12 steps past a window of 4: every step's logits equal the full forward's, from a 3-position cache."""
    torch.manual_seed(0)
    model = perturbed(build_model(tiny(arch=arch, n_head=4, n_kv_head=2, window_size=4, pos_encoding="rope"))).eval()
    x, src = tokens(2, 16), tokens(2, 7, seed=1)
    memory, src_mask = model.encode(src) if arch == "encoder_decoder" else (None, None)

    def step(part, cache):
        if arch == "gpt":
            return model.head(model.body(part, cache=cache)[0])
        return model.decode(part, memory, src_mask, cache=cache)

    cache = model.new_cache()
    steps = [step(x[:, :4], cache)]
    for t in range(4, 16):
        steps.append(step(x[:, t : t + 1], cache))
        for self_cache, _ in cache:
            assert self_cache.k.shape == self_cache.v.shape == (2, 2, 3, 8)  # (B, n_kv_head, window - 1, D)
            assert self_cache.length == t + 1
    torch.testing.assert_close(torch.cat(steps, dim=1), logits_of(model, src, x) if memory is not None else model(x)[0])


@pytest.mark.parametrize("arch", ["gpt", "encoder"])
def test_padded_queries_with_no_key_leave_every_real_position_finite(arch):
    """
    Padding far beyond a window: some padded queries see no real key. Neither the loss, the gradients nor the
    attention maps of 3 layers may turn NaN, and the real positions keep the values they have without it.
    (A GPT's padding goes on the right, where the causal mask keeps it from real positions; an encoder's anywhere.)
    """
    model = build_model(tiny(arch=arch, n_layer=3, window_size=2, pad_token_id=PAD))
    before = 0 if arch == "gpt" else 3
    x = F.pad(tokens(2, 4), (before, 12 - before), value=PAD)
    targets = x.masked_fill(x == PAD, IGNORE_INDEX)
    loss = model(x, targets)[1]
    loss.backward()
    assert loss.isfinite() and all(p.grad.isfinite().all() for p in model.parameters() if p.grad is not None)
    real = x != PAD
    for layer in model.attention_maps(x):
        assert layer["self"].isfinite().all()
        real_reads_padding = (real[:, :, None] & ~real[:, None, :])[:, None].expand_as(layer["self"])
        assert (layer["self"][real_reads_padding] == 0).all()
    # the same positions without the trailing padding, whose queries are the ones with no key in their window
    shorter = model(x[:, : before + 4])[0][:, before:]
    torch.testing.assert_close(model(x)[0][:, before : before + 4], shorter, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_logit_softcap(arch, monkeypatch):
    """Within the cap; cap * tanh(plain / cap) of the uncapped model with the same weights; the loss of those logits."""
    monkeypatch.setattr("model.LOSS_CHUNK_BYTES", 4 * V * 5)  # the loss in chunks of 5 positions
    torch.manual_seed(0)
    cap = 2.0
    capped = build_model(tiny(arch=arch, logit_softcap=cap, pad_token_id=PAD))
    with torch.no_grad():
        capped.lm_head.weight.mul_(100)  # logits far beyond the cap
    plain = build_model(tiny(arch=arch, pad_token_id=PAD))
    plain.load_state_dict(capped.state_dict())
    x, y, targets = tokens(2, 7), tokens(2, 6, seed=1), tokens(2, 7 if arch != "encoder_decoder" else 6, seed=2)
    plain_logits = logits_of(plain, x, y).double()
    assert plain_logits.abs().max() > 5 * cap
    expected = cap * torch.tanh(plain_logits / cap)
    inputs = (x, y) if arch == "encoder_decoder" else (x,)
    logits, loss = capped(*inputs, targets)
    assert logits.abs().max() <= cap
    torch.testing.assert_close(logits.double(), expected, atol=1e-5, rtol=1e-5)
    if arch == "encoder_decoder":  # what generate and beam_search read
        torch.testing.assert_close(capped.decode(y, *capped.encode(x)).double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        loss.double(), F.cross_entropy(expected.flatten(0, 1), targets.flatten()), atol=1e-5, rtol=1e-5
    )


def test_softcap_in_float32_under_bfloat16_autocast():
    """The loss caps the head's bfloat16 logits in float32: as the float64 cap of those same logits, not 3 roundings."""
    cap = 3.0
    model = build_model(tiny(logit_softcap=cap))
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # logits across the cap's whole range
    projected = []
    model.lm_head.register_forward_hook(lambda module, args, out: projected.append(out))
    x, targets = tokens(2, 9), tokens(2, 9, seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x, targets, return_logits=False)[1]
    (logits,) = projected
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    expected = F.cross_entropy(cap * torch.tanh(logits.double() / cap), targets.flatten())
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=0)


def test_sampling_reads_the_capped_logits():
    """generate draws from the softmax of the capped logits: the same tokens as a loop over the capped forward."""
    model = build_model(tiny(logit_softcap=0.5)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(100)  # peaked plain logits, nearly flat capped ones: a missed cap changes the draws
    prompt, g = tokens(2, 3), torch.Generator().manual_seed(3)
    expected = prompt
    for _ in range(10):
        expected = torch.cat([expected, sample_next(model(expected)[0][:, -1], 1.0, generator=g)], dim=1)
    assert torch.equal(generate(model, prompt, 10, 1.0, generator=torch.Generator().manual_seed(3)), expected)


@pytest.mark.parametrize("arch", ARCHS)
def test_zero_init_proj_zeroes_exactly_the_residual_projections(arch):
    model = build_model(tiny(arch=arch, zero_init_proj=True))
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    residual = [m for m in linears if getattr(m, "residual", False)]
    blocks = {"gpt": 2, "encoder": 2, "encoder_decoder": 4}[arch]
    assert len(residual) == 2 * blocks + (2 if arch == "encoder_decoder" else 0)  # attn, MLP (and cross-attn)
    assert all((m.weight == 0).all() for m in residual)
    assert all((m.weight != 0).any() for m in linears if m not in residual)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("options", OPTIONS)
def test_attention_maps_with_each_option(arch, options):
    model = perturbed(build_model(tiny(arch=arch, pad_token_id=PAD, **options))).eval()
    src, tgt = F.pad(tokens(2, 6), (0, 2), value=PAD), tokens(2, 5, seed=1)
    if arch == "encoder_decoder":
        maps = model.attention_maps(src, tgt)["decoder"]
        assert maps[0]["cross"].shape == (2, model.config.n_head, 5, 8)
        assert (maps[1]["cross"][..., 6:] == 0).all()  # padded source positions get no attention
    else:
        maps = model.attention_maps(tgt)
    assert maps[0]["self"].shape == (2, model.config.n_head, 5, 5)  # one map per query head
    for layer in maps:
        torch.testing.assert_close(layer["self"].sum(-1), torch.ones(2, model.config.n_head, 5))
        if arch != "encoder":
            assert (layer["self"].triu(1) == 0).all()


def test_config_without_the_option_keys_loads_as_before():
    """A checkpoint's config from before the options existed: the defaults fill in, the weights keep their shapes."""
    from dataclasses import asdict

    new_keys = ("n_kv_head", "qk_norm", "logit_softcap", "zero_init_proj", "window_size")
    old = {k: v for k, v in asdict(tiny()).items() if k not in new_keys}
    config = ModelConfig.from_dict(old)
    assert config == tiny() and config.n_kv_head == config.n_head
    state = build_model(config).state_dict()
    assert state["body.blocks.0.attn.qkv.weight"].shape == (96, 32)  # W_q, W_k, W_v of C rows each
    assert not any("norm" in k and "attn" in k for k in state) and not any(".up." in k for k in state)


@pytest.mark.parametrize("arch", ARCHS)
def test_activation_checkpointing_recomputes_blocks_and_keeps_the_gradients(arch):
    """float64, dropout on: the loss and every gradient equal those of the same model storing its activations."""
    config = tiny(arch=arch, dropout=0.1, pad_token_id=PAD, pos_encoding="rope", window_size=4)
    plain = build_model(config).double().train()
    recomputing = build_model(config).double().train().set_activation_checkpointing()
    recomputing.load_state_dict(plain.state_dict())
    calls = []
    for block in recomputing.modules():
        if isinstance(block, Block):
            block.register_forward_pre_hook(lambda module, args: calls.append(module))
    x, y = F.pad(tokens(2, 9), (0, 3), value=PAD), tokens(2, 7, seed=1)
    inputs = (x, y) if arch == "encoder_decoder" else (x,)
    targets = y if arch == "encoder_decoder" else x
    results = []
    for model in (plain, recomputing):
        torch.manual_seed(0)  # the same dropout masks in both
        loss = model(*inputs, targets.masked_fill(targets == PAD, IGNORE_INDEX))[1]
        loss.backward()
        results.append((loss, {name: p.grad for name, p in model.named_parameters()}))
    blocks = {"gpt": 2, "encoder": 2, "encoder_decoder": 4}[arch]
    assert len(calls) == 2 * blocks  # each block ran twice: its forward, and again in the backward
    (plain_loss, plain_grads), (loss, grads) = results
    torch.testing.assert_close(loss, plain_loss, rtol=1e-12, atol=1e-12)
    assert grads.keys() == plain_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], plain_grads[name], rtol=1e-10, atol=1e-12, msg=name)
    with torch.no_grad():  # no backward to come: nothing is recomputed
        recomputing(*inputs)
    assert len(calls) == 3 * blocks


@pytest.mark.parametrize(
    "arch,pos,tied", [("gpt", "rope", True), ("encoder", "sinusoidal", False), ("encoder_decoder", "learned", True)]
)
def test_a_model_built_on_the_meta_device_is_the_model_built_in_memory(arch, pos, tied):
    """No memory until to_empty; then init_weights gives the weights, tables and tying of build_model with that seed."""
    config = tiny(arch=arch, pos_encoding=pos, tie_embeddings=tied, n_kv_head=1, qk_norm=True, norm="layernorm")
    with torch.device("meta"):
        lazy = build_model(config)
    assert all(t.is_meta for t in (*lazy.parameters(), *lazy.buffers()))
    lazy.to_empty(device="cpu")
    torch.manual_seed(5)
    lazy.init_weights()
    torch.manual_seed(5)
    ordinary = build_model(config)  # the default inits drawn in construction must not shift init_weights's draws
    expected = dict(ordinary.named_buffers()) | ordinary.state_dict()
    got = dict(lazy.named_buffers()) | lazy.state_dict()
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    embedding = lazy.decoder.wte if arch == "encoder_decoder" else lazy.body.wte
    assert (lazy.lm_head.weight is embedding.weight) == tied
    x = tokens(2, 7)
    torch.testing.assert_close(logits_of(lazy.eval(), x), logits_of(ordinary.eval(), x), atol=0, rtol=0)


def test_the_kv_cache_grows_with_the_positions_decoded_not_block_size():
    """block_size 1024: the cache starts at 256 positions and doubles; every step's logits equal the full forward's."""
    model = build_model(tiny(block_size=1024, n_layer=1, pos_encoding="rope")).eval()
    x = tokens(1, 600)
    cache = model.new_cache()
    steps, sizes = [model.head(model.body(x[:, :200], cache=cache)[0])], []
    for t in range(200, 600):
        steps.append(model.head(model.body(x[:, t : t + 1], cache=cache)[0]))
        sizes.append(cache[0][0].k.size(2))
    assert sorted(set(sizes)) == [256, 512, 1024]
    torch.testing.assert_close(torch.cat(steps, dim=1), model(x)[0], atol=1e-5, rtol=1e-5)
