"""
Muon (Keller Jordan, 2024): momentum whose update for each 2-D weight is orthogonalised, replaced by about the
nearest matrix with every singular value near 1, by a few Newton-Schulz iterations. Muon here computes what
torch.optim.Muon computes (its momentum, Nesterov, quintic iteration, coefficients, steps, learning-rate scaling
by shape and decoupled weight decay) and reads and writes the same state_dict, but

- orthogonalises all matrices of one shape at once, as one (N, rows, cols) batch: a few batched matmuls per shape
  instead of about 24 kernels per matrix launched from Python; torch.compile'd by default on CUDA;
- in a dtype chosen by device (ns_dtype): bfloat16 on CUDA, float32 on CPUs, which emulate bfloat16 many times slower;
- skips a step on the device, as fused AdamW does: without the host waiting to read the flag (found_inf).
"""

import math
import warnings

import torch

from log import one_line

# PyTorch's and Keller Jordan's quintic: the coefficients maximise the slope at zero, so that 5 steps bring every
# singular value into roughly (0.5, 1.5), which trains as well as exactly 1 and needs fewer steps
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5


def newton_schulz(G, coefficients, steps, eps, dtype):
    """
    Orthogonalise each matrix of G (N, rows, cols): about U V^T of its SVD U S V^T, by `steps` quintic Newton-Schulz
    iterations X <- a X + b (X X^T) X + c (X X^T)^2 X computed in dtype. Returns (N, rows, cols) in dtype.
    """
    a, b, c = coefficients
    X = G.to(dtype)
    tall = G.size(-2) > G.size(-1)
    if tall:  # iterate on the wide orientation, whose Gram matrix X X^T is the smaller one
        X = X.mT
    # the Frobenius norm bounds the spectral norm: every singular value starts at most 1, where the iteration converges
    X = X / torch.linalg.matrix_norm(X, keepdim=True).clamp(min=eps)
    for _ in range(steps):
        A = torch.bmm(X, X.mT)  # (N, rows, rows) with rows <= cols
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A^2
        X = torch.baddbmm(X, B, X, beta=a)  # a X + B X
    return X.mT if tall else X


def lr_scale(shape, adjust_lr_fn):
    """The learning rate's factor for a (rows, cols) matrix, as torch.optim.Muon's adjust_lr_fn gives it."""
    rows, cols = shape
    if adjust_lr_fn == "match_rms_adamw":  # Moonshot's: the update's RMS about AdamW's, so AdamW's lr carries over
        return 0.2 * math.sqrt(max(rows, cols))
    # "original" (None): an orthogonal tall matrix's entries are smaller; scaled, every update's RMS is 1 / sqrt(cols)
    return math.sqrt(max(1, rows / cols))


class Muon(torch.optim.Optimizer):
    """
    Muon for 2-D parameters, with torch.optim.Muon's arguments and defaults (lr, weight_decay, momentum, nesterov,
    ns_coefficients, eps, ns_steps, adjust_lr_fn: None or "original", or "match_rms_adamw") and state_dict (one
    "momentum_buffer" per parameter; no step count, as PyTorch's), and two more:

    ns_dtype: the dtype of the Newton-Schulz iterations; None: bfloat16 on CUDA (as PyTorch and modded-nanogpt),
    float32 on other devices (docs/performance.md, "The modern recipe on 2 CPU cores").
    compile: torch.compile the iterations (one graph per shape); None: on CUDA only (on 2 CPU cores it did not
        help). If compiling fails, one warning, and the iterations run eagerly from then on.

    step() honours found_inf (a 0-d tensor on the parameters' device, nonzero: skip) and grad_scale (gradients
    still multiplied by it), as a GradScaler or train.update_weights set them for the call, without a host sync.
    """

    # a GradScaler hands such an optimizer found_inf and grad_scale instead of reading found_inf on the host
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params,
        lr=1e-3,
        weight_decay=0.1,
        momentum=0.95,
        nesterov=True,
        ns_coefficients=NS_COEFFICIENTS,
        eps=1e-7,
        ns_steps=NS_STEPS,
        adjust_lr_fn=None,
        *,
        ns_dtype=None,
        compile=None,
    ):
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"Muon: lr, momentum and weight_decay must be >= 0, got {lr}, {momentum}, {weight_decay}")
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"Muon: adjust_lr_fn={adjust_lr_fn!r} is not one of None, 'original', 'match_rms_adamw'")
        # the same group keys as torch.optim.Muon's, so that either loads the other's state_dict
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
        }
        super().__init__(params, defaults)
        for group in self.param_groups:
            if any(p.dim() != 2 for p in group["params"]):
                raise ValueError("Muon: only 2-D parameters (matrices); give the others to AdamW")
        self.ns_dtype, self.compile = ns_dtype, compile
        # a lazy wrapper: nothing is compiled before its first call. Shapes are fixed, so no dynamic-shape kernels
        self.compiled_newton_schulz = torch.compile(newton_schulz, dynamic=False)

    @torch.no_grad()
    def step(self, closure=None):
        """One Muon step for every parameter with a gradient (skipped on the device where self.found_inf is set)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # set for this call only, by a GradScaler or train.update_weights
        found_inf = getattr(self, "found_inf", None)
        skip = None if found_inf is None else found_inf.bool()  # a dtype conversion on the device, not bool(tensor)
        grad_scale = getattr(self, "grad_scale", None)
        for group in self.param_groups:
            batches = {}
            for p in group["params"]:
                if p.grad is not None:
                    batches.setdefault((p.shape, p.device, p.dtype), []).append(p)
            for params in batches.values():
                self.update_stack(params, group, skip, grad_scale)
        return loss

    def update_stack(self, params, group, skip, grad_scale):
        """The step for params, matrices of one shape in group, on stacked (N, rows, cols) copies written back."""
        momentum, lr = group["momentum"], group["lr"]
        buffers = [self.momentum_buffer_of(p) for p in params]
        grads = torch.stack([p.grad for p in params])
        if grad_scale is not None:  # a GradScaler's gradients, not unscaled before step()
            grads = grads / grad_scale
        old_momentum, weights = torch.stack(buffers), torch.stack(params)
        # an exponential average of the gradients, as PyTorch's (lerp, not SGD's running sum)
        new_momentum = old_momentum.lerp(grads, 1 - momentum)
        # Nesterov: orthogonalise the next step's average, as it would be if the gradient stayed the same
        update = grads.lerp(new_momentum, momentum) if group["nesterov"] else new_momentum
        update = self.orthogonalise(update, group)
        # decoupled weight decay at the unscaled lr, then the update at the lr scaled for this shape
        scaled_lr = lr * lr_scale(params[0].shape, group["adjust_lr_fn"])
        new_weights = weights.mul(1 - lr * group["weight_decay"]).add_(update, alpha=-scaled_lr)
        if skip is not None:
            # a non-finite gradient made everything above NaN or inf: keep the old values, chosen on the device
            new_momentum = torch.where(skip, old_momentum, new_momentum)
            new_weights = torch.where(skip, weights, new_weights)
        torch._foreach_copy_(buffers, list(new_momentum.unbind()))
        torch._foreach_copy_(params, list(new_weights.unbind()))

    def momentum_buffer_of(self, p):
        """p's momentum, zeros at first (created even for a skipped step, as fused AdamW creates its moments)."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        return state["momentum_buffer"]

    def orthogonalise(self, update, group):
        """newton_schulz over update (N, rows, cols), in ns_dtype, compiled if asked (eagerly if that fails)."""
        dtype = self.ns_dtype or (torch.bfloat16 if update.is_cuda else torch.float32)
        args = (update, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)
        if self.compile if self.compile is not None else update.is_cuda:
            try:
                return self.compiled_newton_schulz(*args)
            except torch._dynamo.exc.TorchDynamoException as e:  # what compiling raises (no C compiler, no Triton)
                self.compile = False
                warnings.warn(
                    f"Muon: torch.compile failed ({type(e).__name__}: {one_line(e)}); orthogonalising without it",
                    stacklevel=3,
                )
        return newton_schulz(*args)
