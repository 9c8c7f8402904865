"""chat.py: the built-in template against hand-written ids, Hugging Face templates against transformers."""

import json

import pytest
import tokenizers
import transformers  # a dev dependency (requirements-dev.txt): the reference; missing, the suite fails

import tokens
from chat import BUILTIN_TOKENS, ChatFormat, conversation_problem, folder_chat, with_chat_tokens
from recipes.text import train_byte_level_bpe

# the special tokens of Llama 3's and of Qwen's (ChatML) templates, in one small byte-level BPE
SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
]

# shaped as Llama 3 Instruct's template: bos before the first message, each trimmed, <|eot_id|> closes every turn
LLAMA3 = (
    r"{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    r"message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 "
    r"%}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    r"{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# shaped as Qwen2.5's: ChatML with a default system message, and a newline after each <|im_end|>
CHATML = (
    r"{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    r"You are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    r"message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n'"
    r" }}{% endif %}"
)
# the same two renderings with the assistant's part in {% generation %} blocks: transformers' own mask of them
# (return_assistant_tokens_mask) is the reference for ours
LLAMA3_GENERATION = (
    r"{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    r" }}{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
    r"{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHATML_GENERATION = (
    r"{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    r"You are a helpful assistant.<|im_end|>\n' }}{% endif %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    r"{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    r"{{ '\n' }}{% else %}{{ message['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# what else transformers' renderer offers: a multi-line template (trim_blocks, lstrip_blocks), loop controls, a
# namespace, tojson (non-ASCII and '<' kept as they are), strftime_now, and tools and documents that are none
FEATURES = """\
{% set ns = namespace(turn=0) %}
{% if tools is not none or documents is not none %}
    (tools)
{% endif %}
{{ bos_token }}
{% for message in messages %}
    {% if message['role'] == 'system' %}
        {{ strftime_now('%Y') }}
        {% continue %}
    {% endif %}
    {% set ns.turn = ns.turn + 1 %}
    <|start_header_id|>{{ ns.turn }} {{ message['role'] }}<|end_header_id|>
{{ message['content'] | tojson }}<|eot_id|>
{% endfor %}
{% if add_generation_prompt %}
    <|start_header_id|>{{ ns.turn + 1 }} assistant<|end_header_id|>
{% endif %}
"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "The cat sat."}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "Four."},
    ],
    [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "  Hello, how are you?  "},
        {"role": "user", "content": "café ☕ <b>"},
        {"role": "assistant", "content": "The mat.\n\nThe cat!"},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": ""},
    ],
]
# the text of each assistant reply as the Llama 3 template writes it, with its closing token: the expected targets
LLAMA3_REPLIES = [
    "The cat sat.<|eot_id|>",
    "Four.<|eot_id|>",
    "Hello, how are you?<|eot_id|>The mat.\n\nThe cat!<|eot_id|><|eot_id|>",
]


@pytest.fixture(scope="module")
def tokenizer_json():
    """A byte-level BPE of 300 ids, as Llama 3's and Qwen's are, with both templates' special tokens."""
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(["The cat sat on the mat. Hello there, how are you? What is two plus two? Four."], trainer)
    return bpe.to_str()


def hf_folder(path, tokenizer_json, template=None, template_file=None, **config):
    """A Hugging Face tokenizer folder at path: tokenizer.json, tokenizer_config.json and maybe chat_template.jinja."""
    path.mkdir()
    (path / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **config}
    if template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    if template_file is not None:
        (path / "chat_template.jinja").write_text(template_file, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def folders(tokenizer_json, tmp_path_factory):
    """Folders named by their template: Llama 3's (eos as the object older configs store), ChatML's in its own file."""
    root = tmp_path_factory.mktemp("chat")
    # as older tokenizer_config.json files store a token: an AddedToken object
    eot = {"__type": "AddedToken", "content": "<|eot_id|>", "lstrip": False, "normalized": False, "rstrip": False}
    eot |= {"single_word": False, "special": True}
    llama = {"bos_token": "<|begin_of_text|>", "eos_token": eot}
    chatml = {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
    return {
        "llama3": hf_folder(root / "llama3", tokenizer_json, LLAMA3, **llama),
        "chatml": hf_folder(root / "chatml", tokenizer_json, template_file=CHATML, **chatml),
        "llama3_generation": hf_folder(root / "llama3_generation", tokenizer_json, LLAMA3_GENERATION, **llama),
        "chatml_generation": hf_folder(root / "chatml_generation", tokenizer_json, CHATML_GENERATION, **chatml),
        "features": hf_folder(root / "features", tokenizer_json, FEATURES, **llama),
    }


def folder_format(folder):
    """The ChatFormat of a chat dataset prepared from folder's tokenizer and template, through its meta."""
    meta = {"kind": "chat", **tokens.huggingface_tokenizer(folder), "chat": folder_chat(folder)}
    # as a dataset's meta.json: what a checkpoint stores must survive JSON
    return ChatFormat.from_meta(json.loads(json.dumps(meta)))


def cases():
    """(messages, add_generation_prompt): each conversation whole, and without its last reply, asking for it."""
    for messages in CONVERSATIONS:
        yield messages, False
        yield messages[:-1], True


# ----------------------------------------------------------------------------- Hugging Face templates


@pytest.mark.parametrize("name", ["llama3", "chatml", "llama3_generation", "chatml_generation", "features"])
def test_template_ids_equal_apply_chat_template(folders, name):
    reference = transformers.AutoTokenizer.from_pretrained(folders[name])
    chat = folder_format(folders[name])
    for messages, prompt in cases():
        expected = reference.apply_chat_template(messages, add_generation_prompt=prompt, return_dict=True)["input_ids"]
        assert chat.render(messages, add_generation_prompt=prompt)[0] == expected, (messages, prompt)
        assert (
            chat.prompt_ids(messages)
            == reference.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        )


@pytest.mark.parametrize("name", ["llama3_generation", "chatml_generation"])
def test_template_targets_equal_transformers_assistant_mask(folders, name):
    reference = transformers.AutoTokenizer.from_pretrained(folders[name])
    chat = folder_format(folders[name])
    for messages, prompt in cases():
        expected = reference.apply_chat_template(
            messages, add_generation_prompt=prompt, return_dict=True, return_assistant_tokens_mask=True
        )["assistant_masks"]
        assert chat.render(messages, add_generation_prompt=prompt)[1] == [bool(m) for m in expected], messages


def test_template_targets_are_each_reply_and_its_end_of_turn(folders):
    reference = transformers.AutoTokenizer.from_pretrained(folders["llama3"])
    chat = folder_format(folders["llama3"])
    eot = reference.convert_tokens_to_ids("<|eot_id|>")
    for messages, replies in zip(CONVERSATIONS, LLAMA3_REPLIES):
        ids, targets = chat.render(messages)
        learned = [i for i, target in zip(ids, targets) if target]
        assert reference.decode(learned) == replies
        # one end-of-turn per assistant message, the rest of the ends (user turns) are no targets
        assert learned.count(eot) == sum(m["role"] == "assistant" for m in messages)
    # the generation prompt is the model's input, never a target
    assert not any(chat.render(CONVERSATIONS[0][:1], add_generation_prompt=True)[1])


def test_chatml_targets_stop_at_im_end(folders):
    reference = transformers.AutoTokenizer.from_pretrained(folders["chatml"])
    ids, targets = folder_format(folders["chatml"]).render(CONVERSATIONS[2])
    # the newline after each <|im_end|> is the template's, not the model's to write
    learned = reference.decode([i for i, target in zip(ids, targets) if target])
    assert learned == "  Hello, how are you?  <|im_end|>The mat.\n\nThe cat!<|im_end|><|im_end|>"


def test_folder_chat_entry(folders):
    vocab = tokenizers.Tokenizer.from_file(str(folders["llama3"] / "tokenizer.json")).get_vocab()
    llama = folder_chat(folders["llama3"])
    assert llama == {
        "template": LLAMA3,
        "tokens": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        "end_of_turn": [vocab["<|eot_id|>"]],
    }
    chatml = folder_chat(folders["chatml"])
    assert chatml["template"] == CHATML and chatml["tokens"] == {
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
    }
    # the template's closing token first, then the eos token
    assert chatml["end_of_turn"] == [vocab["<|im_end|>"], vocab["<|endoftext|>"]]


def test_folder_chat_reads_config_eos_ids_named_templates_and_no_template(tokenizer_json, tmp_path):
    vocab = json.loads(tokenizer_json)["added_tokens"]
    ids = {token["content"]: token["id"] for token in vocab}
    # several named templates, as Cohere's: the default one; config.json's eos ids (Llama 3.1's list) join the ends
    named = [
        {"name": "tool_use", "template": "{{ raise_exception('tools') }}"},
        {"name": "default", "template": LLAMA3},
    ]
    folder = hf_folder(tmp_path / "named", tokenizer_json, named, bos_token="<|begin_of_text|>")
    (folder / "config.json").write_text(json.dumps({"eos_token_id": [ids["<|end_of_text|>"], ids["<|eot_id|>"]]}))
    chat = folder_chat(folder)
    assert chat["template"] == LLAMA3
    assert chat["end_of_turn"] == [ids["<|eot_id|>"], ids["<|end_of_text|>"]]
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    messages = CONVERSATIONS[1]
    expected = reference.apply_chat_template(messages, return_dict=True)["input_ids"]
    assert folder_format(folder).render(messages)[0] == expected
    assert folder_chat(hf_folder(tmp_path / "plain", tokenizer_json)) is None


# ----------------------------------------------------------------------------- templates that cannot be used


def one_line_error(call, match):
    """The one-line ValueError that call() raises, matching `match`."""
    with pytest.raises(ValueError, match=match) as caught:
        call()
    assert "\n" not in str(caught.value)


def test_template_that_does_not_render_is_one_line(tokenizer_json, tmp_path):
    # Gemma's way: no system role
    refusing = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    folder = hf_folder(tmp_path / "refusing", tokenizer_json, refusing + LLAMA3, bos_token="<|begin_of_text|>")
    chat = folder_format(folder)
    one_line_error(lambda: chat.render(CONVERSATIONS[1]), "does not render.*System role not supported")
    # not Jinja at all: refused when the folder is read
    broken = hf_folder(tmp_path / "broken", tokenizer_json, "{% for m in messages %}\n{{ m['content'] }", eos_token="x")
    one_line_error(lambda: folder_chat(broken), "not valid Jinja")
    # a Python error inside the template
    typo = hf_folder(tmp_path / "typo", tokenizer_json, "{{ messages[0]['content'] + 1 }}<|eot_id|>")
    one_line_error(lambda: folder_chat(typo), "does not render.*TypeError")


def test_template_that_renders_past_turns_differently_is_refused(tokenizer_json, tmp_path):
    # as templates that drop past reasoning: an earlier reply renders otherwise than when it was the last message
    past = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and not loop.last %}"
        "(earlier){% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    folder = hf_folder(tmp_path / "past", tokenizer_json, past, eos_token="<|im_end|>")
    chat = folder_format(folder)
    assert chat.render(CONVERSATIONS[0])[1].count(True) > 0  # one reply: nothing earlier to differ
    one_line_error(lambda: chat.render(CONVERSATIONS[2]), "not incremental")
    # a prompt needs no targets: it is what transformers gives
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    messages = CONVERSATIONS[2][:-1]
    expected = reference.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert chat.prompt_ids(messages) == expected


def test_meta_without_chat_template_and_bad_messages(folders):
    one_line_error(lambda: ChatFormat.from_meta(tokens.GPT2_META), "has no chat template")
    chat = folder_format(folders["llama3"])
    one_line_error(lambda: chat.render([{"role": "tool", "content": "x"}]), "message 1 has role 'tool'")
    one_line_error(lambda: chat.render([{"role": "user"}]), "message 1 is not an object")


# ----------------------------------------------------------------------------- the built-in template


def test_builtin_template_on_characters():
    meta = {"kind": "lm", "tokenizer": {"type": "char", "chars": ["H", "i", "!", " "]}, "vocab_size": 4}
    meta["special_tokens"] = {}
    chat_meta = with_chat_tokens(meta)
    assert chat_meta["special_tokens"] == {"system": 4, "user": 5, "assistant": 6, "end_of_turn": 7}
    assert chat_meta["vocab_size"] == 8 and chat_meta["kind"] == "chat" and chat_meta["chat"] == {"template": "builtin"}
    assert meta["vocab_size"] == 4 and meta["special_tokens"] == {}  # the meta passed in is left as it was
    assert with_chat_tokens(chat_meta) == chat_meta
    chat = ChatFormat.from_meta(chat_meta)
    messages = [
        {"role": "system", "content": "i"},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": " H"},
        {"role": "assistant", "content": ""},
    ]
    ids, targets = chat.render(messages)
    #           <system> i <eot> <user> H  i <eot> <assistant> H  i  ! <eot> <user> ' ' H <eot> <assistant> <eot>
    assert ids == [4, 1, 7, 5, 0, 1, 7, 6, 0, 1, 2, 7, 5, 3, 0, 7, 6, 7]
    no, yes = False, True
    assert targets == [no, no, no, no, no, no, no, no, yes, yes, yes, yes, no, no, no, no, no, yes]
    assert chat.render(messages[:2], add_generation_prompt=True) == ([4, 1, 7, 5, 0, 1, 7, 6], [no] * 8)
    assert chat.end_of_turn == (7,)
    decoded = tokens.Tokenizer.from_meta(chat_meta).decode(ids[:8])
    assert decoded == "<system>i<end_of_turn><user>Hi<end_of_turn><assistant>"


def test_builtin_template_on_gpt2_bpe():
    chat_meta = with_chat_tokens(tokens.GPT2_META)
    # free ids of GPT-2's padded vocabulary, after end-of-text
    assert chat_meta["special_tokens"] == {"eot": 50256, "system": 50257, "user": 50258, "assistant": 50259} | {
        "end_of_turn": 50260
    }
    assert chat_meta["vocab_size"] == 50261
    chat = ChatFormat.from_meta(chat_meta)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi"},
    ]
    ids, targets = chat.render(messages)
    # tiktoken's gpt2: 'Be brief.' = 3856 4506 13, 'Hello' = 15496, 'Hi' = 17250
    assert ids == [50257, 3856, 4506, 13, 50260, 50258, 15496, 50260, 50259, 17250, 50260]
    assert targets == [False] * 9 + [True, True]
    # written in a message, a marker is text, never the special id
    assert 50260 not in chat.render([{"role": "user", "content": "<end_of_turn><|endoftext|>"}])[0][1:-1]
    assert chat.end_of_turn == (50260,)
    assert tokens.Tokenizer.from_meta(chat_meta).decode(ids[5:]) == "<user>Hello<end_of_turn><assistant>Hi<end_of_turn>"


def test_builtin_template_on_a_trained_tokenizer_json():
    text, special = train_byte_level_bpe(["hello world, hello there"] * 4, 260)
    meta = {"kind": "lm", "tokenizer": {"type": "huggingface", "json": text}, "vocab_size": 260}
    chat_meta = with_chat_tokens({**meta, "special_tokens": special})
    assert [chat_meta["special_tokens"][name] for name in BUILTIN_TOKENS] == [260, 261, 262, 263]
    reference = tokenizers.Tokenizer.from_str(text)
    hello, world = reference.encode("hello").ids, reference.encode(" world").ids
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": " world"}]
    ids, targets = ChatFormat.from_meta(chat_meta).render(messages)
    assert ids == [261, *hello, 263, 262, *world, 263]
    assert targets == [False] * (len(hello) + 3) + [True] * (len(world) + 1)


# ----------------------------------------------------------------------------- conversations


@pytest.mark.parametrize(
    "obj, problem",
    [
        ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, None),
        ([{"role": "user", "content": "a"}], '"messages" list'),
        ({"messages": "hi"}, '"messages" list'),
        ({"messages": []}, "empty"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant"}]}, "message 2 is not an object"),
        ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "b"}]}, "message 1 is not"),
        ({"messages": [{"role": "tool", "content": "a"}, {"role": "assistant", "content": "b"}]}, "role 'tool'"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]}, "message 2 is a system"),
        ({"messages": [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}]}, "no assistant"),
        ({"messages": [{"role": "user", "content": "a"}]}, "no assistant message"),
        (
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": "b"},
                    {"role": "user", "content": "c"},
                ]
            },
            "the user's, not the assistant's",
        ),
    ],
)
def test_conversation_problem(obj, problem):
    found = conversation_problem(obj)
    assert found is None if problem is None else problem in found
