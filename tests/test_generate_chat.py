"""generate.py's conversation pieces: replies decoded from a KV cache kept across turns, and the final replies that
exact match scores, checked against full forward passes that recompute every position."""

import numpy as np
import pytest
import torch

from generate import ChatSession, decoded_replies
from model import GPT, ModelConfig

SYSTEM, USER, ASSISTANT, END = 0, 1, 2, 3  # the toy template's role and end-of-turn ids
ROLE_IDS = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}


class ToyFormat:
    """A template in the builtin layout (role id, content ids, end-of-turn): each character of a content is one id."""

    end_of_turn = (END,)

    def render(self, messages, add_generation_prompt=False):
        ids, targets = [], []
        for message in messages:
            content = [ord(c) - 256 for c in message["content"]]
            ids += [ROLE_IDS[message["role"]], *content, END]
            # the assistant's text and its end-of-turn are what a model learns to write
            targets += [False] + [message["role"] == "assistant"] * (len(content) + 1)
        if add_generation_prompt:
            ids, targets = ids + [ASSISTANT], targets + [False]
        return ids, targets

    def prompt_ids(self, messages):
        return self.render(messages, add_generation_prompt=True)[0]

    def reply_ends(self):
        return self.end_of_turn


def decode(ids):
    """The toy template's text of ids: any id, specials included, reads back as itself."""
    return "".join(chr(256 + i) for i in ids)


def tiny_gpt(block_size=64, seed=0):
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=24, block_size=block_size, n_layer=2, n_head=2, n_embd=32, pos_encoding="rope")
    return GPT(config).eval()


@torch.no_grad()
def greedy_uncached(model, ids, stop, limit):
    """The reference: every step a full forward pass over the whole sequence, argmax of the last position."""
    out = []
    while len(out) < limit:
        logits, _ = model(torch.tensor([ids + out]))
        token = int(logits[0, -1].argmax())
        out.append(token)
        if token in stop or len(ids) + len(out) > model.config.block_size:
            break
    return out


def test_a_session_keeps_its_cache_across_turns_and_replies_as_full_forward_passes_do():
    model, fmt = tiny_gpt(), ToyFormat()
    fed = []  # the positions each forward pass of the body reads
    body = model.body.forward

    def counting(idx, **kwargs):
        fed.append(idx.size(1))
        return body(idx, **kwargs)

    model.body.forward = counting
    session = ChatSession(model, fmt, system=decode([5, 6]), max_new_tokens=6, temperature=0.0)
    messages = [{"role": "system", "content": decode([5, 6])}]
    for user in ([7, 8, 9], [10, 11], [12]):
        reply = list(session.reply(decode(user), decode))
        # the reference renders the whole conversation so far and recomputes every position at every step
        messages.append({"role": "user", "content": decode(user)})
        prompt, _ = fmt.render(messages, add_generation_prompt=True)
        model.body.forward = body
        expected = greedy_uncached(model, prompt, {END}, 6)
        model.body.forward = counting
        assert reply == [t for t in expected if t != END]
        assert session.ended == ("end_of_turn" if expected[-1] == END else "max_new_tokens")
        messages.append({"role": "assistant", "content": decode(reply)})
    # every position went through the model once: the earlier turns were never fed again
    assert session.recomputed == 0
    final, _ = fmt.render(messages)
    assert sum(fed) == session.cache[0][0].length <= len(final)
    assert session.fed == final[: len(session.fed)]


def test_a_session_feeds_everything_again_when_the_history_renders_otherwise():
    model, fmt = tiny_gpt(), ToyFormat()
    session = ChatSession(model, fmt, max_new_tokens=4, temperature=0.0)
    first = list(session.reply(decode([7]), decode))
    # as a template that rewrites earlier turns would: the kept ids no longer begin the rendered history
    session.messages[-1]["content"] = decode([9, 9, 9])
    second = list(session.reply(decode([8]), decode))
    messages = [
        {"role": "user", "content": decode([7])},
        {"role": "assistant", "content": decode([9, 9, 9])},
        {"role": "user", "content": decode([8])},
    ]
    prompt, _ = fmt.render(messages, add_generation_prompt=True)
    assert session.recomputed == 1 and first
    assert second == [t for t in greedy_uncached(model, prompt, {END}, 4) if t != END]


def test_a_reply_that_reaches_block_size_says_so_and_a_message_that_cannot_fit_is_refused():
    model, fmt = tiny_gpt(block_size=12), ToyFormat()
    fmt.end_of_turn = ()  # no id ends a reply: it runs until the cache is full
    session = ChatSession(model, fmt, max_new_tokens=100, temperature=0.0)
    reply = list(session.reply(decode([7, 8, 9]), decode))
    assert session.ended == "block_size"
    assert session.cache[0][0].length == 12  # prompt (6 ids) + the reply's ids but its last one
    assert len(reply) == 12 - 6 + 1
    # the earlier exchange is dropped first, then the message alone (22 ids and the assistant's header) is too long
    before = list(session.messages)
    with pytest.raises(
        ValueError, match=r"^the message takes 23 tokens with the chat template, and the model reads 12"
    ):
        list(session.reply(decode([7] * 20), decode))
    assert session.messages == before and session.dropped == 0  # refused: nothing changed
    session.reset()
    assert session.messages == [] and session.cache[0][0].length == 0


def test_decoded_replies_greedily_answer_the_last_turn():
    model, fmt = tiny_gpt(), ToyFormat()
    conversations = []
    for user in ([7, 8], [9], [10, 11, 12]):
        ids, targets = fmt.render(
            [{"role": "user", "content": decode(user)}, {"role": "assistant", "content": "\u0105"}]
        )
        conversations.append((np.array(ids), np.array(targets)))
    for (ids, _), (output, reference) in zip(conversations, decoded_replies(model, conversations, {END})):
        prompt = ids[:-2].tolist()  # the user turn and the assistant's header
        assert reference == [5, END]
        assert output == greedy_uncached(model, prompt, {END}, model.config.block_size)
