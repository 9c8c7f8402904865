"""
What the tests of train.py's runs share (test_train, test_resume, test_distributed, test_compile, ...): TINY, the
settings for a real run in a second or so on a CPU (2 layers, 32 wide, 32 positions, float32, no compile, no
TensorBoard) on the session's prepared shakespeare_char (conftest's data_root); SHRINK, a shipped config's command
line shrunk as much; the reverse dataset's options; and ways to run them and read what they saved.
"""

import socket
import subprocess
import sys
from pathlib import Path

import torch

from train import TrainConfig

REPO = Path(__file__).resolve().parent.parent
CONFIGS = sorted((REPO / "configs").glob("*.py"))
# the synthetic datasets the tests train on, each always prepared with the same options (so built once)
REVERSE = {"num_train": 2000, "num_val": 200, "num_test": 100}
SHRINK = [
    "--n_layer=2",
    "--n_head=2",
    "--n_embd=32",
    "--d_ff=None",
    "--block_size=32",
    "--batch_size=4",
    "--gradient_accumulation_steps=1",
    "--max_iters=3",
    "--eval_iters=2",
    "--eval_interval=1000",
    "--eval_accuracy_examples=8",
    "--device=cpu",
    "--dtype=float32",
    "--compile=false",
    "--tensorboard=false",
]

TINY = dict(
    n_layer=2,
    n_head=2,
    n_embd=32,
    block_size=32,
    batch_size=8,
    gradient_accumulation_steps=1,
    eval_iters=2,
    eval_interval=1000,
    log_interval=1000,
    device="cpu",
    dtype="float32",
    compile=False,
    tensorboard=False,
    learning_rate=3e-3,
    min_lr=3e-4,
    warmup_iters=0,
    lr_decay_iters=100,
    max_iters=5,
)


def tiny(data_root, out_dir, **overrides):
    """TINY on shakespeare_char under data_root, writing into out_dir, with overrides."""
    settings = {**TINY, "dataset": "shakespeare_char", "data_dir": data_root, "out_dir": str(out_dir)}
    return TrainConfig(**{**settings, **overrides})


def cli_argv(data_root, out_dir, **settings):
    """train.py's command line for TINY + settings on shakespeare_char under data_root, writing into out_dir."""
    return ["--dataset=shakespeare_char", f"--data_dir={data_root}", f"--out_dir={out_dir}"] + [
        f"--{k}={v}" for k, v in {**TINY, **settings}.items()
    ]


def ckpt_weights(path, key="weights"):
    """The tensors saved under key (the weights, or the average) in the checkpoint file at path."""
    return torch.load(path, map_location="cpu", weights_only=True)[key]


def torchrun_script(source, tmp_path, env, *args):
    """A script of this source run on 2 ranks under torchrun, the repository importable: the finished process."""
    script = tmp_path / "script.py"
    script.write_text(source)
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), *args],
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on now (a server or a rendezvous to start there)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
