"""Session-wide fixtures shared by the whole suite."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# the project is a flat layout: make its modules importable however pytest is started, and the developer tools' in
# tools/ (plain scripts, not a package: tools/bench.py says how they import)
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]


def pytest_configure(config):
    """
    torch.compile's kernels cached in a folder of the session's own (children inherit it), unless one is named:
    Inductor's shared cache (/tmp/torchinductor_USER) served kernels built under another ATEN_CPU_CAPABILITY to a
    run under avx2, whose compiled steps then gave NaN; a fresh cache compiled them right. Set before collection:
    importing the planner's tools fixes the folder for the whole process.
    """
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        config.own_compile_cache = tempfile.mkdtemp(prefix="nanoformer-tests-inductor-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = config.own_compile_cache


def pytest_unconfigure(config):
    if getattr(config, "own_compile_cache", None):
        shutil.rmtree(config.own_compile_cache, ignore_errors=True)


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """
    Tiny models spend their time in per-op overhead, which a second thread only adds to; on cores shared with
    other jobs, two spinning threads per op made the training and sampling tests over ten times slower.
    """
    threads, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # what train.main's own choice of threads (runtime.pick_threads) reads
    yield
    torch.set_num_threads(threads)
    if env is None:
        del os.environ["OMP_NUM_THREADS"]
    else:
        os.environ["OMP_NUM_THREADS"] = env


@pytest.fixture(scope="session")
def shakespeare_path() -> Path:
    """tinyshakespeare.txt from the offline mirror named by NANOFORMER_DATA_MIRROR."""
    mirror = os.environ.get("NANOFORMER_DATA_MIRROR")
    if not mirror:
        pytest.fail(
            "NANOFORMER_DATA_MIRROR is not set: export NANOFORMER_DATA_MIRROR=<folder holding "
            "tinyshakespeare.txt> (and TIKTOKEN_CACHE_DIR for BPE), as .ci/run does"
        )
    path = Path(mirror) / "tinyshakespeare.txt"
    if not path.is_file():
        pytest.fail(f"{path} not found: NANOFORMER_DATA_MIRROR must name a folder holding tinyshakespeare.txt")
    return path


@pytest.fixture(scope="session")
def nanogpt_dir(shakespeare_path, tmp_path_factory) -> Path:
    """
    A copy of the nanoGPT checkout named by NANOFORMER_NANOGPT (which is never written to): its scripts, configs and
    tiny Shakespeare, the two prepared datasets as the checkout holds them or else by its own prepare.py, which
    reads the mirror's text as input.txt instead of downloading it (data/shakespeare's also needs tiktoken's gpt2).
    """
    source = os.environ.get("NANOFORMER_NANOGPT")
    if not source:
        pytest.fail(
            "NANOFORMER_NANOGPT is not set: export NANOFORMER_NANOGPT=<a nanoGPT checkout> (git clone "
            "https://github.com/karpathy/nanoGPT), as .ci/run does"
        )
    source = Path(source)
    if not (source / "train.py").is_file():
        pytest.fail(f"{source} has no train.py: NANOFORMER_NANOGPT must name a nanoGPT checkout")
    copy = tmp_path_factory.mktemp("nanogpt")
    # only what its train.py reads: a checkout's data/ may hold OpenWebText's 17 GB
    wanted = [*source.glob("*.py"), *source.glob("config/*.py"), *source.glob("data/shakespeare*/*")]
    for path in wanted:
        (copy / path.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, copy / path.relative_to(source))  # the files, not the checkout's read-only modes
    for data in (copy / "data" / "shakespeare_char", copy / "data" / "shakespeare"):
        if not (data / "train.bin").is_file():
            shutil.copyfile(shakespeare_path, data / "input.txt")
            run = subprocess.run([sys.executable, "prepare.py"], cwd=data, capture_output=True, text=True, timeout=300)
            if run.returncode:
                lines = (run.stdout + run.stderr).strip().splitlines() or ["no output"]
                pytest.fail(f"nanoGPT's {data.relative_to(copy)}/prepare.py failed: {lines[-1]}")
    return copy


@pytest.fixture(scope="session")
def shakespeare_char_dir(shakespeare_path, tmp_path_factory) -> Path:
    """shakespeare_char, prepared once per session into a temporary data dir; returns its folder."""
    import prepare_data

    # no --input: the text comes through NANOFORMER_DATA_MIRROR, the documented offline route
    return prepare_data.prepare("shakespeare_char", data_dir=tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="session")
def llama_dir(shakespeare_path, tmp_path_factory) -> Path:
    """
    A tiny random LlamaForCausalLM saved by transformers, with a tokenizer.json beside it: a byte-level BPE of 300 ids
    trained on the start of tiny Shakespeare, whose template puts bos (<s>, id 0) before every text as Llama's does.
    """
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator([shakespeare_path.read_text(encoding="utf-8")[:20_000]], trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="session")
def data_root(shakespeare_char_dir):
    """The folder holding the prepared shakespeare_char, as train.py's data_dir takes it."""
    return str(shakespeare_char_dir.parent)


@pytest.fixture
def env(data_root):
    """The environment for train.py subprocesses: datasets from the session's data dir."""
    return {**os.environ, "NANOFORMER_DATA_DIR": data_root, "OMP_NUM_THREADS": "1"}


CHAT_QUESTIONS = ["abc", "bca", "cab", "aab", "bba", "cca", "abab", "baba", "acca", "caac", "bcb", "aca"]


def conversation(question, answer, *more):
    """{"messages": user question, assistant answer, then more (question, answer) turns}."""
    turns = [(question, answer), *more]
    return {
        "messages": [m for q, a in turns for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})]
    }


@pytest.fixture(scope="session")
def chat_run(tmp_path_factory):
    """
    A tiny GPT trained on conversations whose answer is "ok" when the question starts with a, else "no" (character
    vocabulary, the built-in template, exact answers): (its data root, the prepared folder, train.main's summary).
    """
    import prepare_data
    import train

    root = tmp_path_factory.mktemp("chat")
    lines = []
    for k in range(240):
        q = CHAT_QUESTIONS[k % len(CHAT_QUESTIONS)] + "abc"[k % 3] * (k % 4)
        more = [(q[::-1], "ok" if q[-1] == "a" else "no")] if k % 5 == 0 else []
        lines.append(json.dumps(conversation(q, "ok" if q[0] == "a" else "no", *more)))
    (root / "talk.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    folder = prepare_data.prepare(
        "chat", data_dir=root, input=str(root / "talk.jsonl"), tokenizer="char", exact_answers=True, val_fraction=0.2
    )
    cfg = train.TrainConfig(
        out_dir=str(root / "out"),
        data_dir=str(root),
        dataset=folder.name,
        n_layer=2,
        n_head=2,
        n_embd=32,
        block_size=48,
        batch_size=8,
        gradient_accumulation_steps=1,
        max_iters=60,
        eval_interval=60,
        eval_iters=2,
        log_interval=100,
        learning_rate=1e-2,
        min_lr=1e-3,
        warmup_iters=0,
        device="cpu",
        tensorboard=False,
        compile=False,
    )
    summary = train.main(cfg)
    return root, folder, summary
