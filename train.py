"""
Train a GPT, a masked-LM encoder or an encoder-decoder: one loop, from a laptop CPU to many GPUs.

    python train.py configs/shakespeare.py                          # device and dtype picked automatically
    python train.py configs/shakespeare.py --max_iters=500 --device=cpu
    torchrun --standalone --nproc_per_node=8 train.py configs/gpt2.py
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 train.py configs/gpt2.py
    python train.py --help                                          # every setting with its default and meaning

One optimizer step sees batch_size * gradient_accumulation_steps sequences; the accumulation steps are
shared out over the ranks, so a config means the same optimisation on one device or on eight.
"""

import contextlib
import copy
import ctypes
import math
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields, replace
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import prepare_data
import tokens
from checkpoint import (
    all_finite,
    is_checkpoint,
    load_checkpoint,
    load_sharded,
    model_from_checkpoint,
    nanogpt_meta,
    nonfinite_weights,
    save_checkpoint,
    save_sharded,
    set_rng_state,
    sharded_state,
    training_state,
    weights_state,
    write_json,
)
from config import ConfigError, parse_config
from data import (
    Objective,
    count_targets,
    count_tokens,
    get_batch,
    make_objective,
    micro_seeds,
    seq2seq_batch,
)
from devices import DTYPES, autocast, peak_flops, resolve_device, resolve_dtype
from model import GPT, IGNORE_INDEX, Block, ModelConfig, build_model, download_from_hub

# ModelConfig fields a TrainConfig sets directly; the vocabulary and padding id come from the dataset
MODEL_KEYS = tuple(f.name for f in fields(ModelConfig) if f.name not in ("vocab_size", "pad_token_id"))


@dataclass
class TrainConfig:
    # input and output
    out_dir: str = "out"  # checkpoints (ckpt.pt latest, best.pt best val), config.json and TensorBoard logs
    eval_interval: int = 2000  # evaluate every this many iterations, and after the last one
    log_interval: int = 1  # print a progress line every this many iterations
    eval_iters: int = 200  # batches per split at each evaluation, shared out over the ranks
    eval_only: bool = False  # evaluate once (e.g. init_from='resume' or 'gpt2') and exit
    always_save_checkpoint: bool = True  # ckpt.pt at every eval; False: only at the end (best.pt tracks the best)
    init_from: str = "scratch"  # 'scratch', 'resume', 'gpt2'..., a HF folder, or a checkpoint file (ours or nanoGPT's)
    tensorboard: bool = True  # write TensorBoard scalars into out_dir (tensorboard --logdir OUT_DIR)
    wandb_log: bool = False  # also log to Weights & Biases (pip install wandb)
    wandb_project: str = "nanoformer"  # W&B project
    wandb_run_name: str = "run"  # W&B run name
    # data
    dataset: str = "openwebtext"  # a prepare_data.py dataset (prepared when missing) or a prepared folder's name
    data_dir: str | None = None  # root of the datasets; None: $NANOFORMER_DATA_DIR, else data/ beside prepare_data.py
    data_options: dict = field(default_factory=dict)  # prepare_data.py options, e.g. {'input': 'pairs.tsv'}
    gradient_accumulation_steps: int = 40  # micro-batches per step over all ranks together: a multiple of the ranks
    batch_size: int = 12  # sequences per micro-batch per rank
    block_size: int = 1024  # context length: tokens per LM sequence, longest source/target for seq2seq
    # model (see ModelConfig in model.py)
    arch: str = "gpt"  # 'gpt' (causal LM), 'encoder' (masked LM), 'encoder_decoder' (sequence to sequence)
    n_layer: int = 12  # blocks (decoder blocks of an encoder-decoder)
    n_encoder_layer: int | None = None  # encoder blocks of an encoder-decoder; None: n_layer
    n_head: int = 12  # attention heads
    n_kv_head: int | None = None  # key/value heads, shared by groups of query heads (1: multi-query); None: n_head
    n_embd: int = 768  # width of the residual stream
    d_ff: int | None = None  # MLP hidden width; None: 4 * n_embd, for swiglu too
    dropout: float = 0.0  # 0 for pretraining, 0.1+ for fine-tuning and small data
    bias: bool = False  # bias in Linears and LayerNorms; False is a bit better and faster
    pos_encoding: str = "learned"  # 'learned', 'sinusoidal' or 'rope'
    norm_position: str = "pre"  # 'pre' (GPT-2) or 'post' (2017 paper)
    norm: str = "layernorm"  # 'layernorm' or 'rmsnorm'
    activation: str = "gelu"  # 'gelu', 'gelu_tanh', 'relu', 'relu2' (ReLU squared) or 'swiglu' (gated SiLU)
    qk_norm: bool = False  # RMS-normalise each head's queries and keys before rotary and the dot product
    logit_softcap: float = 0.0  # output logits become cap * tanh(logits / cap), e.g. 30; 0: off
    zero_init_proj: bool = False  # projections into the residual stream start at zero, not GPT-2's scaled init
    tie_embeddings: bool = True  # output projection shares the token embedding
    share_embeddings: bool = False  # encoder_decoder: source and target share one embedding
    norm_eps: float = 1e-5  # epsilon of the norms
    rope_theta: float = 10000.0  # rotary base
    window_size: int = 0  # sliding window: attend to keys fewer than this many positions away (causal: earlier); 0: off
    # objective
    mask_prob: float = 0.15  # encoder: fraction of tokens to predict; 80% shown as [MASK], 10% random, 10% unchanged
    label_smoothing: float = 0.0  # 0.1 in the 2017 paper; evaluation losses are always plain cross-entropy
    eval_accuracy_examples: int = 200  # encoder_decoder: val pairs greedily decoded for exact-match accuracy; 0: none
    # optimizer
    optimizer: str = "adamw"  # 'adamw', or 'muon': Muon for the blocks' matrices, AdamW for the rest (PyTorch 2.9+)
    learning_rate: float = 6e-4  # peak learning rate (of AdamW)
    muon_lr: float = 0.02  # optimizer='muon': Muon's peak learning rate; the schedule scales it as learning_rate
    max_iters: int = 600000  # optimizer steps in total
    weight_decay: float = 1e-1  # on matrices and embeddings only (both optimizers)
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.95  # AdamW beta2
    grad_clip: float = 1.0  # clip the gradient norm to this; 0: no clipping (the norm is logged either way)
    ema_decay: float = 0.0  # evaluate, save and sample a moving average of the weights (e.g. 0.99); 0: off
    # learning-rate schedule
    decay_lr: bool = True  # False: constant learning_rate
    lr_schedule: str = "cosine"  # 'cosine': warmup, cosine to min_lr at lr_decay_iters; 'noam': warmup, 1/sqrt(step)
    warmup_iters: int = 2000  # linear warmup steps
    lr_decay_iters: int = 600000  # cosine reaches min_lr here (usually max_iters)
    min_lr: float = 6e-5  # cosine floor, usually learning_rate / 10
    # system
    backend: str = "auto"  # DDP backend: 'auto' (nccl on CUDA, gloo otherwise), 'nccl' or 'gloo'
    fsdp: bool = False  # torchrun: shard weights, gradients and optimizer state over the ranks (FSDP2), not DDP
    device: str = "auto"  # 'auto' (cuda, else mps, else cpu), 'cpu', 'cuda', 'cuda:1', 'mps'
    dtype: str = "auto"  # 'float32', 'bfloat16', 'float16'; 'auto': bf16 (else fp16) on CUDA, float32 elsewhere
    compile: bool | None = None  # torch.compile the model; None: on for CUDA only
    activation_checkpointing: bool = False  # recompute each block's activations in backward: less memory, ~25% slower
    seed: int = 1337  # seeds data sampling, initialisation and dropout (dropout differs per rank)
    dist_timeout: int = 900  # seconds a rank waits for the others before the job fails instead of hanging

    def __post_init__(self):
        choices = {
            # settings with a fixed set of values; the model's own (arch, norm, ...) are checked by ModelConfig below
            "dtype": DTYPES,
            "lr_schedule": ("cosine", "noam"),
            "backend": ("auto", "nccl", "gloo"),
            "optimizer": ("adamw", "muon"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name}={getattr(self, name)!r} is not one of {', '.join(allowed)}")
        # 0 would divide by zero (the intervals are taken modulo) or make empty batches
        for name in (
            "eval_interval",
            "log_interval",
            "eval_iters",
            "gradient_accumulation_steps",
            "batch_size",
            "dist_timeout",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        # 0 means something here (no steps, no warmup, no clipping); a negative value never does
        for name in ("max_iters", "warmup_iters", "lr_decay_iters", "eval_accuracy_examples", "grad_clip", "min_lr"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.learning_rate <= 0 or self.muon_lr <= 0:
            raise ConfigError(f"learning_rate and muon_lr must be positive, got {self.learning_rate}, {self.muon_lr}")
        if self.fsdp and self.optimizer == "muon":
            raise ConfigError(
                "fsdp=True cannot train with optimizer='muon': Muon orthogonalises each whole matrix, which FSDP "
                "splits over the ranks; use optimizer='adamw' with fsdp, or Muon without fsdp (DDP)"
            )
        if self.optimizer == "muon" and not hasattr(torch.optim, "Muon"):
            raise ConfigError(
                f"optimizer='muon' needs PyTorch 2.9 or newer (torch.optim.Muon); this is {torch.__version__}"
            )
        if not 0 <= self.ema_decay < 1:
            raise ConfigError(f"ema_decay must be in [0, 1) (0: off), got {self.ema_decay}")
        if not 0 < self.mask_prob < 1 or not 0 <= self.label_smoothing < 1:
            raise ConfigError("mask_prob must be in (0, 1) and label_smoothing in [0, 1)")
        if self.lr_schedule == "noam" and self.warmup_iters < 1:
            raise ConfigError("lr_schedule='noam' needs warmup_iters >= 1 (4000 in the paper)")
        try:  # the model settings, checked now rather than after the data is prepared
            self.model_config(vocab_size=1)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def model_config(self, vocab_size, pad_token_id=None):
        """The ModelConfig these settings describe, for a vocabulary of vocab_size ids."""
        settings = {k: getattr(self, k) for k in MODEL_KEYS}
        return ModelConfig(**settings, vocab_size=vocab_size, pad_token_id=pad_token_id)


# -----------------------------------------------------------------------------
# Devices and processes


def log(message):
    """Print on rank 0 only (torchrun sets RANK); flushed so piped logs stay current."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, flush=True)


@dataclass(frozen=True)
class Runtime:
    """Where this process runs: its rank among world_size processes (torchrun sets them), its device and dtype."""

    rank: int = 0
    local_rank: int = 0  # rank within this machine: which GPU is ours
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32  # what forward passes compute in; float32 means no mixed precision
    fsdp: bool = False  # the model is sharded over the ranks with FSDP (else whole on each rank, under DDP)

    def autocast(self):
        """Mixed precision for a forward pass: autocast to dtype, except under FSDP, whose own policy casts."""
        return autocast(self.device, torch.float32 if self.fsdp else self.dtype)


def make_runtime(cfg):
    """The Runtime of this process: ranks from torchrun's variables, device and dtype from cfg."""
    # torchrun sets RANK, LOCAL_RANK and WORLD_SIZE in each process; a plain `python train.py` is rank 0 of 1
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(cfg.device, local_rank)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    dtype = resolve_dtype(cfg.dtype, device)
    if cfg.fsdp and dtype == torch.float16:
        raise ConfigError(
            "fsdp=True computes in bfloat16 or float32, not float16 (whose gradient scaler FSDP runs lack); use "
            "--dtype=bfloat16, or DDP (fsdp=False) on GPUs without bfloat16"
        )
    # one process has nothing to shard over: it trains the whole model, as without fsdp (setup says so)
    return Runtime(rank, local_rank, world_size, device, dtype, fsdp=cfg.fsdp and world_size > 1)


def keep_freed_memory():
    """
    Have glibc keep freed memory for reuse instead of handing it back to the OS. A CPU training step frees and
    reallocates the same activation buffers every time; by default glibc maps the large ones afresh, and the page
    faults of touching them again cost 5-15% of a small model's step (README, Performance). No-op without glibc.
    """
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # macOS, Windows, musl, or a C library without mallopt
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    mallopt(m_mmap_threshold, 32 << 20)  # glibc's maximum: blocks up to 32 MiB come from the reusable heap
    mallopt(m_trim_threshold, 1 << 30)  # and up to 1 GiB of freed heap is kept rather than returned


def split_accumulation(steps, world_size):
    """
    Micro-batches per rank: the global gradient_accumulation_steps shared out over the ranks. Fewer steps than
    ranks (e.g. the quick start's 1 on 2 ranks) give each rank one micro-batch, as nanoGPT users expect.
    """
    if steps < world_size:
        return 1
    if steps % world_size:
        raise ConfigError(
            f"gradient_accumulation_steps={steps} does not divide among {world_size} ranks; "
            f"make it a multiple of {world_size}"
        )
    return steps // world_size


def all_reduce(values, rt):
    """Sum numbers and 0-d tensors over the ranks in one collective; returns a tensor on rt.device."""
    dtype = torch.float32 if rt.device.type == "mps" else torch.float64  # float64 keeps token counts exact
    tensor = torch.stack([torch.as_tensor(v, device=rt.device).to(dtype) for v in values])
    if rt.world_size > 1:
        dist.all_reduce(tensor)
    return tensor


def raise_if_any_failed(error, world_size):
    """
    Every rank passes its one-line error (or None); if any rank failed, all raise the first rank's error at once,
    instead of the others waiting in their next collective until dist_timeout.
    """
    errors = [error]
    if world_size > 1:
        errors = [None] * world_size
        # every rank receives every rank's message (a string or None)
        dist.all_gather_object(errors, error)
    # the lowest failing rank's message: every rank raises the same one
    failed = next((e for e in errors if e), None)
    if failed:
        raise ConfigError(failed)


class StopRequest:
    """SIGINT and SIGTERM set a flag: the loop finishes its step, saves and exits. A second signal acts as usual."""

    def __enter__(self):
        self.signal = None
        # the handlers replaced are kept, to be put back after the first signal and at exit
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def handle(self, signum, frame):
        # the name ('SIGTERM') for the log; the loop checks it before each step
        self.signal = signal.Signals(signum).name
        # so that a second Ctrl-C interrupts at once, should the save hang
        signal.signal(signum, self.previous[signum])

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


# -----------------------------------------------------------------------------
# Data


def prepared_dataset(name, data_dir, options):
    """The folder of dataset `name`, prepared first if missing or out of date; ConfigError says why it cannot be."""
    try:
        folder = tokens.dataset_dir(name, data_dir)
        if name not in prepare_data.DATASETS:  # a folder of the user's own: say what is wrong with it, if anything
            if options:
                raise ValueError(f"data_options need one of the datasets {', '.join(prepare_data.DATASETS)}")
            if not folder.is_dir():
                raise ValueError(f"not one of {', '.join(prepare_data.DATASETS)}, nor a folder in {folder.parent}")
            tokens.check_prepared(folder)
        # prepare() keeps outputs that are up to date for these options: with none, an intact folder is enough
        elif options or not tokens.is_prepared(folder):
            log(f"dataset {name}: preparing it in {folder.parent} unless up to date")
            folder = prepare_data.prepare(name, data_dir, **options)
    # bad options, a missing input, a failed download, a full disk: all reported as one line
    except (ValueError, OSError) as e:
        raise ConfigError(f"dataset {name}: {e}") from None
    return folder


def find_dataset(cfg, rt):
    """The dataset's folder, prepared first if missing: by rank 0, then by each node's first rank, then by the rest."""
    folder = None
    # three turns, so that one process downloads and tokenizes while the others wait: rank 0 first, then the first
    # rank of every other machine (its data_dir may be a local disk), then everyone else, who find it done
    for my_turn in (rt.rank == 0, rt.rank != 0 and rt.local_rank == 0, rt.local_rank != 0):
        error = None
        if my_turn:
            try:
                folder = prepared_dataset(cfg.dataset, cfg.data_dir, cfg.data_options)
            except ConfigError as e:
                error = str(e)
        raise_if_any_failed(error, rt.world_size)  # also makes the others wait until the files exist
    return folder


def load_splits(folder, meta, block_size):
    """train and val data: token memmaps (LM), or (Pairs, indices of the pairs that fit block_size) (seq2seq)."""
    splits = {}
    for split in ("train", "val"):
        if meta["kind"] == "lm":
            # a memmap: the file stays on disk, and each batch reads only the windows it draws
            splits[split] = tokens.load_tokens(folder / f"{split}.bin")
            if len(splits[split]) <= block_size:  # a GPT's window is block_size + 1 tokens (inputs and targets)
                raise ConfigError(
                    f"{folder.name}'s {split} split has {len(splits[split]):,} tokens, too few for "
                    f"block_size={block_size}: use block_size <= {len(splits[split]) - 1}, or a "
                    f"dataset with a longer {split} split"
                )
            continue
        # seq2seq: pairs.index is (n + 1, 2), the offsets of each pair's source and target in two flat arrays
        pairs = tokens.load_pairs(folder, split)
        lengths = np.diff(pairs.index, axis=0)  # (n, 2): source and target length of each pair
        # the decoder reads bos + target and predicts target + eos: target + 1 positions
        fits = np.flatnonzero((lengths[:, 0] <= block_size) & (lengths[:, 1] + 1 <= block_size))
        if not len(fits):
            raise ConfigError(f"no {split} pair of {folder.name} fits block_size={block_size}; raise block_size")
        if len(fits) < len(pairs):
            log(
                f"note: {len(pairs) - len(fits):,} of {len(pairs):,} {split} pairs do not fit block_size={block_size}; "
                "they are left out"
            )
        splits[split] = (pairs, fits)
    return splits


def model_inputs(inputs, targets, device):
    """
    A batch on device: (inputs tuple, targets). Pinned host memory (see TrainBatches) lets the copy overlap with GPU
    work. Sequence-to-sequence batches (src, tgt) vary in length from batch to batch: their lengths are marked
    dynamic, so torch.compile builds one graph for all of them instead of recompiling for each new length.
    """
    moved = [x.to(device, non_blocking=x.is_pinned()) for x in (*inputs, targets)]
    # (src (B, S), tgt_in (B, T)): dimension 1 is the length, which varies by batch
    if len(inputs) == 2:
        for x in moved:
            torch._dynamo.maybe_mark_dynamic(x, 1)
    return tuple(moved[:-1]), moved[-1]


class TrainBatches:
    """
    The training micro-batches of this rank, one step ahead: while the device runs a step, a background thread
    builds the next step's batches (pinned in memory on CUDA) and counts their targets and tokens, so a small
    model's step does not wait for Python. Each micro-batch depends only on its seed, drawn in order from
    `generator` for the micro-batches of all ranks: the stream is the same on any number of ranks.
    """

    def __init__(self, data, objective, cfg, generator, rt, per_rank):
        self.data, self.objective, self.cfg, self.pin = data, objective, cfg, rt.device.type == "cuda"
        self.generator, self.rank, self.per_rank, self.world_size = generator, rt.rank, per_rank, rt.world_size
        # one worker: the next step's batches are built in order while this step runs, never further ahead
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.advance()

    def advance(self):
        """Start building the next step's batches."""
        self.resume_state = self.generator.get_state()  # what a checkpoint stores: the pending step is not taken
        # every rank draws all ranks' seeds, so the generator moves alike everywhere; each keeps its own slice
        seeds = micro_seeds(self.generator, self.per_rank * self.world_size)
        mine = seeds[self.rank * self.per_rank : (self.rank + 1) * self.per_rank]
        self.pending = self.pool.submit(self.build, mine)

    def build(self, seeds):
        """(micro-batches, real targets, input tokens) for these seeds; runs on the background thread."""
        cfg, objective = self.cfg, self.objective
        batches = [
            # a fresh generator per micro-batch: its contents depend on its seed alone
            get_batch(self.data, objective, cfg.batch_size, cfg.block_size, torch.Generator().manual_seed(s))
            for s in seeds
        ]
        # pinned (page-locked) memory lets the copy to the GPU run asynchronously (non_blocking)
        if self.pin:
            batches = [(tuple(x.pin_memory() for x in inputs), targets.pin_memory()) for inputs, targets in batches]
        # counted here on the CPU, so the training loop never waits for a count on the GPU
        n_targets = sum(count_targets(targets) for _, targets in batches)
        return batches, n_targets, sum(count_tokens(inputs, objective) for inputs, _ in batches)

    def peek(self):
        """(micro-batches, real targets, input tokens) of the next step, without taking it."""
        return self.pending.result()

    def close(self):
        self.pool.shutdown(cancel_futures=True)


# -----------------------------------------------------------------------------
# Learning rate, one step, evaluation


def get_lr(it, learning_rate, min_lr, warmup_iters, lr_decay_iters, schedule="cosine"):
    """
    Learning rate of step it (0-based). 'cosine': linear warmup to learning_rate over warmup_iters steps, cosine
    decay to min_lr at lr_decay_iters, min_lr after. 'noam' (the 2017 paper): the same warmup, then
    learning_rate * sqrt(warmup_iters / step); the paper's d_model**-0.5 * warmup_iters**-0.5 is learning_rate here.
    """
    # 1-based: the first step (it 0) already gets a nonzero learning rate
    step = it + 1
    if schedule == "noam":
        return learning_rate * min(step / warmup_iters, math.sqrt(warmup_iters / step))
    if step <= warmup_iters:
        return learning_rate * step / warmup_iters
    if it >= lr_decay_iters:
        return min_lr
    # 0 -> 1 from the end of warmup to lr_decay_iters; the cosine factor goes 1 -> 0 over it
    progress = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (learning_rate - min_lr)


def gradient_sync(parallel, enabled):
    """
    A context for one micro-batch's backward. enabled False: its gradients only add up on this rank, no
    communication (DDP's no_sync; FSDP keeps them unsharded); True (the last micro-batch of a step): the summed
    gradients are averaged over the ranks (DDP all-reduces, FSDP reduce-scatters: each rank keeps its shard).
    parallel: the DDP module or the FSDP-sharded root module, or None in one process.
    """
    if isinstance(parallel, DDP) and not enabled:
        return parallel.no_sync()
    if isinstance(parallel, FSDPModule):
        parallel.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()


def accumulate_gradients(model, batches, n_targets, scaler, rt, *, label_smoothing=0.0, parallel=None):
    """
    Forward and backward over this rank's micro-batches; returns their summed loss. Each summed loss is divided by
    n_targets, the real targets of the whole step on all ranks, and multiplied by world_size to undo the ranks'
    average: the gradient is that of the mean over every target of the step, not a mean of per-micro-batch means.
    parallel: the DDP or FSDP module of `model`, if any: the ranks exchange gradients after the last micro-batch only.
    """
    total = torch.zeros((), device=rt.device)
    for i, (inputs, targets) in enumerate(batches):
        with gradient_sync(parallel, enabled=i == len(batches) - 1):
            inputs, targets = model_inputs(inputs, targets, rt.device)
            with rt.autocast():
                # the model sums the loss itself, in chunks of positions: the (B, T, V) logits never exist whole
                _, loss = model(*inputs, targets, label_smoothing=label_smoothing, reduction="sum", return_logits=False)
            # / n_targets: this micro-batch's part of the step's mean loss; * world_size: undoes the ranks' average
            scaler.scale(loss * (rt.world_size / n_targets)).backward()
        # a device tensor: adding to it never waits for the GPU
        total += loss.detach()
    return total


def clip_gradients(parameters, max_norm):
    """
    Scale the gradients of parameters (a list) so that their global norm is at most max_norm; returns the norm from
    before. Under FSDP each rank holds a shard of each gradient: the norm is taken over all the shards of all ranks.
    """
    norm = torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()  # every rank's part of the sum of squares, added up
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm


def train_step(
    model, optimizers, scaler, batches, rt, *, n_targets, lrs, grad_clip, label_smoothing=0.0, parallel=None
):
    """
    One optimizer step on this rank's micro-batches (n_targets: the real targets of the step on all ranks).
    optimizers: {name: optimizer}, each over its own parameters; lrs: {name: its learning rate for this step}.
    Returns device tensors, without waiting for the device: (this rank's share of the step's mean loss, the
    gradient norm, 1.0 if the step was skipped else 0.0). A step whose gradient is not finite (a bf16 overflow in
    backward, say) is skipped: the weights and every optimizer's state stay as they were.
    """
    # the schedule's value, set on every group of each optimizer (AdamW's differ only in weight decay)
    for name, optimizer in optimizers.items():
        for group in optimizer.param_groups:
            group["lr"] = lrs[name]
    args = (batches, n_targets, scaler, rt)
    kwargs = {"label_smoothing": label_smoothing, "parallel": parallel}
    try:
        loss = accumulate_gradients(model, *args, **kwargs)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # a recompiled graph's backward is compiled at its first use, inside backward()
        if not isinstance(model, CompiledModel) or model.failed:
            raise
        if isinstance(parallel, FSDPModule):
            # FSDP holds the earlier micro-batches' gradients where zero_grad does not reach: a redo would add them
            raise ConfigError(
                f"torch.compile failed in a backward ({first_line(e)}); run with --compile=false"
            ) from None
        model.fall_back(e)
        for optimizer in optimizers.values():
            optimizer.zero_grad(set_to_none=True)
        loss = accumulate_gradients(model, *args, **kwargs)  # the step again, eagerly: the model's own errors recur
    # float16 gradients were scaled up: unscaled (a no-op otherwise) before clipping, so grad_clip is in true units
    for optimizer in optimizers.values():
        scaler.unscale_(optimizer)
    # with no clipping (math.inf) the norm is still computed, for the log and the finiteness check
    grad_norm = clip_gradients(list(model.parameters()), grad_clip if grad_clip > 0 else math.inf)
    skipped = (~torch.isfinite(grad_norm)).float()  # of the gradients averaged over the ranks: the same everywhere
    for optimizer in optimizers.values():
        if scaler.is_enabled():
            scaler.step(optimizer)  # float16: the gradient scaler skips such steps itself
        elif getattr(optimizer, "_step_supports_amp_scaling", False):
            # fused AdamW takes the flag a gradient scaler would pass and skips the update on the device: no host sync
            optimizer.found_inf = skipped
            optimizer.step()
            del optimizer.found_inf
        # any other optimizer (Muon, unfused AdamW): the host must read the flag to decide, one wait per step
        elif not skipped.item():
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    scaler.update()  # after every optimizer's step; a no-op without float16
    # this rank's share of the step's mean loss: summed over the ranks, it is the mean
    return loss / n_targets, grad_norm, skipped


class StepLosses:
    """
    The losses of the latest steps, kept on the device and read back at log lines and evaluations only: reading a
    number from a GPU waits for all the work queued before it, so a read every step would leave the GPU idle.
    """

    def __init__(self, rt):
        self.world_size = rt.world_size
        self.pending = []  # (iteration, this rank's share of the step's mean loss)
        self.skipped = torch.zeros((), device=rt.device)  # steps with a non-finite gradient since the last read
        self.unreported = 0  # skipped steps read back but not yet reported

    def add(self, iteration, loss, skipped):
        self.pending.append((iteration, loss))
        self.skipped += skipped

    def read(self):
        """
        {iteration: mean loss over all ranks} of the steps since the last read; FloatingPointError at the first
        non-finite loss. The count of skipped steps waits in `unreported` for take_unreported.
        """
        if not self.pending:
            return {}
        # one stacked tensor: one all-reduce and one device-to-host copy for all the pending steps
        losses = torch.stack([loss for _, loss in self.pending])
        if self.world_size > 1:
            dist.all_reduce(losses)
        # the skipped count rides in the same copy, so reading it costs no second wait
        *losses, skipped = torch.cat([losses.float(), self.skipped[None]]).tolist()
        iterations = [iteration for iteration, _ in self.pending]
        self.pending, self.skipped = [], torch.zeros_like(self.skipped)
        self.unreported += int(skipped)
        for iteration, loss in zip(iterations, losses):
            if not math.isfinite(loss):
                raise FloatingPointError(
                    f"loss is {loss} at iteration {iteration}; stopped at iteration "
                    f"{iterations[-1]} with nothing saved since, so the last checkpoint is "
                    "untouched. Lower learning_rate or raise warmup_iters"
                )
        return dict(zip(iterations, losses))

    def take_unreported(self):
        """How many steps were skipped since the last call."""
        count, self.unreported = self.unreported, 0
        return count


@torch.no_grad()
def evaluate(model, splits, objective, cfg, rt, byte_lengths=None):
    """
    Mean cross-entropy per real target over eval_iters batches of each split, the batches shared out over the ranks
    and the sums added over all of them. Fixed seeds: every evaluation sees the same batches. byte_lengths (the
    UTF-8 bytes each id stands for, tokens.token_byte_lengths): also "val_bpb", the val loss in bits per byte of
    the text its targets cover, which compares across tokenizers.
    """
    model.eval()
    losses = {}
    for i, (split, data) in enumerate(splits.items()):
        # fixed seeds apart from training's stream: the same batches at every evaluation; rank r takes every
        # world_size-th of them
        seeds = micro_seeds(torch.Generator().manual_seed(cfg.seed + 1 + i), cfg.eval_iters)
        mine = seeds[rt.rank :: rt.world_size]
        # under FSDP every forward pass is a collective (it gathers the weights): all ranks run as many, a rank
        # with one batch fewer (eval_iters not a multiple of the ranks) runs one more that is not counted
        rounds = -(-len(seeds) // rt.world_size) if rt.fsdp else len(mine)
        total, count, n_bytes = torch.zeros((), device=rt.device), 0, 0
        for r in range(rounds):
            counted = r < len(mine)
            generator = torch.Generator().manual_seed(mine[r] if counted else seeds[0])
            inputs, targets = get_batch(data, objective, cfg.batch_size, cfg.block_size, generator)
            # counted on the CPU before the copy, so that no batch waits for the GPU
            count += count_targets(targets) * counted
            if byte_lengths is not None and counted:
                n_bytes += int(byte_lengths[targets[targets != IGNORE_INDEX].numpy()].sum())
            inputs, targets = model_inputs(inputs, targets, rt.device)
            with rt.autocast():
                _, loss = model(*inputs, targets, reduction="sum", return_logits=False)
            total += loss.float() * counted
        # sums over the ranks, then one division: the mean over every target, however they were shared out
        total, count, n_bytes = all_reduce([total, count, n_bytes], rt).tolist()
        losses[split] = total / max(count, 1)
        if byte_lengths is not None and split == "val":
            # nats summed over the targets, in bits, per byte of the text they spell
            losses["val_bpb"] = total / (math.log(2) * max(n_bytes, 1))
    if rt.fsdp:
        # FSDP keeps the root's weights gathered after a forward pass, for the backward that follows in training
        next(m for m in model.modules() if isinstance(m, FSDPModule)).reshard()
    return losses


@torch.no_grad()
def exact_match(model, pairs, rows, objective, cfg, rt):
    """
    Fraction of the pairs `rows` whose greedy decoding (at most cfg.block_size tokens) equals the reference
    exactly, over all ranks.
    """
    model.eval()
    # rank r decodes every world_size-th pair
    mine, correct = rows[rt.rank :: rt.world_size], 0
    for start in range(0, len(mine), cfg.batch_size):
        src, _, targets = seq2seq_batch(pairs, mine[start : start + cfg.batch_size], objective)
        with rt.autocast():
            # (B, L) ids without bos, each row ending at its eos, padded after it
            out = model.generate(src.to(rt.device), cfg.block_size, objective.bos_id, objective.eos_id).tolist()
        for hyp, ref in zip(out, targets.tolist()):
            ref = [t for t in ref if t != IGNORE_INDEX]  # the target and its eos: nothing may follow before eos
            correct += hyp[: len(ref)] == ref
    correct, total = all_reduce([correct, len(mine)], rt).tolist()
    return correct / max(total, 1)


class CompiledModel(nn.Module):
    """
    torch.compile(module), falling back to the eager module with one warning if a compilation fails, whenever it
    happens: at the first call or at a later recompilation (evaluation mode, say). A backward graph is compiled at
    its first use, in loss.backward(): train_step redoes such a step eagerly after calling fall_back.
    """

    def __init__(self, module):
        super().__init__()
        # the eager module is kept for the fallback; both share the same parameters
        self.module, self.compiled, self.failed = module, torch.compile(module), False

    def forward(self, *args, **kwargs):
        if not self.failed:
            try:
                return self.compiled(*args, **kwargs)
            except torch._dynamo.exc.TorchDynamoException as e:  # what compilation raises, not the model's errors
                self.fall_back(e)
        return self.module(*args, **kwargs)

    def fall_back(self, error):
        self.failed = True
        log(f"warning: torch.compile failed ({type(error).__name__}: {first_line(error)}); going on without it")


def compile_model(model, example, rt, label_smoothing=0.0):
    """
    CompiledModel(model), tried on one forward and backward pass (the backward is compiled at its first call);
    if that fails, one warning and the eager model. Running out of memory is no compile failure: it is raised.
    """
    compiled = CompiledModel(model)
    try:
        # the trial leaves every random generator as it was, so compiling does not change the run
        with torch.random.fork_rng(devices=[rt.device.index] if rt.device.type == "cuda" else []):
            inputs, targets = model_inputs(*example, rt.device)
            with rt.autocast():
                # the training step's exact call, so that training reuses this graph instead of compiling another
                _, loss = compiled(
                    *inputs, targets, label_smoothing=label_smoothing, reduction="sum", return_logits=False
                )
            loss.backward()
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # a missing C compiler, an unsupported operator, ...: all mean eager mode
        compiled.fall_back(e)
    # the trial's gradients must not add to the first real step's
    model.zero_grad(set_to_none=True)
    return model if compiled.failed else compiled


def first_line(error):
    """The first line of an error's message, at most 300 characters, for a one-line report."""
    return (str(error).strip().splitlines() or [""])[0][:300]


# -----------------------------------------------------------------------------
# Weights to start from, where to write


def pretrained_weights(name, arch, meta, dropout, block_size):
    """
    Hugging Face weights (a hub id or a local folder) for fine-tuning: GPT-2 on GPT-2 BPE data, or any model (Llama,
    Mistral, GPT-2) on data prepared with its folder's tokenizer.json.
    """
    folder = Path(name).expanduser()
    # a hub id is refused before any download where no pretrained model could fit: char-level ids, another arch
    if not folder.is_dir() and (arch != "gpt" or meta["tokenizer"]["type"] == "char"):
        raise ConfigError(
            f"init_from={name} needs arch='gpt' and data in the model's token ids: a GPT-2 BPE dataset "
            "(e.g. dataset='shakespeare') for GPT-2, else one prepared with its tokenizer.json (--tokenizer)"
        )
    try:
        if not folder.is_dir():
            # a hub id: its config.json and tokenizer.json come down with the weights (or from the local cache)
            folder = download_from_hub(name)
        # the ids the model was trained on, read before the slow load: its tokenizer.json, or GPT-2's BPE
        accepted = [tokens.pretrained_meta(folder)["tokenizer"]]
        gpt2 = tokens.model_config(folder).get("model_type") == "gpt2"
    except (OSError, ValueError) as e:
        raise ConfigError(f"init_from={name}: {first_line(e)}") from None
    if gpt2:
        # GPT-2 reads GPT-2 BPE however the data was prepared: with tiktoken, or with its own tokenizer.json
        accepted.append(tokens.GPT2_META["tokenizer"])
    # the weights only fit a causal LM on the token ids they were trained on
    if gpt2 and (arch != "gpt" or meta["tokenizer"] not in accepted):
        raise ConfigError(f"init_from={name} needs arch='gpt' and a GPT-2 BPE dataset (e.g. dataset='shakespeare')")
    if arch != "gpt":
        raise ConfigError(f"init_from={name} holds a causal LM: it needs arch='gpt', not arch={arch!r}")
    if meta["tokenizer"] not in accepted:
        raise ConfigError(
            f"init_from={name} needs a dataset prepared with its tokenizer.json, which {meta.get('name')} was not; "
            f"prepare one with --tokenizer={folder}, e.g. --dataset=shakespeare "
            f"--data_options=\"{{'tokenizer': '{folder}'}}\""
        )
    try:
        return GPT.from_pretrained(folder, dropout=dropout, block_size=block_size)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"init_from={name}: {first_line(e)}") from None


def out_dir_problem(out_dir):
    """Why out_dir could not be written (None if it can), found before any work is done, creating nothing."""
    path = Path(out_dir).absolute()
    # the deepest part of the path that exists: the folder in which the rest would be created
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        return f"out_dir={out_dir} cannot be a folder: {existing} is a file; choose another --out_dir"
    # write to create entries in it, execute to enter it
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"out_dir={out_dir} cannot be written: {existing} is not writable by this user; choose another --out_dir"
    return None


class Scalars:
    """TensorBoard (and W&B) scalars; inert on ranks other than 0 and when both are off."""

    def __init__(self, cfg, active):
        self.tensorboard = self.wandb = None
        if active and cfg.tensorboard:
            try:
                # imported only when asked for: TensorBoard and W&B are optional dependencies
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError("tensorboard=True needs: pip install tensorboard (or --tensorboard=false)") from None
            self.tensorboard = SummaryWriter(cfg.out_dir)
        if active and cfg.wandb_log:
            try:
                import wandb
            except ImportError:
                raise ConfigError("wandb_log=True needs: pip install wandb (or --wandb_log=false)") from None
            self.wandb = wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name, config=asdict(cfg))

    def add(self, step, values):
        if self.tensorboard:
            for name, value in values.items():
                self.tensorboard.add_scalar(name, value, step)
        if self.wandb:
            self.wandb.log(values, step=step)

    def close(self):
        if self.tensorboard:
            self.tensorboard.close()
        if self.wandb:
            self.wandb.finish()


# -----------------------------------------------------------------------------
# The run


def checkpoint_weights(path, cfg, meta):
    """
    (model, meta for its checkpoints) from a checkpoint file, train.py's (another run's best.pt or ckpt.pt: its
    weights, the average if it kept one) or nanoGPT's, to fine-tune or evaluate on the dataset whose meta is given.
    It must have been trained on the same tokenizer; nanoGPT's character-level models, whose characters this
    project does not read (they are in a pickle), take the dataset's, which must be as many.
    """
    ckpt = load_checkpoint(path)
    # nanoGPT's character-level checkpoints take the dataset's characters
    saved = ckpt["meta"] or nanogpt_meta(ckpt, path, meta, "train it on a character-level dataset")
    if saved["tokenizer"] != meta["tokenizer"]:
        raise ConfigError(f"{path} was trained with another tokenizer than dataset={cfg.dataset}'s")
    # its architecture and weights; dropout is the new run's (0 to evaluate, 0.1 to fine-tune on little data)
    return model_from_checkpoint(ckpt, dropout=cfg.dropout).train(), saved


UNAVERAGED_NOTE = "note: training goes on from the un-averaged weights; their average is dropped (ema_decay=0)"


def init_model(cfg, meta, lazy=False):
    """
    (cfg, model, objective, meta for checkpoints, checkpoint or None) for cfg.init_from. A checkpoint or GPT-2
    decides the model's settings, and cfg is updated to match (with a note when settings given differ).
    lazy: a model that starts from scratch or from a sharded checkpoint is built on the meta device, without memory
    or values (FSDP then allocates and fills each rank's shards). A sharded checkpoint's weights are not loaded here:
    the checkpoint comes back with "sharded", for load_sharded once the model and optimizer are in place.
    """
    ckpt = None
    if cfg.init_from == "resume":
        path = Path(cfg.out_dir) / "ckpt.pt"
        ckpt = load_checkpoint(path, weights=False)
        if ckpt.get("nanogpt"):
            raise ConfigError(
                f"{path} was written by nanoGPT: start a new run from it with --init_from={path} and another "
                "--out_dir (its optimizer state is not carried over)"
            )
        # the weights were trained on another tokenizer's ids: on this data they would read nonsense
        if ckpt["meta"]["tokenizer"] != meta["tokenizer"]:
            raise ConfigError(f"{path} was trained with another tokenizer than dataset={cfg.dataset}'s")
        # settings the user gave (not left at their defaults) that the checkpoint overrides; None resolved first
        defaults = {f.name: f.default for f in fields(TrainConfig)}
        given = asdict(cfg.model_config(vocab_size=1))
        # the checkpoint's settings completed with today's defaults: a checkpoint older than a setting lacks it
        saved = asdict(ModelConfig.from_dict(ckpt["model_config"]))
        changed = [f"{k}={saved[k]!r}" for k in MODEL_KEYS if getattr(cfg, k) != defaults[k] and given[k] != saved[k]]
        if changed:
            log(f"note: resuming with the checkpoint's model settings: {', '.join(changed)}")
        # the checkpoint's settings win: its weights fit only the architecture they were trained in
        cfg = replace(cfg, **{k: saved[k] for k in MODEL_KEYS})
    if cfg.init_from not in ("scratch", "resume") and is_checkpoint(cfg.init_from):
        # a new run from a checkpoint's weights: its settings decide the architecture, as a resume's do; the
        # objective from the dataset, the meta to save from the checkpoint (an encoder's holds its [MASK] id)
        model, saved_meta = checkpoint_weights(Path(cfg.init_from).expanduser(), cfg, meta)
        cfg = replace(cfg, **{k: getattr(model.config, k) for k in MODEL_KEYS})
        return cfg, model, make_objective(cfg.arch, meta, cfg.mask_prob)[0], saved_meta, None
    # meta_out may add a [MASK] id; a resumed run keeps the checkpoint's meta, which already has it
    objective, vocab_size, meta_out = make_objective(cfg.arch, meta, cfg.mask_prob)
    if ckpt is not None and "sharded" in ckpt:
        with torch.device("meta") if lazy else contextlib.nullcontext():
            model = build_model(ModelConfig.from_dict(ckpt["model_config"]))
        return cfg, model, objective, ckpt["meta"], ckpt
    if ckpt is not None:
        model = model_from_checkpoint(ckpt)
        if "train_model" in ckpt and not cfg.eval_only:  # trained with ema_decay: "model" is the average,
            model.load_state_dict(ckpt["train_model"])  # these are the optimizer's weights (eval_only: the average)
            if not cfg.ema_decay:
                log(UNAVERAGED_NOTE)
        return cfg, model.train(), objective, ckpt["meta"], ckpt
    if cfg.init_from == "scratch":
        with torch.device("meta") if lazy else contextlib.nullcontext():
            model = build_model(cfg.model_config(vocab_size, objective.pad_id))
        return cfg, model, objective, meta_out, None
    # init_from names Hugging Face weights: their size decides n_layer, n_head, n_embd and the rest
    model = pretrained_weights(cfg.init_from, cfg.arch, meta, cfg.dropout, cfg.block_size)
    return replace(cfg, **{k: getattr(model.config, k) for k in MODEL_KEYS}), model, objective, meta_out, None


def update_ema(averages, weights, decay, step):
    """
    After optimizer step number `step`: average = d * average + (1 - d) * weight for each pair of tensors of the
    lists, with d = min(decay, (1 + step) / (10 + step)), so the average soon forgets the first weights and then
    spans about 1 / (1 - decay) steps. Evaluated mid-run, the average is about as good as the weights would be
    after a learning-rate decay, without the decay.
    """
    d = min(decay, (1 + step) / (10 + step))
    with torch.no_grad():  # one fused lerp over all tensors (what torch.optim.swa_utils uses): 3x faster than a loop
        torch._foreach_lerp_(averages, weights, 1 - d)


def format_eta(seconds):
    """seconds as '1h05m' or '4m09s': the time left, on the progress line."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


@dataclass
class Run:
    """What setup() builds for the training loop: the models, the optimizer, the data and where results go."""

    cfg: TrainConfig  # with the model settings of the checkpoint or GPT-2 weights it starts from
    rt: Runtime
    raw_model: nn.Module  # the plain model: what is saved (without prefixes), counted, sampled
    model: nn.Module  # what a training step calls: compiled and/or wrapped in DDP
    parallel: nn.Module | None  # the DDP module inside `model`, or the FSDP-sharded raw_model; None in one process
    eval_model: nn.Module  # what evaluation calls: outside DDP (ranks may see different numbers of eval batches)
    ema_model: nn.Module | None  # with ema_decay: the moving average of raw_model's weights, else None
    ema_pairs: tuple  # (the average's parameters, raw_model's): listed once, not at every step
    optimizers: dict  # {"adamw": AdamW} or, with optimizer='muon', {"adamw": AdamW, "muon": Muon}
    scaler: torch.amp.GradScaler
    batches: TrainBatches
    splits: dict  # "train" and "val" data, as get_batch reads them
    byte_lengths: np.ndarray | None  # GPT: the UTF-8 bytes of each token id, for val_bpb; else None
    objective: Objective
    meta: dict  # the dataset's meta, as checkpoints store it
    scalars: "Scalars"
    stop: StopRequest
    host_group: object  # a gloo group for numbers the host already has; None in one process
    peak_flops: float | None  # of this GPU, for MFU; None on CPUs and unknown GPUs
    start_iter: int
    best_val_loss: float
    resumed: bool

    @property
    def kept_model(self):
        """What is evaluated, saved as "model" and sampled: the weight average if there is one."""
        return self.raw_model if self.ema_model is None else self.ema_model


@dataclass
class Step:
    """One optimizer step's results: device tensors (loss, grad_norm, skipped) and host numbers."""

    loss: torch.Tensor  # this rank's share of the step's mean loss
    grad_norm: torch.Tensor
    skipped: torch.Tensor  # 1.0 if the gradient was not finite and the weights were left as they were
    lr: float
    tokens: int  # input tokens on all ranks
    flops: float  # of this rank's matmuls (counted only where MFU is reported)


@dataclass
class Window:
    """The training steps since the last progress line: their wall time (evaluations left out), tokens, FLOPs."""

    start: float = field(default_factory=time.perf_counter)
    steps: int = 0
    tokens: int = 0
    flops: float = 0.0

    def add(self, step):
        self.steps, self.tokens, self.flops = self.steps + 1, self.tokens + step.tokens, self.flops + step.flops


def init_distributed(cfg, rt, stack):
    """Join the torchrun job (a no-op in one process); returns the host-side gloo group, or None."""
    if rt.world_size == 1:
        return None
    if rt.device.type == "cuda":
        # NCCL uses the current GPU: each rank's must be its own before the group forms
        torch.cuda.set_device(rt.device)
    backend = cfg.backend if cfg.backend != "auto" else "nccl" if rt.device.type == "cuda" else "gloo"
    # the timeout turns a dead or stuck rank into an error on the others instead of a hang, in both groups
    timeout = timedelta(seconds=cfg.dist_timeout)
    dist.init_process_group(backend, timeout=timeout)
    stack.callback(dist.destroy_process_group)
    # target counts and stop votes are host numbers: summing them over gloo never waits for the GPU
    return dist.new_group(backend="gloo", timeout=timeout)


def shard_model(model, rt, seed):
    """
    FSDP2 over the ranks: each Block sharded as a unit, then the root (embeddings, head, final norm), so that a
    block's weights are gathered just before its forward and backward and freed after. Each rank keeps its shard of
    every weight, gradient and (built afterwards) optimizer state. A model built on the meta device gets memory for
    its shards only and is initialised with seed on every rank: the same weights as an unsharded model built after
    torch.manual_seed(seed). With rt.dtype other than float32 (bfloat16 on CUDA), a mixed-precision policy replaces
    autocast: weights gathered in rt.dtype for the forward and backward, gradients reduced in float32, the sharded
    weights and AdamW's state kept in float32.
    """
    mesh = init_device_mesh(rt.device.type, (rt.world_size,))
    policy = MixedPrecisionPolicy()  # float32: no casts
    if rt.dtype != torch.float32:
        policy = MixedPrecisionPolicy(param_dtype=rt.dtype, reduce_dtype=torch.float32)
    for block in [m for m in model.modules() if isinstance(m, Block)]:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if next(model.parameters()).is_meta:
        model.to_empty(device=rt.device)
        # every rank draws the same values on the CPU (each keeps its part); the per-rank generators of dropout
        # are left as they were (torch.manual_seed would also reset every GPU's)
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            model.init_weights()
    return model


def average_model(raw_model, rt, seed):
    """A copy of raw_model for the weight average (sharded alike under FSDP): never trained, always in eval mode."""
    if not rt.fsdp:
        return copy.deepcopy(raw_model).eval().requires_grad_(False)
    with torch.device("meta"):
        average = build_model(raw_model.config)
    average = shard_model(average, rt, seed)
    # each rank copies its own shards: sharded state dicts load into a model sharded alike
    average.load_state_dict(raw_model.state_dict())
    return average.eval().requires_grad_(False)


def wrap_model(raw_model, cfg, rt, example):
    """
    (model for training steps, its DDP or FSDP module or None, model for evaluation): activation checkpointing if
    cfg says so, DDP under torchrun (FSDP models were sharded by setup, before their optimizer was built), then
    torch.compile if cfg says so. DDP is compiled, not wrapped around a compiled model: then its graph is split at
    the gradient buckets, so each bucket's all-reduce starts while the backward of the layers before it still runs.
    """
    raw_model.set_activation_checkpointing(cfg.activation_checkpointing)
    parallel = raw_model if rt.fsdp else None
    if rt.world_size > 1 and not rt.fsdp:  # DDP also gives every rank rank 0's initial weights
        parallel = DDP(raw_model, device_ids=[rt.device.index] if rt.device.type == "cuda" else None)
    ddp = isinstance(parallel, DDP)
    model, eval_model = parallel if ddp else raw_model, raw_model
    # compile=None: on CUDA only, where the compile time pays for itself
    if cfg.compile or cfg.compile is None and rt.device.type == "cuda":
        model = compile_model(model, example, rt, cfg.label_smoothing)
        if isinstance(model, CompiledModel):
            # with DDP, the compiled model is DDP's: evaluation, which stays outside DDP, compiles the plain model apart
            eval_model = CompiledModel(raw_model) if ddp else model
    return model, parallel, eval_model


def load_whole_optimizer_state(model, optimizer, state):
    """
    AdamW's state_dict() from a run without FSDP (ckpt.pt as a file) into optimizer over the FSDP-sharded model:
    its parameters renumbered as names, each rank then keeping its shards.
    """
    # the names in the order of the optimizer's own numbering (the same in both runs: configure_optimizers's)
    names = [name for group in get_optimizer_state_dict(model, optimizer)["param_groups"] for name in group["params"]]
    by_name = {
        "state": {names[i]: value for i, value in state["state"].items()},
        "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


def setup(cfg, rt, stack):
    """Everything before the first step: processes, data, model, optimizer, resume state, outputs. Returns a Run."""
    # checked before any process group or data: a bad setting fails at once
    per_rank = split_accumulation(cfg.gradient_accumulation_steps, rt.world_size)
    host_group = init_distributed(cfg, rt, stack)
    torch.manual_seed(cfg.seed + rt.rank)  # dropout differs per rank; DDP copies rank 0's initial weights
    if rt.device.type == "cuda":
        # TF32 matmuls (Ampere and newer): far faster than float32, and precise enough for training
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    # rank 0 alone writes files, and an eval_only run writes none
    out_dir, is_writer = Path(cfg.out_dir), rt.rank == 0 and not cfg.eval_only
    # an unwritable out_dir is found now, not at the first save hours later
    raise_if_any_failed(out_dir_problem(out_dir) if is_writer else None, rt.world_size)

    folder = find_dataset(cfg, rt)
    data_meta = tokens.load_meta(folder)
    # cfg comes back with the model settings of the checkpoint or GPT-2 weights, if it starts from either
    cfg, raw_model, objective, meta, ckpt = init_model(cfg, data_meta, lazy=rt.fsdp)
    # resuming a finished run would train nothing and only save it again
    if ckpt is not None and ckpt["iter_num"] >= cfg.max_iters and not cfg.eval_only:
        raise ConfigError(
            f"{out_dir / 'ckpt.pt'} is at iteration {ckpt['iter_num']}, which max_iters="
            f"{cfg.max_iters} has reached: nothing to train. To train further, pass a larger "
            "--max_iters (and --lr_decay_iters, where the cosine schedule ends)"
        )
    # the optimizers' states must fit the optimizers; checkpoints from before optimizer existed are AdamW's
    saved_optimizer = ckpt["train_config"].get("optimizer", "adamw") if ckpt is not None else cfg.optimizer
    if saved_optimizer != cfg.optimizer:
        raise ConfigError(
            f"{out_dir / 'ckpt.pt'} was trained with optimizer={saved_optimizer!r}: resume it with "
            f"--optimizer={saved_optimizer}"
        )
    splits = load_splits(folder, data_meta, cfg.block_size)
    # on the device (sharded, under FSDP) before the optimizer is built, so that its state lives there too
    if rt.fsdp:
        shard_model(raw_model, rt, cfg.seed)
    else:
        raw_model.to(rt.device)
    if cfg.fsdp and not rt.fsdp:
        log("note: fsdp=True with one process: nothing to shard over, the model is trained whole")
    if rt.device.type == "cpu":
        keep_freed_memory()
    # AdamW (and Muon for the blocks' matrices), weight decay on matrices and embeddings only; summary: one line
    optimizers, summary = raw_model.configure_optimizers(
        cfg.weight_decay,
        cfg.learning_rate,
        (cfg.beta1, cfg.beta2),
        rt.device.type,
        optimizer=cfg.optimizer,
        muon_lr=cfg.muon_lr,
    )
    # float16 only: its small gradients would underflow to 0 without a loss scale; bfloat16 has float32's range
    scaler = torch.amp.GradScaler(rt.device.type, enabled=rt.dtype == torch.float16)
    generator = torch.Generator().manual_seed(cfg.seed)  # the training data stream: the same on every rank
    if ckpt is not None:
        # a resume goes on where the run stopped: Adam's moments (and Muon's), the loss scale, the data's position;
        # a sharded checkpoint's optimizer state is loaded below, with its weights
        if "sharded" not in ckpt and rt.fsdp:
            load_whole_optimizer_state(raw_model, optimizers["adamw"], ckpt["optimizer"])
        elif "sharded" not in ckpt:
            optimizers["adamw"].load_state_dict(ckpt["optimizer"])
        if "muon" in optimizers:
            optimizers["muon"].load_state_dict(ckpt["muon"])
        if scaler.is_enabled() and ckpt["scaler"]:
            scaler.load_state_dict(ckpt["scaler"])
        generator.set_state(ckpt["sampler"]["generator"])
    batches = TrainBatches(splits["train"], objective, cfg, generator, rt, per_rank)
    stack.callback(batches.close)
    log(
        f"{cfg.arch} on {folder.name}: {raw_model.num_params():,} parameters, {rt.device} {str(rt.dtype)[6:]}, "
        f"{rt.world_size} rank(s); {cfg.batch_size * per_rank * rt.world_size} sequences per step "
        f"({cfg.batch_size} x {per_rank} micro-batches x {rt.world_size} rank(s))"
    )
    if per_rank * rt.world_size > cfg.gradient_accumulation_steps:
        log(
            f"note: gradient_accumulation_steps={cfg.gradient_accumulation_steps} is fewer than the "
            f"{rt.world_size} ranks: each rank runs one micro-batch, so a step sees {rt.world_size} x batch_size "
            "sequences"
        )
    log(summary)
    if "muon" in optimizers and rt.device.type == "cpu":
        # measured on the quick start (2 cores, AVX-512 without BF16): 470 ms per step against 30 ms with AdamW
        log(
            "note: torch.optim.Muon orthogonalises in bfloat16, which CPUs without native bfloat16 emulate slowly; "
            "optimizer='adamw' is the faster choice here"
        )

    # a batch for compile_model's trial, drawn with a throwaway generator so that the training stream is untouched
    example = get_batch(splits["train"], objective, cfg.batch_size, cfg.block_size, torch.Generator())
    model, parallel, eval_model = wrap_model(raw_model, cfg, rt, example)
    ema_model = None  # the average starts from the weights DDP gave every rank
    if cfg.ema_decay:
        ema_model = eval_model = average_model(raw_model, rt, cfg.seed)
        # a checkpoint with train_model holds the average in "model"; without one, the average starts afresh
        if ckpt is not None and "train_model" in ckpt and rt.fsdp:
            # whole tensors from a run without FSDP: each rank keeps its shards of them
            set_model_state_dict(ema_model, ckpt["model"], options=StateDictOptions(full_state_dict=True))
        elif ckpt is not None and "train_model" in ckpt:
            ema_model.load_state_dict(ckpt["model"])
    if ckpt is not None and "sharded" in ckpt:
        # weights, AdamW's state and the average from the folder, each rank reading what its shards need
        averaged = "train_model" in ckpt["sharded_keys"]
        key = "train_model" if averaged and not cfg.eval_only else "model"
        load_sharded(ckpt["sharded"], raw_model, optimizer=optimizers["adamw"], ema_model=ema_model, key=key)
        if key == "train_model" and not cfg.ema_decay:
            log(UNAVERAGED_NOTE)
    if ckpt is not None:
        # each rank's own generators (dropout) back as they were, in rank order, if the rank count is unchanged
        if len(ckpt["rng"]) == rt.world_size:
            set_rng_state(ckpt["rng"][rt.rank])
        else:
            log(
                f"note: the checkpoint has RNG states for {len(ckpt['rng'])} rank(s), not {rt.world_size}; "
                "dropout restarts from the seed"
            )
    if is_writer:
        out_dir.mkdir(parents=True, exist_ok=True)
        # the run's settings in readable JSON beside the checkpoints, for people and tools without torch
        write_json(
            {
                "train_config": asdict(cfg),
                "model_config": asdict(raw_model.config),
                "meta": meta,
                "world_size": rt.world_size,
            },
            out_dir / "config.json",
        )
    scalars = Scalars(cfg, is_writer)
    stack.callback(scalars.close)
    stop = stack.enter_context(StopRequest())
    # this GPU's peak bf16 FLOP/s from a table in model.py, for MFU; None where unknown
    peak = peak_flops(torch.cuda.get_device_name(rt.device)) if rt.device.type == "cuda" else None
    start_iter, best_val_loss = (0, math.inf) if ckpt is None else (ckpt["iter_num"], ckpt["best_val_loss"])
    ema_pairs = () if ema_model is None else (list(ema_model.parameters()), list(raw_model.parameters()))
    return Run(
        cfg,
        rt,
        raw_model,
        model,
        parallel,
        eval_model,
        ema_model,
        ema_pairs,
        optimizers,
        scaler,
        batches,
        splits,
        tokens.token_byte_lengths(data_meta) if objective.arch == "gpt" else None,
        objective,
        meta,
        scalars,
        stop,
        host_group,
        peak,
        start_iter,
        best_val_loss,
        resumed=ckpt is not None,
    )


def should_evaluate(run, iter_num, last, stopping):
    """At every eval_interval and after the last step; not when a signal stops the run, nor right after a resume."""
    if run.cfg.eval_only:
        return True
    just_resumed = run.resumed and iter_num == run.start_iter  # nothing new to evaluate or save
    return not stopping and not just_resumed and (iter_num % run.cfg.eval_interval == 0 or last)


def check_shards_finite(models, rt, iter_num):
    """Under FSDP, before a save: the error of finite_weights on every rank if any rank's shards hold inf or nan."""
    shards = [p.to_local() for model in models for p in model.parameters()]
    if all_reduce([~all_finite(shards)], rt).item():
        raise nonfinite_weights(iter_num)


def whole_weights(model, rt):
    """model's state dict, whole; under FSDP gathered onto rank 0's CPU (the others get {}): call it on every rank."""
    if not rt.fsdp:
        return model.state_dict()
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_training_state(run, iter_num):
    """
    ckpt.pt: everything a resume needs (every rank takes part: their RNG states are gathered). Under FSDP, a
    sharded checkpoint (a folder) that every rank writes its part of: no rank ever holds the whole model or optimizer.
    """
    state = training_state(
        run.raw_model,
        ema_model=run.ema_model,
        cfg=run.cfg,
        meta=run.meta,
        iter_num=iter_num,
        best_val_loss=run.best_val_loss,
        optimizers=run.optimizers,
        scaler=run.scaler,
        sampler_state=run.batches.resume_state,
        world_size=run.rt.world_size,
        sharded=run.rt.fsdp,
    )
    path = Path(run.cfg.out_dir) / "ckpt.pt"
    if run.rt.fsdp:
        check_shards_finite([m for m in (run.raw_model, run.ema_model) if m is not None], run.rt, iter_num)
        tensors = sharded_state(run.raw_model, ema_model=run.ema_model, optimizer=run.optimizers["adamw"])
        save_sharded(tensors, state, path, run.rt.rank)
    # every rank built the state (gathering the RNG states is a collective); one writes it
    elif run.rt.rank == 0:
        save_checkpoint(state, path)


def val_accuracy(run):
    """
    Exact match of greedy decoding on the first eval_accuracy_examples val pairs, with the kept model. Under FSDP
    rank 0 decodes them all with the weights gathered: decoding stops at different steps on different ranks,
    and a sharded model's every forward pass is a collective.
    """
    cfg, rt = run.cfg, run.rt
    pairs, usable = run.splits["val"]
    rows = usable[: cfg.eval_accuracy_examples]
    if not rt.fsdp:
        return exact_match(run.kept_model, pairs, rows, run.objective, cfg, rt)
    weights, correct = whole_weights(run.kept_model, rt), 0.0
    if rt.rank == 0:
        with torch.random.fork_rng(devices=[]):  # its initial values are overwritten: they must not move rank 0's RNG
            model = build_model(run.raw_model.config)
        model.load_state_dict(weights)
        # a Runtime of one process: exact_match then decodes every pair, in autocast where FSDP would cast
        one = Runtime(device=rt.device, dtype=rt.dtype)
        correct = exact_match(model.to(rt.device), pairs, rows, run.objective, cfg, one)
    return all_reduce([correct], rt).item()


def evaluate_and_save(run, iter_num, last):
    """
    Evaluate the kept model, log it and save: best.pt when the val loss improves, ckpt.pt at each evaluation
    (unless always_save_checkpoint is off; the end of the run saves it anyway). Returns the evaluation's record.
    """
    cfg, rt = run.cfg, run.rt
    # eval_model: the average when there is one, outside DDP (ranks may evaluate different numbers of batches)
    result = evaluate(run.eval_model, run.splits, run.objective, cfg, rt, run.byte_lengths)
    if not all(map(math.isfinite, result.values())):
        raise FloatingPointError(
            f"the evaluation at iteration {iter_num} gave {result}; nothing saved, "
            "the last checkpoint is untouched. Lower learning_rate"
        )
    if run.objective.arch == "encoder_decoder" and cfg.eval_accuracy_examples:
        result["accuracy"] = val_accuracy(run)
    # evaluation switched the model to eval mode; training needs its dropout back
    run.raw_model.train()
    run.scalars.add(iter_num, {f"eval/{k}": v for k, v in result.items()})
    saved = []
    # only weights trained in this run can be a new best: the first evaluation after a resume just measures
    if iter_num > run.start_iter and result["val"] < run.best_val_loss:
        run.best_val_loss = result["val"]
        if rt.fsdp:
            check_shards_finite([run.kept_model], rt, iter_num)
        # under FSDP, gathered one tensor at a time onto rank 0's CPU: the optimizer's state is never gathered
        weights = whole_weights(run.kept_model, rt)
        if rt.rank == 0:
            state = weights_state(weights, run.raw_model.config, cfg, run.meta, iter_num, run.best_val_loss)
            save_checkpoint(state, Path(cfg.out_dir) / "best.pt")
        saved.append("best.pt")
    # after the last step main saves ckpt.pt anyway, with the final state
    if iter_num > run.start_iter and cfg.always_save_checkpoint and not last:
        save_training_state(run, iter_num)
        saved.append("ckpt.pt")
    extra = f" ({result['val_bpb']:.4f} bits/byte)" if "val_bpb" in result else ""
    extra += f", exact match {result['accuracy']:.1%}" if "accuracy" in result else ""
    log(
        f"eval {iter_num}: train loss {result['train']:.4f}, val loss {result['val']:.4f}{extra}"
        + (f" (saved {', '.join(saved)})" if saved else "")
    )
    return {"iter": iter_num, **result}


def take_step(run, iter_num):
    """
    Optimizer step number iter_num + 1 on this rank's share of the next micro-batches, and the weight average
    after it. Returns a Step, or None when a signal reached any rank (then no rank takes the step).
    """
    cfg, rt = run.cfg, run.rt
    micro_batches, n_targets, n_tokens = run.batches.peek()
    # the step's loss is a mean over all its targets, so their number is needed before the first backward
    counts = torch.tensor([n_targets, n_tokens, run.stop.signal is not None])
    if rt.world_size > 1:
        # the stop votes ride along: every rank must decide alike, or some would wait forever in the next collective
        dist.all_reduce(counts, group=run.host_group)
    n_targets, n_tokens, stop_votes = counts.tolist()
    if stop_votes:
        return None
    run.batches.advance()  # the next step's batches are built while this one runs
    lr = cfg.learning_rate
    if cfg.decay_lr:
        lr = get_lr(iter_num, lr, cfg.min_lr, cfg.warmup_iters, cfg.lr_decay_iters, cfg.lr_schedule)
    # the schedule's multiplier scales each optimizer's peak learning rate alike
    lrs = {"adamw": lr, "muon": cfg.muon_lr * lr / cfg.learning_rate}
    loss, grad_norm, skipped = train_step(
        run.model,
        run.optimizers,
        run.scaler,
        micro_batches,
        rt,
        # at least 1: a step whose batches hold no real target must not divide by zero
        n_targets=max(n_targets, 1),
        lrs=lrs,
        grad_clip=cfg.grad_clip,
        label_smoothing=cfg.label_smoothing,
        parallel=run.parallel,
    )
    if run.ema_model is not None:
        update_ema(*run.ema_pairs, cfg.ema_decay, iter_num + 1)
    flops = sum(run.raw_model.training_flops(*inputs) for inputs, _ in micro_batches) if run.peak_flops else 0.0
    return Step(loss, grad_norm, skipped, lr, n_tokens, flops)


def memory_use(run):
    """
    This rank's memory in MiB: {"weights", "gradients" (one per trained weight), "optimizer" (its state), "peak"}.
    Under FSDP, the rank's shards only. peak: the most CUDA memory allocated, or on a CPU the process's peak
    resident set (the Python interpreter and the libraries included).
    """
    mib = 2**20

    def size(tensors):
        # a DTensor's local part: what this rank holds
        return sum(
            t.numel() * t.element_size() for t in (x.to_local() if isinstance(x, DTensor) else x for x in tensors)
        )

    params = list(run.raw_model.parameters())
    states = [v for opt in run.optimizers.values() for state in opt.state.values() for v in state.values()]
    if run.rt.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(run.rt.device)
    else:  # ru_maxrss counts KiB on Linux, bytes on macOS (resource: Unix only, imported where needed)
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return {
        "weights": size(params) / mib,
        "gradients": size(p for p in params if p.requires_grad) / mib,
        "optimizer": size(v for v in states if torch.is_tensor(v)) / mib,
        "peak": peak / mib,
    }


def log_memory(run):
    """One line per rank (rank 0 prints them all): weights, gradients, optimizer state and peak memory."""
    uses = [memory_use(run)]
    if run.rt.world_size > 1:
        uses = [None] * run.rt.world_size
        dist.all_gather_object(uses, memory_use(run))
    where = "CUDA allocated" if run.rt.device.type == "cuda" else "process resident set"
    for rank, use in enumerate(uses):
        log(
            f"memory rank {rank}: weights {use['weights']:.1f} MiB, gradients {use['gradients']:.1f} MiB, "
            f"optimizer state {use['optimizer']:.1f} MiB, peak {use['peak']:.1f} MiB ({where})"
        )


def log_progress(run, iter_num, loss, step, window, skipped):
    """The progress line of iteration iter_num and its TensorBoard scalars; the losses have just been read back."""
    cfg = run.cfg
    seconds = time.perf_counter() - window.start
    # tokens per second of training time: evaluations are left out of window.start
    norm, speed = step.grad_norm.item(), window.tokens / seconds
    values = {"train/loss": loss, "train/lr": step.lr, "train/grad_norm": norm, "perf/tokens_per_sec": speed}
    line = (
        f"iter {iter_num}/{cfg.max_iters} | loss {loss:.4f} | lr {step.lr:.2e} | grad norm {norm:.3f} | "
        f"{1000 * seconds / window.steps:.1f} ms/iter | {speed:,.0f} tok/s"
    )
    if run.peak_flops:
        # MFU: the fraction of this GPU's peak FLOP/s that the model's matmuls used
        values["perf/mfu"] = window.flops / seconds / run.peak_flops
        line += f" | mfu {values['perf/mfu']:.1%}"
    if skipped:
        line += f" | {skipped} step(s) skipped: gradient not finite, weights left as they were"
    log(f"{line} | eta {format_eta((cfg.max_iters - iter_num) * seconds / window.steps)}")
    run.scalars.add(iter_num, values)


def main(cfg):
    """
    Train (or, with eval_only, evaluate) as cfg says, in one process or under torchrun. Returns a summary:
    {"losses": {iteration: train loss}, "evals": [{"iter", "train", "val"[, "val_bpb"][, "accuracy"]}], "iter_num",
    "best_val_loss"}.
    Raises ConfigError for bad settings or data, FloatingPointError for a non-finite loss and OSError for a failed
    save.
    """
    rt = make_runtime(cfg)
    with contextlib.ExitStack() as stack:
        run = setup(cfg, rt, stack)
        cfg = run.cfg  # a checkpoint or GPT-2's weights decide the model settings
        history = {"losses": {}, "evals": []}
        losses, window = StepLosses(rt), Window()  # losses stay on the device until a progress line or evaluation
        iter_num, stopping = run.start_iter, False
        # each pass: evaluate if due, stop if this is the last iteration, else take one step
        while True:
            last = iter_num >= cfg.max_iters or stopping
            if should_evaluate(run, iter_num, last, stopping):
                began = time.perf_counter()
                history["losses"].update(losses.read())  # a non-finite loss stops the run before any save
                history["evals"].append(evaluate_and_save(run, iter_num, last))
                window.start += time.perf_counter() - began  # progress lines time the training steps only
                if cfg.eval_only:
                    break
            if last:
                # the final ckpt.pt, for --init_from=resume to go on from; a run that took no step has nothing new
                if iter_num > run.start_iter:
                    history["losses"].update(losses.read())
                    if skipped := losses.take_unreported():
                        log(f"{skipped} step(s) skipped since the last progress line: gradient not finite")
                    save_training_state(run, iter_num)
                    log_memory(run)
                    how = f"stopped by {run.stop.signal or 'a signal to another rank'}" if stopping else "done"
                    log(
                        f"{how} at iteration {iter_num}: saved {Path(cfg.out_dir) / 'ckpt.pt'}"
                        + ("; resume with --init_from=resume" if stopping else "")
                    )
                break
            step = take_step(run, iter_num)
            if step is None:  # a signal reached some rank: every rank stops here, before this step
                stopping = True
                continue
            # iterations are numbered by the steps done: the step just taken ends iteration iter_num + 1
            iter_num += 1
            losses.add(iter_num, step.loss, step.skipped)
            window.add(step)
            if iter_num % cfg.log_interval == 0:
                history["losses"].update(losses.read())  # waits for the device: the window's time is real
                log_progress(run, iter_num, history["losses"][iter_num], step, window, losses.take_unreported())
                window = Window()
        return {**history, "iter_num": iter_num, "best_val_loss": run.best_val_loss}


def cli(argv):
    """
    The command line; returns the exit status. Errors print one line: 2 bad settings or data; 1 a run that cannot
    go on (non-finite loss, out of memory, a checkpoint that cannot be written).
    """
    try:
        cfg = parse_config(TrainConfig, argv)
        main(cfg)
    except ConfigError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 2
    except (FloatingPointError, OSError) as e:
        print(f"train.py: error: {first_line(e)}", file=sys.stderr)
        return 1
    except torch.OutOfMemoryError:
        print(
            f"train.py: error: out of GPU memory with batch_size={cfg.batch_size}, block_size={cfg.block_size}: "
            "lower batch_size (raising gradient_accumulation_steps keeps the step's size), block_size or the "
            "model's size",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:  # before training started; during training a signal stops the run cleanly
        print("train.py: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
