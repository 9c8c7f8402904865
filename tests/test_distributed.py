"""train.py on several ranks: DDP and FSDP under torchrun (two processes, gloo on the CPU, nccl on GPUs) against
one process, sharded checkpoints, and ranks that fail, stop or wait."""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny_run import REPO, REVERSE, TINY, ckpt_weights, free_port, tiny, torchrun_script

import log
import train
from checkpoint import kept_weights, load_checkpoint
from config import ConfigError, parse_config
from model import build_model
from runtime import Runtime, split_accumulation
from train import TrainConfig, cli, main


def torchrun(args, env, timeout=300):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(REPO / "train.py"),
            *args,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def tensorboard_scalars(folder, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)}


def root_cause(stderr):
    """The block torchrun prints last when a rank fails (its summary of the first failure), without its border."""
    head, _, block = stderr.rpartition("Root Cause (first observed failure):\n")
    *lines, border = block.rstrip().splitlines()
    assert head and set(border) == {"="}  # nothing printed after the summary
    return "\n".join(lines) + "\n"


# -----------------------------------------------------------------------------
# DDP


# the model options of the modern recipe, all at once: under DDP they must change nothing about the equality
MODERN = {
    "n_kv_head": 1,
    "qk_norm": True,
    "activation": "relu2",
    "logit_softcap": 30.0,
    "zero_init_proj": True,
    "pos_encoding": "rope",
    "window_size": 5,
    "tie_embeddings": False,
    "activation_checkpointing": True,
}


@pytest.mark.parametrize(
    "device, optimizer, options",
    [
        ("cpu", "adamw", {}),
        ("cpu", "muon", MODERN),
        pytest.param(
            "cuda",
            "adamw",
            {},
            marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (nccl)"),
        ),
    ],
)
def test_ddp_matches_one_process_with_the_same_global_batch(tmp_path, data_root, env, device, optimizer, options):
    """
    Masked LM: micro-batches hold different numbers of targets, so the global token mean is really exercised.
    With a weight average, which must start from the weights DDP gives every rank (rank 1 draws others at init).
    """
    settings = dict(
        arch="encoder",
        batch_size=4,
        gradient_accumulation_steps=4,
        max_iters=4,
        eval_interval=4,
        eval_iters=3,
        log_interval=1,
        warmup_iters=1,
        dropout=0.0,
        ema_decay=0.5,
        device=device,
        optimizer=optimizer,
        **options,
    )
    tolerance = 1e-5 if device == "cpu" else 1e-3  # TF32 matmuls and reduction order on GPUs
    # Newton-Schulz's matrix powers amplify the reduction order's last-bit differences: on this tiny model Muon's
    # matrices differ by up to ~4e-3 after 4 steps between two single-process runs with different thread counts
    weight_atol = 1e-2 if optimizer == "muon" else tolerance / 10
    if optimizer == "muon":
        tolerance *= 10
    single = main(tiny(data_root, tmp_path / "single", **settings))
    args = [f"--{k}={v}" for k, v in {**TINY, **settings}.items()] + [
        "--dataset=shakespeare_char",
        "--tensorboard=true",
        f"--out_dir={tmp_path / 'ddp'}",
    ]
    run = torchrun(args, env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "2 rank(s)" in run.stdout and "4 x 2 micro-batches x 2 rank(s)" in run.stdout
    assert "FutureWarning" not in run.stderr, run.stderr[-3000:]  # DDP built with the current options
    ddp_losses = tensorboard_scalars(tmp_path / "ddp", "train/loss")
    assert sorted(ddp_losses) == [1, 2, 3, 4]
    single_losses = [single["losses"][i] for i in range(1, 5)]
    assert [ddp_losses[i] for i in range(1, 5)] == pytest.approx(single_losses, rel=tolerance)
    ddp_val = tensorboard_scalars(tmp_path / "ddp", "eval/val")
    assert [ddp_val[0], ddp_val[4]] == pytest.approx([e["val"] for e in single["evals"]], rel=tolerance)
    for key in ("weights", "average"):
        a, b = ckpt_weights(tmp_path / "single" / "ckpt.pt", key), ckpt_weights(tmp_path / "ddp" / "ckpt.pt", key)
        assert a.keys() == b.keys()  # no "module." prefix
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=100 * tolerance, atol=weight_atol)


def test_fewer_accumulation_steps_than_ranks_give_each_rank_one_micro_batch(tmp_path, data_root, env):
    """The quick-start config's 1 step on 2 ranks works: the same losses as one process accumulating 2."""
    assert split_accumulation(1, 2) == 1 and split_accumulation(3, 8) == 1
    settings = dict(max_iters=3, log_interval=1, warmup_iters=1)
    single = main(tiny(data_root, tmp_path / "single", gradient_accumulation_steps=2, **settings))
    args = [f"--{k}={v}" for k, v in {**TINY, **settings}.items()] + [
        "--dataset=shakespeare_char",
        "--tensorboard=true",
        f"--out_dir={tmp_path / 'ddp'}",
    ]
    assert "--gradient_accumulation_steps=1" in args
    run = torchrun(args, env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "16 sequences per step (8 x 1 micro-batches x 2 rank(s))" in run.stdout
    assert "each rank runs one micro-batch" in run.stdout
    ddp_losses = tensorboard_scalars(tmp_path / "ddp", "train/loss")
    assert [ddp_losses[i] for i in (1, 2, 3)] == pytest.approx([single["losses"][i] for i in (1, 2, 3)], rel=1e-5)


def test_ddp_indivisible_accumulation_fails_fast_on_every_rank(tmp_path, data_root, env, monkeypatch, capsys):
    args = [f"--{k}={v}" for k, v in TINY.items()]
    args += [
        "--dataset=shakespeare_char",
        f"--data_dir={data_root}",
        "--gradient_accumulation_steps=3",
        f"--out_dir={tmp_path}",
    ]
    message = "gradient_accumulation_steps=3 does not divide among 2 ranks"
    run = torchrun(args, env, timeout=120)
    # the ranks fail alike, and the error shows once: rank 0's, before the other rank's grace is over
    assert run.returncode != 0 and run.stderr.count(message) == 1
    # each rank finds the error by itself, before any collective (so none waits for the other), and would say so
    # if it were the only one: rank by rank
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(log, "ERROR_GRACE", 0.0)
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", rank)
        assert cli(args) == 2
        assert capsys.readouterr().err.count(message) == 1
    assert not tmp_path.joinpath("ckpt.pt").exists()


def test_an_error_of_one_rank_alone_shows_under_torchrun(tmp_path, env):
    """
    torchrun ends every rank once one exits: an error that only rank 1 meets must be printed by rank 1 (after its
    grace), not lost with rank 0's silence. Rank 1 alone fails here, at its start.
    """
    script = "import os, sys, train\n"
    script += "if os.environ['RANK'] == '1':\n    sys.exit(train.fail('rank 1 alone cannot go on', 2))\n"
    script += "import time\ntime.sleep(60)\n"  # rank 0 would go on: torchrun ends it when rank 1 exits
    run = torchrun_script(script, tmp_path, env)
    assert run.returncode != 0 and run.stderr.count("train.py: error: rank 1 alone cannot go on") == 1
    assert "traceback : train.py: error: rank 1 alone cannot go on" in root_cause(run.stderr)


def test_the_default_run_needs_its_data_prepared_and_says_how_once(tmp_path, env):
    """
    torchrun train.py with no config: the defaults are GPT-2 124M on OpenWebText, which is not prepared here. One
    line, once for the two ranks, saying how to prepare it (a download of hours is never started by accident).
    """
    run = torchrun([], {**env, "NANOFORMER_DATA_DIR": str(tmp_path / "data")}, timeout=120)
    assert run.returncode != 0
    lines = [line for line in run.stderr.splitlines() if "train.py: error:" in line]
    assert len(lines) == 1 and "python prepare_data.py openwebtext" in lines[0] and "configs/shakespeare.py" in lines[0]
    assert "  rank      : 0 (local_rank: 0)\n" in root_cause(run.stderr) and lines[0] in root_cause(run.stderr)
    assert not (tmp_path / "data").exists()


def test_the_default_run_trains_configs_gpt2_model_when_its_data_is_prepared(tmp_path, data_root, env):
    """
    The same command with OpenWebText prepared (a stand-in: the session's characters under its name) trains the
    model of configs/gpt2.py on both ranks: one step of 2 micro-batches of 1 x 32 positions, to keep it short.
    """
    data = tmp_path / "data"
    data.mkdir()
    shutil.copytree(Path(data_root) / "shakespeare_char", data / "openwebtext")
    small = ["--block_size=32", "--batch_size=1", "--gradient_accumulation_steps=2", "--max_iters=1", "--eval_iters=1"]
    run = torchrun([*small, f"--out_dir={tmp_path / 'out'}"], {**env, "NANOFORMER_DATA_DIR": str(data)}, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    gpt2 = parse_config(TrainConfig, [str(REPO / "configs" / "gpt2.py"), *small]).model_config(65)
    expected = build_model(gpt2).num_params()
    assert f"gpt on openwebtext: {expected:,} parameters" in run.stdout
    assert load_checkpoint(tmp_path / "out" / "ckpt.pt")["iter_num"] == 1


def test_a_cuda_rank_makes_its_gpu_current_before_anything_else(tmp_path, data_root, monkeypatch):
    """Even alone (--device=cuda:3): else CUDA's first use would open a context on GPU 0."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(torch, "set_float32_matmul_precision", lambda p: calls.append(("matmul precision", p)))
    rt = Runtime(device=torch.device("cuda", 3))
    with contextlib.ExitStack() as stack:
        train.join_processes(tiny(data_root, tmp_path), rt, stack)
    assert calls == [("set_device", torch.device("cuda", 3)), ("matmul precision", "high")]


# -----------------------------------------------------------------------------
# Ranks that fail, stop or wait


def child_processes(pid):
    """Linux: the ids of the processes whose parent is pid."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # "pid (name) state ppid ..."
        except (OSError, IndexError):
            continue  # the process ended meanwhile
        if parent == pid:
            children.append(int(stat.parent.name))
    return children


def running(pid):
    """Linux: whether process pid is alive, neither ended nor a zombie that its parent has yet to reap."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds torchrun's workers through /proc")
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["dead", "stopped"])
def test_a_dead_or_stopped_rank_ends_the_job_instead_of_hanging(tmp_path, env, how):
    """
    A dead rank (SIGKILL) is seen by torchrun; a hung one (SIGSTOP) must not hold the others in any collective
    past dist_timeout. Once the healthy rank has left, the test kills the stopped one itself: torchrun would give it
    30 s to answer a SIGTERM that it cannot (torch 2.13's agent ignores --shutdown-timeout when a worker fails).
    """
    args = [f"--{k}={v}" for k, v in TINY.items()] + [
        "--dataset=shakespeare_char",
        "--max_iters=100000",
        "--gradient_accumulation_steps=2",
        "--log_interval=1",
        "--dist_timeout=10",
        f"--out_dir={tmp_path}",
    ]
    torchrun_args = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(REPO / "train.py")]
    process = subprocess.Popen(
        [sys.executable, *torchrun_args, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    workers = []
    try:
        for line in process.stdout:
            if line.startswith("iter 3/"):
                break
        workers = child_processes(process.pid)
        assert len(workers) == 2
        os.kill(workers[-1], how)
        for _ in range(600):  # a hang would end here, as a failure after 60 s; dist_timeout is 10
            if not running(workers[0]):
                break
            time.sleep(0.1)
        assert not running(workers[0]), "the healthy rank still waits for the stopped one"
        with contextlib.suppress(ProcessLookupError):  # the dead one is gone already
            os.kill(workers[-1], signal.SIGKILL)
        process.communicate(timeout=60)
    finally:
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.kill()
    assert process.returncode not in (0, None)


SLOW_PREPARE = """
import sys, time
import recipes, train
real_prepare = recipes.prepare
def prepare(*args, **kwargs):
    time.sleep(6)  # twice --dist_timeout, as preparing OpenWebText is to the default 900 s
    return real_prepare(*args, **kwargs)
recipes.prepare = prepare
sys.exit(train.cli(sys.argv[1:]))
"""


def test_a_dataset_prepared_inside_torchrun_outlasts_dist_timeout(tmp_path, env):
    """Rank 1 waits while rank 0 prepares for longer than dist_timeout: the run goes on, it does not time out."""
    args = [f"--{k}={v}" for k, v in TINY.items()] + [
        "--dataset=shakespeare_char",
        f"--data_dir={tmp_path / 'data'}",  # not prepared yet
        "--dist_timeout=3",
        "--max_iters=1",
        f"--out_dir={tmp_path / 'out'}",
    ]
    run = torchrun_script(SLOW_PREPARE, tmp_path, env, *args)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "preparing it" in run.stdout and "done at iteration 1" in run.stdout


def test_a_rank_failing_to_prepare_the_data_stops_every_rank_at_once(tmp_path, env):
    """Ranks started by hand, as on two nodes: rank 0 cannot prepare the data, rank 1 must not wait for it."""
    args = [f"--{k}={v}" for k, v in TINY.items()] + [
        "--dataset=text",
        "--data_options={'input': '/no/such/corpus.txt', 'name': 'corpus'}",
        f"--data_dir={tmp_path / 'data'}",
        f"--out_dir={tmp_path / 'out'}",
        "--dist_timeout=600",
        "--gradient_accumulation_steps=2",
    ]
    port = str(free_port())
    ranks = [
        subprocess.Popen(
            [sys.executable, str(REPO / "train.py"), *args],
            stderr=subprocess.PIPE,
            text=True,
            env={
                **env,
                "RANK": str(r),
                "LOCAL_RANK": "0",
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            },
        )
        for r in range(2)
    ]
    try:
        errors = [rank.communicate(timeout=60)[1].strip() for rank in ranks]  # not dist_timeout
    finally:
        for rank in ranks:
            rank.kill()
    # both stop with the error and say so (started by hand, as on two nodes, each on its own console; rank 1 after
    # its grace, which under torchrun would have ended it once rank 0 had)
    assert [rank.returncode for rank in ranks] == [2, 2]
    assert len(errors[0].splitlines()) == 1 and "/no/such/corpus.txt" in errors[0] and errors[1] == errors[0]


# -----------------------------------------------------------------------------
# FSDP (torchrun, two processes, gloo on the CPU): sharded weights, gradients, optimizer state and checkpoints


def cli_args(settings, out_dir):
    """train.py's command line for TINY + settings, writing into out_dir with TensorBoard on."""
    settings = {**TINY, "dataset": "shakespeare_char", "tensorboard": True, **settings, "out_dir": out_dir}
    return [f"--{k}={v}" for k, v in settings.items()]


# a step of two micro-batches per rank and a gradient norm (0.6-1.1 on these models) that clipping at 0.5 cuts
FSDP_RUN = dict(
    batch_size=4,
    gradient_accumulation_steps=4,
    grad_clip=0.5,
    max_iters=20,
    eval_interval=10,
    eval_iters=3,
    log_interval=1,
    dropout=0.0,
)


@pytest.mark.parametrize(
    "options",
    [
        # weight average and activation checkpointing, both running on the sharded model
        {"arch": "gpt", "ema_decay": 0.9, "activation_checkpointing": True},
        # untied head, grouped-query attention, rotary, RMSNorm, SwiGLU: parameters of every shape and kind sharded;
        # torch.compile of the sharded model
        {
            "arch": "encoder",
            "tie_embeddings": False,
            "n_kv_head": 1,
            "pos_encoding": "rope",
            "norm": "rmsnorm",
            "activation": "swiglu",
            "qk_norm": True,
            "compile": True,
        },
        # shared source/target embedding, exact match decoded on rank 0 with the gathered weights
        {
            "arch": "encoder_decoder",
            "dataset": "reverse",
            "data_options": REVERSE,
            "share_embeddings": True,
            "eval_accuracy_examples": 8,
        },
    ],
)
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")  # from inside torch.compile
def test_fsdp_matches_one_process_with_the_same_global_batch(tmp_path, data_root, env, options, capsys):
    """
    20 steps with accumulation and clipping: the same losses, evaluations and best weights as one process. The
    compiled one-process run (Inductor's C++ kernels) compiles without a fallback and saves its weights unwrapped.
    """
    settings = {**FSDP_RUN, **options}
    single = main(tiny(data_root, tmp_path / "single", **settings))
    assert "torch.compile failed" not in capsys.readouterr().out
    run = torchrun(cli_args({**settings, "fsdp": True}, tmp_path / "fsdp"), env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "(4 x 2 micro-batches x 2 rank(s))" in run.stdout
    losses = tensorboard_scalars(tmp_path / "fsdp", "train/loss")
    assert [losses[i] for i in range(1, 21)] == pytest.approx([single["losses"][i] for i in range(1, 21)], rel=1e-5)
    for name in ("val", "train") + (("accuracy",) if options["arch"] == "encoder_decoder" else ()):
        evals = tensorboard_scalars(tmp_path / "fsdp", f"eval/{name}")
        assert [evals[i] for i in (0, 10, 20)] == pytest.approx([e[name] for e in single["evals"]], rel=1e-5)
    # best.pt: one file, gathered on rank 0, the same weights (the average, with ema_decay) with the same keys
    ours, theirs = load_checkpoint(tmp_path / "fsdp" / "best.pt"), load_checkpoint(tmp_path / "single" / "best.pt")
    ours, theirs = kept_weights(ours), kept_weights(theirs)
    assert ours.keys() == theirs.keys()
    assert not any(k.startswith(("_orig_mod.", "module.")) for k in theirs)
    # Adam divides by the gradient's running size: where that is tiny, last-bit differences in the reductions (each
    # micro-batch reduce-scattered, then added up, against one sum) grow to ~1.5e-5 after 20 steps of lr 3e-3
    for k in theirs:
        torch.testing.assert_close(ours[k], theirs[k], rtol=1e-3, atol=3e-5)
    # ckpt.pt: a folder of both ranks' shards, read whole into one process
    folder = tmp_path / "fsdp" / "ckpt.pt"
    assert folder.is_dir() and {p.name for p in folder.glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    whole, plain = load_checkpoint(folder), load_checkpoint(tmp_path / "single" / "ckpt.pt")
    assert whole["iter_num"] == 20 and kept_weights(whole).keys() == kept_weights(plain).keys()
    for k in kept_weights(plain):
        torch.testing.assert_close(kept_weights(whole)[k], kept_weights(plain)[k], rtol=1e-3, atol=3e-5)


FSDP_HELD_GRADIENTS = """
import os, sys, torch, torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
import runtime, train
from model import ModelConfig, build_model
dist.init_process_group("gloo")
rt = runtime.Runtime(rank=dist.get_rank(), world_size=2, fsdp=True)
with torch.device("meta"):
    model = build_model(ModelConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
runtime.shard_model(model, rt, seed=0)
models = runtime.Models(raw=model, step=model)
x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rt.rank))
with runtime.gradient_sync(models, enabled=False):  # a micro-batch before the step's last
    model(x, x)[1].backward()
held = 0  # bytes of whole (unsharded) gradients FSDP keeps on this rank until the step's last micro-batch
for module in model.modules():
    group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
    for param in group.fsdp_params if group else []:
        for grad in (getattr(param, "_unsharded_param", None), param.unsharded_accumulated_grad):
            grad = grad.grad if isinstance(grad, torch.nn.Parameter) else grad
            held += 0 if grad is None else grad.numel() * grad.element_size()
whole = sum(p.numel() for p in model.parameters()) * 4
with open(f"{sys.argv[1]}/rank{rt.rank}.txt", "w") as f:
    f.write(f"{held} {whole}")
dist.barrier()  # as train.main ends: gloo's workers release the last collective's tensors before the teardown
dist.destroy_process_group()
# the results are written: leave without the interpreter's teardown, in which gloo's threads aborted one CI run in
# three here ("terminate called without an active exception")
os._exit(0)
"""


def test_fsdp_accumulation_holds_only_gradient_shards(tmp_path, env):
    """After a micro-batch that is not the step's last: no whole gradient (whole: their bytes, were they held)."""
    run = torchrun_script(FSDP_HELD_GRADIENTS, tmp_path, env, str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in range(2):
        held, whole = map(int, (tmp_path / f"rank{rank}.txt").read_text().split())
        assert held == 0 < whole


def killing_train(folder):
    """
    A train.py that SIGKILLs itself (rank 0) in the middle of its first sharded save: every rank's shards are
    written, state.pt is being written, nothing is renamed yet.
    """
    script = folder / "train_killed.py"
    script.write_text(
        f"import os, signal, sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "import checkpoint, train\n"
        "write = checkpoint.write_file\n"
        "def write_file(state, path):\n"
        "    write(state, path)\n"
        "    if path.name == checkpoint.STATE_FILE:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "checkpoint.write_file = write_file\n"
        "sys.exit(train.cli(sys.argv[1:]))\n"
    )
    return script


def test_a_sharded_checkpoint_resumes_on_one_or_two_ranks_and_outlives_a_kill(tmp_path, data_root, env):
    """
    Saved by 2 FSDP ranks at iteration 10 (with a weight average, saved beside the weights), resumed in one
    process, on 2 DDP ranks and on 2 FSDP ranks: the losses of iterations 11-20 are those of an uninterrupted run.
    The FSDP resume is killed in its first save (iteration 15) and resumed again: from iteration 10, as if nothing
    had happened.
    A single-file ckpt.pt (a run without fsdp) also resumes under FSDP, its optimizer state sharded.
    """
    settings = {**FSDP_RUN, "eval_interval": 5, "ema_decay": 0.9}
    # the reference: one process, 10 steps, then 10 more from its single-file checkpoint (exact, tested above)
    single = main(tiny(data_root, tmp_path / "single", **{**settings, "max_iters": 10}))
    shutil.copytree(tmp_path / "single", tmp_path / "from_file")
    single["losses"].update(main(tiny(data_root, tmp_path / "single", **settings, init_from="resume"))["losses"])
    expected = [single["losses"][i] for i in range(11, 21)]

    run = torchrun(cli_args({**settings, "max_iters": 10, "fsdp": True}, tmp_path / "a"), env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "a" / "ckpt.pt").is_dir()
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.copytree(tmp_path / "a", tmp_path / "ddp")
    # under DDP: every rank reads every part (whole tensors), together
    run = torchrun(cli_args({**settings, "init_from": "resume"}, tmp_path / "ddp"), env)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = tensorboard_scalars(tmp_path / "ddp", "train/loss")
    assert [losses[i] for i in range(11, 21)] == pytest.approx(expected, rel=1e-5)
    # in one process: weights, optimizer state and average read whole from both ranks' shards
    one = main(tiny(data_root, tmp_path / "a", **settings, init_from="resume"))
    assert [one["losses"][i] for i in range(11, 21)] == pytest.approx(expected, rel=1e-5)
    assert (tmp_path / "a" / "ckpt.pt").is_file()  # a run without fsdp writes the single file again

    resume = cli_args({**settings, "fsdp": True, "init_from": "resume"}, tmp_path / "b")
    killed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        + [str(killing_train(tmp_path)), *resume],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode != 0 and "saved ckpt.pt" not in killed.stdout
    assert (tmp_path / "b" / ".ckpt.pt.new").is_dir()  # the new checkpoint, complete but for its rename
    assert load_checkpoint(tmp_path / "b" / "ckpt.pt", weights=False)["iter_num"] == 10  # the previous, intact
    run = torchrun(resume, env)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = tensorboard_scalars(tmp_path / "b", "train/loss")
    assert [losses[i] for i in range(11, 21)] == pytest.approx(expected, rel=1e-5)
    assert not (tmp_path / "b" / ".ckpt.pt.new").exists()  # the next save cleared what the kill left

    run = torchrun(cli_args({**settings, "fsdp": True, "init_from": "resume"}, tmp_path / "from_file"), env)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = tensorboard_scalars(tmp_path / "from_file", "train/loss")
    assert [losses[i] for i in range(11, 21)] == pytest.approx(expected, rel=1e-5)


def test_a_sharded_save_failing_on_rank_0_stops_both_ranks_with_one_line(tmp_path, env):
    """Rank 0's state.pt cannot be written: rank 1, past its own shards, hears of it and raises the same OSError."""
    script = tmp_path / "save.py"
    script.write_text(
        "import errno, sys, torch, torch.distributed as dist\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "import checkpoint\n"
        "from model import ModelConfig, build_model\n"
        "dist.init_process_group('gloo')\n"
        "def read_only(state, path):\n"
        "    raise OSError(errno.EROFS, 'Read-only file system')\n"
        "checkpoint.write_file = read_only\n"
        "model = build_model(ModelConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8))\n"
        "optimizers = {'adamw': torch.optim.AdamW(model.parameters())}\n"
        "tensors = checkpoint.sharded_state(model, ema_model=None, optimizers=optimizers)\n"
        "try:\n"
        "    checkpoint.save_sharded(tensors, {}, sys.argv[1], dist.get_rank())\n"
        "except OSError as e:\n"
        "    print(f'rank {dist.get_rank()}: {e}', flush=True)\n"
        # as train.main does: gloo's threads let go of the last collective's tensors before the group goes
        "dist.barrier()\n"
        "dist.destroy_process_group()\n"
    )
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
        + [str(tmp_path / "ckpt.pt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: could not write {tmp_path / 'ckpt.pt'} (Read-only file system; " in run.stdout
    assert not (tmp_path / "ckpt.pt").exists() and not (tmp_path / ".ckpt.pt.new").exists()  # nothing left


def test_fsdp_refuses_muon_and_trains_whole_in_one_process(tmp_path, data_root, capsys):
    with pytest.raises(ConfigError, match="fsdp=True cannot train with optimizer='muon': Muon orthogonalises"):
        tiny(data_root, tmp_path, fsdp=True, optimizer="muon")
    alone = main(tiny(data_root, tmp_path / "fsdp", fsdp=True))
    assert "note: fsdp=True with one process" in capsys.readouterr().out
    assert alone["losses"] == main(tiny(data_root, tmp_path / "plain"))["losses"]
    assert (tmp_path / "fsdp" / "ckpt.pt").is_file()
