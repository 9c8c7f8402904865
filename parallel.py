"""
How a training run is spread over processes and devices: this process's place (Runtime: rank, device, dtype), the
process group and the few collectives train.py needs, and parallelize(), which applies activation checkpointing,
then FSDP2 or DDP, then torch.compile, in that order, and returns the model under the names of its uses (Models).
"""

import contextlib
import copy
import inspect
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from config import ConfigError, log, one_line
from devices import autocast, resolve_device, resolve_dtype
from model import Block, build_model

# -----------------------------------------------------------------------------
# Processes


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
    check_cuda_graphs(cfg, world_size)
    if cfg.cuda_graphs and device.type != "cuda":
        raise ConfigError(f"cuda_graphs=True needs a CUDA GPU, not device {device}; drop --cuda_graphs")
    dtype = resolve_dtype(cfg.dtype, device)
    if cfg.fsdp and dtype == torch.float16:
        raise ConfigError(
            "fsdp=True computes in bfloat16 or float32, not float16 (whose gradient scaler FSDP runs lack); use "
            "--dtype=bfloat16, or DDP (fsdp=False) on GPUs without bfloat16"
        )
    # one process has nothing to shard over: it trains the whole model, as without fsdp (setup says so)
    return Runtime(rank, local_rank, world_size, device, dtype, fsdp=cfg.fsdp and world_size > 1)


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


def check_cuda_graphs(cfg, world_size):
    """
    cuda_graphs' one-line refusals, before anything runs (train.py and --plan alike), of what its replays cannot
    train yet. More than one micro-batch per rank: gradients cleared to None are made by the first backward inside
    the CUDA-graph pool, and the next micro-batch's forward starts a new generation of graphs that overwrites them
    (PyTorch's cudagraph_trees errors with "reduce-overhead and gradient accumulation"); DDP's no_sync path is that
    case too. FSDP over ranks: its gathers and reduce-scatters run outside the graphs, untested under replay.
    """
    if not cfg.cuda_graphs:
        return
    per_rank = split_accumulation(cfg.gradient_accumulation_steps, world_size)
    if per_rank > 1:
        raise ConfigError(
            f"cuda_graphs=True replays one micro-batch per rank a step, not {per_rank} (gradient_accumulation_steps="
            f"{cfg.gradient_accumulation_steps} on {world_size} rank(s)): for the same step use --batch_size="
            f"{cfg.batch_size * per_rank} --gradient_accumulation_steps={world_size}, or drop --cuda_graphs"
        )
    if cfg.fsdp and world_size > 1:
        raise ConfigError("cuda_graphs=True does not replay FSDP's sharded steps: use DDP (--fsdp=false) or drop it")


def init_distributed(cfg, rt, stack):
    """Join the torchrun job (a no-op in one process); returns the host-side gloo group, or None."""
    if rt.world_size == 1:
        return None
    backend = cfg.backend if cfg.backend != "auto" else "nccl" if rt.device.type == "cuda" else "gloo"
    # the timeout turns a dead or stuck rank into an error on the others instead of a hang, in both groups
    timeout = timedelta(seconds=cfg.dist_timeout)
    # device_id: NCCL binds the group to this rank's GPU at once, instead of guessing it at the first collective
    dist.init_process_group(backend, timeout=timeout, device_id=rt.device if rt.device.type == "cuda" else None)
    stack.callback(dist.destroy_process_group)
    # target counts and stop votes are host numbers: summing them over gloo never waits for the GPU
    return dist.new_group(backend="gloo", timeout=timeout)


def all_reduce(values, rt):
    """Sum numbers and 0-d tensors over the ranks in one collective; returns a tensor on rt.device."""
    dtype = torch.float32 if rt.device.type == "mps" else torch.float64  # float64 keeps token counts exact
    tensor = torch.stack([torch.as_tensor(v, device=rt.device).to(dtype) for v in values])
    if rt.world_size > 1:
        dist.all_reduce(tensor)
    return tensor


def agreed_minimum(value, world_size, group=None):
    """The smallest of the ranks' integers value, on every rank: so that each rank decides alike. group: over which."""
    if world_size == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64)  # on the CPU: the group must be gloo (train.py's host group)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
    return int(tensor.item())


def raise_if_any_failed(error, world_size, group=None):
    """
    Every rank passes its one-line error (or None); if any rank failed, all raise the first rank's error at once,
    instead of the others waiting in their next collective until dist_timeout. group: the process group to
    exchange them over (None: the default one).
    """
    errors = [error]
    if world_size > 1:
        errors = [None] * world_size
        # every rank receives every rank's message (a string or None)
        dist.all_gather_object(errors, error, group=group)
    # the lowest failing rank's message: every rank raises the same one
    failed = next((e for e in errors if e), None)
    if failed:
        raise ConfigError(failed)


# -----------------------------------------------------------------------------
# The model over the ranks


@dataclass
class Models:
    """
    The model under the name of each use. All but the average share raw's parameters.

        raw      the plain model: what the optimizers update, what is saved, counted and measured (under FSDP
                 its weights are sharded in place, each rank holding its shards)
        step     what a training step calls: raw, under DDP and/or compiled
        ddp      the DDP module inside step (gradient_sync turns its all-reduce off until the last micro-batch);
                 None without DDP
        average  with ema_decay: the moving average of raw's weights (sharded alike), never trained; else None
        eval     what evaluation calls: the average if there is one, else raw compiled as step is; never DDP,
                 since ranks may evaluate different numbers of batches
    """

    raw: nn.Module
    step: nn.Module
    ddp: DDP | None = None
    average: nn.Module | None = None
    eval: nn.Module | None = None

    @property
    def kept(self):
        """What is saved as best.pt, decoded for accuracy and sampled: the average if there is one, else raw."""
        return self.raw if self.average is None else self.average


def parallelize(model, cfg, rt, task):
    """
    Models for training `model` (on the CPU, or on the meta device under FSDP) on this process's ranks, made in
    this order, as torchtitan's parallelize does:
      1. activation checkpointing, if cfg says so: each block recomputed in the backward;
      2. FSDP2 (fsdp under torchrun): each block, then the root, sharded over the ranks; or DDP (torchrun without
         fsdp), which also gives every rank rank 0's initial weights; or neither, in one process;
      3. torch.compile (cfg.compile; None: on CUDA only), tried on the task's example batch (data.Task).
         DDP is compiled, not wrapped around a compiled model: then its graph is split at the gradient buckets,
         so each bucket's all-reduce starts while the backward of the layers before it still runs;
      4. with ema_decay, the weight average: a copy, sharded alike.
    Call it before the optimizers are built: FSDP replaces the parameters with sharded ones.
    """
    model.set_activation_checkpointing(cfg.activation_checkpointing)
    ddp = None
    if rt.fsdp:
        shard_model(model, rt, cfg.seed)
    else:
        model.to(rt.device)
        if rt.world_size > 1:
            # no buffer needs syncing before each forward (the position tables are computed alike everywhere), and
            # gradients that are views into DDP's buckets save a copy of them. PyTorch 2.13 renamed the first
            # option (forward_sync_buffers) and warns on every rank about the old name, which older versions need
            device_ids = [rt.device.index] if rt.device.type == "cuda" else None
            renamed = "forward_sync_buffers" in inspect.signature(DDP).parameters
            no_sync = {"forward_sync_buffers" if renamed else "broadcast_buffers": False}
            ddp = DDP(model, device_ids=device_ids, gradient_as_bucket_view=True, **no_sync)
    average = average_model(model, rt, cfg.seed) if cfg.ema_decay else None
    step, evaluated = ddp or model, model if average is None else average
    eval_model = evaluated
    if cfg.compile or cfg.compile is None and rt.device.type == "cuda":
        # fixed shapes (windows): graphs specialised to them; pairs and conversations vary in length: one dynamic graph
        how = dict(dynamic=None if task.varying else False, regions=cfg.compile_regions)
        how["mode"] = "reduce-overhead" if cfg.cuda_graphs else None
        step = compile_model(step, task, cfg.batch_size, cfg.block_size, rt, **how)
        if isinstance(step, CompiledModel):
            # evaluation stays outside DDP and measures the average if there is one: compiled apart, unless it is
            # exactly what a step calls
            eval_model = step if step.module is evaluated else CompiledModel(evaluated, **how)
    return Models(model, step, ddp, average, eval_model)


def shard_model(model, rt, seed, mesh=None):
    """
    FSDP2 over the ranks: each Block sharded as a unit, then the root (embeddings, head, final norm), so that a
    block's weights are gathered just before its forward and backward and freed after. Each rank keeps its shard of
    every weight, gradient and (built afterwards) optimizer state. A model built on the meta device gets memory for
    its shards only and is initialised with seed on every rank: the same weights as an unsharded model built after
    torch.manual_seed(seed). With rt.dtype other than float32 (bfloat16 on CUDA), a mixed-precision policy replaces
    autocast: weights gathered in rt.dtype for the forward and backward, gradients reduced in float32, the sharded
    weights and AdamW's state kept in float32. mesh: the ranks' DeviceMesh; None: a new one over all of them.
    """
    if mesh is None:
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


def average_model(model, rt, seed):
    """A copy of model for the weight average (sharded alike under FSDP): never trained, always in eval mode."""
    if not rt.fsdp:
        return copy.deepcopy(model).eval().requires_grad_(False)
    with torch.device("meta"):
        average = build_model(model.config)
    average = shard_model(average, rt, seed)
    # each rank copies its own shards: sharded state dicts load into a model sharded alike
    average.load_state_dict(model.state_dict())
    return average.eval().requires_grad_(False)


def gradient_sync(models, enabled):
    """
    A context for one micro-batch's backward; enabled: it is the last of its step. DDP exchanges nothing until then
    (no_sync: its gradients add up on this rank), then all-reduces the sums. FSDP reduce-scatters every
    micro-batch's gradients as they come (nothing to do here), so that each rank only ever holds its shards.
    """
    if models.ddp is not None and not enabled:
        return models.ddp.no_sync()
    return contextlib.nullcontext()


# -----------------------------------------------------------------------------
# Compilation


class CompiledModel(nn.Module):
    """
    torch.compile(module), falling back to the eager module with one warning if a compilation fails, whenever it
    happens: at the first call or at a later recompilation (evaluation mode, say). A backward graph is compiled at
    its first use, in loss.backward(): train.accumulate_gradients turns a failure there into a one-line error.
    regions: compile each Block and the loss instead of the whole model (compile_regions); mode: torch.compile's,
    "reduce-overhead" for CUDA graphs.
    """

    def __init__(self, module, dynamic=None, regions=False, mode=None):
        super().__init__()
        self.module, self.failed = module, False  # the eager module is kept for the fallback; both share parameters
        if regions:
            compile_regions(module, dynamic=dynamic, mode=mode)
            self.compiled = module  # the glue between the regions (embeddings, the final norm) runs eagerly
        else:
            self.compiled = torch.compile(module, dynamic=dynamic, mode=mode)

    def forward(self, *args, **kwargs):
        if not self.failed:
            try:
                return self.compiled(*args, **kwargs)
            except torch._dynamo.exc.TorchDynamoException as e:  # what compilation raises, not the model's errors
                self.fall_back(e)
        return self.module(*args, **kwargs)

    def fall_back(self, error):
        self.failed = True
        compile_regions(self.module, enabled=False)  # a no-op unless the regions were compiled
        log(f"warning: torch.compile failed ({type(error).__name__}: {one_line(error)}); going on without it")


def compile_regions(module, enabled=True, **options):
    """
    Regional compilation: torch.compile each Block of module (a model, or DDP around one) and its loss, in place, or
    with enabled=False undo that. The blocks share their code, so one graph serves them all: compiled once instead of
    n_layer times over, which shortens the wait for the first step, for the same kernels within each block.
    """
    model = module.module if isinstance(module, DDP) else module
    for block in model.modules():
        if isinstance(block, Block):
            if enabled:
                block.compile(**options)
            else:
                block._compiled_call_impl = None  # what nn.Module.compile set: calls go to the eager forward again
    if enabled:  # the head's matmul, soft-cap and cross-entropy fused, as whole-model compilation fuses them
        model.chunk_loss = torch.compile(model.chunk_loss, **options)
    else:
        model.__dict__.pop("chunk_loss", None)  # the method again


def compile_model(model, task, batch_size, block_size, rt, dynamic=None, regions=False, mode=None):
    """
    CompiledModel(model), tried on one forward and backward pass of the task's example batch with the training
    step's exact call (the backward is compiled at its first call); if that fails, one warning and the eager model,
    on every rank if it failed on any. Running out of memory or a failed collective is no compile failure: it is
    raised. Under FSDP a backward that fails to compile leaves the ranks' gathers of weights half done: one line, no
    fallback.
    """
    compiled = CompiledModel(model, dynamic, regions, mode)
    inputs, targets = task.to_device(*task.example_batch(batch_size, block_size), rt.device)
    # DDP's no_sync: the trial's backward exchanges nothing, so a rank whose backward fails to compile leaves no
    # other rank waiting in an all-reduce, and all can agree below
    no_sync = model.no_sync() if isinstance(model, DDP) else contextlib.nullcontext()
    try:
        # the trial leaves every random generator as it was, so compiling does not change the run
        with torch.random.fork_rng(devices=[rt.device.index] if rt.device.type == "cuda" else []), no_sync:
            with rt.autocast():
                # the training step's exact call, so that training reuses this graph instead of compiling another
                loss = task.loss(compiled, inputs, targets)
            loss.backward()
    except (torch.OutOfMemoryError, dist.DistError):
        raise
    except Exception as e:  # a missing C compiler, an unsupported operator, ...: all mean eager mode
        if rt.fsdp:  # a forward's failure falls back inside CompiledModel: this one is a backward's
            raise ConfigError(f"torch.compile failed in a backward ({one_line(e)}); run with --compile=false") from None
        compiled.fall_back(e)
    # every rank must run the same graphs, or their collectives would not pair: one rank's failure is everyone's
    if rt.world_size > 1 and all_reduce([compiled.failed], rt).item() and not compiled.failed:
        compiled.fall_back(RuntimeError("it failed on another rank"))
    # the trial's gradients must not add to the first real step's
    model.zero_grad(set_to_none=True)
    return model if compiled.failed else compiled
