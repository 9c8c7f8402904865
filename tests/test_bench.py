"""
tools/bench.py: sampling speed's counting, the tables, the serve part, the step harness, and the whole GPU call
dry-run on the CPU beside the real nanoGPT.
"""

import itertools
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tiny_run import SHRINK, tiny

import bench
import bench_common
import bench_sample
import bench_serve
import bench_step
import bench_train
import train
from bench_sample import sampling_speed
from config import parse_config
from model import ModelConfig, build_model
from train import TrainConfig

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "tools" / "bench.py"


def test_bench_refuses_an_unknown_part(tmp_path):
    run = subprocess.run(
        [sys.executable, str(BENCH), "--parts=train,tokens"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert run.returncode != 0 and "unknown tokens" in run.stderr and "Traceback" not in run.stderr


def test_a_step_case_must_start_with_a_config_that_exists():
    with pytest.raises(ValueError, match="cases: config configs/nope.py not found; each case starts with"):
        bench.BenchConfig(cases="configs/shakespeare.py;configs/nope.py --n_layer=2")
    assert bench.BenchConfig(cases="configs/shakespeare.py --n_layer=2").step_cases == [
        ["configs/shakespeare.py", "--n_layer=2"]
    ]


def test_the_serve_part_streams_from_a_real_server(tmp_path, data_root, monkeypatch):
    # a served quick-start model (a tiny one here, trained where the part looks for it): 1 and 3 clients, 4 tokens each
    monkeypatch.chdir(tmp_path)  # the part's serve.py runs from the project; nothing may be written here
    train.main(tiny(data_root, tmp_path / "serve" / "quick-start", max_iters=2))
    cfg = bench.BenchConfig(parts="serve", serve_models="quick", serve_clients="1,3", serve_tokens=4, repeats=2)
    header, rows = bench_serve.bench_serving(cfg, tmp_path / "serve")
    values = {label: value[0] for label, value in rows}
    assert header[1].startswith("quick start") and len(rows) == 9
    number = r"[\d,.]+x? \([\d,.]+x?-[\d,.]+x?\)"
    assert all(re.fullmatch(number, v) for label, v in values.items() if "memory" not in label), values
    assert values["1 client(s): all together / 1 client(s)"] == "1.00x (1.00x-1.00x)"
    assert re.fullmatch(r"[\d,]+ \(0\)", values["server peak memory, MiB (KV cache budget)"])  # 3 x 32 positions
    assert list(tmp_path.iterdir()) == [tmp_path / "serve"]


def test_a_given_checkpoint_gets_its_own_sampling_table(monkeypatch, capsys):
    """--out_dir with several configs: the sampling rows are that checkpoint's, never under a config's column."""
    monkeypatch.setattr(
        bench_train, "bench_training", lambda cfg, work: [("training tokens/s", ["100 (1-2)", "200 (1-2)"])]
    )
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
    calls, generate = [], bench_sample.generate

    def spy(model, idx, max_new_tokens, **options):
        calls.append((idx.size(0), max_new_tokens, options["use_cache"]))
        return generate(model, idx, max_new_tokens, **options)

    monkeypatch.setattr(bench_sample, "generate", spy)
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
    # the autocast checked is the CPU's
    monkeypatch.setattr(bench_sample, "sampling_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(bench_sample, "load_checkpoint", lambda path: None)
    monkeypatch.setattr(bench_sample, "model_from_checkpoint", lambda ckpt: model)
    states, generate = set(), bench_sample.generate

    def spy(model, idx, max_new_tokens, **options):
        autocast = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        states.add((torch.is_grad_enabled(), autocast))
        return generate(model, idx, max_new_tokens, **options)

    monkeypatch.setattr(bench_sample, "generate", spy)
    cfg = bench.BenchConfig(parts="sample", samples=2, sample_tokens=3, repeats=1, dtype=dtype)
    rows = bench_sample.bench_sampling(cfg, "unused")
    assert len(rows) == 3 and states == {(False, autocast_dtype)}


def test_bench_refuses_a_dtype_it_cannot_sample_in(monkeypatch):
    monkeypatch.setattr(bench, "sampling_device", lambda: torch.device("cpu"))
    with pytest.raises(ValueError, match="not one of"):
        bench.BenchConfig(dtype="float64")
    with pytest.raises(ValueError, match="float16 needs CUDA"):  # as sample.py refuses it
        bench.BenchConfig(dtype="float16")


def test_summary_counts_runs_that_never_got_there_apart():
    inf = float("inf")
    assert bench_common.summary([3.0, 1.0, 2.0], "{:.1f}") == "2.0 (1.0-3.0)"
    assert bench_common.summary([inf, 4.0, 2.0], "{:.1f}") == "3.0 (2.0-4.0); never in 1 of 3 run(s)"
    assert bench_common.summary([inf, inf], "{:.1f}") == "never in 2 of 2 run(s)"
    assert bench_common.summary([], "{:.1f}") == "n/a"


# The bench's own time limits are the machine's business: the tests that run it set them far above what a 2-core
# machine under any load takes (the whole suite in parallel), and pytest's limit above those, so that a slow or busy
# machine only makes them slower, never failed; a limit is still there, so nothing can hang
LOADED = pytest.mark.timeout(1800)


@LOADED
def test_the_step_harness_times_each_case_in_a_process_of_its_own(tmp_path, data_root):
    """
    --parts=step on the CPU: two cases, the loss computed whole and in chunks of 4 positions, each in a child process
    that sets up train.py's run and times its real steps. A value per case in every row; the same seed and data give
    the same loss however the loss is cut; nothing compiled on a CPU by default.
    """
    tiny = (
        f"configs/shakespeare.py --data_dir={data_root} --n_layer=1 --n_embd=32 --n_head=2 --block_size=32 --threads=1"
    )
    cases = f"{tiny};{tiny} --loss_chunk_mb=0.0005"  # 524 bytes: 2 positions of 65 float32 logits a chunk
    command = [sys.executable, str(BENCH), "--parts=step", f"--cases={cases}", "--steps=3", "--warmup=1"]
    command += ["--rounds=1", "--case_timeout=1200"]  # the rounds' order has a test of its own
    run = subprocess.run([*command, "--profile=true"], capture_output=True, text=True, timeout=1500, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    table = {}
    for line in run.stdout.splitlines():
        if line.startswith("| "):
            name, *values = [cell.strip() for cell in line.strip("|").split("|")]
            table[name] = values
    assert len(table["measure"]) == 2 and table["measure"][1].endswith("--loss_chunk_mb=0.0005")
    for name in ("ms per step", "tokens/s", "optimizer ms per step"):
        assert all(re.fullmatch(r"[\d,.]+ \([\d,.]+-[\d,.]+\)", v) for v in table[name]), (name, table[name])
    assert table["MFU %"] == ["n/a", "n/a"]  # no peak FLOP/s for a CPU
    assert all(v.endswith("(no compile)") for v in table["launch to first step done, s"])
    assert table["graphs / breaks / recompiled in timing"] == ["0 / 0 / 0"] * 2
    losses = table["train loss after the last step"]
    assert losses[0] == losses[1] and float(losses[0]) > 1.0
    assert all(float(v) > 0 for v in table["profile: matmul ms per step"])


FAKE_NANOGPT = """
import sys, time
# nanoGPT's lines as its train.py prints them: the tokens per iteration, a progress line per iteration, evaluations
print("tokens per iteration will be: 1,024", flush=True)
if "--race" in sys.argv:
    print("step 0: train loss 4.1000, val loss 4.1100", flush=True)
    print("step 250: train loss 1.4000, val loss 1.4600", flush=True)
    time.sleep(600)  # the bench stops it at the target instead of waiting
for i in range(8):
    print(f"iter {i}: loss 3.0000, time {100.0 + i:.2f}ms, mfu 12.00%", flush=True)
"""


def test_nanogpt_s_own_lines_are_read_and_its_race_stopped_at_the_target(tmp_path):
    folder = tmp_path / "nanogpt"
    folder.mkdir()
    (folder / "train.py").write_text(FAKE_NANOGPT)
    cfg = bench.BenchConfig(nanogpt=str(folder), nanogpt_step="config.py", warmup=3, steps=20, target_loss=1.47)
    result = bench_step.nanogpt_step(cfg, tmp_path)
    # the iterations after the 3 of warm-up; tokens per step as nanoGPT counts them
    assert result["ms"] == [103.0, 104.0, 105.0, 106.0, 107.0] and result["tokens"] == 1024 and result["launch"] > 0
    rows = dict(bench_step.step_rows([bench_step.merged([result])], []))
    assert rows["tokens/s"] == ["9,752 (9,570-9,942)"]  # 1,024 tokens in 105 ms (107-103)
    race = replace(cfg, nanogpt_race="config.py --race")
    with ThreadPoolExecutor(1) as pool:
        seconds, iteration, loss = pool.submit(bench_train.nanogpt_race, race, tmp_path).result(timeout=600)
    assert (iteration, loss) == (250, 1.46) and 0 < seconds < 600
    # a run that ends without reaching the target: its exit status, and the column says so
    assert bench_train.nanogpt_race(replace(cfg, nanogpt_race="config.py"), tmp_path) == 0
    races = [(seconds, iteration, loss), 0]
    rows = dict(
        bench_train.nanogpt_column([("seconds to val loss <= 1.47", []), ("val loss at the stop", [])], races, cfg)
    )
    assert rows == {
        "seconds to val loss <= 1.47": [
            f"{seconds:.1f} ({seconds:.1f}-{seconds:.1f}); never in 1 of 2 run(s) (at iteration 250) (ended first, "
            "exit status 0)"
        ],
        "val loss at the stop": ["not measured"],
    }


def test_kernels_are_sorted_by_kind_as_an_h100_s_profile_names_them():
    """Names from a profile of configs/shakespeare_gpu.py on an H100 (torch 2.11), and a CPU's operators."""
    kinds = {
        "triton_per_fused__to_copy_add_native_dropout_backward_native_layer_norm_backward_view_4": "fused by Inductor",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1_cga1x1x1_kernel0_": (
            "attention"
        ),
        "nvjet_sm90_tst_192x128_64x5_1x2_h_bz_coopB_NNT": "matmul",
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16>": "other",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>": "optimizer",
        "Memcpy HtoD (Pinned -> Device)": "copies and fills",
        "aten::addmm": "matmul",
        "cpp_fused_add_native_layer_norm_0": "fused by Inductor",
    }
    assert {name: bench_step.kernel_kind(name) for name in kinds} == kinds


def test_the_step_cases_and_nanogpt_s_run_in_turns_each_round_from_empty_caches(tmp_path, monkeypatch):
    """
    Case 1, case 2, nanoGPT, then again (A B A B): the machine's drift hits all alike. Each round compiles in
    folders of its own, so every round starts from the cache state of the first; the rows hold every round's steps.
    """
    order = []

    def step_run(cfg, words, index, work):
        order.append((f"case {index + 1}", work))
        cold = not (work / "cache-shared").exists()
        (work / "cache-shared").mkdir(parents=True, exist_ok=True)  # what the case's compilation leaves
        return {
            "ms": [10.0 + len(order)],
            "tokens": 1000,
            "launch": 30.0 + len(order),
            "cold": cold,
            "graphs": 1,
            "graph_breaks": 0,
            "recompiled": 0,
        }

    def nanogpt_step(cfg, work):
        order.append(("nanoGPT", work))
        return {"ms": [20.0 + len(order)], "tokens": 1000, "launch": 50.0, "cold": True}

    monkeypatch.setattr(bench_step, "step_run", step_run)
    monkeypatch.setattr(bench_step, "nanogpt_step", nanogpt_step)
    cases = "configs/shakespeare.py;configs/shakespeare.py --n_layer=2"
    cfg = bench.BenchConfig(cases=cases, rounds=2, nanogpt=str(tmp_path), nanogpt_step="config.py")
    header, rows = bench_step.bench_steps(cfg, tmp_path)
    assert [(who, work.name) for who, work in order] == [
        ("case 1", "round1"),
        ("case 2", "round1"),
        ("nanoGPT", "round1"),
        ("case 1", "round2"),
        ("case 2", "round2"),
        ("nanoGPT", "round2"),
    ]
    rows = dict(rows)
    assert header[-1] == "nanoGPT: config.py"
    assert rows["ms per step"] == ["12.5 (11.0-14.0)", "13.5 (12.0-15.0)", "24.5 (23.0-26.0)"]
    # the first case compiles cold in every round, the second from the cache the first left in that round
    assert rows["launch to first step done, s"] == [
        "32.5 (31.0-34.0) (cold)",
        "33.5 (32.0-35.0) (warm)",
        "50.0 (50.0-50.0) (cold)",
    ]


def test_each_side_waits_for_the_device_once_a_step_and_counts_the_wait(monkeypatch):
    """
    Ours: the host clock around a step and one synchronisation after it, as nanoGPT's log_interval=1 gives its own
    time.time() around each iteration (its loss.item() waits once). The wait's time is part of the step's.
    """
    waits = []

    def synchronize(device=None):
        waits.append(device)
        time.sleep(0.03)  # the device finishing the step's kernels

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    clock, step_ms = bench_step.DeviceClock(torch.device("cuda")), []
    for _ in range(2):
        with clock.step(step_ms):
            time.sleep(0.01)  # the host launching the step's kernels
    assert len(waits) == 2 and all(ms >= 40 for ms in step_ms)
    assert "--log_interval=1" in bench_step.NANOGPT_STEP.split()


def test_both_races_compile_cold_in_turns_and_evaluate_alike(tmp_path, monkeypatch):
    """
    Ours and nanoGPT's race, in turns: each run compiles into an empty cache folder of its own (none reuses a
    warm one), nanoGPT's prints reach the pipe as it makes them (unbuffered), and nanoGPT evaluates as
    configs/shakespeare_gpu.py does: as many batches, so both sides' evaluations cost alike.
    """
    launched, real_launch = [], bench_train.launch
    lines = "eval 250: train loss 1.4000, val loss 1.4600\nstep 250: train loss 1.4000, val loss 1.4600"

    def launch(command, cwd=bench_common.ROOT, env=None):
        cache = Path(env["TORCHINDUCTOR_CACHE_DIR"])
        launched.append(("nanoGPT" if cwd != bench_common.ROOT else "ours", command, env, cache.exists()))
        return real_launch([sys.executable, "-c", f"print({lines!r})"], cwd, env)

    monkeypatch.setattr(bench_train, "launch", launch)
    config = "configs/shakespeare_gpu.py"
    cfg = bench.BenchConfig(config=config, runs=2, target_loss=1.47, stop_at_target=True, nanogpt=str(tmp_path))
    rows = dict(bench_train.bench_training(cfg, tmp_path))
    assert [who for who, *_ in launched] == ["ours", "nanoGPT"] * 2
    caches = [env["TORCHINDUCTOR_CACHE_DIR"] for _, _, env, _ in launched]
    assert len(set(caches)) == 4 and not any(existed for *_, existed in launched)
    assert all(env["PYTHONUNBUFFERED"] == "1" for who, _, env, _ in launched if who == "nanoGPT")
    ours = parse_config(TrainConfig, [config])
    assert f"--eval_iters={ours.eval_iters}" in shlex.split(bench_train.NANOGPT_RACE)
    assert f"--eval_iters={ours.eval_iters}" in launched[1][1]
    assert len(rows["seconds to val loss <= 1.47"]) == 2


def markdown_tables(output):
    """The Markdown tables in a printed output: for each, its header cells and {row name: cells}."""
    tables, lines = [], output.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("| ") and not (i and lines[i - 1].startswith("|")):
            table = []
            for row in lines[i:]:
                if not row.startswith("|"):
                    break
                table.append([cell.strip() for cell in row.strip().strip("|").split("|")])
            tables.append((table[0], {name: values for name, *values in table[2:]}))
    return tables


@LOADED
def test_the_gpu_call_dry_runs_on_a_cpu_beside_nanogpt(tmp_path, nanogpt_dir):
    """
    tools/bench.py --parts=gpu as a GPU machine runs it, beside the real nanoGPT, on the CPU at tiny shapes, so that
    a lent GPU's first minutes never go to a broken harness: every stage runs and prints its table. Stage 1 measures
    GPT-2's case (the first of GPU_CASES) beside nanoGPT's step; stage 2 races configs/shakespeare_gpu.py and
    nanoGPT's recipe to a tiny target; stage 3 every case of GPU_MORE_CASES, the CUDA-graphs one refused for its
    device alone. With --plan=true both step stages plan each case beside its measured peak.
    """
    import prepare_data

    data = tmp_path / "data"
    for name in ("shakespeare", "shakespeare_char"):  # GPT-2's BPE and the race's characters
        prepare_data.prepare(name, data_dir=data)
    # one shape for both sides, in options both train.py's take; at this learning rate the race reaches 3.5 in ~20 steps
    tiny = "--n_layer=1 --n_head=2 --n_embd=32 --block_size=32 --batch_size=4 --gradient_accumulation_steps=1"
    tiny += " --dropout=0.0 --learning_rate=1e-2 --warmup_iters=0 --eval_interval=10 --eval_iters=2 --max_iters=200"
    train_args = f"--device=cpu --data_dir={data} {tiny}"
    nanogpt_step = f"{bench_step.NANOGPT_STEP} --device=cpu --compile=False --dtype=float32 {tiny}"
    nanogpt_race = f"{bench_train.NANOGPT_RACE} --device=cpu --compile=False --dtype=float32 {tiny}"
    command = [sys.executable, str(BENCH), "--parts=gpu", f"--nanogpt={nanogpt_dir}", "--plan=true"]
    command += [f"--cases={bench.GPT2}", "--steps=2", "--warmup=1", "--rounds=1", "--race_target=3.5"]
    command += [f"--train_args={train_args}", f"--nanogpt_step={nanogpt_step}", f"--nanogpt_race={nanogpt_race}"]
    # about 45 s of CPU time, 200 s on 2 cores that other suites kept busy: the limits are for a hang (LOADED)
    command += ["--case_timeout=1200"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=1500, cwd=tmp_path)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    (core_header, core), (race_header, race), (more_header, more) = markdown_tables(run.stdout)
    number, spread = r"[\d,.]+", r"[\d,.]+ \([\d,.]+-[\d,.]+\)"

    # 1: our case beside nanoGPT's, each timed from its launch; our peak beside the plan's
    assert core_header[1:] == [f"1: {bench.GPT2} {train_args}", f"nanoGPT: {nanogpt_step}"]
    assert all(re.fullmatch(spread, v) for v in core["ms per step"] + core["tokens/s"]), core
    launches = core["launch to first step done, s"]
    assert re.fullmatch(rf"{spread} \(no compile\)", launches[0]) and re.fullmatch(rf"{spread} \(cold\)", launches[1])
    for name in ("peak memory MiB", "--plan: predicted peak MiB", "--plan: predicted ms per step"):
        assert re.fullmatch(number, core[name][0]) and core[name][1] == "n/a", (name, core[name])

    # 2: both sides reached the target (once each: --rounds=1), and ours stopped there
    assert race_header[1:] == ["configs/shakespeare_gpu.py median (min-max)", f"nanoGPT: {nanogpt_race}"]
    ours, theirs = race["seconds to val loss <= 3.5"]
    assert re.fullmatch(spread, ours) and re.fullmatch(rf"{spread} \(at iteration \d+\)", theirs), race
    assert 0 < float(race["val loss at the stop"][0].split()[0]) <= 3.5

    # 3: every case of GPU_MORE_CASES timed and planned, but CUDA graphs', refused here for the CPU alone
    cases = bench.GPU_MORE_CASES.split(";")
    assert more_header[1:] == [f"{i + 1}: {case} {train_args}" for i, case in enumerate(cases)]
    assert cases[-1].endswith("--cuda_graphs=true")
    cells = {"ms per step": spread, "tokens/s": spread, "peak memory MiB": number}
    cells["launch to first step done, s"] = rf"{spread} \(no compile\)"
    for name, pattern in cells.items():
        assert all(re.fullmatch(pattern, v) for v in more[name][:-1]), (name, more[name])
        assert "cuda_graphs=True needs a CUDA GPU" in more[name][-1], (name, more[name])
    for name in ("--plan: predicted peak MiB", "--plan: predicted ms per step"):
        assert all(re.fullmatch(number, v) for v in more[name]), (name, more[name])


@LOADED
def test_bench_prints_every_measure_for_each_config(tmp_path, env):
    """The table's rows and their formats, a column per config; the numbers are the machine's business, not a test's."""
    train_args = " ".join([*SHRINK, "--log_interval=1", "--dataset=shakespeare_char"])
    other = tmp_path / "relu2.py"  # a second config, outside the repository
    other.write_text((REPO / "configs/shakespeare.py").read_text() + 'activation = "relu2"\n')
    run = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            f"--config=configs/shakespeare.py,{other}",
            "--runs=2",
            "--repeats=2",
            "--samples=2",
            "--sample_tokens=8",
            "--target_loss=10",
            "--budget=3600",
            f"--train_args={train_args}",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    table = [line for line in lines if line.startswith("| ")]  # the header, then the rows (the rule is "|---")
    assert lines[0].startswith("device: CPU") and table[0].split("|")[2:4] == [
        " configs/shakespeare.py median (min-max) ",
        f" {other} median (min-max) ",
    ]
    rows = {cells[1].strip(): [c.strip() for c in cells[2:-1]] for cells in (line.split("|") for line in table[1:])}
    number = r"[\d,.]+ \([\d,.]+-[\d,.]+\)"  # median (min-max)
    for name in ("training tokens/s (per progress line)", "seconds to val loss <= 10.0", "best val loss within 3600 s"):
        assert len(rows[name]) == 2 and all(re.fullmatch(number, value) for value in rows[name]), (name, rows[name])
    speedup = rows[next(k for k in rows if k.startswith("sampling speedup"))]
    assert len(speedup) == 2 and all(re.fullmatch(r"[\d.]+x \([\d.]+x-[\d.]+x\)", value) for value in speedup)


def test_bench_refuses_a_config_that_does_not_exist(tmp_path):
    run = subprocess.run(
        [sys.executable, str(BENCH), "--config=configs/shakespeare.py,configs/nope.py"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert run.returncode == 2 and run.stderr.strip() == (
        "bench.py: error: config configs/nope.py not found; pass --config=PATH[,PATH...] of train.py configs"
    )
