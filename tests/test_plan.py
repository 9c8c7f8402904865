"""
train.py --plan (plan.py): its traced figures against real runs of the same settings on this CPU: a process's
weights, gradients and optimizer state exactly as its closing memory line prints them, its measured peak within
PEAK_TOLERANCE, FSDP's shards rank by rank under torchrun; the KV cache against a cache filled by the model; and
bad input as one line.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import plan
from config import ConfigError, parse_config
from model import ModelConfig, build_model
from runtime import GPUS, peak_flops
from train import TrainConfig, cli, make_optimizers, micro_step, update_weights

REPO = Path(__file__).resolve().parent.parent
# the measured peak (the process's resident set, VmHWM) against the plan's, glibc's heap included (plan.HEAP_EXCESS):
# on SETTINGS identical runs peaked at 804 to 867 MiB against 830 predicted (-4% to +3%; docs/planning.md). Without
# the heap the plan said 685 MiB, 15% to 21% low; without the activations it would be about 50% low
PEAK_TOLERANCE = 0.10
# a model whose tensors, not the interpreter, make most of a process's peak (about 1 GB against 0.35)
SETTINGS = [
    "--dataset=shakespeare_char",
    "--n_layer=4",
    "--n_head=4",
    "--n_embd=256",
    "--block_size=256",
    "--batch_size=16",
    "--gradient_accumulation_steps=2",
    "--max_iters=2",
    "--eval_iters=1",
    "--eval_interval=1000",
    "--device=cpu",
    "--dtype=float32",
    "--compile=false",
    "--tensorboard=false",
]


def state_mib(trace):
    """A trace's weights, gradients and optimizer state as the memory line prints them (MiB, one decimal)."""
    return tuple(round(getattr(trace, k) / 2**20, 1) for k in ("weights", "gradients", "optimizer"))


def printed_state(log):
    """{rank: (weights, gradients, optimizer state, peak)} in MiB from a run's closing memory lines."""
    number = r"([\d.]+) MiB"
    pattern = rf"memory rank (\d+): weights {number}, gradients {number}, optimizer state {number}, peak {number}"
    return {int(m[1]): tuple(float(m[i]) for i in range(2, 6)) for m in re.finditer(pattern, log)}


@pytest.fixture
def env(shakespeare_char_dir):
    return {**os.environ, "NANOFORMER_DATA_DIR": str(shakespeare_char_dir.parent), "OMP_NUM_THREADS": "1"}


def plan_of(args, monkeypatch, env):
    monkeypatch.setenv("NANOFORMER_DATA_DIR", env["NANOFORMER_DATA_DIR"])
    return plan.make_plan(parse_config(TrainConfig, args), plan.TrainStep(make_optimizers, micro_step, update_weights))


def planned_mib(output, label):
    """The value (MiB) of a row of the plan's memory table, in its first column."""
    return float(re.search(rf"^{re.escape(label)} +([\d,.]+) MiB", output, re.M)[1].replace(",", ""))


def test_a_planned_step_matches_a_real_run(tmp_path, env):
    def train(*extra):
        command = [sys.executable, str(REPO / "train.py"), *SETTINGS, f"--out_dir={tmp_path}", *extra]
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        return run.stdout

    # the plan in a process of its own, as a user runs it: its interpreter and libraries are measured as the run's.
    # First, so that the run finds its data ready: a preparation's memory would count in its peak, not in the plan's
    output = train("--plan", "--plan_device=cpu")
    weights, gradients, optimizer, peak = printed_state(train())[0]
    assert [planned_mib(output, k) for k in ("weights", "gradients", "optimizer state")] == [
        weights,
        gradients,
        optimizer,
    ]
    # AdamW keeps two moments per weight (and a step count per tensor): the plan traced the optimizer's own state
    assert optimizer >= 2 * weights
    predicted = planned_mib(output, "peak, activation_checkpointing=False")
    assert abs(predicted - peak) <= PEAK_TOLERANCE * peak, (predicted, peak)
    # the activations are most of what the model adds: a plan that left them out would fail the line above
    assert planned_mib(output, "activations and temporaries at the peak") > 0.4 * (
        predicted - planned_mib(output, "interpreter and libraries (measured now)")
    )


def test_traced_flops_count_every_micro_batch_and_match_a_counted_step(monkeypatch, env):
    """
    A micro-batch's traced FLOPs are the same whether the step has one or two of them, and equal FlopCounterMode's
    count of a real forward and backward (the explicit step, on real tensors); the table says they are all ranks'.
    """
    from torch.utils.flop_counter import FlopCounterMode

    args = [*SETTINGS, "--n_layer=2", "--n_embd=64", "--block_size=64", "--batch_size=4", "--plan_device=cpu"]
    one, two = (plan_of([*args, f"--gradient_accumulation_steps={n}"], monkeypatch, env) for n in (1, 2))
    assert one.traces[0].micro_flops == two.traces[0].micro_flops > 0
    model = build_model(one.config)
    inputs, targets = one.task.example_batch(4, 64)
    with FlopCounterMode(display=False) as counter:
        one.task.loss(model, inputs, targets).backward()
    assert one.traces[0].micro_flops == counter.get_total_flops()


def test_traced_flops_lack_only_attention_s_scores_and_weighted_sum(monkeypatch, env):
    """
    Why the traced FLOPs sit below the model FLOPs: FlopCounterMode has no formula for the fused attention kernel a
    CPU trace runs, so they lack exactly the T x T scores and the weighted sum, 2 x T x T x C multiply-adds a layer
    and sequence (3 x 2 FLOPs each, forward and backward), which the model FLOPs count.
    """
    B, T, C, n_layer = 4, 64, 64, 2
    args = [*SETTINGS, f"--n_layer={n_layer}", f"--n_embd={C}", f"--block_size={T}", f"--batch_size={B}"]
    p = plan_of([*args, "--gradient_accumulation_steps=1", "--plan_device=cpu"], monkeypatch, env)
    with torch.device("meta"):
        model_flops = build_model(p.config).training_flops(*p.task.example_batch(B, T)[0])
    assert p.traces[0].micro_flops == model_flops - 6 * n_layer * B * 2 * T * T * C


def test_only_a_cpu_plan_counts_glibc_s_heap(monkeypatch, env):
    """The heap glibc keeps is a CPU's: a GPU's plan counts none, and its memory table is as it was."""
    args = [*SETTINGS, "--n_layer=2", "--n_embd=64", "--block_size=64", "--batch_size=4"]
    cpu, gpu = (plan_of([*args, f"--plan_device={d}"], monkeypatch, env) for d in ("cpu", "H100"))
    assert cpu.traces[0].heap > 0 and cpu.traces[0].peak > cpu.traces[0].heap
    assert gpu.traces[0].heap == 0
    assert "glibc" not in " ".join(label for label, _ in plan.memory_rows(gpu))


def test_fsdp_shards_rank_by_rank_match_torchrun(tmp_path, env, monkeypatch):
    args = [*SETTINGS, "--n_layer=2", "--n_embd=64", "--block_size=64", "--fsdp=true"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    run = subprocess.run(
        [*command, str(REPO / "train.py"), *args, f"--out_dir={tmp_path}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    measured = printed_state(run.stdout)
    sharded = plan_of([*args, "--plan_device=cpu", "--plan_ranks=2"], monkeypatch, env)
    whole = plan_of([*args, "--plan_device=cpu"], monkeypatch, env).traces[0]
    # 65 characters do not split evenly over 2 ranks: rank 1 holds one embedding row fewer, and its own column
    assert [list(g) for g in sharded.groups] == [[0], [1]]
    for group, trace in zip(sharded.groups, sharded.traces):
        assert state_mib(trace) == measured[group[0]][:3]
    for key in ("weights", "gradients", "optimizer"):
        # each rank holds its shards only: together, the unsharded model's bytes, each about half
        shards = [getattr(t, key) for t in sharded.traces]
        assert abs(shards[0] - shards[1]) <= 2 * 4 * 64 * 3  # a row of the embedding (and its two moments)
        if key != "optimizer":  # AdamW's step counts are one per tensor on every rank
            assert sum(shards) == getattr(whole, key)


def test_kv_cache_is_what_decoding_block_size_positions_holds():
    for config in (
        ModelConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=24, vocab_size=50),
        ModelConfig(n_layer=2, n_head=4, n_embd=32, block_size=24, vocab_size=50, window_size=8),
        ModelConfig(arch="encoder_decoder", n_layer=2, n_head=4, n_embd=32, block_size=24, vocab_size=50),
    ):
        model = build_model(config).eval()
        cache = model.new_cache()
        idx = torch.randint(50, (1, config.block_size))
        with torch.no_grad():
            if config.arch == "encoder_decoder":  # a block_size source, then the decoder a token at a time
                memory, src_mask = model.encode(idx)
                for t in range(config.block_size):
                    model.decode(idx[:, t : t + 1], memory, src_mask, cache=cache)
            else:
                for t in range(config.block_size):
                    model.body(idx[:, t : t + 1], cache=cache)
        # the memory behind the cached tensors, each storage once: a sliding window's are views of what it holds,
        # cross-attention's keys and values views of one projection
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage() for pair in cache for c in pair if c for t in (c.k, c.v)
        }
        held = sum(s.nbytes() for s in storages.values())
        assert config.kv_cache_bytes(torch.float32) == held


def test_every_planned_gpu_has_its_peak_and_is_found_however_spelled():
    for gpu in GPUS:
        assert peak_flops(gpu.name) is not None and plan.find_target(gpu.name.lower(), 0.0, 1).name == gpu.name
    target = plan.find_target("nvidia h100-pcie", 0.0, 1)
    assert (target.name, target.memory, target.flops) == ("H100 PCIe", 80 * 2**30, 756e12)
    # MFU measured on an H100 SXM (tools/bench.py --parts=gpu): the PCIe card, not measured, is timed at that figure
    assert (target.mfu, target.mfu_source) == (0.40, "the H100's: none measured on this GPU")
    # the name CUDA gives an H100 SXM (plan_device=auto on one) is the measured one's
    measured = plan.gpu_target("NVIDIA H100 80GB HBM3", 80 * 2**30, 989e12, 0.0)
    assert (measured.mfu, measured.mfu_source) == (0.40, "measured on an H100")
    assert plan.gpu_target("NVIDIA H100 80GB HBM3", 80 * 2**30, 989e12, 0.3).mfu == 0.3  # --plan_mfu wins


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--plan_device=H900"],
            "plan_device='H900' is not a device plans know; use cpu or one of H100 PCIe, H100 NVL,",
        ),
        (["--plan_ranks=3", "--gradient_accumulation_steps=4"], "does not divide among 3 ranks"),
        (["--plan_ranks=0"], "plan_ranks must be at least 1"),
        (["--plan_device=T4", "--dtype=bfloat16"], "T4 has no native bfloat16"),
        (
            ["--plan_device=H100", "--compile=true", "--cuda_graphs=true"],
            "cuda_graphs=True replays one micro-batch per rank a step, not 2",
        ),
        (
            ["--plan_device=H100", "--compile=true", "--cuda_graphs=true", "--plan_ranks=2", "--fsdp=true"],
            "cuda_graphs=True does not replay FSDP's sharded steps",
        ),
    ],
)
def test_bad_plan_input_is_one_line(tmp_path, env, monkeypatch, capsys, args, message):
    monkeypatch.setenv("NANOFORMER_DATA_DIR", env["NANOFORMER_DATA_DIR"])
    out_dir = tmp_path / "out"
    assert cli([*SETTINGS, f"--out_dir={out_dir}", "--plan", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not out_dir.exists()


def test_a_chat_fine_tune_is_planned_from_its_folder_alone(llama_dir, monkeypatch, env):
    args = [
        str(REPO / "configs" / "chat_llama.py"),
        f"--init_from={llama_dir}",
        f"--data_options={{'tokenizer': '{llama_dir}'}}",
        "--block_size=64",
        "--batch_size=2",
        "--plan_device=cpu",
    ]
    with pytest.raises(ConfigError, match="plan with --lora_rank=0"):
        plan_of(args, monkeypatch, env)
    trace = plan_of([*args, "--lora_rank=0"], monkeypatch, env).traces[0]
    # the folder's config.json alone: 2 blocks of qkv (32 -> 64: 4 query heads and 2 key/value heads of 8), proj
    # (32 x 32), SwiGLU's fc, up (32 -> 64) and proj (64 -> 32), 2 RMSNorm gains of 32; the final norm; the embedding
    # and the untied head, of the tokenizer's ids and the built-in template's 4 markers (the folder has no template)
    config = hf_config(llama_dir)
    assert not config.get("tie_word_embeddings") and "chat_template" not in config
    params = 2 * (32 * 64 + 32 * 32 + 3 * 32 * 64 + 2 * 32) + 32 + 2 * (config["vocab_size"] + 4) * 32
    assert trace.weights == trace.gradients == 4 * params


def hf_config(folder):
    return json.loads((Path(folder) / "config.json").read_text())


# -----------------------------------------------------------------------------
# The peak FLOPS a plan and a run's MFU divide by (runtime.peak_flops)

# Dense bf16 tensor-core peaks (float32 accumulation, what training runs) in TFLOPS, from the vendors' documents as
# quoted beside each. Figures marked * there are with 2:4 sparsity, twice the dense rate: halved here.
# PEAK_FLOPS keeps whole TFLOPS where a sheet has more digits (989 for 1,979* / 2, 362 for 362.05), at most 0.07% off:
# 0.1% lets that through, and no mix-up of variant (SXM, PCIe and NVL are 10% or more apart), sparsity or accumulation
# (2x) would pass.
ROUNDED_TO_WHOLE_TFLOPS = 1e-3
DATASHEET_TFLOPS = {
    # NVIDIA H100 Tensor Core GPU datasheet, BFLOAT16 Tensor Core: H100 SXM 1,979 teraFLOPS*, H100 PCIe 1,513*
    # (2022 edition, SXM beside PCIe), H100 NVL 1,671* (2023 edition, SXM beside NVL)
    "NVIDIA H100 80GB HBM3": 1979 / 2,  # the SXM5 board
    "NVIDIA H100 PCIe": 1513 / 2,
    "NVIDIA H100 NVL": 1671 / 2,
    # NVIDIA H200 Tensor Core GPU datasheet, BFLOAT16 Tensor Core: H200 SXM 1,979 TFLOPS*, H200 NVL 1,671*
    "NVIDIA H200": 1979 / 2,
    "NVIDIA H200 NVL": 1671 / 2,
    # NVIDIA GH200 Grace Hopper Superchip datasheet: FP16/BF16 Tensor Core 1,979 TFLOPS* (its GPU is the H100 SXM's)
    "NVIDIA GH200 480GB": 1979 / 2,
    # NVIDIA A100 Tensor Core GPU datasheet: BFLOAT16 Tensor Core 312 TFLOPS | 624 TFLOPS*, for 40GB and 80GB, PCIe
    # and SXM alike
    "NVIDIA A100-SXM4-40GB": 312,
    "NVIDIA A100-SXM4-80GB": 312,
    "NVIDIA A100-PCIE-40GB": 312,
    "NVIDIA A100 80GB PCIe": 312,
    # NVIDIA A10 Tensor Core GPU datasheet: BFLOAT16 Tensor Core 125 TF | 250 TF*
    "NVIDIA A10": 125,
    # NVIDIA L40S datasheet: BF16 Tensor Core 362.05 | 733* TFLOPS; NVIDIA L40 datasheet: BFLOAT16 Tensor Core
    # 181.05 | 362.1*
    "NVIDIA L40S": 362.05,
    "NVIDIA L40": 181.05,
    # NVIDIA L4 Tensor Core GPU datasheet: BFLOAT16 Tensor Core 242 teraFLOPS*
    "NVIDIA L4": 242 / 2,
    # float16 for Volta and Turing, which have no bf16. NVIDIA Tesla V100 datasheet: Tensor Performance, V100 SXM2
    # 125 TFLOPS, V100 PCIe 112; NVIDIA V100S datasheet: Tensor Performance 130; NVIDIA T4 datasheet: Mixed Precision
    # (FP16/FP32) 65 TFLOPS. None of them has sparsity.
    "Tesla V100-SXM2-16GB": 125,
    "Tesla V100-PCIE-32GB": 112,
    "Tesla V100S-PCIE-32GB": 130,
    "Tesla T4": 65,
    # NVIDIA Ada Lovelace GPU Architecture whitepaper, appendix A, GeForce RTX 4090: Peak BF16 Tensor TFLOPS with
    # FP32 Accumulate 165.2 (330.4 with sparsity). NVIDIA Ampere GA102 GPU Architecture whitepaper, appendix A,
    # GeForce RTX 3090: Peak BF16 Tensor TFLOPS with FP32 Accumulate 71 (142 with sparsity)
    "NVIDIA GeForce RTX 4090": 165.2,
    "NVIDIA GeForce RTX 3090": 71,
    # No vendor figure: NVIDIA publishes no datasheet for the A10G (AWS's variant of the A10) and AWS gives no tensor
    # TFLOPS for it. 70 is the figure third-party comparisons quote; unverified.
    "NVIDIA A10G": 70,
}


@pytest.mark.parametrize("name", list(DATASHEET_TFLOPS))  # names as torch.cuda.get_device_name returns them
def test_peak_flops_of_real_device_names(name):
    assert peak_flops(name) == pytest.approx(DATASHEET_TFLOPS[name] * 1e12, rel=ROUNDED_TO_WHOLE_TFLOPS)


@pytest.mark.parametrize("name", ["NVIDIA GeForce RTX 4080", "AMD Instinct MI300X", "Some Unknown Accelerator"])
def test_no_peak_flops_for_devices_not_in_the_table(name):
    assert peak_flops(name) is None


# Streaming multiprocessors (SMs) of the whole GPUs: NVIDIA H100 Tensor Core GPU Architecture whitepaper, H100 SXM5
# 132 (the H200 and GH200 have the same GH100 GPU); NVIDIA A100 Tensor Core GPU Architecture whitepaper, A100 108.
H100_SMS, A100_SMS = 132, 108


@pytest.mark.parametrize(
    "name,multiprocessors,peak",
    [  # MIG slices as torch.cuda.get_device_name names them, with their SMs as nvidia-smi mig -lgip lists them
        # (NVIDIA's MIG User Guide, "List GPU Instance Profiles"). A slice's peak is the whole GPU's times its share
        # of the SMs. The guide's "Fraction of SMs" (1/7 for a 1g profile) is nominal: of the SMs that MIG mode
        # uses, 98 of an A100's 108 (7 x 14), 7 x 16 = 112 of an H100's 132 for seven 1g.10gb slices.
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", 16, 1979 / 2 * 16 / H100_SMS),
        ("NVIDIA H100 80GB HBM3 MIG 1g.20gb", 26, 1979 / 2 * 26 / H100_SMS),
        ("NVIDIA H100 80GB HBM3 MIG 3g.40gb", 60, 1979 / 2 * 60 / H100_SMS),
        ("NVIDIA H100 80GB HBM3 MIG 7g.80gb", 132, 1979 / 2),  # every SM
        ("NVIDIA H200 MIG 1g.18gb", 16, 1979 / 2 * 16 / H100_SMS),
        ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", 14, 312 * 14 / A100_SMS),
        ("NVIDIA A100-SXM4-40GB MIG 3g.20gb", 42, 312 * 42 / A100_SMS),
        ("NVIDIA A100-SXM4-40GB MIG 7g.40gb", 98, 312 * 98 / A100_SMS),  # "7/7" in the guide, yet 10 SMs idle
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", None, None),  # a slice's share unknown: no peak rather than the GPU's
        ("NVIDIA A30 MIG 1g.6gb", 14, None),  # not in the table
        ("NVIDIA H100 80GB HBM3", 132, 1979 / 2),  # a whole GPU: its peak, whatever the count
    ],
)
def test_peak_flops_of_mig_slices(name, multiprocessors, peak):
    expected = None if peak is None else pytest.approx(peak * 1e12, rel=ROUNDED_TO_WHOLE_TFLOPS)
    assert peak_flops(name, multiprocessors) == expected
