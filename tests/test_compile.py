"""train.py's torch.compile: compiled against eager steps, one graph per shipped config, regional compilation,
the loss chunk's trial step, CUDA graphs' refusals, and compile failures on one rank or all."""

import contextlib
import copy
import os
import re

import pytest
import torch
from functorch.compile import aot_module_simplified, make_boxed_compiler
from tiny_run import CONFIGS, REPO, REVERSE, SHRINK, TINY, tiny, torchrun_script

import compiling
import data
import plan
import runtime
import train
from compiling import loss_chunk_budget, sized_loss_chunk, trial_step
from config import ConfigError, parse_config
from model import LOSS_CHUNK_BYTES, Block, ModelConfig, build_model
from runtime import Models, Runtime
from tasks.lm import CausalLM
from train import TrainConfig, accumulate_gradients, cli, main, update_weights


def assert_close_at_scale(mine, reference, rel, name=""):
    """Every entry of mine within rel of reference's largest magnitude: float32 sums taken in another order."""
    error, scale = (mine - reference).abs().max().item(), reference.abs().max().item()
    assert error <= rel * scale, f"{name}: differs by {error:.3g}, {error / scale:.3g} of its largest entry"


def shrunk_model_and_batches(config):
    """A shipped config's model at SHRINK's size in training mode, and two training batches of random tokens for it."""
    # LoRA configs adapt given weights: any init_from passes the settings' check (the model here is built plain)
    cfg = parse_config(TrainConfig, [str(config), *SHRINK, "--dropout=0.0", "--init_from=base.pt"])
    V, g = 40, torch.Generator().manual_seed(0)
    model = build_model(cfg.model_config(V, 0 if cfg.arch == "encoder_decoder" else None)).train()
    if config.stem.startswith("chat_"):  # conversations of two different lengths: one dynamic graph serves both
        batches = [tuple(torch.randint(1, V, (4, T), generator=g) for _ in range(2)) for T in (20, 13)]
        return cfg, model, [((x,), y) for x, y in batches]
    if cfg.arch == "encoder_decoder":  # pairs of two different lengths: one dynamic graph must serve both
        shapes = [((4, 20), (4, 24)), ((4, 13), (4, 9))]
        batches = [tuple(torch.randint(1, V, s, generator=g) for s in (src, tgt, tgt)) for src, tgt in shapes]
        return cfg, model, [((src, tgt), targets) for src, tgt, targets in batches]
    batches = [tuple(torch.randint(1, V, (4, 32), generator=g) for _ in range(2)) for _ in range(2)]
    return cfg, model, [((x,), y) for x, y in batches]


def counting_backend(graphs, fail_after=None):
    """A torch.compile backend that runs each graph as traced (no code generation) and records it."""

    def backend(gm, example_inputs):
        graphs.append(gm)
        if fail_after is not None and len(graphs) > fail_after:
            raise RuntimeError("this backend fails on purpose")
        return gm.forward

    return backend


# -----------------------------------------------------------------------------
# Compiled steps and their graphs


@pytest.mark.parametrize("config", ["shakespeare", "shakespeare_mlm", "reverse"])  # gpt, encoder, encoder_decoder
def test_compiled_steps_equal_eager_steps(config):
    """
    Three steps through torch.compile's default backend (Inductor's C++ kernels, what train.py compiles with)
    against eager PyTorch from the same weights: every loss, gradient and updated weight within 1e-5 of its largest
    entry (fused kernels sum in another order; measured at most 1.5e-6). SGD, whose step is linear in the gradient:
    Adam's g / sqrt(v) would blow a rounding difference in a near-zero gradient up to a whole step. The pairs' two
    lengths take the encoder-decoder through one dynamic graph, their length marked dynamic as in training.
    """
    cfg, model, batches = shrunk_model_and_batches(REPO / "configs" / f"{config}.py")
    varying = cfg.arch == "encoder_decoder"
    batches = [data.model_inputs(*batch, torch.device("cpu"), varying) for batch in batches]
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, dynamic=None if varying else False)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    runs = [  # (the module stepped, its optimizers)
        (Models(raw=m, step=step), {"adamw": torch.optim.SGD(m.parameters(), lr=0.1)})
        for m, step in ((model, compiled), (eager, eager))
    ]
    for batch in (*batches, batches[0]):
        losses = [
            accumulate_gradients(models, CausalLM({}), [batch], batch[1].numel(), scaler, Runtime())
            for models, optimizers in runs
        ]
        assert_close_at_scale(losses[0], losses[1], 1e-5, "loss")
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            assert_close_at_scale(p.grad, q.grad, 1e-5, f"{name}'s gradient")
        for models, optimizers in runs:
            update_weights(models.raw, optimizers, scaler, grad_clip=0)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert_close_at_scale(p.detach(), q.detach(), 1e-5, name)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_every_shipped_config_compiles_to_one_graph_that_never_recompiles(config):
    """
    The training call as train.py makes it: no graph break (each would split the compiled step); and after a first
    train step and evaluation (warm-up), train / evaluate / train again compiles nothing new.
    """
    cfg, model, batches = shrunk_model_and_batches(config)
    # conversations and pairs vary in length (Task.varying), windows do not
    varying = config.stem.startswith("chat_") or cfg.arch == "encoder_decoder"
    call = {"label_smoothing": cfg.label_smoothing, "reduction": "sum", "return_logits": False}
    inputs, targets = data.model_inputs(*batches[0], torch.device("cpu"), varying)
    explanation = torch._dynamo.explain(model)(*inputs, targets, **call)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    dynamic = None if varying else False
    compiled = torch.compile(model, backend="eager", dynamic=dynamic)

    def train_then_evaluate(batch):
        inputs, targets = data.model_inputs(*batch, torch.device("cpu"), varying)
        compiled.train()
        compiled(*inputs, targets, **call)[1].backward()
        with torch.no_grad():
            compiled.eval()
            compiled(*inputs, targets, reduction="sum", return_logits=False)

    train_then_evaluate(batches[0])  # warm-up: the training graph and the evaluation graph
    with torch._dynamo.config.patch(error_on_recompile=True):
        train_then_evaluate(batches[1])
        train_then_evaluate(batches[0])


@pytest.mark.parametrize("config", ["shakespeare", "reverse"])  # gpt, encoder_decoder (two lengths, dynamic)
def test_regional_compilation_equals_eager_with_one_graph_for_every_block(config):
    """
    compile_regions: each block and the loss compiled (through AOTAutograd, as Inductor compiles, run as traced:
    Inductor's kernels are checked on the whole model above), the embeddings between them eager. Losses and
    gradients equal eager ones; the GPT's two blocks share one graph (two in all, with the loss's); with
    enabled=False every region is eager again and nothing more compiles.
    """
    cfg, model, batches = shrunk_model_and_batches(REPO / "configs" / f"{config}.py")
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):  # AOTAutograd's forward and backward graphs, run as traced
        graphs.append(gm)
        as_traced = make_boxed_compiler(lambda graph, inputs: graph)
        return aot_module_simplified(gm, example_inputs, fw_compiler=as_traced, bw_compiler=as_traced)

    dynamic = None if cfg.arch == "encoder_decoder" else False
    compiling.compile_regions(model, backend=backend, dynamic=dynamic)
    for batch in (*batches, batches[0]):
        inputs, targets = batch
        losses = []
        for m in (model, eager):
            m.zero_grad()
            loss = m(*inputs, targets, reduction="sum", return_logits=False)[1]
            loss.backward()
            losses.append(loss)
        assert_close_at_scale(losses[0], losses[1], 1e-5, "loss")
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            assert_close_at_scale(p.grad, q.grad, 1e-5, f"{name}'s gradient")
    if cfg.arch == "gpt":
        assert len(graphs) == 2
    compiling.compile_regions(model, enabled=False)
    assert all(b._compiled_call_impl is None for b in model.modules() if isinstance(b, Block))
    assert "chunk_loss" not in vars(model)
    before = len(graphs)
    model(*batches[0][0], batches[0][1])
    assert len(graphs) == before


def test_seq2seq_lengths_compile_once(tmp_path, data_root, monkeypatch):
    """Batches of many lengths: one training graph and one evaluation graph, not one per length."""
    real_compile, graphs, dynamic = torch.compile, [], []

    def compile(module, **kwargs):
        dynamic.append(kwargs["dynamic"])
        return real_compile(module, backend=counting_backend(graphs), **kwargs)

    monkeypatch.setattr(torch, "compile", compile)
    # with label smoothing, which the trial compilation must use too, or training compiles a graph of its own
    main(
        tiny(
            data_root,
            tmp_path,
            arch="encoder_decoder",
            dataset="reverse",
            data_options=REVERSE,
            compile=True,
            max_iters=6,
            eval_interval=3,
            eval_iters=3,
            eval_accuracy_examples=0,
            label_smoothing=0.1,
        )
    )
    assert len(graphs) == 2 and dynamic == [None]  # lengths vary: one dynamic graph


def test_windows_compile_static_graphs_and_the_average_is_compiled_too(tmp_path, data_root, monkeypatch):
    """LM windows have one shape: graphs specialised to it (dynamic=False); the evaluated average is compiled."""
    real_compile, compiled = torch.compile, []

    def compile(module, **kwargs):
        compiled.append((type(module).__name__, kwargs["dynamic"]))
        return real_compile(module, backend="eager", **kwargs)

    monkeypatch.setattr(torch, "compile", compile)
    main(tiny(data_root, tmp_path, compile=True, max_iters=2, eval_interval=2, ema_decay=0.9))
    assert compiled == [("GPT", False), ("GPT", False)]  # the trained model, then its average


DDP_GRAPHS = """
import os, sys, torch
import compiling, train
out = sys.argv.pop(1)  # the folder for each rank's count: a file, not stdout, which torchrun's pipes lost once in CI
graphs, counts = [], []
real_compile, real_compile_model = torch.compile, compiling.compile_model
def backend(gm, example_inputs):
    graphs.append(gm)
    return gm.forward
def compile_model(*args, **kwargs):
    compiled = real_compile_model(*args, **kwargs)
    counts.append(len(graphs))  # the graphs of the first forward and backward, inside DDP
    return compiled
torch.compile = lambda module, **kwargs: real_compile(module, backend=backend, **kwargs)
compiling.compile_model = compile_model
code = train.cli(sys.argv[1:])
with open(os.path.join(out, f"graphs{os.environ['RANK']}.txt"), "w") as f:
    f.write(str(counts[0]))
sys.exit(code)
"""


def test_ddp_compiles_one_graph_per_gradient_bucket(tmp_path, data_root, env):
    """DDP's graph split (its all-reduce overlapping the backward) needs DDP compiled, not wrapping a compiled model."""
    # 6 x 384-wide layers: 42 MB of fp32 weights, two or more of DDP's 25 MB buckets
    args = [f"--{k}={v}" for k, v in TINY.items()] + [
        "--dataset=shakespeare_char",
        "--n_layer=6",
        "--n_embd=384",
        "--batch_size=2",
        "--block_size=16",
        "--max_iters=1",
        "--eval_iters=2",
        "--compile=true",
        "--gradient_accumulation_steps=2",
        f"--out_dir={tmp_path / 'out'}",
    ]
    run = torchrun_script(DDP_GRAPHS, tmp_path, env, str(tmp_path), *args)
    assert run.returncode == 0, run.stderr[-3000:]
    assert all(int((tmp_path / f"graphs{rank}.txt").read_text()) > 1 for rank in range(2))


# -----------------------------------------------------------------------------
# The loss chunk


def test_the_loss_chunk_starts_at_the_cap_or_loss_chunk_mb(monkeypatch):
    """
    None on a CPU (the model's budget); on a GPU an eighth of the card until the trial step sizes it, whatever is
    free; loss_chunk_mb anywhere, for good. The planner counts the cap of the GPU it plans for.
    """
    cfg, gpu = TrainConfig(), Runtime(device=torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * 2**30, 80 * 2**30))
    assert train.loss_chunk_bytes(cfg, Runtime(), None) is None
    assert train.loss_chunk_bytes(cfg, gpu, None) == 10 * 2**30
    given = TrainConfig(loss_chunk_mb=64)
    assert train.loss_chunk_bytes(given, Runtime(), None) == train.loss_chunk_bytes(given, gpu, None) == 64 * 2**20
    h100, cpu = plan.find_target("H100", 0.0, 1), plan.Target("cpu", 2**34, 1e11, 0.5, "given", gpu=False)
    assert plan.planned_loss_chunk(cfg, h100) == h100.memory // 8
    assert plan.planned_loss_chunk(cfg, cpu) == 16 * 2**20
    assert plan.planned_loss_chunk(given, h100) == 64 * 2**20


def test_the_loss_chunk_is_sized_from_what_a_step_leaves_and_capped():
    """
    compiling.loss_chunk_budget: GPT-2 124M's logits stay one chunk on an 80 GB card (the -8% of docs/performance.md),
    at 12 and 24 x 1024 positions; an eager run's three copies of a chunk fit in what its step left; a step that
    lacked memory shrinks the chunk, never below LOSS_CHUNK_BYTES; plenty of memory never takes it past the cap.
    """
    card = 80 * 10**9  # an H100's 80 GB
    cap = card // 8
    for batch in (12, 24):
        logits = batch * 1024 * 50304 * 4
        assert loss_chunk_budget(cap, 60 * 2**30, card, copies=1) == cap >= logits
    # eager, 24 GB card, 6 GiB left by a step in 16 MiB chunks: a third of it more per chunk
    chunk = loss_chunk_budget(LOSS_CHUNK_BYTES, 6 * 2**30, 24 * 10**9, copies=3)
    assert chunk == LOSS_CHUNK_BYTES + 2 * 2**30 and 3 * (chunk - LOSS_CHUNK_BYTES) <= 6 * 2**30
    # compiled at the cap, 2 GiB short: 2 GiB less chunk
    assert loss_chunk_budget(cap, -2 * 2**30, card, copies=1) == cap - 2 * 2**30
    assert loss_chunk_budget(LOSS_CHUNK_BYTES, -(2**30), card, copies=3) == LOSS_CHUNK_BYTES
    assert loss_chunk_budget(LOSS_CHUNK_BYTES, 10**15, card, copies=3) == cap


def test_the_trial_step_sizes_the_chunk_from_its_peak_and_leaves_no_trace(monkeypatch):
    """
    compiling.sized_loss_chunk (a GPU's memory figures given here): an eager trial step in the smallest chunks, its
    peak and AdamW's two moments (not made yet) counted, a tenth of the card kept, three copies a chunk; the trial
    leaves no gradient and the random generator as it was.
    """
    gib = 2**30
    memory = {"mem_get_info": (20 * gib, 80 * gib), "memory_reserved": 10 * gib, "max_memory_allocated": 12 * gib}
    for name, value in memory.items():
        monkeypatch.setattr(torch.cuda, name, lambda device, value=value: value)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: None)
    model = build_model(ModelConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32, dropout=0.1))
    cfg = TrainConfig(batch_size=2, block_size=16, dropout=0.1)
    optimizers, _ = train.make_optimizers(model, cfg, Runtime())
    trials = []
    model.register_forward_hook(lambda module, args, output: trials.append(module.loss_chunk_bytes))
    rng = torch.get_rng_state()

    def trial():  # the trial step as train.py's setup hands it over
        trial_step(model, CausalLM({"vocab_size": 64}), cfg.batch_size, cfg.block_size, Runtime())

    chunk = sized_loss_chunk(model, trial, optimizers, compiled=False)
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert trials == [LOSS_CHUNK_BYTES]
    assert chunk == LOSS_CHUNK_BYTES + (20 * gib + 10 * gib - 12 * gib - 2 * weights - 8 * gib) // 3
    assert all(p.grad is None for p in model.parameters()) and torch.equal(torch.get_rng_state(), rng)


AGREED_CHUNK = """
import os, sys, torch.distributed as dist
import runtime
dist.init_process_group("gloo")
rank = dist.get_rank()
chunk = runtime.agreed_minimum([7 * 2**30, 5 * 2**30][rank], 2)  # what each rank's own memory would give
with open(os.path.join(sys.argv[1], f"chunk{rank}.txt"), "w") as f:
    f.write(str(chunk))
dist.barrier()  # as train.main ends: gloo's workers release the last collective's tensors before the teardown
dist.destroy_process_group()
os._exit(0)  # the result is written: no interpreter teardown for gloo's threads to abort
"""


def test_the_ranks_cut_the_loss_alike(tmp_path, env):
    """Each rank sizes the chunk from its own memory; all take the smallest, so that runs and resumes stay equal."""
    run = torchrun_script(AGREED_CHUNK, tmp_path, env, str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    assert [int((tmp_path / f"chunk{rank}.txt").read_text()) for rank in range(2)] == [5 * 2**30] * 2


# -----------------------------------------------------------------------------
# CUDA graphs


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "cuda_graphs=True needs a CUDA GPU, not device cpu"),
        (["--compile=false"], "it needs compile (not --compile=false)"),
        (
            ["--gradient_accumulation_steps=4"],
            "cuda_graphs=True replays one micro-batch per rank a step, not 4 (gradient_accumulation_steps=4 on 1 "
            "rank(s)): for the same step use --batch_size=32 --gradient_accumulation_steps=1, or drop --cuda_graphs",
        ),
    ],
)
def test_cuda_graphs_are_refused_in_one_line_where_they_cannot_replay(tmp_path, data_root, capsys, args, message):
    argv = [f"--{k}={v}" for k, v in TINY.items() if k != "compile"]
    argv += ["--dataset=shakespeare_char", f"--data_dir={data_root}", f"--out_dir={tmp_path}", "--cuda_graphs=true"]
    assert cli(argv + args) == 2
    error = capsys.readouterr().err.strip()
    assert message in error and len(error.splitlines()) == 1, error
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("world_size", "settings", "message"),
    [
        (2, dict(gradient_accumulation_steps=4), "not 2 (gradient_accumulation_steps=4 on 2 rank(s))"),  # DDP no_sync
        (2, dict(gradient_accumulation_steps=2, fsdp=True), "does not replay FSDP's sharded steps"),
        (4, dict(gradient_accumulation_steps=2), None),  # fewer steps than ranks: one micro-batch each
        (2, dict(gradient_accumulation_steps=2), None),
        (1, dict(gradient_accumulation_steps=1, fsdp=True), None),  # one process trains whole: no FSDP
    ],
)
def test_cuda_graphs_take_one_micro_batch_per_rank_and_no_fsdp(monkeypatch, world_size, settings, message):
    """Refused before any process group or data (make_runtime is main's first call), on every rank alike."""
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setattr(runtime, "resolve_device", lambda device, local_rank: torch.device("cuda", local_rank))
    cfg = TrainConfig(cuda_graphs=True, compile=True, dtype="float32", **settings)
    if message is None:
        assert runtime.make_runtime(cfg).world_size == world_size
    else:
        with pytest.raises(ConfigError, match=re.escape(message)):
            runtime.make_runtime(cfg)


def test_cuda_graphs_are_refused_for_batches_of_varying_length(tmp_path, data_root, monkeypatch):
    """Pairs (and conversations) vary in length: refused once the data says so, before any model is parallelized."""
    monkeypatch.setattr(train, "make_runtime", lambda cfg: Runtime())  # past the check for a CUDA GPU
    monkeypatch.setattr(train, "parallelize", None)  # never reached
    settings = dict(arch="encoder_decoder", dataset="reverse", data_options=REVERSE, compile=None, cuda_graphs=True)
    cfg = tiny(data_root, tmp_path, **settings)
    with pytest.raises(ConfigError, match="cuda_graphs=True needs batches of one length, which reverse's vary"):
        main(cfg)


# -----------------------------------------------------------------------------
# Compile failures


def test_a_failed_recompilation_falls_back_to_eager(tmp_path, data_root, monkeypatch, capsys):
    """The first graph compiles, the evaluation's (a recompilation) fails: one warning, then eager numbers."""
    eager = main(tiny(data_root, tmp_path / "eager", max_iters=3, eval_interval=3))
    real_compile, graphs = torch.compile, []
    monkeypatch.setattr(
        torch, "compile", lambda module, **kwargs: real_compile(module, backend=counting_backend(graphs, 1), **kwargs)
    )
    compiled = main(tiny(data_root, tmp_path / "compiled", max_iters=3, eval_interval=3, compile=True))
    out = capsys.readouterr().out
    assert out.count("warning: torch.compile failed") == 1 and len(graphs) == 2
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-6)
    assert [e["val"] for e in compiled["evals"]] == pytest.approx([e["val"] for e in eager["evals"]], rel=1e-6)


def test_a_failed_regional_recompilation_falls_back_to_the_whole_eager_model(tmp_path, data_root, monkeypatch, capsys):
    """
    compile_regions: the blocks' graph (one for both blocks) and the loss's compile; the evaluation's recompilation
    of the blocks fails: one warning, every region back to eager, and the eager run's numbers.
    """
    eager = main(tiny(data_root, tmp_path / "eager", max_iters=3, eval_interval=3))
    real_compile, graphs = torch.compile, []
    monkeypatch.setattr(
        torch, "compile", lambda module, **kwargs: real_compile(module, backend=counting_backend(graphs, 2), **kwargs)
    )
    settings = dict(max_iters=3, eval_interval=3, compile=True, compile_regions=True)
    compiled = main(tiny(data_root, tmp_path / "compiled", **settings))
    out = capsys.readouterr().out
    assert out.count("warning: torch.compile failed") == 1 and len(graphs) == 3
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-6)
    assert [e["val"] for e in compiled["evals"]] == pytest.approx([e["val"] for e in eager["evals"]], rel=1e-6)


def test_out_of_memory_while_compiling_is_reported_as_such(tmp_path, data_root, monkeypatch, capsys):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(torch, "compile", lambda module, **kwargs: out_of_memory)
    argv = [f"--{k}={v}" for k, v in TINY.items()] + [
        "--dataset=shakespeare_char",
        f"--data_dir={data_root}",
        f"--out_dir={tmp_path}",
        "--compile=true",
    ]
    assert cli(argv) == 1
    captured = capsys.readouterr()
    assert "torch.compile failed" not in captured.out
    error = captured.err.strip()
    assert len(error.splitlines()) == 1 and "out of GPU memory" in error and "batch_size=8" in error


def second_backward_fails(model):
    """(model compiled so that its second backward graph, a recompilation's, fails to compile; the graphs made)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.exc import InductorError

    backward_graphs = []

    def backward_compiler(gm, example_inputs):
        backward_graphs.append(gm)
        if len(backward_graphs) > 1:  # as Inductor reports any failure to compile a graph
            raise InductorError(RuntimeError("this backward compiler fails on purpose"), None)
        return make_boxed_func(gm)

    backend = aot_autograd(fw_compiler=lambda gm, inputs: make_boxed_func(gm), bw_compiler=backward_compiler)
    compiled = compiling.CompiledModel.__new__(compiling.CompiledModel)
    torch.nn.Module.__init__(compiled)
    compiled.module, compiled.failed = model, False
    compiled.compiled = torch.compile(model, backend=backend, dynamic=False)  # a new length recompiles
    return compiled, backward_graphs


def test_a_failed_backward_recompilation_is_one_line():
    """
    A backward is compiled at its first use, inside loss.backward(): a failure there ends the run with one line (a
    redo on one rank alone would pair its collectives with the other ranks' next step), and no rank falls back.
    Two ranks under DDP: test_a_failed_backward_recompilation_under_ddp_is_one_line_on_each_rank.
    """
    model = build_model(ModelConfig(vocab_size=20, block_size=8, n_layer=1, n_head=2, n_embd=16))
    compiled, backward_graphs = second_backward_fails(model)
    models, rt = Models(raw=model, step=compiled), Runtime()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for length in (8, 6):  # the second length's backward cannot be compiled
        x, y = torch.randint(0, 20, (2, length)), torch.randint(0, 20, (2, length))
        batches, expected = [((x,), y)], contextlib.nullcontext()
        if length == 6:
            expected = pytest.raises(ConfigError, match=r"the compiled backward failed \(RuntimeError: this backward")
        with expected:
            accumulate_gradients(models, CausalLM({}), batches, 2 * length, scaler, rt)
    assert not compiled.failed and len(backward_graphs) == 2


class FailingBackward(torch.autograd.Function):
    """The identity, whose backward fails as a device-side assert does: an error of the step, not of a compiler."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("CUDA error: device-side assert triggered")


def test_a_backward_error_that_is_no_compile_failure_keeps_its_message():
    """Only a failed compilation becomes backward's one line: any other error is raised as it is, cause and all."""
    model = build_model(ModelConfig(vocab_size=20, block_size=8, n_layer=1, n_head=2, n_embd=16))
    compiled = compiling.CompiledModel.__new__(compiling.CompiledModel)
    torch.nn.Module.__init__(compiled)
    compiled.module, compiled.failed = model, False

    def failing(*args, **kwargs):  # the model, its loss passed through FailingBackward
        return None, FailingBackward.apply(model(*args, **kwargs)[1])

    compiled.compiled = failing
    x, y = torch.randint(0, 20, (2, 8)), torch.randint(0, 20, (2, 8))
    models, scaler = Models(raw=model, step=compiled), torch.amp.GradScaler("cpu", enabled=False)
    with pytest.raises(RuntimeError, match="^CUDA error: device-side assert triggered$") as raised:
        accumulate_gradients(models, CausalLM({}), [((x,), y)], 16, scaler, Runtime())
    assert raised.type is RuntimeError and not compiled.failed


DDP_BACKWARD_FAILS = """
import os, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
out, tests = sys.argv[1:3]
sys.path.insert(0, tests)
from test_compile import second_backward_fails
import runtime
from config import ConfigError
from tasks.lm import CausalLM
from model import ModelConfig, build_model
from train import accumulate_gradients
dist.init_process_group("gloo")
rt = runtime.Runtime(rank=dist.get_rank(), world_size=2)
torch.manual_seed(0)  # the same weights on both ranks
model = build_model(ModelConfig(vocab_size=20, block_size=8, n_layer=1, n_head=2, n_embd=16))
reference = build_model(model.config)
reference.load_state_dict(model.state_dict())
ddp = DDP(model)
compiled, backward_graphs = second_backward_fails(ddp)  # DDP compiled, as runtime.parallelize does
models, task = runtime.Models(raw=model, step=compiled, ddp=ddp), CausalLM({})
scaler = torch.amp.GradScaler("cpu", enabled=False)
def batches(length):  # each rank's own batch, and both ranks' for the reference
    ids = [torch.randint(0, 20, (2, length + 1), generator=torch.Generator().manual_seed(r)) for r in range(2)]
    return [((ids[rt.rank][:, :-1],), ids[rt.rank][:, 1:])], torch.cat(ids)
# step 1: the real all-reduce of DDP's backward hooks; each rank's gradient is the mean over both ranks' targets
mine, both = batches(8)
accumulate_gradients(models, task, mine, 2 * 2 * 8, scaler, rt)
reference(both[:, :-1], both[:, 1:])[1].backward()
exchanged = all(torch.allclose(p.grad, r.grad, atol=1e-6) for p, r in zip(model.parameters(), reference.parameters()))
# step 2: another length recompiles, and its backward fails to compile on both ranks
try:
    accumulate_gradients(models, task, batches(6)[0], 2 * 2 * 6, scaler, rt)
    error = "no error"
except ConfigError as e:
    error = str(e)
with open(os.path.join(out, f"rank{rt.rank}.txt"), "w") as f:
    f.write(f"{exchanged} {compiled.failed} {len(backward_graphs)}\\n{error}")
dist.barrier()
os._exit(0)  # the results are written; gloo's teardown after a failed backward is not what is tested
"""


def test_a_failed_backward_recompilation_under_ddp_is_one_line_on_each_rank(tmp_path):
    """
    On two ranks, after a step whose DDP all-reduce ran (each rank's gradient is that of both ranks' batches), a
    backward that fails to compile is the one-line error on every rank: none falls back, none waits for the other.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = torchrun_script(DDP_BACKWARD_FAILS, tmp_path, env, str(tmp_path), str(REPO / "tests"))
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in range(2):
        counts, error = (tmp_path / f"rank{rank}.txt").read_text().split("\n", 1)
        assert counts == "True False 2"  # gradients exchanged, no fallback, the second backward graph was tried
        assert error.startswith("the compiled backward failed (RuntimeError: this backward") and "\n" not in error


RANK_1_CANNOT_COMPILE = """
import os, sys, torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
import train
where = sys.argv.pop(1)  # "forward" or "backward": the graphs rank 1 cannot compile
def fails(gm, example_inputs):
    raise RuntimeError("this compiler fails on rank 1 on purpose")
def works(gm, example_inputs):
    return make_boxed_func(gm)
broken = os.environ["RANK"] == "1"
backend = aot_autograd(
    fw_compiler=fails if broken and where == "forward" else works,
    bw_compiler=fails if broken and where == "backward" else works,
)
real_compile = torch.compile
torch.compile = lambda module, **kwargs: real_compile(module, backend=backend)
sys.exit(train.cli(sys.argv[1:]))
"""


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_compile_failure_on_one_rank_is_every_ranks(tmp_path, env, where):
    """
    DDP on 2 ranks, torch.compile failing on rank 1 only, in the forward or in the backward graph: both ranks go on
    eagerly (one rank compiled and one not would run different graphs, and a failed backward must not leave the
    other rank waiting in an all-reduce).
    """
    args = [f"--{k}={v}" for k, v in TINY.items()] + [
        "--dataset=shakespeare_char",
        "--compile=true",
        "--max_iters=2",
        "--dist_timeout=60",
        f"--out_dir={tmp_path / 'out'}",
    ]
    run = torchrun_script(RANK_1_CANNOT_COMPILE, tmp_path, env, where, *args)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "torch.compile failed (RuntimeError: it failed on another rank); going on without it" in run.stdout
    assert "done at iteration 2" in run.stdout
