"""
serve.py end to end: a server on a free port with a tiny trained chat model, talked to with the official openai
client, its answers checked against sample.py's own output and the model's log-softmax computed here; bad requests,
the API key, a client that leaves mid-stream, and the chat page in a real browser (Debian's chromium).
"""

import io
import json
import shutil
import socket
import threading
import time
from dataclasses import asdict, replace

import httpx
import openai
import pytest
import torch
import uvicorn

import sample
import serve
from checkpoint import load_checkpoint
from config import parse_config
from model import ModelConfig, build_model
from tokens import Tokenizer


@pytest.fixture(scope="module")
def chat_dir(chat_run):
    """The folder of conftest's tiny chat GPT (answers "ok" to questions that start with a, else "no")."""
    return chat_run[0] / "out"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    """A serve.py app served by uvicorn in a thread of this process: its URL, and its engine for the tests to see."""

    def __init__(self, served, **options):
        self.app = serve.make_app(served, **options)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join()


def served_from(out, **settings):
    return serve.load_served(serve.ServeConfig(out_dir=str(out), checkpoint="ckpt.pt", device="cpu", **settings))


@pytest.fixture(scope="module")
def server(chat_dir):
    running = Running(served_from(chat_dir))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def sample_out(*args):
    """sample.py's stdout for these options, run in this process."""
    out = io.StringIO()
    sample.main(parse_config(sample.SampleConfig, [str(a) for a in args]), out=out)
    return out.getvalue()


# -----------------------------------------------------------------------------
# What it answers, against sample.py and the model


def test_models_lists_the_one_model_under_its_folder_name(client, chat_dir):
    (model,) = client.models.list().data
    assert model.id == chat_dir.name == "out"
    assert model.model_extra["max_model_len"] == 48 and model.model_extra["chat"] is True


@pytest.mark.parametrize("prompt", ["abca", "c"])
def test_greedy_completion_is_sample_py_at_temperature_0(client, chat_dir, prompt):
    options = (f"--out_dir={chat_dir}", "--checkpoint=ckpt.pt", f"--start={prompt}", "--max_new_tokens=20")
    expected = sample_out(*options, "--temperature=0")
    got = client.completions.create(model="out", prompt=prompt, max_tokens=20, temperature=0)
    assert prompt + got.choices[0].text + "\n" == expected
    assert got.choices[0].finish_reason == "length"  # character data has no end-of-text token
    assert (got.usage.prompt_tokens, got.usage.completion_tokens, got.usage.total_tokens) == (
        len(prompt),
        20,
        20 + len(prompt),
    )


@pytest.mark.parametrize("system", ["", "bc"])
def test_greedy_chat_reply_is_sample_py_chat_at_temperature_0(client, chat_dir, system):
    options = [f"--out_dir={chat_dir}", "--checkpoint=ckpt.pt", "--chat", "--temperature=0", "--start=abca"]
    expected = sample_out(*options, *([f"--system={system}"] if system else []))
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "abca"}]
    got = client.chat.completions.create(model="out", messages=messages, temperature=0)
    assert got.choices[0].message.content + "\n" == expected
    assert got.choices[0].message.content  # a real reply is compared
    assert got.choices[0].finish_reason == "stop"
    # <system> bc <end_of_turn> <user> abca <end_of_turn> <assistant>; the reply's ids and its end-of-turn
    assert got.usage.prompt_tokens == (len(system) + 2 if system else 0) + 4 + 3
    assert got.usage.completion_tokens == len(got.choices[0].message.content) + 1


def test_samples_repeat_with_their_seed_and_are_sample_py_num_samples(client, chat_dir):
    def draw(seed):
        got = client.completions.create(model="out", prompt="ab", max_tokens=12, temperature=1.0, n=3, seed=seed)
        return [choice.text for choice in got.choices]

    first = draw(5)
    assert draw(5) == first and draw(6) != first
    # sample.py draws its samples in one batch with the same seeded generator: the same texts
    options = (f"--out_dir={chat_dir}", "--checkpoint=ckpt.pt", "--start=ab", "--max_new_tokens=12", "--top_k=None")
    expected = sample_out(*options, "--temperature=1.0", "--num_samples=3", "--seed=5")
    assert expected.removesuffix("\n").split("\n" + "-" * 15 + "\n") == ["ab" + text for text in first]


def stream_text(chunks):
    """The texts of a stream's chunks joined per choice, and the usage of its last chunk."""
    texts, last = {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta.content if hasattr(choice, "delta") else choice.text
            texts[choice.index] = texts.get(choice.index, "") + (delta or "")
        last = chunk
    return [texts[i] for i in sorted(texts)], last.usage


def test_streamed_chunks_join_into_the_unstreamed_text(client):
    options = dict(prompt=["ab", "ca"], max_tokens=15, temperature=1.0, n=2, seed=3, stop=["cc"])
    whole = client.completions.create(model="out", **options)
    texts, used = stream_text(client.completions.create(model="out", **options, stream=True))
    assert texts == [choice.text for choice in whole.choices] and used == whole.usage
    assert len(texts) == 4 and "cc" not in "".join(texts)

    options = dict(messages=[{"role": "user", "content": "bca"}], temperature=1.0, seed=1, n=2)
    whole = client.chat.completions.create(model="out", **options)
    texts, used = stream_text(client.chat.completions.create(model="out", **options, stream=True))
    assert texts == [choice.message.content for choice in whole.choices] and used == whole.usage


def test_stop_strings_cut_the_text_before_them(client):
    free = client.completions.create(model="out", prompt="ab", max_tokens=20, temperature=0).choices[0]
    stop = free.text[3:5]  # a stop string that the free text holds
    cut = client.completions.create(model="out", prompt="ab", max_tokens=20, temperature=0, stop=stop).choices[0]
    assert cut.text == free.text[: free.text.index(stop)] and cut.finish_reason == "stop"


def test_logprobs_are_the_models_own_log_softmax(client, chat_dir):
    ckpt = load_checkpoint(chat_dir / "ckpt.pt")
    model = build_model(ModelConfig.from_dict(ckpt["model_config"]))
    model.load_state_dict(ckpt["weights"])
    model.eval()
    tokenizer = Tokenizer.from_meta(ckpt["meta"])
    # greedy by full forward passes, and every position's log-softmax in float64
    ids = tokenizer.encode("abcab")
    with torch.no_grad():
        for _ in range(4):
            ids.append(int(model(torch.tensor([ids]))[0][0, -1, : tokenizer.vocab_size].argmax()))
        reference = model(torch.tensor([ids]))[0][0, :, : tokenizer.vocab_size].double().log_softmax(-1)  # (T, V)
    for echo, max_tokens in [(True, 0), (True, 4), (False, 4)]:
        got = client.completions.create(
            model="out", prompt="abcab", max_tokens=max_tokens, temperature=0, logprobs=2, echo=echo
        ).choices[0]
        first = 0 if echo else 5  # the prompt's tokens come first with echo; the first has no log p
        shown = ids[first : 5 + max_tokens]
        assert got.logprobs.tokens == [tokenizer.decode([i]) for i in shown]
        assert got.text == ("abcab" if echo else "") + tokenizer.decode(ids[5 : 5 + max_tokens])
        expected = [None if t == 0 else float(reference[t - 1, ids[t]]) for t in range(first, 5 + max_tokens)]
        assert got.logprobs.token_logprobs == pytest.approx(expected, abs=1e-4)
        for t, top in zip(range(first, 5 + max_tokens), got.logprobs.top_logprobs):
            if t:  # the two likeliest, the likeliest first
                values = reference[t - 1].topk(2).values.tolist()
                assert sorted(top.values(), reverse=True) == pytest.approx(values, abs=1e-4)
    # one prompt id scored alone has no log p; asking for more likeliest ids than the vocabulary holds lists them all
    got = client.completions.create(model="out", prompt=ids[:1], max_tokens=1, logprobs=20, echo=True, temperature=0)
    assert got.choices[0].logprobs.token_logprobs[0] is None
    assert len(got.choices[0].logprobs.top_logprobs[1]) == len(
        {tokenizer.decode([i]) for i in range(tokenizer.vocab_size)}
    )


# -----------------------------------------------------------------------------
# Bad requests


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/completions", "{not json", 400, None),
        ("/v1/completions", "[1, 2]", 400, None),
        ("/v1/completions", {"prompt": "ab", "model": "gpt-4"}, 404, "model"),
        ("/v1/completions", {"prompt": "ab", "max_tokens": -1}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "ab", "max_tokens": 47}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "ab" * 30}, 400, "prompt"),
        ("/v1/completions", {"prompt": "xyz"}, 400, "prompt"),
        ("/v1/completions", {"prompt": [[]]}, 400, "prompt"),
        ("/v1/completions", {"prompt": "ab", "temperature": -0.5}, 400, "temperature"),
        ("/v1/completions", {"prompt": "ab", "temperature": 3}, 400, "temperature"),
        ("/v1/completions", {"prompt": "ab", "temperature": 1e-40}, 400, "temperature"),
        ("/v1/completions", {"prompt": "ab", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"prompt": "ab", "stop": ""}, 400, "stop"),
        ("/v1/completions", {"prompt": "ab", "stop": ["a" * 257]}, 400, "stop"),
        ("/v1/completions", {"prompt": ["ab"] * 5, "n": 13}, 400, "n"),
        ("/v1/completions", {"prompt": "ab", "top_k": -2}, 400, "top_k"),
        ("/v1/completions", {"prompt": "ab", "frequency_penalty": 1}, 400, "frequency_penalty"),
        ("/v1/completions", {"prompt": "ab", "best_of": 3}, 400, "best_of"),
        ("/v1/completions", {"prompt": "ab", "logprobs": 1, "stream": True}, 400, "logprobs"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "ab"}]}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab" * 30}]}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}], "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/nowhere", {}, 404, None),
    ],
)
def test_a_bad_request_gets_its_error_and_the_next_one_is_answered(server, path, body, status, param):
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    after = httpx.post(server.url + "/v1/completions", json={"prompt": "ab", "max_tokens": 2})
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 2


def test_a_body_over_the_limit_is_refused_before_it_is_read(server):
    huge = json.dumps({"prompt": "a" * 1_100_000})
    assert httpx.post(server.url + "/v1/completions", content=huge).status_code == 413

    def chunks():  # no Content-Length: counted as it comes
        for _ in range(12):
            yield b"a" * 100_000

    assert httpx.post(server.url + "/v1/completions", content=chunks()).status_code == 413


def test_a_client_that_leaves_mid_stream_frees_its_share_at_once(server, monkeypatch):
    """Steps that never end on their own (a reply as long as a client wants): only the client's leaving ends them."""
    closed = threading.Event()

    def endless(model, prompt, n, *args, **kwargs):
        try:
            while True:
                yield [prompt[0]] * n
        finally:
            closed.set()

    monkeypatch.setattr(serve, "completion_steps", endless)
    engine = server.app.state.engine
    body = {"prompt": "a", "max_tokens": 47, "n": 4, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as response:
        next(response.iter_lines())  # the first chunk, then the client is gone
    assert closed.wait(timeout=30)  # the job's steps were closed: without the client's leaving, never
    deadline = time.monotonic() + 5  # and the job is dropped right after
    while engine.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.active


def test_the_engine_drops_a_cancelled_job_and_closes_its_steps():
    closed = threading.Event()

    def endless():
        try:
            while True:
                yield 1
        finally:
            closed.set()

    engine = serve.Engine(torch.device("cpu"), torch.float32)
    engine.thread.start()
    seen = threading.Event()
    job = engine.submit(serve.Job(endless(), lambda item: seen.set()))
    assert seen.wait(5)
    job.cancelled = True
    assert closed.wait(5)
    engine.stop()


# -----------------------------------------------------------------------------
# The API key, a model without a template, what is not served


def test_with_an_api_key_every_request_needs_it_and_a_plain_model_only_completes(chat_dir, tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    ckpt = load_checkpoint(chat_dir / "ckpt.pt")
    ckpt["meta"] = {k: v for k, v in ckpt["meta"].items() if k != "chat"}
    torch.save(ckpt, plain / "ckpt.pt")
    running = Running(served_from(plain), api_key="s3cret")
    try:
        assert httpx.get(running.url + "/v1/models").status_code == 401
        bad = httpx.post(running.url + "/v1/completions", json={"prompt": "ab"}, headers={"Authorization": "Bearer no"})
        assert bad.status_code == 401 and bad.json()["error"]["message"]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=running.url + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=running.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.models.list().data[0].model_extra["chat"] is False
        assert good.completions.create(model="plain", prompt="ab", max_tokens=3).usage.completion_tokens == 3
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            good.chat.completions.create(model="plain", messages=[{"role": "user", "content": "ab"}])
    finally:
        running.stop()


def test_an_encoder_is_refused_at_startup_in_one_line(chat_dir, tmp_path, capsys):
    ckpt = load_checkpoint(chat_dir / "ckpt.pt")
    config = replace(ModelConfig.from_dict(ckpt["model_config"]), arch="encoder")
    ckpt["model_config"] = asdict(config)
    ckpt["weights"] = build_model(config).state_dict()
    ckpt.pop("average", None)
    (tmp_path / "enc").mkdir()
    torch.save(ckpt, tmp_path / "enc" / "ckpt.pt")
    assert serve.cli([f"--init_from={tmp_path / 'enc' / 'ckpt.pt'}", "--device=cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("serve.py: error:") and "sample.py" in err and err.count("\n") == 1
    assert serve.cli(["--port=70000"]) == 2
    assert "port" in capsys.readouterr().err


# -----------------------------------------------------------------------------
# The chat page, in a real browser


@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_the_chat_page_streams_a_reply_in_a_browser(server, client):
    from playwright.sync_api import sync_playwright

    expected = client.chat.completions.create(
        model="out", messages=[{"role": "user", "content": "abca"}], temperature=0
    )
    expected = expected.choices[0].message.content
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=shutil.which("chromium"),
            headless=True,
            args=["--no-sandbox", "--disable-background-networking", "--disable-component-update"],
        )
        try:
            page = browser.new_page()
            streamed = []
            page.on("request", lambda r: streamed.append(r.post_data_json) if r.method == "POST" else None)
            page.goto(server.url + "/")
            page.wait_for_function("document.title === 'out'")
            page.fill("#temperature", "0")
            page.fill("#input", "abca")
            page.press("#input", "Enter")
            reply = page.locator(".assistant").first
            page.wait_for_function(
                "!document.getElementById('send').disabled && !!document.querySelector('.assistant')"
            )
            assert reply.text_content() == expected and expected
            assert page.locator(".user").first.text_content() == "abca"
            assert streamed[0]["stream"] is True and streamed[0]["messages"] == [{"role": "user", "content": "abca"}]
            page.click("#reset")  # start over: the log is empty
            assert page.locator(".message").count() == 0
        finally:
            browser.close()
