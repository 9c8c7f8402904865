"""muon.Muon against torch.optim.Muon and a float64 Muon written out here; its skip, its host syncs, its state."""

import io
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model import ModelConfig, build_model
from muon import NS_COEFFICIENTS, Muon, newton_schulz
from optim import configure_optimizers
from train import update_weights

# tall, square and wide matrices; (24, 16) twice, so that one batch holds two
SHAPES = [(24, 16), (16, 16), (16, 40), (24, 16), (40, 16)]
# muon.Muon runs on older PyTorch; the reference is there from 2.9
needs_torch_muon = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is PyTorch 2.9+")


def matrices(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]


def copies(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def gradients(step):
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def set_gradients(params, grads):
    for p, grad in zip(params, grads):
        p.grad = None if grad is None else grad.clone()


def bits(tensors):
    """The tensors' bit patterns: equal only if bitwise equal (NaN to NaN, -0 apart from 0)."""
    return [t.detach().view(torch.int32).clone() for t in tensors]


def momenta(optimizer, params):
    return [optimizer.state[p]["momentum_buffer"] for p in params]


def reference_newton_schulz(G):
    """PyTorch's quintic Newton-Schulz on one matrix, in float64, as its documentation writes it."""
    a, b, c = NS_COEFFICIENTS
    tall = G.shape[0] > G.shape[1]
    X = G.double().T if tall else G.double()
    X = X / X.norm()
    for _ in range(5):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


def reference_muon(weights, grads_per_step, lrs, momentum=0.95, weight_decay=0.1):
    """Muon's steps in float64, one matrix at a time: Nesterov momentum, "original" lr scaling, decoupled decay."""
    weights = [w.detach().double() for w in weights]
    buffers = [torch.zeros_like(w) for w in weights]
    for grads, lr in zip(grads_per_step, lrs):
        for i, g in enumerate(grads):
            buffers[i] = momentum * buffers[i] + (1 - momentum) * g.double()
            update = reference_newton_schulz((1 - momentum) * g.double() + momentum * buffers[i])
            rows, cols = g.shape
            weights[i] = weights[i] * (1 - lr * weight_decay) - lr * math.sqrt(max(1, rows / cols)) * update
    return weights


@needs_torch_muon
@pytest.mark.parametrize(
    "settings",
    [
        {"nesterov": True, "adjust_lr_fn": "original", "weight_decay": 0.1},  # configure_optimizers's
        {"nesterov": False, "adjust_lr_fn": "match_rms_adamw", "weight_decay": 0.0},
    ],
)
def test_in_bfloat16_it_steps_as_torch_muon(settings):
    """In PyTorch's dtype, steps at changing learning rates give torch.optim.Muon's weights and momentum."""
    mine, theirs = matrices(), matrices()
    optimizer = Muon(mine, lr=0.02, ns_dtype=torch.bfloat16, **settings)
    reference = torch.optim.Muon(theirs, lr=0.02, **settings)
    for step, lr in enumerate([0.02, 0.01, 0.005]):
        grads = gradients(step)
        if step == 1:
            grads[2] = None  # a matrix without a gradient is left alone
        for opt, params in ((optimizer, mine), (reference, theirs)):
            opt.param_groups[0]["lr"] = lr
            set_gradients(params, grads)
            opt.step()
    # the momentum is the same float32 arithmetic: exact
    assert all(torch.equal(a, b) for a, b in zip(momenta(optimizer, mine), momenta(reference, theirs)))
    # exact on the CPU this was written on; the tolerance allows a batched bfloat16 matmul to round an element of an
    # update (at most ~0.5) one bfloat16 ulp (2^-8) otherwise than the per-matrix one, at lrs up to 0.03 per step
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


def test_by_default_on_a_cpu_it_is_float32_muon():
    """The default CPU dtype is float32: within float32 rounding of Muon computed in float64 (bfloat16 is ~1e-4 off)."""
    params = matrices()
    optimizer = Muon(params, lr=0.02, weight_decay=0.1, adjust_lr_fn="original")
    lrs, grads_per_step = [0.02, 0.01, 0.005], [gradients(step) for step in range(3)]
    expected = reference_muon(matrices(), grads_per_step, lrs)
    for lr, grads in zip(lrs, grads_per_step):
        optimizer.param_groups[0]["lr"] = lr
        set_gradients(params, grads)
        optimizer.step()
    for p, w in zip(params, expected):
        torch.testing.assert_close(p.double(), w, rtol=0, atol=1e-6)


def test_newton_schulz_orthogonalises_a_batch_in_float32():
    """Each matrix of a batch as the float64 reference (to 2e-6; bfloat16 is 1e-2 off); singular values near 1."""
    G = torch.randn(3, 40, 16, generator=torch.Generator().manual_seed(0))
    for batch in (G, G.mT):  # tall and wide
        out = newton_schulz(batch, NS_COEFFICIENTS, 5, 1e-7, torch.float32)
        expected = torch.stack([reference_newton_schulz(g) for g in batch])
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-6)
        # the quintic trades exactness for speed: singular values in about (0.7, 1.2), not all 1
        singular = torch.linalg.svdvals(expected)
        assert singular.min() > 0.6 and singular.max() < 1.2


class CountMatmuls(TorchDispatchMode):
    """Counts the matrix products PyTorch runs (aten mm, addmm, bmm, baddbmm) while active."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_matrices_of_one_shape_are_orthogonalised_together():
    """Three products per Newton-Schulz step for each shape, not for each matrix (torch.optim.Muon: 5 x 3 x 6)."""
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in [(24, 16), (16, 40)] * 3]
    optimizer = Muon(params, lr=0.02)
    set_gradients(params, [torch.randn(p.shape) for p in params])
    with CountMatmuls() as counter:
        optimizer.step()
    assert counter.count == 5 * 3 * 2


def forbid_host_reads(monkeypatch):
    """Make every way of reading a tensor's value on the host raise: a step that completes never waited for it."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a host sync")

    for name in ("item", "tolist", "__bool__", "__float__", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)


def test_a_skipped_step_changes_nothing_and_no_step_syncs_the_host(monkeypatch):
    """found_inf = 1: weights and momentum bitwise as they were; 0: the plain step. Neither reads the device."""
    params, plain = matrices(), matrices()
    optimizer, reference = Muon(params, lr=0.02), Muon(plain, lr=0.02)
    for opt, ps in ((optimizer, params), (reference, plain)):
        set_gradients(ps, gradients(0))
        opt.step()
    before = bits(params) + bits(momenta(optimizer, params))
    poisoned = gradients(1)
    poisoned[0][0, 0], poisoned[3][1, 1] = math.inf, math.nan
    set_gradients(params, poisoned)
    forbid_host_reads(monkeypatch)
    optimizer.found_inf = torch.tensor(1.0)
    optimizer.step()
    after = bits(params) + bits(momenta(optimizer, params))
    # then a step that is not skipped: as a plain step without the flag
    set_gradients(params, gradients(1))
    set_gradients(plain, gradients(1))
    optimizer.found_inf = torch.tensor(0.0)
    optimizer.step()
    reference.step()
    monkeypatch.undo()
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert all(torch.equal(a, b) for a, b in zip(bits(params), bits(plain)))
    assert all(torch.equal(a, b) for a, b in zip(momenta(optimizer, params), momenta(reference, plain)))


def test_train_updates_with_muon_and_adamw_without_a_host_sync(monkeypatch):
    """train.update_weights with configure_optimizers's Muon and fused AdamW: a step and a skipped step, no sync."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=20, block_size=8, n_layer=2, n_head=2, n_embd=16))
    optimizers, _ = configure_optimizers(model, 0.1, 1e-3, (0.9, 0.95), "cpu", optimizer="muon", muon_lr=0.02)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    idx = torch.randint(0, 20, (2, 8))
    forbid_host_reads(monkeypatch)
    model(idx, idx)[1].backward()
    _, skipped = update_weights(model, optimizers, scaler, grad_clip=1.0)
    model(idx, idx)[1].backward()
    model.lm_head.weight.grad[0, 0] = math.inf
    weights = bits(model.parameters())
    _, skipped_inf = update_weights(model, optimizers, scaler, grad_clip=1.0)
    monkeypatch.undo()
    assert skipped.item() == 0 and skipped_inf.item() == 1
    assert all(torch.equal(a, b) for a, b in zip(weights, bits(model.parameters())))


def test_a_grad_scaler_steps_it_with_scaled_gradients_and_skips_an_overflow():
    """GradScaler.step without unscale_: the plain step on the unscaled gradients; an inf gradient: no step."""
    params, plain = matrices(), matrices()
    optimizer, reference = Muon(params, lr=0.02), Muon(plain, lr=0.02)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for step in range(2):
        grads = gradients(step)
        scaler.scale(sum((p * g).sum() for p, g in zip(params, grads))).backward()  # gradients: 1024 g
        scaler.step(optimizer)  # a power of two: unscaled exactly, by the optimizer
        scaler.update()
        set_gradients(plain, grads)
        reference.step()
        assert all(torch.equal(a, b) for a, b in zip(params, plain))
        optimizer.zero_grad()
    weights = bits(params)
    grads = gradients(2)
    grads[1][0, 0] = math.inf
    scaler.scale(sum((p * g).sum() for p, g in zip(params, grads))).backward()
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() == 2.0**9 and all(torch.equal(a, b) for a, b in zip(weights, bits(params)))


@needs_torch_muon
def test_a_torch_muon_state_dict_loads_and_the_run_goes_on_identically():
    """A checkpoint's torch.optim.Muon state_dict (as torch.load reads it) into Muon: both go on the same way."""
    theirs = matrices()
    reference = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, adjust_lr_fn="original")
    for step in range(2):
        set_gradients(theirs, gradients(step))
        reference.step()
    saved = io.BytesIO()
    torch.save(reference.state_dict(), saved)
    saved.seek(0)
    mine = copies(theirs)
    optimizer = Muon(mine, lr=0.5, ns_dtype=torch.bfloat16)  # the saved lr, decay and lr scaling replace these
    optimizer.load_state_dict(torch.load(saved, weights_only=True))
    assert optimizer.state_dict()["param_groups"] == reference.state_dict()["param_groups"]
    assert all(optimizer.state[p].keys() == {"momentum_buffer"} for p in mine)
    for step in range(2, 4):
        for opt, params in ((optimizer, mine), (reference, theirs)):
            set_gradients(params, gradients(step))
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(momenta(optimizer, mine), momenta(reference, theirs)))
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)  # as in the bfloat16 test above


def test_compiled_it_steps_as_eager_and_a_failed_compile_falls_back(monkeypatch):
    """compile=True gives the eager step (float32); where compiling fails, one warning and eager from then on."""
    compiled, eager = matrices(), matrices()
    optimizers = Muon(compiled, lr=0.02, compile=True), Muon(eager, lr=0.02, compile=False)
    for opt, params in zip(optimizers, (compiled, eager)):
        set_gradients(params, gradients(0))
        opt.step()
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)  # the fused kernels round otherwise

    calls = []

    def no_compiler(fn, **kwargs):
        def fail(*args):
            calls.append(1)
            raise torch._dynamo.exc.TorchDynamoException("no working C++ compiler")

        return fail

    monkeypatch.setattr(torch, "compile", no_compiler)
    failing, params = Muon(compiled, lr=0.02, compile=True), copies(compiled)
    reference = Muon(params, lr=0.02, compile=False)
    for step in range(2):
        for opt, ps in ((failing, compiled), (reference, params)):
            set_gradients(ps, gradients(step))
            if opt is failing and step == 0:
                with pytest.warns(UserWarning, match="torch.compile failed .* no working C\\+\\+ compiler"):
                    opt.step()
            else:
                opt.step()
    assert len(calls) == 1 and all(torch.equal(a, b) for a, b in zip(compiled, params))


@pytest.mark.parametrize(
    "params, settings, message",
    [
        ([torch.nn.Parameter(torch.zeros(4))], {}, "only 2-D parameters"),
        (matrices(), {"lr": -1.0}, "must be >= 0"),
        (matrices(), {"adjust_lr_fn": "rms"}, "adjust_lr_fn='rms' is not one of"),
    ],
)
def test_what_it_cannot_do_is_a_value_error(params, settings, message):
    with pytest.raises(ValueError, match=message):
        Muon(params, **settings)
