"""
tools/bench.py --parts=sample: generation's speed from a checkpoint, cached and batched against neither, measured in
this process as sample.py samples.
"""

import time
from pathlib import Path

import torch

from bench_common import summary
from checkpoint import load_checkpoint
from generate import generate
from runtime import autocast, resolve_dtype
from start import model_from_checkpoint


def sampling_speed(model, prompt, num_samples, max_new_tokens, *, use_cache, batched, repeats, dtype):
    """
    Tokens generated per second, one measurement per repeat: num_samples continuations of prompt (a list of ids)
    by max_new_tokens tokens each (no early stop), either in one batch or one sample after another. Sampled as
    sample.py samples: without gradients, under autocast to dtype (a no-op for float32).
    """
    device = next(model.parameters()).device
    # batched: one call of num_samples rows; else num_samples calls of one row
    batches = [num_samples] if batched else [1] * num_samples
    rates = []
    for repeat in range(repeats):
        # seeded per repeat: the timings are reproducible, and each repeat draws other tokens
        generator = torch.Generator(device).manual_seed(repeat)
        begin = time.perf_counter()
        with torch.no_grad(), autocast(device, dtype):
            for size in batches:
                idx = torch.tensor([prompt] * size, dtype=torch.long, device=device)
                generate(model, idx, max_new_tokens, generator=generator, use_cache=use_cache)
        # CUDA runs asynchronously: wait for the last kernel before reading the clock
        if device.type == "cuda":
            torch.cuda.synchronize()
        rates.append(num_samples * max_new_tokens / (time.perf_counter() - begin))
    return rates


def sampling_device():
    """Where bench_sampling samples: the first GPU if there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def bench_sampling(cfg, out_dir):
    """Rows (name, value) for sampling speed from out_dir's ckpt.pt: KV cache and batched vs neither."""
    # the latest checkpoint: the speed does not depend on how well the weights are trained
    ckpt = load_checkpoint(Path(out_dir) / "ckpt.pt")
    device = sampling_device()
    model = model_from_checkpoint(ckpt).to(device)
    dtype = resolve_dtype(cfg.dtype, device)  # the precision sample.py would sample in with the same --dtype
    prompt = [0]  # the speed does not depend on the prompt's content
    # the two ends of the scale: cached and batched, against recomputed and one sample at a time
    args = (model, prompt, cfg.samples, cfg.sample_tokens)
    cached, uncached = [], []
    for _ in range(cfg.repeats):  # in turns, so that the machine's drift in speed hits both ways alike
        cached += sampling_speed(*args, use_cache=True, batched=True, repeats=1, dtype=dtype)
        uncached += sampling_speed(*args, use_cache=False, batched=False, repeats=1, dtype=dtype)
    what = f"{cfg.samples} x {cfg.sample_tokens} tokens"
    speedups = [c / u for c, u in zip(cached, uncached)]
    return [
        (f"sampling tokens/s, KV cache, batched ({what})", summary(cached, "{:,.0f}")),
        (f"sampling tokens/s, no cache, one at a time ({what})", summary(uncached, "{:,.0f}")),
        ("sampling speedup (each cached run over the uncached run after it)", summary(speedups, "{:.1f}x")),
    ]
