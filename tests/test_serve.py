"""
serve.py end to end: a server on a free port with a tiny trained chat model (and a tiny Llama-shaped BPE model whose
template puts bos first, and a model that fails), talked to with the official openai client and with the bodies
other clients send, its answers checked against sample.py's own output and the model's log-softmax computed here;
concurrent requests, the budget, a conversation longer than the context (cut where sample.py --chat cuts it, in
time linear in its messages), a full waiting line (429), the time limit, Ctrl-C on a real `python serve.py`, bad
requests and their plain messages, the API key's reach, a client that leaves mid-stream, lm-evaluation-harness, and
the chat page in a real browser (Debian's chromium), over a reload too.
"""

import contextlib
import io
import json
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace

import httpx
import openai
import pytest
import torch
import uvicorn
from test_chat import CHATML, LLAMA3, hf_folder
from tiny_run import free_port, tiny

import engine
import eval as eval_py
import sample
import serve
import train
from chat import ChatFormat, folder_chat
from checkpoint import load_checkpoint
from config import parse_config
from generate import fit_conversation
from model import ModelConfig, build_model
from tokens import Tokenizer, huggingface_tokenizer


@pytest.fixture(scope="module")
def chat_dir(chat_run):
    """The folder of conftest's tiny chat GPT (answers "ok" to questions that start with a, else "no")."""
    return chat_run[0] / "out"


class Running:
    """A serve.py app served by uvicorn in a thread of this process: its URL, and its engine for the tests to see."""

    def __init__(self, served, **options):
        self.app = serve.make_app(served, **options)
        self.engine = self.app.state.api.engine
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
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "the server did not stop"


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


KEEP_SPECIALS = {"skip_special_tokens": False}  # sample.py prints <end_of_turn> and the other markers


@pytest.mark.parametrize("prompt", ["abca", "c"])
def test_greedy_completion_is_sample_py_at_temperature_0(client, chat_dir, prompt):
    options = (f"--out_dir={chat_dir}", "--checkpoint=ckpt.pt", f"--start={prompt}", "--max_new_tokens=20")
    expected = sample_out(*options, "--temperature=0")
    got = client.completions.create(model="out", prompt=prompt, max_tokens=20, temperature=0, extra_body=KEEP_SPECIALS)
    assert prompt + got.choices[0].text + "\n" == expected
    assert "<end_of_turn>" in expected  # the markers this chat model writes, which completions skip by default:
    default = client.completions.create(model="out", prompt=prompt, max_tokens=20, temperature=0).choices[0].text
    assert prompt + default + "\n" == expected.replace("<end_of_turn>", "").replace("<user>", "").replace(
        "<assistant>", ""
    ).replace("<system>", "")
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


def test_eight_concurrent_greedy_requests_are_each_sample_py_alone(client, chat_dir):
    """Eight prompts of different lengths share the batch, joining and leaving at different steps."""
    prompts = ["a", "cb", "abc", "bcab", "cabca", "aabbcc", "abcabca", "bbbccaab"]
    lengths = [12, 30, 7, 25, 18, 40, 3, 21]

    def complete(k):
        body = dict(model="out", prompt=prompts[k], max_tokens=lengths[k], temperature=0, extra_body=KEEP_SPECIALS)
        return client.completions.create(**body).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(complete, range(8)))
    for prompt, length, text in zip(prompts, lengths, texts):
        options = (f"--out_dir={chat_dir}", "--checkpoint=ckpt.pt", f"--start={prompt}", f"--max_new_tokens={length}")
        assert prompt + text + "\n" == sample_out(*options, "--temperature=0")


def test_samples_repeat_with_their_seed_and_are_sample_py_num_samples(client, chat_dir):
    def draw(seed):
        options = dict(prompt="ab", max_tokens=12, temperature=1.0, n=3, seed=seed, extra_body=KEEP_SPECIALS)
        return [choice.text for choice in client.completions.create(model="out", **options).choices]

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
    usage = {"stream_options": {"include_usage": True}}
    options = dict(prompt=["ab", "ca"], max_tokens=15, temperature=1.0, n=2, seed=3, stop=["cc"])
    whole = client.completions.create(model="out", **options)
    texts, used = stream_text(client.completions.create(model="out", **options, stream=True, **usage))
    assert texts == [choice.text for choice in whole.choices] and used == whole.usage
    assert len(texts) == 4 and "cc" not in "".join(texts)

    options = dict(messages=[{"role": "user", "content": "bca"}], temperature=1.0, seed=1, n=2)
    whole = client.chat.completions.create(model="out", **options)
    texts, used = stream_text(client.chat.completions.create(model="out", **options, stream=True, **usage))
    assert texts == [choice.message.content for choice in whole.choices] and used == whole.usage
    # without include_usage every chunk has a choice, as the usual `chunk.choices[0]` loop expects
    chunks = list(client.chat.completions.create(model="out", **options, stream=True))
    assert all(chunk.choices and chunk.usage is None for chunk in chunks)


def test_a_streamed_echo_shows_the_prompt_in_the_first_chunk_only():
    # chunks are forced apart here: through the server, a short reply may come in one chunk and hide a repeated echo
    served = types.SimpleNamespace(tokenizer=types.SimpleNamespace(decode=lambda ids: "".join("abc"[i] for i in ids)))
    served.name = "out"
    body = types.SimpleNamespace(n=2, echo=True, logprobs=None)
    shape = serve.CompletionShape(served, [([0, 1], [0, 1])], body)
    choices = [serve.Choice(k, served.tokenizer.decode) for k in range(2)]
    texts = [shape.chunk(choices[k], t)["choices"][0]["text"] for k, t in [(0, "c"), (1, "a"), (0, "b"), (1, "c")]]
    assert texts == ["abc", "aba", "b", "c"]


def test_stop_strings_cut_the_text_before_them(client):
    def complete(**options):  # with the markers' text: the chat model's replies are short
        options = dict(prompt="ab", max_tokens=30, temperature=0, extra_body=KEEP_SPECIALS, **options)
        return client.completions.create(model="out", **options).choices[0]

    free = complete()
    stop = free.text[3:5]  # a stop string that the free text holds
    assert len(stop) == 2
    cut = complete(stop=stop)
    assert cut.text == free.text[: free.text.index(stop)] and cut.finish_reason == "stop"
    # any number of them: the earliest one in the text cuts it
    many = complete(stop=["zzzz"] * 8 + [free.text[6:8], stop])
    assert many.text == free.text[: min(free.text.index(stop), free.text.index(free.text[6:8]))]


def reference_logprobs(chat_dir, prompt, steps):
    """Greedy continuation by full forward passes, and every position's log-softmax in float64: (ids, (T, V))."""
    ckpt = load_checkpoint(chat_dir / "ckpt.pt")
    model = build_model(ModelConfig.from_dict(ckpt["model_config"]))
    model.load_state_dict(ckpt["weights"])
    model.eval()
    tokenizer = Tokenizer.from_meta(ckpt["meta"])
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids]))[0][0, -1, : tokenizer.vocab_size].argmax()))
        reference = model(torch.tensor([ids]))[0][0, :, : tokenizer.vocab_size].double().log_softmax(-1)  # (T, V)
    return ids, reference, tokenizer


def test_logprobs_are_the_models_own_log_softmax(client, chat_dir):
    ids, reference, tokenizer = reference_logprobs(chat_dir, "abcab", 4)
    for echo, max_tokens, stream in [(True, 0, False), (True, 4, False), (False, 4, False), (True, 4, True)]:
        options = dict(prompt="abcab", max_tokens=max_tokens, temperature=0, logprobs=2, echo=echo)
        if stream:  # each chunk has the logprobs of its ids: joined, the same as unstreamed
            chunks = list(client.completions.create(model="out", **options, stream=True, extra_body=KEEP_SPECIALS))
            tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
            values = [v for c in chunks for v in c.choices[0].logprobs.token_logprobs]
            offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
            got_text = "".join(c.choices[0].text for c in chunks)
        else:
            got = client.completions.create(model="out", **options, extra_body=KEEP_SPECIALS).choices[0]
            tokens, values = got.logprobs.tokens, got.logprobs.token_logprobs
            offsets, got_text = got.logprobs.text_offset, got.text
        first = 0 if echo else 5  # the prompt's tokens come first with echo; the first has no log p
        shown = ids[first : 5 + max_tokens]
        assert tokens == [tokenizer.decode([i]) for i in shown]
        assert got_text == ("abcab" if echo else "") + tokenizer.decode(ids[5 : 5 + max_tokens])
        assert all(got_text[at:].startswith(token) for at, token in zip(offsets, tokens, strict=True))
        expected = [None if t == 0 else float(reference[t - 1, ids[t]]) for t in range(first, 5 + max_tokens)]
        assert values == pytest.approx(expected, abs=1e-4)
        if not stream:
            for t, top in zip(range(first, 5 + max_tokens), got.logprobs.top_logprobs):
                if t:  # the two likeliest, the likeliest first
                    likeliest = reference[t - 1].topk(2).values.tolist()
                    assert sorted(top.values(), reverse=True) == pytest.approx(likeliest, abs=1e-4)
    # one prompt id scored alone has no log p; asking for more likeliest ids than the vocabulary holds lists them all
    got = client.completions.create(model="out", prompt=ids[:1], max_tokens=1, logprobs=20, echo=True, temperature=0)
    assert got.choices[0].logprobs.token_logprobs[0] is None
    assert len(got.choices[0].logprobs.top_logprobs[1]) == len(
        {tokenizer.decode([i]) for i in range(tokenizer.vocab_size)}
    )


def test_chat_logprobs_are_the_models_own_log_softmax(client, chat_dir):
    got = client.chat.completions.create(
        model="out", messages=[{"role": "user", "content": "abca"}], temperature=0, logprobs=True, top_logprobs=3
    ).choices[0]
    ckpt = load_checkpoint(chat_dir / "ckpt.pt")
    model = build_model(ModelConfig.from_dict(ckpt["model_config"])).eval()
    model.load_state_dict(ckpt["weights"])
    tokenizer, special = Tokenizer.from_meta(ckpt["meta"]), ckpt["meta"]["special_tokens"]
    prompt = [special["user"], *tokenizer.encode("abca"), special["end_of_turn"], special["assistant"]]
    reply = tokenizer.encode(got.message.content)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + reply]))[0][0, len(prompt) - 1 :, : tokenizer.vocab_size]
    reference = logits.double().log_softmax(-1)  # (reply + 1, V): each reply id's, then the end-of-turn's
    entries = got.logprobs.content
    assert [e.token for e in entries] == list(got.message.content) and entries
    assert [e.logprob for e in entries] == pytest.approx(
        [float(reference[k, i]) for k, i in enumerate(reply)], abs=1e-4
    )
    for k, entry in enumerate(entries):
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(reference[k].topk(3).values.tolist(), abs=1e-4)
        assert entry.bytes == list(entry.token.encode())


def test_a_reply_ends_at_any_role_marker_and_completions_skip_special_tokens(client, chat_dir):
    special = load_checkpoint(chat_dir / "ckpt.pt")["meta"]["special_tokens"]
    user = [{"role": "user", "content": "abca"}]
    # the bias makes <user> the likeliest first id: the reply ends there, empty, and the next turn is answered
    forced = {str(special["user"]): 100}
    got = client.chat.completions.create(model="out", messages=user, temperature=0, logit_bias=forced).choices[0]
    assert (got.message.content, got.finish_reason) == ("", "stop")
    after = [*user, {"role": "assistant", "content": got.message.content}, {"role": "user", "content": "ab"}]
    assert client.chat.completions.create(model="out", messages=after, temperature=0).choices[0].finish_reason == "stop"
    # a completion drawing <end_of_turn> first: no text for it, unless asked
    forced = {str(special["end_of_turn"]): 100}
    options = dict(model="out", prompt="ab", max_tokens=1, temperature=0, logit_bias=forced)
    assert client.completions.create(**options).choices[0].text == ""
    assert client.completions.create(**options, extra_body=KEEP_SPECIALS).choices[0].text == "<end_of_turn>"


def test_min_p_of_1_keeps_only_the_likeliest_id(client):
    greedy = client.completions.create(model="out", prompt="ab", max_tokens=20, temperature=0).choices[0].text
    options = dict(prompt="ab", max_tokens=20, temperature=1.5, seed=7, extra_body={"min_p": 1.0})
    assert client.completions.create(model="out", **options).choices[0].text == greedy


def test_a_conversation_longer_than_the_context_goes_on_without_its_oldest_turns(client, chat_dir, tmp_path):
    """The chat model reads 48 positions: six exchanges are more, and the server drops the oldest ones."""
    messages = [{"role": "system", "content": "bc"}]
    for question in ["abca", "bcab", "cabc", "abab", "bbca", "acca"]:
        messages.append({"role": "user", "content": question})
        got = client.chat.completions.create(model="out", messages=messages, temperature=0, max_tokens=4)
        messages.append({"role": "assistant", "content": got.choices[0].message.content})
    dropped = got.model_extra["dropped_messages"]
    assert dropped >= 2 and dropped % 2 == 0  # whole exchanges
    # the reply is what the model gives the conversation without them, the system prompt kept
    kept = [messages[0], *messages[1 + dropped : -1]]
    again = client.chat.completions.create(model="out", messages=kept, temperature=0, max_tokens=4)
    assert again.choices[0].message.content == messages[-1]["content"] and "dropped_messages" not in again.model_extra
    refusing = Running(served_from(chat_dir), context="refuse")
    try:
        body = {"messages": messages[:-1], "temperature": 0}
        response = httpx.post(refusing.url + "/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    finally:
        refusing.stop()


def chat_formats(chat_dir, llama_dir, root):
    """
    (name, ChatFormat, Tokenizer) of three templates: the chat model's built-in one, and on the Llama folder's BPE
    ChatML's with its default system message and Llama 3's, which trims each message (so that a message's text may
    count more tokens than it renders).
    """
    meta = load_checkpoint(chat_dir / "ckpt.pt")["meta"]
    formats = [("builtin", ChatFormat.from_meta(meta), Tokenizer.from_meta(meta))]
    text = (llama_dir / "tokenizer.json").read_text(encoding="utf-8")
    for name, template in [("chatml", CHATML), ("llama3", LLAMA3)]:
        folder = hf_folder(root / name, text, template, bos_token="<s>", eos_token="</s>")
        meta = {"kind": "chat", **huggingface_tokenizer(folder), "chat": folder_chat(folder)}
        formats.append((name, ChatFormat.from_meta(meta), Tokenizer.from_meta(meta)))
    return formats


class Counting:
    """A ChatFormat's prompt_ids that records how many messages each call rendered."""

    def __init__(self, chat):
        self.chat, self.rendered = chat, []

    def prompt_ids(self, messages):
        self.rendered.append(len(messages))
        return self.chat.prompt_ids(messages)


def random_conversation(rng, count, alphabet, padded=0.0):
    """
    count messages of random roles and lengths (empty ones too), maybe a system prompt first, the user's last; in
    the later half, that fraction of messages end in spaces (which Llama 3's template trims).
    """
    roles = ["user", "assistant"]
    messages = [{"role": "system", "content": "ab"}] if rng.random() < 0.5 else []
    for k in range(count):
        text = "".join(rng.choices(alphabet, k=rng.randrange(k == count - 1, 13)))
        if k > count // 2 and rng.random() < padded:
            text += " " * rng.randrange(40)
        messages.append({"role": "user" if k == count - 1 else rng.choice(roles), "content": text})
    return messages


def outcome(fit, *args):
    """What a fit returns, or its ValueError's message."""
    try:
        return fit(*args)
    except ValueError as err:
        return str(err)


def test_a_long_conversation_is_cut_where_fit_conversation_cuts_it_rendering_it_once(chat_dir, llama_dir, tmp_path):
    """
    generate.fit_conversation (sample.py --chat's) drops the oldest exchange and renders the rest again until it
    fits: the reference, and quadratic in the messages. The server's fit keeps what it keeps, or refuses as it does,
    for random conversations on three templates, and renders the whole conversation once, then about a context.
    """
    rng = random.Random(0)
    for name, chat, chat_tokenizer in chat_formats(chat_dir, llama_dir, tmp_path):
        alphabet = "abc" if name == "builtin" else "ab c. "  # the chat model's characters; spaces for Llama's trim
        # contexts of a few messages to a few hundred: this BPE spells each template's markers in many tokens
        blocks = [48, 100, 300] if name == "builtin" else [300, 1000, 3000]
        for _ in range(40):
            padded = 0.0 if name == "builtin" else rng.choice([0.0, 0.5])
            messages = random_conversation(rng, rng.choice([1, 3, 10, 40, 100]), alphabet, padded)
            block, room = rng.choice(blocks), rng.choice([1, 7, 30])
            expected = outcome(fit_conversation, chat, messages, block, room)
            assert outcome(serve.fit_long_conversation, chat, messages, block, room, chat_tokenizer) == expected
        if name == "llama3":  # later messages that count 30 spaces more than they render: the cut comes back
            messages = [
                {"role": ["user", "assistant"][k % 2], "content": "ab" + " " * 30 * (k > 100)} for k in range(201)
            ]
            counting = Counting(chat)
            fitted = serve.fit_long_conversation(counting, messages, 3000, 1, chat_tokenizer)
            assert fitted == fit_conversation(chat, messages, 3000, 1) and counting.rendered[1] < len(fitted[0])
        counting, messages = Counting(chat), random_conversation(rng, 5000, alphabet)
        kept, _ = serve.fit_long_conversation(counting, messages, blocks[-1], 1, chat_tokenizer)
        rendered = counting.rendered
        assert 10 < len(kept) < 1000 and rendered[0] == len(messages)
        # then a few renderings of what is kept; the reference renders an exchange less each time, ~2,500 times
        assert len(rendered) <= 8 and sum(rendered[1:]) <= 8 * len(kept), rendered


def tiny_messages_body(max_body):
    """The largest chat body of at most max_body bytes made of one-letter messages, as JSON text: (body, its count)."""
    message = '{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}'
    head, tail = '{"max_tokens": 1, "temperature": 0, "messages": [', '{"role": "user", "content": "a"}]}'
    pairs = (max_body - len(head) - len(tail)) // (len(message) + 2)
    body = head + ", ".join([message] * pairs) + ", " + tail
    assert len(body) <= max_body < len(body) + len(message) + 2
    return body, 2 * pairs + 1


@pytest.mark.parametrize("max_messages", [100_000, None])
def test_the_largest_body_of_tiny_messages_is_answered_in_seconds_and_health_meanwhile(chat_dir, max_messages):
    """
    About 27,000 one-letter messages in the 1 MB a body may hold. Dropping their oldest turns one render at a time,
    on the loop, held the server for 469 s (and /health with it); now 0.2 s, /health answering within 0.1 s. The
    bounds are 100x that, for a loaded 2-core machine. With --max_messages at its default they are refused at once.
    """
    options = {} if max_messages is None else {"max_messages": max_messages}
    running = Running(served_from(chat_dir), **options)
    body, count = tiny_messages_body(1_000_000)
    worst, done = [0.0], threading.Event()

    def probe():  # /health's slowest answer while the request runs
        while not done.is_set():
            start = time.monotonic()
            assert httpx.get(running.url + "/health", timeout=60).status_code == 200
            worst[0] = max(worst[0], time.monotonic() - start)
            time.sleep(0.02)

    try:
        with ThreadPoolExecutor(1) as pool:
            probing = pool.submit(probe)
            start = time.monotonic()
            headers = {"Content-Type": "application/json"}
            response = httpx.post(running.url + "/v1/chat/completions", content=body, headers=headers, timeout=120)
            took = time.monotonic() - start
            done.set()
            probing.result()
    finally:
        done.set()
        running.stop()
    assert took < 20 and worst[0] < 10, (took, worst[0])
    if max_messages is None:
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == "messages"
        assert f"{count} messages" in error["message"] and "--max_messages" in error["message"]
        assert "\n" not in error["message"]
    else:
        # all but the last exchanges dropped: whole exchanges (a user message and its reply), the last message kept
        assert response.status_code == 200, response.text
        dropped = response.json()["dropped_messages"]
        assert dropped % 2 == 0 and 0 < count - dropped < 48


def test_truncate_prompt_tokens_keeps_the_prompts_last_ids(client):
    long = "abcabcbbacab" * 5  # 60 characters: more than the 48 the model reads
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="out", prompt=long, max_tokens=5)
    options = dict(model="out", max_tokens=5, temperature=0, echo=True)
    got = client.completions.create(prompt=long, extra_body={"truncate_prompt_tokens": 20}, **options).choices[0]
    assert got.text == client.completions.create(prompt=long[-20:], **options).choices[0].text
    assert got.text.startswith(long[-20:])


# -----------------------------------------------------------------------------
# What every client sends

# Bodies as openai-python, LangChain's ChatOpenAI, lm-evaluation-harness (local-completions, local-chat-completions)
# and Open WebUI send them: each must get 2xx. Fields this server does not implement but that change nothing
# (metadata, store, tools: [], stream_options, ...) are ignored.
CLIENT_BODIES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}], "model": "out"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}], "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "ab"}]}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}], "max_completion_tokens": 3, "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}], "logprobs": True, "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}], "response_format": {"type": "text"}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}], "tools": [], "tool_choice": "none"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}], "parallel_tool_calls": False}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}], "metadata": {"a": "b"}, "store": False}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}], "logit_bias": {}, "min_p": 0.05}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}], "user": "x", "service_tier": "auto"}),
    # LangChain's ChatOpenAI: stream with usage, n and temperature always sent
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "ab"}],
            "model": "out",
            "stream": True,
            "n": 1,
            "temperature": 0.7,
            "stream_options": {"include_usage": True},
        },
    ),
    # Open WebUI
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "system", "content": "b"}, {"role": "user", "content": "ab"}],
            "stream": True,
            "model": "out",
            "top_p": 0.9,
            "frequency_penalty": 0,
            "presence_penalty": 0,
            "seed": 3,
            "stop": ["ccc"],
            "reasoning_effort": None,
            "keep_alive": "5m",
            "options": {},
        },
    ),
    # lm-eval local-chat-completions: greedy, its task's stop strings and max_tokens
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "ab"}],
            "model": "out",
            "max_tokens": 8,
            "temperature": 0,
            "stop": ["\n\n", "Question:", "</s>", "<|im_end|>", "ccc", "bbb"],
            "seed": 1234,
        },
    ),
    # lm-eval local-completions: loglikelihood (echo) and generate_until with six stops
    (
        "/v1/completions",
        {
            "model": "out",
            "prompt": [[1, 2, 3]],
            "temperature": 0,
            "max_tokens": 1,
            "logprobs": 1,
            "seed": 1234,
            "echo": True,
        },
    ),
    (
        "/v1/completions",
        {
            "model": "out",
            "prompt": ["ab", "ca"],
            "max_tokens": 8,
            "temperature": 0,
            "stop": ["\nclass", "\ndef", "\n#", "\nif", "\nprint", "<|endoftext|>"],
            "seed": 1234,
        },
    ),
    # openai-python's completions, with best_of as n, suffix null, and a user
    ("/v1/completions", {"model": "out", "prompt": "ab", "max_tokens": 5, "best_of": 1, "suffix": None, "user": "u"}),
    ("/v1/completions", {"prompt": "ab", "stream": True, "stream_options": {"include_usage": False}}),
    ("/v1/completions", {"prompt": "ab", "logprobs": 2, "stream": True}),
    ("/v1/completions", {"prompt": "ab", "logit_bias": {"0": -100, "1": 2.5}, "min_p": 0.1, "top_k": 5}),
    ("/v1/completions", {"prompt": "ab", "stop": [f"z{k}" for k in range(10)], "temperature": 0}),
    ("/tokenize", {"prompt": "abc", "add_special_tokens": False}),
    ("/tokenize", {"messages": [{"role": "user", "content": "ab"}], "model": "out"}),
    ("/detokenize", {"tokens": [1, 2, 3]}),
]


@pytest.mark.parametrize("path, body", CLIENT_BODIES, ids=range(len(CLIENT_BODIES)))
def test_the_bodies_clients_send_are_answered(server, path, body):
    response = httpx.post(server.url + path, json=body, timeout=60)
    assert response.status_code == 200, response.text
    if body.get("stream"):
        events = [line for line in response.text.split("\n\n") if line]
        assert events[-1] == "data: [DONE]" and not any('"error"' in event for event in events)
        has_usage = (body.get("stream_options") or {}).get("include_usage", False)
        assert any('"usage"' in event for event in events) == has_usage


def test_unknown_fields_are_refused_with_strict(chat_dir):
    strict = Running(served_from(chat_dir), strict=True)
    try:
        body = {"messages": [{"role": "user", "content": "ab"}], "metadata": {"a": "b"}}
        response = httpx.post(strict.url + "/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == "metadata"
    finally:
        strict.stop()


def test_the_tokenizer_endpoints_are_the_models_tokenizer(server, chat_dir):
    meta = load_checkpoint(chat_dir / "ckpt.pt")["meta"]
    tokenizer = Tokenizer.from_meta(meta)
    got = httpx.post(server.url + "/tokenize", json={"prompt": "abca"}).json()
    assert got["tokens"] == tokenizer.encode("abca") and got["count"] == 4 and got["max_model_len"] == 48
    # a special token's text stands for the token, as Hugging Face tokenizers read it
    marked = httpx.post(server.url + "/tokenize", json={"prompt": "ab<end_of_turn>c"}).json()["tokens"]
    assert marked == [*tokenizer.encode("ab"), meta["special_tokens"]["end_of_turn"], *tokenizer.encode("c")]
    back = httpx.post(server.url + "/detokenize", json={"tokens": marked}).json()["prompt"]
    assert back == "ab<end_of_turn>c"
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["eos_token"] is None and info["bos_token"] is None and info["model_max_length"] == 48
    assert httpx.post(server.url + "/detokenize", json={"tokens": [10**6]}).status_code == 400


def test_health_is_503_until_the_model_is_loaded_and_metrics_count(chat_dir):
    running = Running(None)
    try:
        assert httpx.get(running.url + "/health").status_code == 503
        assert httpx.post(running.url + "/v1/completions", json={"prompt": "ab"}).status_code == 503
        running.app.state.api.load(served_from(chat_dir))
        assert httpx.get(running.url + "/health").status_code == 200
        body = {"prompt": "ab", "max_tokens": 5, "n": 2}
        assert httpx.post(running.url + "/v1/completions", json=body, timeout=60).status_code == 200
        metrics = httpx.get(running.url + "/metrics").text
        values = dict(line.split() for line in metrics.splitlines() if not line.startswith("#"))
        assert values["nanoformer_generation_tokens_total"] == "10"
        assert values["nanoformer_requests_running"] == values["nanoformer_requests_waiting"] == "0"
    finally:
        running.stop()


def held_decode(runner, monkeypatch, until):
    """
    runner.decode that waits until `until()` holds before each step, for 20 s at most: the rows' first ids (drawn
    at the prefill) come out, then the stream stands still. Returns how each wait ended: True when until() held,
    False when it timed out.
    """
    decode, ended = runner.decode, []

    def held():
        deadline = time.monotonic() + 20
        while not until() and time.monotonic() < deadline:
            time.sleep(0.01)
        ended.append(until())
        return decode()

    monkeypatch.setattr(runner, "decode", held)
    return ended


def test_requests_wait_for_room_in_the_batch(chat_dir, monkeypatch):
    running = Running(served_from(chat_dir), max_batch=2)
    go = threading.Event()
    held_decode(running.engine.runner, monkeypatch, go.is_set)
    try:
        with ThreadPoolExecutor(2) as pool:
            body = {"prompt": "ab", "max_tokens": 10, "n": 2, "temperature": 0}
            first = pool.submit(httpx.post, running.url + "/v1/completions", json=body, timeout=60)
            second = pool.submit(httpx.post, running.url + "/v1/completions", json={**body, "n": 1}, timeout=60)
            deadline, values = time.monotonic() + 20, {}
            while values.get("nanoformer_requests_waiting") != "1" and time.monotonic() < deadline:
                metrics = httpx.get(running.url + "/metrics").text
                values = dict(line.split() for line in metrics.splitlines() if not line.startswith("#"))
            assert values["nanoformer_requests_waiting"] == "1" and values["nanoformer_requests_running"] == "1"
            go.set()
            assert first.result().status_code == second.result().status_code == 200
        # a request that could never fit is refused rather than kept waiting
        too_many = httpx.post(running.url + "/v1/completions", json={"prompt": "ab", "n": 3}, timeout=60)
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
    finally:
        go.set()
        running.stop()


# -----------------------------------------------------------------------------
# Under load: a full waiting line, the time limit, Ctrl-C


def metrics(url):
    """/metrics' values by name."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {k.removeprefix("nanoformer_"): v for k, v in (line.split() for line in text.splitlines() if line[0] != "#")}


def wait_until(condition, what, seconds=30):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {seconds} s"
        time.sleep(0.01)


def test_a_full_waiting_line_is_refused_with_429_and_retry_after(chat_dir, monkeypatch):
    """One row runs (its steps held), two prompts wait (--max_waiting=2): the next requests are refused at once."""
    running = Running(served_from(chat_dir), max_batch=1, max_waiting=2)
    go = threading.Event()
    held_decode(running.engine.runner, monkeypatch, go.is_set)
    url, body = running.url + "/v1/completions", {"prompt": "ab", "max_tokens": 5, "temperature": 0}
    try:
        with ThreadPoolExecutor(3) as pool:
            first = pool.submit(httpx.post, url, json=body, timeout=60)
            wait_until(lambda: metrics(running.url)["requests_running"] == "1", "the first request runs")
            waiting = [pool.submit(httpx.post, url, json=body, timeout=60) for _ in range(2)]
            wait_until(lambda: metrics(running.url)["requests_waiting"] == "2", "two requests wait")
            for stream in (False, True):  # a stream too, before its headers
                refused = httpx.post(url, json={**body, "stream": stream}, timeout=10)
                assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
                assert "--max_waiting=2" in refused.json()["error"]["message"]
            go.set()
            assert [r.result().status_code for r in [first, *waiting]] == [200] * 3
        assert httpx.post(url, json=body, timeout=60).status_code == 200  # the line is empty again
    finally:
        go.set()
        running.stop()


def test_a_request_past_the_time_limit_ends_and_frees_its_rows(chat_dir, monkeypatch):
    """
    The steps are held until the request is cancelled, so only --request_timeout (1 s here) ends it: unstreamed
    with 504, streamed with an error event and [DONE]; either way its rows are freed, and the server goes on.
    """
    running = Running(served_from(chat_dir), request_timeout=1)
    runner, scheduler = running.engine.runner, running.engine.scheduler
    waits = held_decode(runner, monkeypatch, lambda: all(row.request.cancelled for row in runner.rows))
    url, body = running.url + "/v1/completions", {"prompt": "a", "max_tokens": 40, "n": 2}
    try:
        start = time.monotonic()
        whole = httpx.post(url, json=body, timeout=30)
        took = time.monotonic() - start
        error = whole.json()["error"]
        assert whole.status_code == 504 and error["type"] == "timeout" and "--request_timeout" in error["message"]
        assert 1 <= took < 15  # the held steps would have waited 20 s each
        wait_until(lambda: not runner.rows and scheduler.idle(), "its rows are freed")
        events = [e for e in httpx.post(url, json={**body, "stream": True}, timeout=30).text.split("\n\n") if e]
        assert (
            events[-1] == "data: [DONE]" and json.loads(events[-2].removeprefix("data: "))["error"]["type"] == "timeout"
        )
        wait_until(lambda: not runner.rows and scheduler.idle(), "the stream's rows are freed")
        assert all(waits)  # each held step went on because the request was cancelled, not after its 20 s
        monkeypatch.undo()  # steps run freely: a request within the limit is answered
        assert httpx.post(url, json={**body, "max_tokens": 3}, timeout=30).status_code == 200
    finally:
        running.stop()


def interrupted_while_streaming(chat_dir):
    """
    `python serve.py` on the chat model, four clients streaming one completion after another, then SIGINT: the
    process's exit status and stderr, once the clients are done (each stream ended, or refused as the server went).
    """
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, serve.__file__, f"--out_dir={chat_dir}", "--checkpoint=ckpt.pt", "--device=cpu"]
    process = subprocess.Popen([*command, f"--port={port}"], stderr=subprocess.PIPE, text=True)
    stop, events = threading.Event(), []

    def stream():  # streams until the server is gone
        body = {"prompt": "a", "max_tokens": 47, "n": 4, "stream": True}
        while not stop.is_set():
            with contextlib.suppress(httpx.HTTPError):
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
                    events.extend(response.iter_lines())

    try:
        wait_until(lambda: healthy(url), "the server answers", seconds=120)
        with ThreadPoolExecutor(4) as pool:
            clients = [pool.submit(stream) for _ in range(4)]
            wait_until(lambda: len(events) > 100, "the streams run")
            process.send_signal(signal.SIGINT)
            _, err = process.communicate(timeout=60)
            stop.set()
            for client in clients:
                client.result()
    finally:
        stop.set()
        process.kill()
        process.wait()
    return process.returncode, err


def test_ctrl_c_while_streaming_exits_130_without_an_abort(chat_dir):
    """
    Exit status 130, as sample.py's and train.py's, no traceback, no abort. Before, the engine thread could still be
    in a torch op when the interpreter exited, and the process aborted ("terminate called without an active
    exception", SIGABRT): ten tries in ten with these clients, exit status 0 otherwise. Two tries.
    """
    for _ in range(2):
        status, err = interrupted_while_streaming(chat_dir)
        assert status == 130, err
        assert err.endswith("serve.py: interrupted\n") and "Traceback" not in err and "terminate" not in err, err


def healthy(url):
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


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
        ("/v1/completions", {"prompt": "ab", "min_p": 1.5}, 400, "min_p"),
        ("/v1/completions", {"prompt": "ab", "stop": ""}, 400, "stop"),
        ("/v1/completions", {"prompt": "ab", "stop": ["a" * 257]}, 400, "stop"),
        ("/v1/completions", {"prompt": ["ab"] * 5, "n": 13}, 400, "n"),
        ("/v1/completions", {"prompt": "ab", "top_k": -2}, 400, "top_k"),
        ("/v1/completions", {"prompt": "ab", "frequency_penalty": 1}, 400, "frequency_penalty"),
        ("/v1/completions", {"prompt": "ab", "best_of": 3}, 400, "best_of"),
        ("/v1/completions", {"prompt": "ab", "suffix": "cd"}, 400, "suffix"),
        ("/v1/completions", {"prompt": "ab", "logit_bias": {"x": 1}}, 400, "logit_bias"),
        # digits that are not ASCII ("²" passes isdigit(), which int() refuses), a sign, more digits than int() reads
        ("/v1/completions", {"prompt": "ab", "logit_bias": {"²": 1}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "ab", "logit_bias": {"٣": 1}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "ab", "logit_bias": {"-1": 1}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "ab", "logit_bias": {"9" * 5000: 1}}, 400, "logit_bias"),
        ("/v1/completions", {}, 400, "prompt"),  # OpenAI requires a prompt; "" is one
        ("/v1/completions", {"prompt": "ab", "logit_bias": {"1": 101}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "ab", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "ab"}]}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab" * 30}]}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}], "max_tokens": 0}, 400, "max_tokens"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "ab"}], "max_tokens": 48},
            400,
            "max_tokens",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "tools": [{}]}, 400, "tools"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2},
            400,
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "json_object"}},
            400,
            "response_format",
        ),
        ("/tokenize", {}, 400, "prompt"),
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


PROMPT_RULE = "must be a string, a list of strings, a list of token ids or a list of lists of token ids"
USER = [{"role": "user", "content": "ab"}]


@pytest.mark.parametrize(
    "path, body, message",
    [
        ("/v1/completions", {}, f"prompt is required: it {PROMPT_RULE}"),
        ("/v1/completions", {"prompt": 5}, f"prompt: {PROMPT_RULE}"),
        ("/v1/completions", {"prompt": [[1, "x"]]}, f"prompt: {PROMPT_RULE}"),
        (
            "/v1/completions",
            {"prompt": "ab", "stop": [""]},
            "stop: must be a string or a list of at most 256 strings, each of 1 to 256 characters",
        ),
        ("/v1/completions", {"prompt": "ab", "presence_penalty": 1}, "presence_penalty: only 0 is supported"),
        ("/v1/chat/completions", {"messages": USER, "frequency_penalty": -1}, "frequency_penalty: only 0 is supported"),
        (
            "/v1/completions",
            {"prompt": "ab", "suffix": "cd"},
            "suffix: only null or an empty string is supported: inserting text is not implemented",
        ),
        (
            "/v1/chat/completions",
            {"messages": USER, "tools": [{}]},
            "tools: only none or an empty list is supported: calling tools is not implemented",
        ),
        ("/v1/completions", {"prompt": "ab", "temperature": 3}, "temperature: must be less than or equal to 2"),
        (
            "/v1/completions",
            {"prompt": "ab", "logit_bias": {"²": 1}},
            "logit_bias: its keys are token ids, 0 to 9; '²' is not one",
        ),
        ("/v1/chat/completions", {"messages": [1]}, "messages.0: must be a valid dictionary"),
    ],
)
def test_a_bad_field_is_named_in_plain_words(server, path, body, message):
    response = httpx.post(server.url + path, json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["message"] == message


# where pydantic's errors put a union member's name (prompt.str, stop.constrained-str, list[int]) in the location
TYPE_TAG = re.compile(r"\b(str|int|float|bool|dict|list|none)\b|[\[\]-]", re.IGNORECASE)


@pytest.mark.parametrize(
    "path, model, base",
    [
        ("/v1/completions", serve.CompletionRequest, {"prompt": "ab", "max_tokens": 1}),
        ("/v1/chat/completions", serve.ChatRequest, {"messages": USER, "max_tokens": 1}),
        ("/tokenize", serve.TokenizeRequest, {"prompt": "ab"}),
        ("/detokenize", serve.DetokenizeRequest, {"tokens": [1]}),
    ],
)
def test_no_validation_error_names_pydantics_types(server, path, model, base):
    """Every field of every request, given values of the wrong type or range: each 400 names the field in words."""
    values = [{"x": {}}, "x", -5, 10**30, [[["x"]]], [1, "x"], None]
    refused = set()
    for field in model.model_fields:
        for value in values:
            response = httpx.post(server.url + path, json={**base, field: value}, timeout=60)
            if response.status_code != 400:
                continue
            message = response.json()["error"]["message"]
            where = re.match("[^:= ]*", message).group()  # "prompt.0: ...", "prompt is required", "max_tokens=..."
            assert where.split(".")[0] == field and not TYPE_TAG.search(where), message
            assert "\n" not in message and "Input should" not in message
            refused.add(field)
    assert len(refused) >= len(model.model_fields) - 3  # each field refused something (model, stream_options...)


def test_a_body_over_the_limit_is_refused_before_it_is_read(server):
    huge = json.dumps({"prompt": "a" * 1_100_000})
    assert httpx.post(server.url + "/v1/completions", content=huge).status_code == 413

    def chunks():  # no Content-Length: counted as it comes
        for _ in range(12):
            yield b"a" * 100_000

    assert httpx.post(server.url + "/v1/completions", content=chunks()).status_code == 413


def test_a_client_that_leaves_mid_stream_frees_its_rows_at_once(server, monkeypatch):
    """The engine holds the stream after its first step until the request is cancelled: only the client's leaving
    ends it before its 47 tokens. Every wait is bounded, so a server that never notices fails instead of hanging."""
    runner, drawn = server.engine.runner, server.engine.stats()[2]
    waits = held_decode(runner, monkeypatch, lambda: all(row.request.cancelled for row in runner.rows))
    body = {"prompt": "a", "max_tokens": 47, "n": 4, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
        next(response.iter_lines())  # the first chunk, then the client is gone
    deadline = time.monotonic() + 30
    while (runner.rows or not server.engine.scheduler.idle()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not runner.rows and server.engine.scheduler.idle()
    assert all(waits)  # each held step (if one came before the rows were freed) went on as the request was cancelled
    assert server.engine.stats()[2] - drawn < 4 * 47  # freed, not decoded to the end


def test_a_failing_model_fails_its_request_and_the_server_goes_on(chat_dir):
    """A model that raises on the <user> id: in a prompt's prefill, and in a decode step once it is drawn."""
    served = served_from(chat_dir)
    poison, body = served.meta["special_tokens"]["user"], served.model.body.forward

    def failing(idx, **kwargs):
        if (idx == poison).any():
            raise RuntimeError("the model failed")
        return body(idx, **kwargs)

    served.model.body.forward = failing
    running = Running(served)
    try:
        url = running.url + "/v1/completions"
        alone = httpx.post(url, json={"prompt": [1, poison], "max_tokens": 3}, timeout=20)
        assert alone.status_code == 500 and "the model failed" in alone.json()["error"]["message"]
        drawn = {"prompt": "ab", "max_tokens": 3, "logit_bias": {str(poison): 100}, "stream": True}
        stream = httpx.post(url, json=drawn, timeout=20).text
        assert "the model failed" in stream and stream.endswith("data: [DONE]\n\n")
        # greedy: "no" and end-of-turn, no <user> (which a sampled reply may draw)
        assert httpx.post(url, json={"prompt": "ab", "max_tokens": 3, "temperature": 0}, timeout=20).status_code == 200
    finally:
        running.stop()


# -----------------------------------------------------------------------------
# Text as it streams: held until it is final


def test_a_character_split_over_ids_waits_for_its_last_byte():
    tokenizer = Tokenizer({"type": "tiktoken", "encoding": "gpt2"}, 50257, {"eot": 50256})
    text = "a🙂b été 世界"  # an emoji, accents and CJK: several of them span two or more ids
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    choice = serve.Choice(0, tokenizer.decode)
    pieces = [choice.add(engine.Token(0, i)) for i in ids] + [choice.end_at_length()]
    assert "".join(pieces) == text and not any("\ufffd" in piece for piece in pieces)
    # bytes whose character never completes still go out when the ids end, as the text decodes them
    cut = serve.Choice(0, tokenizer.decode)
    pieces = [cut.add(engine.Token(0, i)) for i in ids[:2]] + [cut.end_at_length()]
    assert "".join(pieces) == tokenizer.decode(ids[:2]) and pieces[-1].endswith("\ufffd")


def test_text_that_may_begin_a_stop_string_waits_for_what_follows():
    chars = Tokenizer({"type": "char", "chars": list("abcd")}, 4, {})
    choice = serve.Choice(0, chars.decode, stops=["cd", "bcx"])
    pieces = [choice.add(engine.Token(0, i)) for i in chars.encode("abcbcd")]
    # "b" may begin "bcx", "bc" too, "c" may begin "cd": each waits for what follows; "cd" then ends the text
    assert pieces == ["a", "", "", "bc", "", "b"]
    assert choice.finish == "stop" and choice.text == "abcb"


# -----------------------------------------------------------------------------
# A BPE model whose template puts bos before every text (a Llama folder), and lm-evaluation-harness


@pytest.fixture(scope="module")
def llama_server(llama_dir):
    running = Running(serve.load_served(serve.ServeConfig(init_from=str(llama_dir), device="cpu")))
    yield running
    running.stop()


def test_a_bos_models_greedy_completion_is_sample_py(llama_server, llama_dir):
    client = openai.OpenAI(base_url=f"{llama_server.url}/v1", api_key="unused", max_retries=0)
    got = client.completions.create(model=llama_dir.name, prompt="ROMEO: Go", max_tokens=12, temperature=0)
    expected = sample_out(f"--init_from={llama_dir}", "--start=ROMEO: Go", "--max_new_tokens=12", "--temperature=0")
    assert "ROMEO: Go" + got.choices[0].text + "\n" == expected


def test_echoed_logprobs_start_at_the_prompts_text_after_bos(llama_server):
    served = llama_server.app.state.api.served
    tokenizer, bos = served.tokenizer, served.tokenizer.template_prefix()
    assert bos == [0]
    body = {"prompt": "ROMEO: Go", "max_tokens": 3, "temperature": 0, "logprobs": 1, "echo": True}
    got = httpx.post(llama_server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    shown = tokenizer.encode("ROMEO: Go")
    with torch.no_grad():
        logits = served.model(torch.tensor([bos + shown]))[0][0, :, : tokenizer.vocab_size]
    reference = logits.double().log_softmax(-1)  # (T, V): position t predicts id t + 1
    logprobs = got["logprobs"]
    assert logprobs["tokens"][: len(shown)] == [tokenizer.decode([i]) for i in shown]
    # the first shown id is scored after bos, which is neither shown nor scored
    expected = [float(reference[t, i]) for t, i in enumerate(shown)]
    assert logprobs["token_logprobs"][: len(shown)] == pytest.approx(expected, abs=1e-4)
    assert got["text"].startswith("ROMEO: Go") and len(logprobs["tokens"]) == len(shown) + 3
    assert logprobs["text_offset"][: len(shown)] == [len(tokenizer.decode(shown[:k])) for k in range(len(shown))]


LM_EVAL_ITEMS = [  # a multiple-choice task of our own: the hub's data sets are out of reach
    {"question": "ROMEO: What light", "choices": ["through yonder", "is the sun", "and the moon"], "answer": 0},
    {"question": "JULIET: O Romeo,", "choices": ["Romeo", "wherefore art", "thou"], "answer": 1},
    {"question": "First Citizen:", "choices": ["Before we proceed", "Speak", "You are all resolved"], "answer": 0},
    {"question": "MENENIUS: What", "choices": ["work's", "my countrymen", "in hand"], "answer": 2},
]
LM_EVAL_TEXT = "First Citizen: Before we proceed any further, hear me speak."  # shorter than the 64 positions


def lm_eval_tasks(folder):
    """The two tasks' JSONL files and YAMLs in folder: nano_choice (multiple choice), nano_rolling (perplexity)."""
    (folder / "choice.jsonl").write_text("\n".join(json.dumps(item) for item in LM_EVAL_ITEMS) + "\n")
    (folder / "text.jsonl").write_text(json.dumps({"text": LM_EVAL_TEXT}) + "\n")
    for name, data, fields in [
        (
            "choice",
            "choice.jsonl",
            "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
            "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n",
        ),
        (
            "rolling",
            "text.jsonl",
            "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
            "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n",
        ),
    ]:
        files = f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(folder / data))}\n"
        (folder / f"{name}.yaml").write_text(
            f"task: nano_{name}\ndataset_path: json\ntest_split: test\n{files}{fields}"
        )


def test_lm_eval_through_the_server_scores_as_eval_py_and_an_explicit_scoring_do(
    llama_server, llama_dir, tmp_path, monkeypatch
):
    """lm_eval --model local-completions with no tokenizer argument: the server's /tokenize serves as its tokenizer."""
    import lm_eval  # a dev dependency (requirements-dev.txt): imported here, as only this test needs it
    from lm_eval.tasks import TaskManager

    for variable in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(variable, "1")
    lm_eval_tasks(tmp_path)
    args = f"base_url={llama_server.url}/v1/completions,model={llama_dir.name},max_length=64"
    # lm-eval's remote tokenizer starts a document with `bos_token_id or eos_token_id`: this bos has id 0, which
    # that `or` passes over, so the bos is named (docs/eval.md); a bos of another id needs nothing
    args += ",custom_prefix_token_id=0"
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=args,
        tasks=["nano_choice", "nano_rolling"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),  # not its thousands of tasks
        log_samples=True,
    )
    served = llama_server.app.state.api.served
    tokenizer, model = served.tokenizer, served.model

    def loglikelihood(context, continuation):  # lm-eval's split of the ids; log p in float64, by one forward pass
        whole, head = tokenizer.encode(context + continuation), tokenizer.encode(context)
        with torch.no_grad():
            logits = model(torch.tensor([whole]))[0][0, :, : tokenizer.vocab_size].double().log_softmax(-1)
        return sum(float(logits[t - 1, whole[t]]) for t in range(len(head), len(whole)))

    scored = [[loglikelihood(item["question"], " " + c) for c in item["choices"]] for item in LM_EVAL_ITEMS]
    logged = sorted(results["samples"]["nano_choice"], key=lambda logged: logged["doc_id"])
    for item, expected in zip(logged, scored, strict=True):
        assert [resp[0][0] for resp in item["resps"]] == pytest.approx(expected, abs=1e-3)
    right = [max(range(3), key=lambda k: s[k]) == item["answer"] for s, item in zip(scored, LM_EVAL_ITEMS)]
    assert results["results"]["nano_choice"]["acc,none"] == pytest.approx(sum(right) / len(right))
    # the rolling loglikelihood of the text is minus eval.py's loss on it times its tokens, each scored after bos
    (tmp_path / "text.txt").write_text(LM_EVAL_TEXT)
    out = io.StringIO()
    eval_py.main(
        parse_config(
            eval_py.EvalConfig,
            [f"--init_from={llama_dir}", f"--input={tmp_path / 'text.txt'}", "--json", "--device=cpu"],
        ),
        out=out,
    )
    measured = json.loads(out.getvalue())
    (rolling,) = results["samples"]["nano_rolling"]
    assert measured["tokens"] == len(tokenizer.encode(LM_EVAL_TEXT))
    assert rolling["resps"][0][0] == pytest.approx(-measured["loss"] * measured["tokens"], abs=1e-3)


# -----------------------------------------------------------------------------
# The API key, a model without a template, what is not served


def plain_run(chat_dir, tmp_path):
    """The chat model's run without its chat template, in tmp_path/plain: a model that only completes."""
    plain = tmp_path / "plain"
    plain.mkdir()
    ckpt = load_checkpoint(chat_dir / "ckpt.pt")
    ckpt["meta"] = {k: v for k, v in ckpt["meta"].items() if k != "chat"}
    torch.save(ckpt, plain / "ckpt.pt")
    return plain


def test_with_an_api_key_every_request_needs_it_and_a_plain_model_only_completes(chat_dir, tmp_path):
    running = Running(served_from(plain_run(chat_dir, tmp_path)), api_key="s3cret")
    try:
        assert httpx.get(running.url + "/v1/models").status_code == 401
        # the tokenizer's endpoints too (lm-eval sends them the key); the page, /health and /metrics answer anyone
        key = {"Authorization": "Bearer s3cret"}
        for method, path, body in [
            ("POST", "/tokenize", {"prompt": "ab"}),
            ("POST", "/detokenize", {"tokens": [1]}),
            ("GET", "/tokenizer_info", None),
        ]:
            assert httpx.request(method, running.url + path, json=body).status_code == 401
            assert httpx.request(method, running.url + path, json=body, headers=key).status_code == 200
        assert [httpx.get(running.url + path).status_code for path in ["/", "/health", "/metrics"]] == [200] * 3
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
    assert serve.cli([f"--init_from={tmp_path / 'enc' / 'ckpt.pt'}", "--device=cpu", f"--port={free_port()}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("serve.py: error:") and "sample.py" in err and err.count("\n") == 1
    assert serve.cli(["--port=70000"]) == 2
    assert "port" in capsys.readouterr().err


def test_a_port_in_use_is_one_line_naming_port_before_anything_is_served(chat_dir, capsys):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert serve.cli([f"--out_dir={chat_dir}", "--checkpoint=ckpt.pt", "--device=cpu", f"--port={port}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("serve.py: error:") and "--port" in err and err.count("\n") == 1 and "serving" not in err


# -----------------------------------------------------------------------------
# The chat page, in a real browser


needs_chromium = pytest.mark.skipif(
    shutil.which("chromium") is None, reason="Debian's chromium is not installed (.ci/run installs it)"
)


@contextlib.contextmanager
def browser_page():
    """A Playwright page in Debian's chromium, headless, that records the JSON bodies it POSTs."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=shutil.which("chromium"),
            headless=True,
            args=["--no-sandbox", "--disable-background-networking", "--disable-component-update"],
        )
        try:
            page = browser.new_page()
            page.set_default_timeout(30_000)
            page.posted = []
            page.on("request", lambda r: page.posted.append(r.post_data_json) if r.method == "POST" else None)
            yield page
        finally:
            browser.close()


@needs_chromium
def test_the_chat_page_carries_a_conversation_longer_than_the_context(server, client):
    """Ten messages on a model of 48 positions: the oldest fade, a note says so; a failed turn leaves no trace."""
    with browser_page() as page:
        page.goto(server.url + "/")
        page.wait_for_function("document.title === 'out'")
        page.fill("#temperature", "0")
        # a message the model cannot read: an error, no bubble kept, the text back in the input box
        page.fill("#input", "xyz")
        page.press("#input", "Enter")
        page.wait_for_selector(".error")
        page.wait_for_function("!document.getElementById('send').disabled")
        assert page.locator(".user, .assistant").count() == 0 and page.input_value("#input") == "xyz"
        questions = ["abcabca", "bcabcab", "cabcabc", "ababcab", "bbcacab"]  # 4 exchanges are more than 48 ids
        for k, question in enumerate(questions):
            page.fill("#input", question)
            page.press("#input", "Enter")
            done = f"document.querySelectorAll('.assistant').length === {k + 1}"
            page.wait_for_function(done + " && !document.getElementById('send').disabled")
        assert page.locator(".error").count() == 0  # the last failure went with the next try
        assert page.locator(".user").all_text_contents() == questions
        replies = page.locator(".assistant").all_text_contents()
        assert len(replies) == 5 and all(replies)
        # every turn sent the whole conversation; the server dropped what did not fit, and the page says so
        last = page.posted[-1]
        assert [m["content"] for m in last["messages"][::2]] == questions and len(last["messages"]) == 9
        assert page.locator(".note").count() == 1 and page.locator(".dropped").count() >= 2
        expected = client.chat.completions.create(model="out", messages=last["messages"], temperature=0)
        assert replies[-1] == expected.choices[0].message.content
        page.click("#reset")  # start over: the log is empty
        assert page.locator(".message").count() == 0


@needs_chromium
def test_the_completion_box_continues_past_the_context(data_root, tmp_path):
    """A quick-start-shaped model (characters, no chat template) of 32 positions: each Continue goes on."""
    train.main(tiny(data_root, tmp_path / "quick"))
    running = Running(served_from(tmp_path / "quick"))
    try:
        with browser_page() as page:
            page.goto(running.url + "/")
            page.wait_for_function("document.title === 'quick'")
            page.fill("#input", "ROMEO:")
            lengths = [len("ROMEO:")]
            for _ in range(3):  # the first fills the context; then the window slides
                page.press("#input", "Enter")
                page.wait_for_function(
                    f"document.getElementById('completion').textContent.length > {lengths[-1]}"
                    " && !document.getElementById('send').disabled"
                )
                lengths.append(len(page.text_content("#completion")))
            assert page.locator(".error").count() == 0 and lengths[1] == 32 and lengths[-1] == 32 + 2 * 16
            assert page.posted[-1]["truncate_prompt_tokens"] == 16 and page.posted[-1]["prompt"].startswith("ROMEO:")
    finally:
        running.stop()


def send(page, text, replies):
    """Type a message into the page and wait until its reply, the `replies`-th, is all in."""
    page.fill("#input", text)
    page.press("#input", "Enter")
    done = f"document.querySelectorAll('.assistant').length === {replies}"
    page.wait_for_function(done + " && !document.getElementById('send').disabled")


@needs_chromium
def test_the_chat_page_keeps_the_conversation_and_settings_over_a_reload(server):
    """Browser storage: a reload shows the same turns and settings, and the next turn carries on from them."""
    with browser_page() as page:
        page.goto(server.url + "/")
        page.wait_for_function("document.title === 'out'")
        page.fill("#temperature", "0")
        page.fill("#max-tokens", "5")
        send(page, "abca", 1)
        reply = page.text_content(".assistant")
        page.reload()
        page.wait_for_function("document.title === 'out'")
        assert page.locator(".user").all_text_contents() == ["abca"]
        assert page.locator(".assistant").all_text_contents() == [reply]
        assert (page.input_value("#temperature"), page.input_value("#max-tokens")) == ("0", "5")
        send(page, "bcab", 2)
        last = page.posted[-1]
        assert last["messages"] == [
            {"role": "user", "content": "abca"},
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "bcab"},
        ]
        assert (last["temperature"], last["max_tokens"]) == (0, 5)
        page.click("#reset")  # New chat: the conversation goes, the settings stay
        page.reload()
        page.wait_for_function("document.title === 'out'")
        assert page.locator(".message").count() == 0 and page.input_value("#temperature") == "0"
        send(page, "abca", 1)
        page.click("#forget")  # Forget: all of it, the settings back to their defaults
        page.reload()
        page.wait_for_function("document.title === 'out'")
        assert page.locator(".message").count() == 0
        assert (page.input_value("#temperature"), page.input_value("#max-tokens")) == ("0.8", "")


@needs_chromium
def test_the_chat_page_asks_for_a_missing_key_in_its_field(chat_dir):
    """The server's 401 speaks of a header; the page asks for the key in its own field, and goes on once it has it."""
    running = Running(served_from(chat_dir), api_key="s3cret")
    try:
        with browser_page() as page:
            page.goto(running.url + "/")
            message = page.text_content(".error")
            assert "API key field" in message and "header" not in message and "reload" not in message
            assert page.is_visible("#key")
            page.fill("#key", "wrong")
            page.press("#key", "Tab")  # the field's change
            page.wait_for_function("document.querySelector('.error').textContent.includes('refused')")
            page.fill("#key", "s3cret")
            page.press("#key", "Tab")
            page.wait_for_function("document.title === 'out'")
            assert page.locator(".error").count() == 0
            send(page, "abca", 1)
            page.reload()  # the key is kept for this tab
            page.wait_for_function("document.title === 'out'")
            assert page.locator(".error").count() == 0 and page.locator(".assistant").count() == 1
    finally:
        running.stop()
