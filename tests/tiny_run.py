"""train.py's settings for a real run in a second or so on a CPU, shared by the tests that train: 2 layers, 32 wide,
32 positions, float32, no compile, no TensorBoard, on the session's prepared shakespeare_char (conftest's data_root)."""

from train import TrainConfig

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
