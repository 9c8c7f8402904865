"""
tools/bench.py --parts=serve: serve.py under concurrent streaming clients, each served model in a process of its own.
"""

import contextlib
import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import torch

from bench_common import ROOT, summary
from log import one_line
from model import ModelConfig, build_model
from tokens import GPT2_META

# the models --parts=serve can make, by serve_models name, with their column titles
SERVED_SHAPES = {"quick": "quick start (2 x 128, 64 positions)", "gpt2": "GPT-2 124M shape (12 x 768, 1,024)"}
GPT2_END = (GPT2_META["special_tokens"]["eot"],)  # <|endoftext|>, banned where the bench's untrained models use it


# -----------------------------------------------------------------------------
# serve.py under concurrent clients


def bench_serving(cfg, work):
    """
    (header, rows) for serve.py under concurrent clients, a column per model of serve_models, each served by a
    `python serve.py` process of its own. In each of cfg.repeats rounds every client count of serve_clients runs in
    turn (so that the machine's drift hits them alike): each client streams a sampled completion of serve_tokens
    tokens (never ending early). Rows: time to first token per request, tokens/s per client and all together, all
    together over one client's in the same round, and the server's peak resident memory beside its KV cache budget.
    """
    work.mkdir(parents=True, exist_ok=True)
    counts = [int(c) for c in cfg.serve_clients.split(",")]
    header, columns = ["measure"], []
    for name in cfg.serve_models.split(","):
        source, title, ban = served_checkpoint(name, work)
        header.append(f"{title}, {cfg.serve_tokens} tokens a request, median (min-max)")
        columns.append(serving_column(cfg, source, counts, work, ban))
    return header, [(label, [column[k][1] for column in columns]) for k, (label, _) in enumerate(columns[0])]


def served_checkpoint(name, work):
    """
    (checkpoint file, column title, ids to ban) of a serve_models entry: the quick start's (characters: no end id),
    GPT-2 124M's shape (untrained: its <|endoftext|> banned, so that every completion runs its length), or a file.
    """
    if name not in SERVED_SHAPES:
        return name, name, ()
    if name == "quick":
        return str(quick_checkpoint(work)), SERVED_SHAPES[name], ()
    config = ModelConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304, bias=True)
    return str(shaped_checkpoint(config, work, work / "gpt2-shape.pt")), SERVED_SHAPES[name], GPT2_END


def quick_checkpoint(work):
    """The quick start's checkpoint in work, trained once."""
    quick = work / "quick-start" / "ckpt.pt"
    return quick if quick.is_file() else Path(quick_start_checkpoint(work))


def shaped_checkpoint(config, work, path):
    """The quick start's checkpoint with ModelConfig config's shape, fresh weights and GPT-2's tokenizer, at path."""
    ckpt = torch.load(quick_checkpoint(work), weights_only=True)
    ckpt |= {"model_config": asdict(config), "weights": build_model(config).state_dict(), "meta": dict(GPT2_META)}
    ckpt.pop("average", None)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(ckpt, path)
    return path


def serving_column(cfg, source, counts, work, ban):
    """A column of bench_serving's rows for one served checkpoint: [(label, value)]."""
    port, log = free_port(), work / "serve.log"
    command = [sys.executable, str(ROOT / "serve.py"), f"--init_from={source}", f"--port={port}", "--device=cpu"]
    command.append(f"--max_batch={max(counts)}")
    firsts, each, together = ({c: [] for c in counts} for _ in range(3))
    ratios = {c: [] for c in counts}
    with open(log, "w") as out, subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT) as proc:
        try:
            url = wait_for_server(f"http://127.0.0.1:{port}", proc, log)
            stream_completion(url, cfg.serve_tokens, 0, ban)  # untimed: the first request's one-off costs
            for repeat in range(cfg.repeats):
                for clients in counts:
                    runs, rate = client_round(url, clients, cfg.serve_tokens, repeat, ban)
                    firsts[clients] += [first for first, _ in runs]
                    each[clients] += [cfg.serve_tokens / total for _, total in runs]
                    together[clients].append(rate)
                for clients in counts:  # against one client in the same round
                    ratios[clients].append(together[clients][-1] / together[counts[0]][-1])
            peak = peak_memory_mib(proc.pid)
        finally:
            proc.terminate()
    rows = []
    for c in counts:
        rows += [
            (f"{c} client(s): time to first token, ms", summary([1000 * f for f in firsts[c]], "{:,.0f}")),
            (f"{c} client(s): tokens/s per client", summary(each[c], "{:,.0f}")),
            (f"{c} client(s): tokens/s all together", summary(together[c], "{:,.0f}")),
            (f"{c} client(s): all together / {counts[0]} client(s)", summary(ratios[c], "{:.2f}x")),
        ]
    config = ModelConfig.from_dict(torch.load(source, weights_only=True)["model_config"])
    budget = max(counts) * config.kv_cache_bytes(torch.float32) / 2**20
    rows.append(("server peak memory, MiB (KV cache budget)", f"{peak} ({budget:,.0f})"))
    return rows


def client_round(url, clients, tokens, repeat, ban=()):
    """
    `clients` clients at once, each streaming a completion of `tokens` tokens (seeds new in every repeat; the ids in
    ban never drawn): their (seconds to first text, seconds in all), and the tokens a second of all of them together.
    A completion that ends before its tokens would make the counts wrong: SystemExit.
    """
    seeds = range(repeat * clients, (repeat + 1) * clients)
    begin = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        runs = list(pool.map(lambda seed: stream_completion(url, tokens, seed, ban), seeds))
    rate = clients * tokens / (time.perf_counter() - begin)
    early = [finish for _, _, finish in runs if finish != "length"]
    if early:
        raise SystemExit(
            f"bench.py: error: {url} ended a completion before its {tokens} tokens (finish_reason {early[0]!r}): "
            "the rates count every token; serve a model that does not end early (or with an end id to ban)"
        )
    return [(first, total) for first, total, _ in runs], rate


# -----------------------------------------------------------------------------
# the server, its clients, and the processes the part starts


def check_run(command):
    """Run command from ROOT; SystemExit with its last words if it fails."""
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"bench.py: error: {' '.join(command)} failed: {one_line(done.stderr or done.stdout)}")


def peak_memory_mib(pid):
    """A process's peak resident memory in MiB, from Linux's /proc; n/a elsewhere."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return "n/a"
    kib = int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1))
    return f"{kib / 1024:,.0f}"


def quick_start_checkpoint(work):
    """A checkpoint of configs/shakespeare.py's model after a few steps, in work."""
    out_dir = work / "quick-start"
    command = [sys.executable, str(ROOT / "train.py"), "configs/shakespeare.py", f"--out_dir={out_dir}"]
    command += ["--max_minutes=0", "--max_iters=10", "--eval_interval=10", "--eval_iters=1", "--tensorboard=false"]
    check_run(command)
    return str(out_dir / "ckpt.pt")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_server(url, proc, log, timeout=120):
    """url once its /v1/models answers; SystemExit with the server's last line if it exits or never answers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError):
            urllib.request.urlopen(f"{url}/v1/models", timeout=5).close()
            return url
        time.sleep(0.2)
    last = (log.read_text().strip().splitlines() or ["no output"])[-1]
    raise SystemExit(f"bench.py: error: serve.py did not start: {last}")


def stream_completion(url, max_tokens, seed, ban=()):
    """
    One streamed completion of max_tokens tokens, the ids in ban never drawn (logit_bias -100): (seconds to its
    first text, seconds in all, finish_reason).
    """
    body = {"prompt": "\n", "max_tokens": max_tokens, "temperature": 1.0, "seed": seed, "stream": True}
    body |= {"logit_bias": {str(i): -100 for i in ban}} if ban else {}
    data = json.dumps(body).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data, headers={"Content-Type": "application/json"})
    begin, first, finish = time.perf_counter(), None, None
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:  # server-sent events: 'data: {chunk}' lines, then 'data: [DONE]'
            choices = json.loads(line[6:])["choices"] if line.startswith(b"data: {") else []
            if choices and first is None:
                first = time.perf_counter() - begin
            if choices and choices[0].get("finish_reason"):  # the last chunk of the choice says why it ended
                finish = choices[0]["finish_reason"]
    return first, time.perf_counter() - begin, finish
