"""bench.py: BPE throughput on the pieces and batches prepare() encodes, sampling speed's counting, the tables."""

import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bench
from bench import bpe_throughput, sampling_speed
from model import ModelConfig, build_model

REPO = Path(__file__).resolve().parent.parent


def test_bpe_throughput_reports_a_rate_per_repeat():
    rates = bpe_throughput("The quick brown fox.\nJumps over the lazy dog.\n" * 500, num_threads=2, repeats=3)
    assert len(rates) == 3 and all(rate > 0 for rate in rates)


def test_bench_bpe_prints_its_rows(tmp_path):
    """--parts=bpe alone: encode at 1 thread and at all cores, then prepare_data.py text, each median (min-max)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("To be, or not to be, that is the question:\nWhether 'tis nobler in the mind\n" * 200)
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench.py"),
            "--parts=bpe",
            "--repeats=2",
            "--bpe_size_mb=0.1",
            f"--bpe_input={corpus}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = dict(line.strip("|").split("|")[:2] for line in run.stdout.splitlines()[2:])
    rows = {name.strip(): value.strip() for name, value in rows.items() if name.strip().startswith("BPE")}
    assert len(rows) in (2, 3) and any(", 1 thread (0.1 MB of corpus.txt)" in name for name in rows)
    assert all(re.fullmatch(r"[\d,]+ \([\d,]+-[\d,]+\)", value) for value in rows.values())


def test_bench_refuses_an_unknown_part(tmp_path):
    run = subprocess.run(
        [sys.executable, str(REPO / "bench.py"), "--parts=bpe,tokens"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert run.returncode != 0 and "unknown tokens" in run.stderr and "Traceback" not in run.stderr


def test_a_given_checkpoint_gets_its_own_sampling_table(monkeypatch, capsys):
    """--out_dir with several configs: the sampling rows are that checkpoint's, never under a config's column."""
    monkeypatch.setattr(bench, "bench_training", lambda cfg, work: [("training tokens/s", ["100 (1-2)", "200 (1-2)"])])
    monkeypatch.setattr(bench, "bench_sampling", lambda cfg, folder: [(f"sampling from {folder}", "999 (9-9)")])
    cfg = bench.BenchConfig(config="configs/shakespeare.py,configs/gpt2.py", parts="train,sample", out_dir="ckpts")
    bench.main(cfg)
    lines = capsys.readouterr().out.splitlines()
    cells = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines if line.startswith("| ")]
    assert cells == [
        ["measure", "configs/shakespeare.py median (min-max)", "configs/gpt2.py median (min-max)"],
        ["training tokens/s", "100 (1-2)", "200 (1-2)"],
        ["measure", "ckpts median (min-max)"],
        ["sampling from ckpts", "999 (9-9)"],
    ]


def test_sampling_speed_generates_what_it_counts(monkeypatch):
    # a GPT of the sampling tests' size: the speed is counted the same whatever its weights
    model = build_model(ModelConfig(vocab_size=65, block_size=32, n_layer=2, n_head=2, n_embd=32)).eval()
    calls, generate = [], bench.generate

    def spy(model, idx, max_new_tokens, **options):
        calls.append((idx.size(0), max_new_tokens, options["use_cache"]))
        return generate(model, idx, max_new_tokens, **options)

    monkeypatch.setattr(bench, "generate", spy)
    for use_cache, batched in itertools.product((True, False), repeat=2):
        calls.clear()
        rates = sampling_speed(
            model,
            [0],
            num_samples=3,
            max_new_tokens=4,
            use_cache=use_cache,
            batched=batched,
            repeats=2,
            dtype=torch.float32,
        )
        assert len(rates) == 2 and all(r > 0 for r in rates)
        # per repeat: one batch of 3, or 3 batches of 1
        assert calls == ([(3, 4, use_cache)] if batched else [(1, 4, use_cache)] * 3) * 2


@pytest.mark.parametrize("dtype,autocast_dtype", [("auto", None), ("float32", None), ("bfloat16", torch.bfloat16)])
def test_sampling_runs_under_sample_py_s_precision(monkeypatch, dtype, autocast_dtype):
    """
    bench_sampling generates as sample.py does with the same --dtype: without gradients, under autocast to that dtype
    (on a CPU "auto" is float32: no autocast), so the speed measured is the speed sample.py gets.
    """
    model = build_model(ModelConfig(vocab_size=65, block_size=32, n_layer=2, n_head=2, n_embd=32))
    monkeypatch.setattr(bench, "sampling_device", lambda: torch.device("cpu"))  # the autocast checked is the CPU's
    monkeypatch.setattr(bench, "load_checkpoint", lambda path: None)
    monkeypatch.setattr(bench, "model_from_checkpoint", lambda ckpt: model)
    states, generate = set(), bench.generate

    def spy(model, idx, max_new_tokens, **options):
        autocast = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        states.add((torch.is_grad_enabled(), autocast))
        return generate(model, idx, max_new_tokens, **options)

    monkeypatch.setattr(bench, "generate", spy)
    cfg = bench.BenchConfig(parts="sample", samples=2, sample_tokens=3, repeats=1, dtype=dtype)
    rows = bench.bench_sampling(cfg, "unused")
    assert len(rows) == 3 and states == {(False, autocast_dtype)}


def test_bench_refuses_a_dtype_it_cannot_sample_in(monkeypatch):
    monkeypatch.setattr(bench, "sampling_device", lambda: torch.device("cpu"))
    with pytest.raises(ValueError, match="not one of"):
        bench.BenchConfig(dtype="float64")
    with pytest.raises(ValueError, match="float16 needs CUDA"):  # as sample.py refuses it
        bench.BenchConfig(dtype="float16")


def test_summary_counts_runs_that_never_got_there_apart():
    inf = float("inf")
    assert bench.summary([3.0, 1.0, 2.0], "{:.1f}") == "2.0 (1.0-3.0)"
    assert bench.summary([inf, 4.0, 2.0], "{:.1f}") == "3.0 (2.0-4.0); never in 1 of 3 run(s)"
    assert bench.summary([inf, inf], "{:.1f}") == "never in 2 of 2 run(s)"
    assert bench.summary([], "{:.1f}") == "n/a"
