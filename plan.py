"""
Know before you rent: `python train.py CONFIG --plan` predicts each rank's memory and the step time of the run
CONFIG describes, on a named GPU and number of ranks, from a laptop: nothing is allocated and nothing trains.

    python train.py configs/gpt2.py --plan --plan_device=H100 --plan_ranks=8
    python train.py configs/gpt2.py --plan --plan_device=A100 --plan_ranks=8 --fsdp=true --batch_size=24
    python train.py configs/shakespeare.py --plan                      # this machine, one process

Traced: the run's own model (from its settings, its checkpoint's or its Hugging Face folder's config), FSDP2's
sharding on a fake process group of plan_ranks ranks, the optimizers and two training steps of train.py's own
micro_step and update_weights, run under FakeTensorMode, whose tensors have shapes and dtypes but no memory or
values. PyTorch's MemTracker (FSDPMemTracker under FSDP) follows every tensor's storage: parameters, gradients,
optimizer state, activations and the peak. FlopCounterMode counts the step's FLOPs, recomputation included, but not
attention's scores and weighted sum: it has no formula for the fused CPU kernel the trace runs (the model FLOPs
count them).
Arithmetic: DDP's buckets (gradient_as_bucket_view: every gradient held from the start), the KV cache, the step time
(the model FLOPs train.py's MFU counts / (peak FLOP/s x MFU)) and the largest micro-batch that fits, from traces at
two batch sizes.
Counted beside the live tensors: on a CPU, the heap glibc keeps (HEAP_EXCESS); compiled on a GPU, the loss's logits
and dropout as Inductor keeps them (trace_step). Not modelled: torch.compile's other fusions (the trace is eager: its
activations bound a compiled run's from above, most for configs/gpt2_modern.py, whose rotary, QK-norm and soft-cap
copies Inductor fuses away), the CUDA context and caching allocator's fragmentation (a GPU counts as full at FULL of
its memory), communication time. LoRA is refused (make_plan).
"""

import contextlib
import os
import re
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

import hf
import runtime
import tokens
from checkpoint import is_checkpoint, load_checkpoint
from config import ConfigError
from data import count_targets, prepared_dataset
from log import local_bytes, one_line, resident_peak, state_bytes
from model import LOSS_CHUNK_BYTES, ModelConfig, build_model, loss_chunk_cap
from recipes import RECIPES, hub
from recipes.chat import chat_meta
from start import task_of
from tasks import Task

# a GPU counts as full at this share of its memory: the CUDA context, cuDNN/cuBLAS workspaces and the caching
# allocator's fragmentation take the rest
FULL = 0.90
# On a CPU the heap holds more than the live tensors. train.py has glibc keep the blocks a step frees (those below
# runtime.MMAP_THRESHOLD) for reuse, but the small allocations made between the tensors' (PyTorch's and Python's
# objects) split them, so a later tensor often finds no hole that fits and the heap grows instead. Measured, the
# resident set exceeded the traced peak by 0.4 to 0.7 of a steady-state step's heap-held tensors (HeapTensors) on
# seven shapes, with 1, 2 or 4 threads alike (docs/planning.md)
HEAP_EXCESS = 0.5
MIB = 2**20


@dataclass(frozen=True)
class Target:
    """What a plan is for: a device's name, its memory (bytes), peak FLOP/s and the MFU assumed there."""

    name: str
    memory: int
    flops: float
    mfu: float
    mfu_source: str
    gpu: bool
    bf16: bool = True  # computes bfloat16 natively (runtime.GPU.bf16)


def find_target(name, mfu, ranks):
    """The Target of --plan_device (''/'auto': this machine); ConfigError naming the choices for an unknown one."""
    if name in ("", "auto"):
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        if name != "cpu":
            props, bf16 = torch.cuda.get_device_properties(0), torch.cuda.is_bf16_supported(including_emulation=False)
            peak = runtime.peak_flops(name, props.multi_processor_count)
            return gpu_target(name, props.total_memory, peak, mfu, bf16)
    if name.lower() == "cpu":
        # this CPU's float32 matmul rate with the threads each of the ranks would get
        threads = runtime.pick_threads(0, ranks)[0]
        measured = runtime.cpu_matmul_flops(threads)
        source = f"the quick start's, of matmuls measured now on {threads} thread(s)"
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // ranks
        return Target("cpu", memory, measured, mfu or runtime.CPU_MFU, "given" if mfu else source, gpu=False)
    gpu = next((gpu for gpu in runtime.GPUS if squeeze(gpu.name) == squeeze(name)), None)
    if gpu is None:
        raise ConfigError(f"plan_device={name!r} is not a device plans know; use cpu or one of {gpu_names()}")
    return gpu_target(gpu.name, gpu.memory_gib * 2**30, gpu.flops, mfu, gpu.bf16)


def gpu_names():
    """The GPUs plans know, for a message."""
    return ", ".join(gpu.name for gpu in runtime.GPUS)


def squeeze(name):
    """A device name compared without case, spaces, hyphens or a vendor's prefix: 'nvidia h100-pcie' -> 'h100pcie'."""
    return re.sub(r"[\s_-]|nvidia|geforce", "", name.lower())


def gpu_target(name, memory, flops, mfu, bf16=True):
    """The Target of a GPU of this name (a runtime.GPUS name, or CUDA's for this machine's), memory and peak."""
    if flops is None:
        raise ConfigError(f"the peak FLOP/s of {name} is not known: give --plan_device one of {gpu_names()}")
    if mfu:
        return Target(name, memory, flops, mfu, "given", gpu=True, bf16=bf16)
    # the GPUS name this device's begins with, the longest ('NVIDIA H100 80GB HBM3' is an H100, 'H100 PCIe' its own)
    known = [gpu.name for gpu in runtime.GPUS if squeeze(name).startswith(squeeze(gpu.name))]
    key = max(known, key=len, default=None)
    if key in runtime.MEASURED_MFU:
        return Target(name, memory, flops, runtime.MEASURED_MFU[key], f"measured on an {key}", gpu=True, bf16=bf16)
    unmeasured = "the H100's: none measured on this GPU"
    return Target(name, memory, flops, runtime.MEASURED_MFU["H100"], unmeasured, gpu=True, bf16=bf16)


# -----------------------------------------------------------------------------
# What the run would build, without its weights or data


def planned_meta(cfg):
    """
    The meta of the run's data: a prepared dataset's; without preparing, GPT-2 BPE's for the datasets that stream for
    hours (openwebtext, fineweb_edu), and chat data's from its tokenizer; any other dataset is prepared first, as a
    run would prepare it.
    """
    folder = tokens.dataset_dir(cfg.dataset, cfg.data_dir)
    if tokens.is_prepared(folder) and not cfg.data_options:
        return tokens.load_meta(folder)
    recipe = RECIPES.get(cfg.dataset)
    if recipe is not None and recipe.inputs is hub.hf_lm_inputs:
        return {**tokens.GPT2_META, "kind": "lm", "name": cfg.dataset}
    tokenizer = cfg.data_options.get("tokenizer", "gpt2")
    if cfg.dataset == "chat" and tokenizer != "char":  # the tokenizer and its template decide the vocabulary
        try:
            return {**chat_meta(tokenizer, []), "name": cfg.dataset}
        except (OSError, ValueError) as e:
            raise ConfigError(f"dataset chat: --tokenizer={tokenizer}: {one_line(e)}") from None
    return tokens.load_meta(prepared_dataset(cfg.dataset, cfg.data_dir, cfg.data_options))


def planned_config(cfg, meta):
    """
    (ModelConfig, Task) of the run: from its settings, its checkpoint's or its Hugging Face folder's config.json,
    without reading any weights (start.start_run would load them).
    """
    task = task_of(cfg, meta)
    if cfg.init_from == "scratch":
        return cfg.model_config(task.model_vocab, task.pad_id), task
    if cfg.init_from == "resume" or is_checkpoint(cfg.init_from) or cfg.init_from.endswith(".pt"):
        path = Path(cfg.out_dir) / "ckpt.pt" if cfg.init_from == "resume" else Path(cfg.init_from)
        config = ModelConfig.from_dict(load_checkpoint(path, weights=False)["model_config"])
        config = replace(config, dropout=cfg.dropout) if cfg.init_from != "resume" else config
    else:
        try:
            config = hf.pretrained_config(
                Path(cfg.init_from).expanduser(), dropout=cfg.dropout, block_size=cfg.block_size
            )
        except (OSError, ValueError) as e:
            raise ConfigError(f"init_from={cfg.init_from}: {one_line(e)}") from None
    if cfg.init_from != "resume":  # grown for chat tokens beyond the model's (start.fit_to_data)
        config = replace(config, vocab_size=max(config.vocab_size, meta["vocab_size"]))
    return config, task


# -----------------------------------------------------------------------------
# Tracing one rank's training step


@dataclass
class Trace:
    """One rank's traced step, in bytes: state_bytes' figures, the peak and its parts; FLOPs."""

    weights: int
    gradients: int
    optimizer: int
    average: int  # the weight average's copy (ema_decay)
    peak: int  # under DDP with every gradient held, as its buckets do
    activations: int  # activations and temporaries of the step at the peak
    gathered: int  # FSDP: gathered weights and gradients, and their collectives' buffers, at the peak
    vocab: int  # the most bytes of (positions, V) tensors (logits, their gradients) alive at once
    heap: int  # on a CPU: what glibc's heap keeps beyond the live tensors (HEAP_EXCESS), in the peak; else 0
    micro_flops: float  # FLOPs of a micro-batch's forward and backward on this rank, recomputation included
    update_flops: float  # FLOPs of the clipping and the optimizers' steps on this rank (Muon's orthogonalisation)


class VocabTensors(TorchDispatchMode):
    """The peak bytes of live tensors whose last dimension is the vocabulary: the loss's (positions, V) tensors."""

    def __init__(self, vocab_size):
        super().__init__()
        self.vocab_size, self.live, self.peak = vocab_size, {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab_size:
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self.live:
                    self.live[key] = storage.nbytes()
                    # forgotten when the storage goes
                    weakref.finalize(storage, self.live.pop, key, None)
                self.peak = max(self.peak, sum(self.live.values()))
        return out


class HeapTensors(TorchDispatchMode):
    """
    The peak bytes of the live tensors that the ops create while the mode is on, each storage once, of those glibc's
    heap holds (below runtime.MMAP_THRESHOLD): over a steady-state step, its activations, temporaries and gradients.
    """

    def __init__(self):
        super().__init__()
        self.live, self.total, self.peak = {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # a storage an input holds is not new: the output is a view of it, or the input itself (in place, out=)
        held = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, size = id(storage), storage.nbytes()
            if key not in held and key not in self.live and size < runtime.MMAP_THRESHOLD:
                self.live[key] = size
                self.total += size
                self.peak = max(self.peak, self.total)
                weakref.finalize(storage, self.free, key)  # called when the storage goes
        return out

    def free(self, key):
        self.total -= self.live.pop(key)


def in_steady_state(mode, step):
    """mode for the second traced step, the steady state (the first creates the optimizers' state); else nothing."""
    return mode if step else contextlib.nullcontext()


def planned_loss_chunk(cfg, target):
    """
    The loss chunk train.py would use on target: loss_chunk_mb if given; on a GPU the largest a run takes there
    (model.loss_chunk_cap; a run short of memory sizes a smaller one, so the plan's peak bounds it from above); on a
    CPU the model's budget for CPUs.
    """
    if cfg.loss_chunk_mb:
        return int(cfg.loss_chunk_mb * 2**20)
    return loss_chunk_cap(target.memory) if target.gpu else LOSS_CHUNK_BYTES


def compiled_on(cfg, target):
    """Whether the plan counts the run as compiled: on a GPU unless --compile=false (a CPU's plan stays eager)."""
    return target.gpu and cfg.compile is not False


def trace_step(cfg, rt, config, task, batch_size, per_rank, target, train):
    """
    The Trace of this rank (rt.rank of rt.world_size, on the fake process group) running two training steps, of one
    and of per_rank micro-batches of batch_size sequences, with train.py's own functions (train, a TrainStep), under
    FakeTensorMode on target's device: its loss is cut into the chunks train.py would cut there (planned_loss_chunk).
    """
    # real (small) batches: the fake mode takes them in as inputs
    batches = [task.example_batch(batch_size, config.block_size)] * per_rank
    n_targets = sum(count_targets(t) for _, t in batches) * rt.world_size
    # FSDP's mesh of ranks, made outside the fake mode: it reads its ranks' numbers
    mesh = init_device_mesh("cpu", (rt.world_size,)) if rt.fsdp else None
    # Compiled on a GPU (the default there), dropout keeps nothing for the backward: Inductor draws its masks again
    # from a seed, and attention's runs inside the fused kernel, where an eager CPU trace holds (B, H, T, T) scores
    compiled, chunk = compiled_on(cfg, target), planned_loss_chunk(cfg, target)
    with FakeTensorMode(allow_non_fake_inputs=True):
        # whole (fake) before FSDP shards it: its values are never read, so the run's initialisation of each rank's
        # shards from the meta device is not needed
        model = build_model(replace(config, dropout=0.0) if compiled else config)
        model.loss_chunk_bytes = chunk
        model.set_activation_checkpointing(cfg.activation_checkpointing)
        average = None
        if rt.fsdp:
            runtime.shard_model(model, rt, cfg.seed, mesh)
            if cfg.ema_decay:
                average = runtime.shard_model(build_model(config), rt, cfg.seed, mesh).requires_grad_(False)
        elif cfg.ema_decay:
            average = build_model(config).requires_grad_(False)
        optimizers, _ = train.make_optimizers(model, cfg, rt)
        if rt.fsdp:
            tracker = FSDPMemTracker(model, *optimizers.values())  # FSDP trains with AdamW alone
        else:
            tracker = MemTracker()
            tracker.track_external(model, *optimizers.values())
        if average is not None:
            tracker.track_external(average)
        models = runtime.Models(model, model)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        vocab, heap = VocabTensors(config.vocab_size), HeapTensors()
        # a FlopCounterMode starts from 0 each time it is entered: its count is added up after each use
        counter, micro_flops, update_flops = FlopCounterMode(display=False), 0, 0
        with tracker:
            # the first step, of one micro-batch, creates the optimizers' state; the second, of the rest, is the
            # steady state: its FLOPs and its heap-held tensors are counted
            for step, batches_now in enumerate((batches[:1], batches)):
                for i, batch in enumerate(batches_now):
                    with vocab, in_steady_state(counter, step), in_steady_state(heap, step):
                        train.micro_step(models, task, batch, i == len(batches_now) - 1, n_targets, scaler, rt)
                    micro_flops += counter.get_total_flops() if step else 0
                    # MemTracker takes one forward pass of a model per iteration: a micro-batch is one
                    tracker.reset_mod_stats()
                with vocab, in_steady_state(counter, step), in_steady_state(heap, step):
                    train.update_weights(model, optimizers, scaler, cfg.grad_clip)
                update_flops = counter.get_total_flops() if step else 0
        snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()))
        use = state_bytes(model, optimizers)
    parts = {str(k.value) if hasattr(k, "value") else k: v for k, v in snapshot.items()}
    gathered = sum(parts.get(k, 0) for k in ("Unsharded Param", "Unsharded Grad", "All Gather", "Reduce Scatter"))
    # DDP's buckets hold every gradient from its start (gradient_as_bucket_view): those not alive at the peak
    peak = parts["Total"] + (use["gradients"] - parts.get("Gradient", 0) if rt.world_size > 1 and not rt.fsdp else 0)
    activations, vocab_bytes = parts.get("Activation", 0) + parts.get("Temp", 0), vocab.peak
    if compiled:
        # Compiled, the head's matmul, soft-cap and cross-entropy fuse: of the (positions, V) tensors that eager
        # autograd holds (the head's output, its float32 copy, the log-probabilities, ...) the backward keeps the
        # head's output alone, a chunk of it in the compute dtype (docs/performance.md#gpus: predicted and measured)
        rows = min(batch_size * config.block_size, max(1, chunk // (4 * config.vocab_size)))
        kept = rows * config.vocab_size * rt.dtype.itemsize
        peak, activations, vocab_bytes = peak - vocab.peak + kept, activations - vocab.peak + kept, kept
    heap_bytes = 0 if target.gpu else round(HEAP_EXCESS * heap.peak)
    return Trace(
        **use,
        average=0 if average is None else local_bytes(average.parameters()),
        peak=peak + heap_bytes,
        activations=activations,
        gathered=gathered,
        vocab=vocab_bytes,
        heap=heap_bytes,
        micro_flops=micro_flops / len(batches),
        update_flops=update_flops,
    )


# -----------------------------------------------------------------------------
# The plan: traces of each kind of rank, then the tables


@dataclass
class Plan:
    """What make_plan traced and derived: enough to print the tables, and for the tests to check them."""

    cfg: object  # the run's TrainConfig
    config: ModelConfig
    task: Task
    target: Target
    dtype: torch.dtype
    per_rank: int  # micro-batches per rank
    groups: list  # the ranks, in groups that hold alike (one group unless FSDP's shards differ)
    traces: list  # a Trace of each group's first rank
    other: Trace  # rank 0 with activation checkpointing the other way
    smallest: Trace  # rank 0 at batch_size 1
    baseline: int  # on a CPU, this process's interpreter and libraries (the memory line counts them); else 0


@dataclass(frozen=True)
class TrainStep:
    """train.py's functions that a plan traces: passed in by train.py, which plan.py does not import."""

    make_optimizers: Callable
    micro_step: Callable
    update_weights: Callable


def make_plan(cfg, train):
    """
    The Plan of the run cfg describes on cfg.plan_ranks ranks of cfg.plan_device, its training step traced with
    train.py's functions (train, a TrainStep): nothing trains.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("--plan runs in one process: use python train.py ... --plan --plan_ranks=N, not torchrun")
    # the interpreter and libraries, measured before any data is read or prepared
    baseline = resident_peak()
    ranks = cfg.plan_ranks
    if cfg.lora_rank:
        raise ConfigError(
            "--plan does not trace lora_rank: PyTorch's MemTracker hooks every weight's gradient, which frozen "
            "weights refuse; plan with --lora_rank=0, whose every-weight fine-tune bounds LoRA's memory from above"
        )
    # one line if plan_ranks does not divide
    per_rank = runtime.split_accumulation(cfg.gradient_accumulation_steps, ranks)
    runtime.check_cuda_graphs(cfg, ranks)  # as train.py refuses it on so many ranks
    target = find_target(cfg.plan_device, cfg.plan_mfu, ranks)
    fsdp = cfg.fsdp and ranks > 1
    # the dtype the run computes in on the target, as runtime.make_runtime resolves it there
    device = torch.device("cuda" if target.gpu else "cpu")
    dtype = runtime.resolve_dtype(cfg.dtype, device, native_bf16=target.bf16, gpu=target.name, fsdp=fsdp)
    config, task = planned_config(cfg, planned_meta(cfg))
    if cfg.cuda_graphs and task.varying:  # as train.py's setup refuses it
        raise ConfigError(f"cuda_graphs=True needs batches of one length, which {cfg.dataset}'s vary; drop it")

    # the second step runs two micro-batches (if it has two): the second adds to the first's gradients
    def trace(rank, batch_size, activation_checkpointing=cfg.activation_checkpointing):
        run = replace(cfg, activation_checkpointing=activation_checkpointing)
        rt = runtime.Runtime(rank, rank, ranks, torch.device("cpu"), dtype, fsdp=fsdp)
        # a GPU's bfloat16 traced in a CPU's autocast, whose kernels warn of what they would not fuse there
        with fake_group(rank, ranks), warnings.catch_warnings(action="ignore", category=UserWarning):
            return trace_step(run, rt, config, task, batch_size, min(per_rank, 2), target, train)

    groups = rank_groups(config, ranks) if fsdp else [list(range(ranks))]
    traces = [trace(group[0], cfg.batch_size) for group in groups]
    return Plan(
        cfg=cfg,
        config=config,
        task=task,
        target=target,
        dtype=dtype,
        per_rank=per_rank,
        groups=groups,
        traces=traces,
        other=trace(0, cfg.batch_size, not cfg.activation_checkpointing),
        smallest=trace(0, 1) if cfg.batch_size > 1 else traces[0],
        baseline=0 if target.gpu else baseline,
    )


def print_plan(p):
    """train.py --plan's output: what runs where, the memory of each group of ranks, the time, what fits."""
    print(describe(p))
    print_table(memory_rows(p), [group_name(g, p.cfg.plan_ranks) for g in p.groups])
    print_table(time_rows(p), ["the run"])
    for line in suggestions(p):
        print(line)


@contextlib.contextmanager
def fake_group(rank, ranks):
    """A fake process group of `ranks` ranks, this process being `rank`: collectives do nothing. None for one rank."""
    if ranks == 1:
        yield
        return
    dist.init_process_group("fake", rank=rank, world_size=ranks, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def rank_groups(config, ranks):
    """
    The ranks in groups that hold alike under FSDP: FSDP2 cuts each weight's first dimension into ranks chunks of
    ceil(n / ranks) rows, the last ones shorter or empty, so ranks differ only where a dimension does not divide.
    """
    with torch.device("meta"):
        rows = [p.shape[0] for p in build_model(config).parameters()]

    def shards(rank):
        return tuple(max(0, min(-(-n // ranks), n - rank * -(-n // ranks))) for n in rows)

    groups = {}
    for rank in range(ranks):
        groups.setdefault(shards(rank), []).append(rank)
    return list(groups.values())


def group_name(group, ranks):
    """The column heading of a group of ranks: 'every rank (8)', 'rank 7', 'ranks 0-6'."""
    if len(group) == ranks:
        return f"each of {ranks} rank(s)"
    return f"rank {group[0]}" if len(group) == 1 else f"ranks {group[0]}-{group[-1]}"


def mib(n):
    """Bytes as the memory line prints them."""
    return f"{n / MIB:,.1f} MiB"


def memory_rows(p):
    """The memory table: (label, [value for each group of ranks]); the peaks as the memory line would count them."""
    ac = p.cfg.activation_checkpointing
    traces = p.traces
    rows = [
        ("weights", [mib(t.weights) for t in traces]),
        ("gradients", [mib(t.gradients) for t in traces]),
        ("optimizer state", [mib(t.optimizer) for t in traces]),
    ]
    if p.cfg.ema_decay:
        rows.append(("weight average (ema_decay)", [mib(t.average) for t in traces]))
    rows.append(("activations and temporaries at the peak", [mib(t.activations) for t in traces]))
    if p.cfg.fsdp and p.cfg.plan_ranks > 1:
        rows.append(("gathered weights, gradients at the peak", [mib(t.gathered) for t in traces]))
    rows.append(("the loss's (positions, V) tensors at most", [mib(t.vocab) for t in traces]))
    if not p.target.gpu:
        rows.append(("glibc's heap kept beyond the live tensors", [mib(t.heap) for t in traces]))
    if p.baseline:
        rows.append(("interpreter and libraries (measured now)", [mib(p.baseline)] * len(traces)))
    rows.append((f"peak, activation_checkpointing={ac}", [mib(t.peak + p.baseline) for t in traces]))
    # the other setting traced on rank 0: the other groups differ from it by their shards alone
    delta = p.other.peak - traces[0].peak
    rows.append((f"peak, activation_checkpointing={not ac}", [mib(t.peak + p.baseline + delta) for t in traces]))
    rows.append(("KV cache to sample one block_size sequence", [mib(p.config.kv_cache_bytes(p.dtype))] * len(traces)))
    return rows


def time_rows(p):
    """The time table: FLOPs per step, the step time at the target's MFU, tokens per second, the run's time."""
    cfg, target, ranks = p.cfg, p.target, p.cfg.plan_ranks
    with torch.device("meta"):
        model = build_model(p.config)
    micro_batches = ranks * p.per_rank  # over all ranks
    model_flops = model.training_flops(*p.task.example_batch(cfg.batch_size, p.config.block_size)[0]) * micro_batches
    traced_flops = (p.traces[0].micro_flops * p.per_rank + p.traces[0].update_flops) * ranks
    seconds = model_flops / (ranks * target.flops * target.mfu)
    tokens = cfg.batch_size * p.config.block_size * micro_batches
    steps = cfg.max_iters if not cfg.max_minutes else min(cfg.max_iters, int(60 * cfg.max_minutes / seconds))
    until = "max_minutes" if steps < cfg.max_iters else "max_iters"
    return [
        ("tokens per step (full windows)", [f"{tokens:,}"]),
        ("model FLOPs per step, all ranks (what MFU counts)", [f"{model_flops:.3e}"]),
        (
            "traced FLOPs per step, all ranks (with recomputation, optimizer; not fused attention)",
            [f"{traced_flops:.3e}"],
        ),
        (f"peak FLOP/s of each {target.name}", [f"{target.flops:.3e}"]),
        (f"MFU ({target.mfu_source})", [f"{target.mfu:.0%}"]),
        ("step time", [f"{1000 * seconds:,.0f} ms" if seconds >= 0.1 else f"{1000 * seconds:.3g} ms"]),
        ("tokens per second", [f"{tokens / seconds:,.0f}"]),
        (f"{steps:,} steps ({until})", [format_hours(steps * seconds)]),
    ]


def format_hours(seconds):
    """A duration in the largest unit that keeps it above 1: seconds, minutes or hours."""
    if seconds >= 3600:
        return f"{seconds / 3600:,.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.1f} s"


def print_table(rows, columns):
    """Rows of (label, [a value per column]) under the columns' headings, aligned."""
    width = max(len(label) for label, _ in rows)
    widths = [max(len(c), *(len(values[i]) for _, values in rows)) for i, c in enumerate(columns)]
    print(f"{'':<{width}}  " + "  ".join(f"{c:>{w}}" for c, w in zip(columns, widths)))
    for label, values in rows:
        print(f"{label:<{width}}  " + "  ".join(f"{v:>{w}}" for v, w in zip(values, widths)))
    print()


def describe(p):
    """The plan's opening lines: what runs where, how."""
    cfg, ranks = p.cfg, p.cfg.plan_ranks
    way = "1 process" if ranks == 1 else "FSDP" if cfg.fsdp else "DDP"
    with torch.device("meta"):
        params = build_model(p.config).num_params()
    return (
        f"plan: {p.config.arch}, {params:,} parameters, on {ranks} x {p.target.name} "
        f"({p.target.memory / 2**30:,.0f} GiB each): {way}, {str(p.dtype)[6:]}, {cfg.optimizer}, "
        f"batch_size {cfg.batch_size} x {p.per_rank} micro-batch(es) per rank\n"
        + (
            "traced eager under FakeTensorMode; compiled there: the loss's logits and dropout counted as Inductor keeps"
            " them, other fusions would lower the activations further\n"
            if compiled_on(cfg, p.target)
            else "traced eager under FakeTensorMode: torch.compile's fusions would lower the activations, not raise "
            "them\n"
        )
    )


def suggestions(p):
    """Lines saying whether the run fits, and the largest micro-batch that does at the same global batch."""
    cfg, target, ranks = p.cfg, p.target, p.cfg.plan_ranks
    usable = target.memory * (FULL if target.gpu else 1)
    where = f"{FULL:.0%} of {target.memory / 2**30:,.0f} GiB" if target.gpu else "this machine's memory per rank"
    peak = max(t.peak for t in p.traces) + p.baseline
    verdict = "fits" if peak <= usable else "does NOT fit"
    lines = [f"{verdict}: a peak of {mib(peak)} per rank, {mib(usable)} usable ({where})"]
    sequences = cfg.batch_size * p.per_rank * ranks  # per step; a micro-batch size b keeps it if ranks divide it / b
    choices = [b for b in range(1, sequences + 1) if sequences % b == 0 and (sequences // b) % ranks == 0]
    for ac, at_batch in ((cfg.activation_checkpointing, p.traces[0]), (not cfg.activation_checkpointing, p.other)):
        # peak = fixed + per sequence * batch_size: a line through the traces at batch_size 1 and cfg.batch_size
        if cfg.batch_size == 1:  # nothing to draw a line through: batch_size 1 fits or nothing does
            fixed, slope, how = at_batch.peak + p.baseline, 0.0, "traced"
            choices = [1]
        else:
            slope = (at_batch.peak - p.smallest.peak) / (cfg.batch_size - 1)
            fixed = at_batch.peak - slope * cfg.batch_size + p.baseline
            how = f"on a line through the traces at batch_size 1 and {cfg.batch_size}"
        fits = [b for b in choices if fixed + slope * b <= usable]
        if fits:
            b = max(fits)
            lines.append(
                f"activation_checkpointing={ac}: the largest micro-batch that fits at the same {sequences:,} sequences "
                f"per step is --batch_size={b} --gradient_accumulation_steps={sequences // b} (peak about "
                f"{mib(fixed + slope * b)}, {how})"
            )
    if len(lines) == 1:
        over = f"the {ranks} ranks" if ranks > 1 and not cfg.fsdp else "more ranks (plan with a larger --plan_ranks)"
        lines.append(
            f"no micro-batch fits, with activation checkpointing or without: shard with --fsdp=true over {over}"
        )
    return lines
