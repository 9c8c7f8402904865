"""
The optimizers of a training run and their learning rate: AdamW over a model's weights, or with optimizer='muon'
Muon (muon.py) for the blocks' matrices and AdamW for the rest, built by train.py once the model is spread over the
ranks; and the Schedule that sets each step's learning rate, which goes on where it stood when a run resumes.
"""

import math
from dataclasses import dataclass, replace

import torch

from muon import Muon


def configure_optimizers(model, weight_decay, learning_rate, betas, device_type, optimizer="adamw", muon_lr=0.02):
    """
    {"adamw": AdamW}, or with optimizer="muon" {"adamw": AdamW, "muon": Muon}, over model's trained parameters: Muon
    for model.block_matrices(), AdamW for the rest (embeddings, head, norms, biases, the encoder's transform). AdamW
    decays matrices and embeddings (dim >= 2) and not biases and norm gains; Muon decays all its matrices. Fused
    AdamW where PyTorch has it (CUDA, and CPU since 2.4). Returns (optimizers, one-line summary).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    hidden = {id(p) for p in model.block_matrices()} if optimizer == "muon" else set()
    muon = [p for p in params if id(p) in hidden]
    rest = [p for p in params if id(p) not in hidden]
    # none on biases and norm gains: pulling a gain towards 0 would only shrink its norm's output
    decay = [p for p in rest if p.dim() >= 2]
    no_decay = [p for p in rest if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = device_type in ("cuda", "cpu")
    optimizers = {"adamw": torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=fused)}
    summary = (
        f"AdamW{' (fused)' if fused else ''}: {len(decay)} tensors with weight decay "
        f"({sum(p.numel() for p in decay):,} params), "
        f"{len(no_decay)} without ({sum(p.numel() for p in no_decay):,} params)"
    )
    if muon:
        # Keller Jordan's settings: Nesterov momentum 0.95, the update scaled by sqrt(max(1, rows / cols))
        # ("original"), so that muon_lr ~0.02 suits any width. Decoupled weight decay, as AdamW's
        optimizers["muon"] = Muon(
            muon, lr=muon_lr, weight_decay=weight_decay, momentum=0.95, nesterov=True, adjust_lr_fn="original"
        )
        summary = (
            f"Muon: {len(muon)} block matrices (attention qkv/proj, cross-attention q/kv, MLP fc/up/proj) with weight "
            f"decay ({sum(p.numel() for p in muon):,} params); {summary} (embeddings, head, norms, biases)"
        )
    return optimizers, summary


def make_optimizers(model, cfg, rt):
    """
    configure_optimizers as cfg says, over model's parallelized (sharded, on device) parameters, each group keeping
    its peak learning rate as "initial_lr", which train_step's schedule scales.
    """
    betas = (cfg.beta1, cfg.beta2)
    optimizers, summary = configure_optimizers(
        model, cfg.weight_decay, cfg.learning_rate, betas, rt.device.type, optimizer=cfg.optimizer, muon_lr=cfg.muon_lr
    )
    for group in (group for optimizer in optimizers.values() for group in optimizer.param_groups):
        group["initial_lr"] = group["lr"]
    return optimizers, summary


@dataclass(frozen=True)
class Schedule:
    """
    The learning rate of each step. 'cosine': linear warmup to learning_rate over warmup_iters steps, then a cosine
    decay to min_lr at decay_iters steps, or at the end of a time budget of max_minutes if that comes first (the
    schedule follows whichever is further along), min_lr after. 'noam' (the 2017 paper): the same warmup, then
    learning_rate * sqrt(warmup_iters / step); the paper's d_model**-0.5 * warmup_iters**-0.5 is learning_rate here.
    """

    learning_rate: float
    min_lr: float
    warmup_iters: int
    decay_iters: int
    kind: str = "cosine"
    max_minutes: float = 0.0  # a time budget; 0: the steps alone
    # (iteration, seconds, fraction decayed): a run resumed with another length than its checkpoint's goes on from
    # the fraction its schedule had decayed, over the steps and time that are left; None: counted from the start
    resumed_at: tuple | None = None

    def lr(self, it, seconds=0.0):
        """The learning rate of step it (0-based), begun after `seconds` of training."""
        # 1-based: the first step (it 0) already gets a nonzero learning rate
        step = it + 1
        if self.kind == "noam":
            return self.learning_rate * min(step / self.warmup_iters, math.sqrt(self.warmup_iters / step))
        if step <= self.warmup_iters:
            return self.learning_rate * step / self.warmup_iters
        decayed = self.decayed(it, seconds)
        if decayed >= 1:
            return self.min_lr
        # the cosine factor goes 1 -> 0 as the fraction decayed goes 0 -> 1
        return self.min_lr + 0.5 * (1.0 + math.cos(math.pi * decayed)) * (self.learning_rate - self.min_lr)

    def decayed(self, it, seconds):
        """The fraction of the decay done at step it (from 0 at the end of warmup to 1 at its end), at least 0."""
        start_it, start_seconds, done = self.resumed_at or (0, 0.0, 0.0)
        start_it = max(start_it, self.warmup_iters)
        steps = (it - start_it) / (self.decay_iters - start_it) if it < self.decay_iters else 1.0
        budget = 60 * self.max_minutes - start_seconds
        clock = 0.0 if not self.max_minutes else (seconds - start_seconds) / budget if budget > 0 else 1.0
        return max(done + (1 - done) * max(steps, clock), 0.0)


def make_schedule(cfg, ckpt=None):
    """
    cfg's Schedule; resuming ckpt, one that goes on from where the checkpoint's stood when the run's length differs
    (a larger max_iters, another max_minutes, the clock switched off or on): the learning rate never jumps back up.
    """
    schedule = Schedule(
        cfg.learning_rate,
        cfg.min_lr,
        cfg.warmup_iters,
        cfg.lr_decay_iters or cfg.max_iters,
        cfg.lr_schedule,
        cfg.max_minutes,
    )
    if ckpt is None or cfg.lr_schedule != "cosine":
        return schedule
    saved = ckpt["train_config"]
    before = Schedule(
        saved["learning_rate"],
        saved["min_lr"],
        saved["warmup_iters"],
        saved["lr_decay_iters"] or saved["max_iters"],
        max_minutes=saved.get("max_minutes", 0.0),
        resumed_at=ckpt.get("schedule_from"),
    )
    lengths = ("warmup_iters", "decay_iters", "max_minutes")
    if all(getattr(before, name) == getattr(schedule, name) for name in lengths):
        return replace(schedule, resumed_at=before.resumed_at)  # the same schedule: exactly as it was
    it, seconds = ckpt["iter_num"], ckpt.get("train_seconds", 0.0)
    return replace(schedule, resumed_at=(it, seconds, min(before.decayed(it, seconds), 1.0)))


def schedule_notes(cfg):
    """A line for each way the learning-rate schedule does not fit the run's length (a short run's surprises)."""
    notes = []
    if not cfg.decay_lr or cfg.lr_schedule != "cosine":
        return notes
    if cfg.lr_decay_iters > cfg.max_iters:
        end = make_schedule(cfg).lr(cfg.max_iters - 1)
        notes.append(
            f"note: lr_decay_iters={cfg.lr_decay_iters:,} is beyond max_iters={cfg.max_iters:,}: the run ends at "
            f"learning rate {end:.2e}, not min_lr={cfg.min_lr:.2e}; --lr_decay_iters=0 ends the decay with the run"
        )
    if cfg.warmup_iters >= min(cfg.max_iters, cfg.lr_decay_iters or cfg.max_iters) > 0:
        notes.append(
            f"note: warmup_iters={cfg.warmup_iters:,} fills the whole run of {cfg.max_iters:,} steps: the learning "
            "rate never decays; lower --warmup_iters"
        )
    return notes
