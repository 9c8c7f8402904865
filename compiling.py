"""
Compilation: torch.compile applied to a training run's model, whole or block by block (regional), by
runtime.parallelize after FSDP or DDP. Its trial step also sizes the loss chunk on a GPU (sized_loss_chunk).
"""

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from config import ConfigError
from log import log, one_line, state_bytes
from model import LOSS_CHUNK_BYTES, Block, loss_chunk_cap


class CompiledModel(nn.Module):
    """
    torch.compile(module), falling back to the eager module with one warning if a compilation fails, at the first
    call or at a later recompilation (evaluation mode, say); a backward's failure is train.backward's to report.
    regions: compile_regions instead of the whole model; mode: torch.compile's, "reduce-overhead" for CUDA graphs.
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
    CompiledModel(model), tried on a trial_step (the backward is compiled at its first call); if that fails, one
    warning and the eager model, on every rank if it failed on any. Running out of memory or a failed collective is
    no compile failure: it is raised. Under FSDP a backward that fails to compile leaves the ranks' gathers of
    weights half done: one line, no fallback.
    """
    compiled = CompiledModel(model, dynamic, regions, mode)
    try:
        trial_step(compiled, task, batch_size, block_size, rt, ddp=model if isinstance(model, DDP) else None)
    except (torch.OutOfMemoryError, dist.DistError):
        raise
    except Exception as e:  # a missing C compiler, an unsupported operator, ...: all mean eager mode
        if rt.fsdp:  # a forward's failure falls back inside CompiledModel: this one is a backward's
            raise ConfigError(f"torch.compile failed in a backward ({one_line(e)}); run with --compile=false") from None
        compiled.fall_back(e)
    # every rank must run the same graphs, or their collectives would not pair: one rank's failure is everyone's
    if rt.world_size > 1:
        failed = torch.tensor(float(compiled.failed), device=rt.device)
        dist.all_reduce(failed)
        if failed.item() and not compiled.failed:
            compiled.fall_back(RuntimeError("it failed on another rank"))
    # the trial's gradients must not add to the first real step's
    model.zero_grad(set_to_none=True)
    return model if compiled.failed else compiled


def trial_step(step, task, batch_size, block_size, rt, ddp=None):
    """
    One forward and backward of the task's example batch through step, with the training step's exact call (so that
    training reuses the graphs made here), leaving every random generator as it was and the gradients for the caller
    to clear. ddp: the DDP module inside step, whose no_sync keeps a rank whose backward fails to compile from
    leaving the others waiting in an all-reduce.
    """
    inputs, targets = task.to_device(*task.example_batch(batch_size, block_size), rt.device)
    no_sync = ddp.no_sync() if ddp is not None else contextlib.nullcontext()
    with torch.random.fork_rng(devices=[rt.device.index] if rt.device.type == "cuda" else []), no_sync:
        with rt.autocast():
            loss = task.loss(step, inputs, targets)
        loss.backward()


def loss_chunk_budget(trial_chunk, spare_bytes, total_bytes, copies):
    """
    The loss chunk's bytes of float32 logits on a GPU of total_bytes, from a training step taken with chunks of
    trial_chunk bytes that left spare_bytes unused at its peak (negative: what it lacked), with what the step did
    not hold yet (the optimizer's state) and a margin counted as used. Each byte more of chunk costs `copies` bytes
    (3 eager, 1 compiled, where Inductor keeps the head's output alone): the chunk grows into the spare memory or
    shrinks by what was lacking, within [LOSS_CHUNK_BYTES, loss_chunk_cap(total_bytes)].
    """
    chunk = trial_chunk + spare_bytes // copies
    return int(min(loss_chunk_cap(total_bytes), max(LOSS_CHUNK_BYTES, chunk)))


def sized_loss_chunk(model, trial, optimizers, compiled):
    """
    On a GPU, model's loss chunk sized once from trial() (trial_step: a forward and backward as a
    training step takes it) with the weights, the gradients and the activations on the device, and the optimizers'
    state ({name: optimizer}) counted, made or not: loss_chunk_budget of what that leaves. Compiled, the trial takes
    the chunk compiled with (the cap), so that a run with room to spare keeps its graphs; eager, the smallest chunk,
    so that the trial itself cannot run out of memory for its logits. This rank's chunk: train.py takes the smallest
    over the ranks, so that every rank cuts the loss alike.
    """
    device = next(model.parameters()).device
    if not compiled:
        model.loss_chunk_bytes = LOSS_CHUNK_BYTES
    torch.cuda.reset_peak_memory_stats(device)
    trial()
    model.zero_grad(set_to_none=True)
    # AdamW's two moments of every trained weight (Muon's one: counted high), less what a resume has made already
    use = state_bytes(model, optimizers)
    unmade = max(0, 2 * use["gradients"] - use["optimizer"])
    free, total = torch.cuda.mem_get_info(device)
    # what the device could give at the trial's peak: what is free, and what the allocator keeps cached, less a
    # tenth of the card (fragmentation, cuBLAS's and NCCL's workspaces: plan.FULL's margin)
    spare = free + torch.cuda.memory_reserved(device) - torch.cuda.max_memory_allocated(device) - unmade - total // 10
    return loss_chunk_budget(model.loss_chunk_bytes, spare, total, copies=1 if compiled else 3)
