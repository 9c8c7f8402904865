"""
export.py against an independent reference: transformers loads each exported folder and must give our logits and
greedy tokens; its AutoTokenizer must give tiktoken's ids. Then the refusals, the folder handling, the command line.
"""

import dataclasses
import io
import json
import sys
from pathlib import Path

import pytest
import torch
import transformers  # a dev dependency (requirements-dev.txt): the reference; missing, the suite fails
from hf_reference import assert_same_greedy_tokens, load_transformers, max_logit_difference, with_large_weights

import chat
import eval as evaluation
import export
import hf
import sample
import train
from checkpoint import load_checkpoint, save_checkpoint, weights_state
from config import parse_config
from eval import EvalConfig
from model import GPT, ModelConfig, build_model
from sample import SampleConfig
from tokens import GPT2_META, Tokenizer, huggingface_tokenizer, load_meta, tiktoken_encoding
from train import TrainConfig

VOCAB = 101
CHAR_META = {
    "kind": "lm",
    "tokenizer": {"type": "char", "chars": [chr(i) for i in range(32, 32 + VOCAB)]},
    "vocab_size": VOCAB,
    "special_tokens": {},
}
LLAMA = {"pos_encoding": "rope", "norm": "rmsnorm", "activation": "swiglu"}  # the defaults are GPT-2's layout


def tiny(**changes):
    return ModelConfig(**{"vocab_size": VOCAB, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 32, **changes})


def random_ids(*shape, vocab=VOCAB, seed=1):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


# -----------------------------------------------------------------------------
# The weights: transformers' logits and greedy tokens are ours

CASES = {  # name: ModelConfig changes
    "gpt2-bias-gelu": {"activation": "gelu"},
    "gpt2-nobias-gelu_tanh": {"bias": False, "activation": "gelu_tanh", "norm_eps": 1e-3, "d_ff": 48, "dropout": 0.1},
    "gpt2-relu-untied": {"activation": "relu", "tie_embeddings": False},
    "gpt2-relu2": {"activation": "relu2"},
    # grouped key/value heads, each repeated for its query heads: the quick start's 2 of 4, and one for all
    "gpt2-gqa": {"n_kv_head": 2, "bias": False, "activation": "relu"},
    "gpt2-mqa-bias": {"n_kv_head": 1},
    "llama-gqa-untied": {
        **LLAMA,
        "n_kv_head": 2,
        "tie_embeddings": False,
        "bias": False,
        "rope_theta": 500.0,
        "norm_eps": 1e-3,
    },
    "llama-mha-tied-bias": {**LLAMA, "bias": True, "d_ff": 80, "rope_theta": 1e6},
    "llama-mqa-tied": {**LLAMA, "n_kv_head": 1, "bias": False, "norm_eps": 1e-6},
}


@pytest.mark.parametrize("case", CASES)
def test_transformers_gives_our_logits_and_greedy_tokens(tmp_path, case):
    torch.manual_seed(0)
    model = with_large_weights(GPT(tiny(**CASES[case])))
    export.export(model, CHAR_META, tmp_path / "hf")
    hf = load_transformers(tmp_path / "hf")
    assert type(hf).__name__ == ("GPT2LMHeadModel" if case.startswith("gpt2") else "LlamaForCausalLM")
    assert max_logit_difference(model, hf, random_ids(2, 32)) < 1e-4
    assert_same_greedy_tokens(model, hf, random_ids(2, 5, seed=2), new_tokens=8)


def test_the_quick_start_s_model_exports_to_gpt2_s_layout(tmp_path):
    """
    configs/shakespeare.py's model as it trains (two key/value heads for four query heads): each key/value head
    repeated for its two query heads, GPT2LMHeadModel computes its logits within 1e-5 and the same greedy tokens.
    """
    quick_start = Path(__file__).resolve().parent.parent / "configs" / "shakespeare.py"
    config = parse_config(TrainConfig, [str(quick_start)]).model_config(VOCAB)
    assert config.n_kv_head < config.n_head and hf.hf_layout(config) == "gpt2"
    torch.manual_seed(0)
    model = with_large_weights(GPT(config))
    export.export(model, CHAR_META, tmp_path / "hf")
    theirs = load_transformers(tmp_path / "hf")
    assert type(theirs).__name__ == "GPT2LMHeadModel" and theirs.config.n_head == config.n_head
    assert max_logit_difference(model, theirs, random_ids(2, config.block_size)) < 1e-5
    assert_same_greedy_tokens(model, theirs, random_ids(2, 5, seed=2), new_tokens=8)


def test_exact_gelu_is_not_gpt2s_tanh_gelu(tmp_path):
    """activation_function is mapped precisely: read as "gelu_new", an exact-GELU model's logits move past 1e-4."""
    torch.manual_seed(0)
    model = with_large_weights(GPT(tiny(activation="gelu")))
    export.export(model, CHAR_META, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["activation_function"] == "gelu"
    (tmp_path / "config.json").write_text(json.dumps({**config, "activation_function": "gelu_new"}))
    assert max_logit_difference(model, load_transformers(tmp_path), random_ids(2, 32)) > 1e-3


@pytest.mark.parametrize("case", CASES)
def test_an_export_loads_back_with_from_pretrained(tmp_path, case):
    """The way back: hf.from_pretrained reads either layout's folder (GELU flavour included) to the same logits."""
    torch.manual_seed(0)
    model = with_large_weights(GPT(tiny(**CASES[case])))
    export.export(model, CHAR_META, tmp_path / "hf")
    back = hf.from_pretrained(tmp_path / "hf").eval()
    assert back.config.activation == model.config.activation
    x = random_ids(2, 32)
    torch.testing.assert_close(back(x)[0], model(x)[0], atol=1e-5, rtol=1e-5)


# -----------------------------------------------------------------------------
# The tokenizer

TEXTS = [
    "ROMEO: But, soft! what light through yonder window breaks?",
    "  two  spaces,\n\nthree newlines\n\n\n\ttab and trailing   ",
    "café naïve 日本語 🤖 Ünïcödé",
    "it's we'll I'M 123456 3.14",
    "",
]
EOT_TEXTS = ["one<|endoftext|>two", "<|endoftext|>", "end <|endoftext|>\n"]


def test_gpt2_tokenizer_gives_tiktokens_ids(tmp_path, shakespeare_path):
    # a Llama-layout model on GPT-2 BPE data: tokenizer_config.json must name GPT-2's tokenizer, not Llama's
    model = GPT(tiny(vocab_size=50304, **LLAMA)).eval()
    assert export.export(model, GPT2_META, tmp_path) is None
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    enc, ours = tiktoken_encoding("gpt2"), Tokenizer.from_meta(GPT2_META)
    shakespeare = shakespeare_path.read_text(encoding="utf-8")[:100_000]
    for text in [*TEXTS, shakespeare]:
        ids = tokenizer(text)["input_ids"]
        assert ids == ours.encode(text) == enc.encode_ordinary(text)
        assert tokenizer.decode(ids) == text
    # '<|endoftext|>' in a text is the end-of-text id, as in GPT-2's tokenizer (ours keeps it as text)
    for text in EOT_TEXTS:
        assert tokenizer(text)["input_ids"] == enc.encode(text, allowed_special={"<|endoftext|>"})
    assert tokenizer.bos_token_id == tokenizer.eos_token_id == tokenizer.unk_token_id == 50256
    # the merges recovered from tiktoken's ranks are GPT-2's own: 50,000 of them, in GPT-2's order
    merges = (tmp_path / "merges.txt").read_text(encoding="utf-8").splitlines()
    assert len(merges) == 1 + 50_000 and merges[:4] == ["#version: 0.2", "Ġ t", "Ġ a", "h e"]
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["vocab_size"], config["bos_token_id"], config["eos_token_id"]) == (50304, 50256, 50256)


def test_huggingface_tokenizer_is_written_as_it_is(tmp_path, llama_dir):
    meta = {"kind": "lm", **huggingface_tokenizer(llama_dir)}  # bos <s> = 0, eos </s> = 1, from its config.json
    model = GPT(tiny(vocab_size=meta["vocab_size"], **LLAMA)).eval()
    assert export.export(model, meta, tmp_path) is None
    assert (tmp_path / "tokenizer.json").read_text(encoding="utf-8").strip() == meta["tokenizer"]["json"].strip()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = Tokenizer.from_meta(meta)
    for text in TEXTS:
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == ours.encode(text)
        assert tokenizer(text)["input_ids"] == ours.template_prefix() + ours.encode(text)  # <s> first, as Llama's
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1)
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (0, 1)


def test_a_character_vocabulary_round_trips_every_character(tmp_path, shakespeare_char_dir):
    """
    The quick start's 65 characters (newline, space and punctuation among them) as a tokenizer.json: AutoTokenizer
    gives each character alone its id and the id back its character, and any text of them our Tokenizer's ids; a
    chat template's markers past the characters are special tokens written as ours decodes them.
    """
    meta = load_meta(shakespeare_char_dir)
    chars = meta["tokenizer"]["chars"]
    assert len(chars) == 65 and {"\n", " ", ":", "'", "!", "$", "&", "3"} <= set(chars)
    note = export.export(GPT(tiny(vocab_size=meta["vocab_size"])), meta, tmp_path / "hf")
    assert note.startswith("a character the vocabulary lacks reads as ' ' in transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    for i, c in enumerate(chars):
        assert tokenizer(c)["input_ids"] == [i] and tokenizer.decode([i]) == c, repr(c)
    ours = Tokenizer.from_meta(meta)
    for text in ["".join(chars), "".join(reversed(chars)), "ROMEO:\n  But, soft!\n\n\nWhat's   this?? $3 & -;. ", ""]:
        ids = tokenizer(text)["input_ids"]
        assert ids == ours.encode(text) and tokenizer.decode(ids) == text
    assert tokenizer.bos_token is None and tokenizer.eos_token is None  # character data has neither
    # a character outside the list reads as the space (the unk token), where ours refuses it; named in tokenizer.json
    # only, so no character is a special token that skip_special_tokens would drop
    space, a = chars.index(" "), chars.index("a")
    assert tokenizer("aé日🤖a")["input_ids"] == [a, space, space, space, a]
    assert json.loads((tmp_path / "hf" / "tokenizer.json").read_text())["model"]["unk_token"] == " "
    assert tokenizer.all_special_ids == [] and tokenizer.decode([a, space, a], skip_special_tokens=True) == "a a"
    # a chat model's vocabulary: the built-in template's four markers after the characters
    names = ("system", "user", "assistant", "end_of_turn")
    chat = {**meta, "vocab_size": 69, "special_tokens": {name: 65 + k for k, name in enumerate(names)}}
    export.export(GPT(tiny(vocab_size=69)), chat, tmp_path / "chat")
    tokenizer, ours = transformers.AutoTokenizer.from_pretrained(tmp_path / "chat"), Tokenizer.from_meta(chat)
    ids = [66, *ours.encode("Who speaks?"), 68, 67, *ours.encode("ROMEO"), 68]
    assert tokenizer.decode(ids) == ours.decode(ids) == "<user>Who speaks?<end_of_turn><assistant>ROMEO<end_of_turn>"
    assert tokenizer(ours.decode(ids))["input_ids"] == ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Who speaks?ROMEO"


# -----------------------------------------------------------------------------
# A chat model: its template and end of turn, for transformers (and vLLM, SGLang)

CONVERSATIONS = [  # (system prompt, turns): each turn a question and an answer; the last answer is the model's to give
    ("", [("abc", None)]),
    ("", [("cab", None)]),
    ("bc", [("abca", None)]),
    ("", [("abc", "ok"), ("bca", None)]),
    ("a", [("abc", "ok"), ("bca", "no"), ("aab", None)]),
    ("cc", [("bba", "no"), ("acca", None)]),
    ("", [("a", "ok"), ("b", "no"), ("c", "no"), ("ab", None)]),
    ("abcabc", [("baba", None)]),
    ("", [("caac", "no"), ("aca", "ok"), ("bcb", None)]),
    ("b", [("cca", "ok"), ("abab", None)]),
]


def messages_of(system, turns):
    """The conversation as messages, without the last (unknown) answer."""
    messages = [{"role": "system", "content": system}] if system else []
    for question, answer in turns:
        messages.append({"role": "user", "content": question})
        if answer is not None:
            messages.append({"role": "assistant", "content": answer})
    return messages


def template_ids(tokenizer, messages):
    """transformers' ids of the conversation with the generation prompt, rendered by the folder's chat template."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def test_a_chat_fine_tune_chats_in_transformers_as_sample_py_does(chat_run, tmp_path, monkeypatch, capsys):
    """
    conftest's chat model exported: apply_chat_template renders 10 conversations to chat.py's ids, and greedy
    generate, which stops at generation_config.json's eos (the end-of-turn token), replies as sample.py --chat
    --temperature=0, with and without a system prompt and over two turns.
    """
    root, _, _ = chat_run
    out, folder = root / "out", tmp_path / "hf"
    assert export.cli([f"--out_dir={out}", "--checkpoint=ckpt.pt", f"--dest={folder}"]) == 0
    meta = load_checkpoint(out / "ckpt.pt")["meta"]
    ours, end = chat.ChatFormat.from_meta(meta), meta["special_tokens"]["end_of_turn"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id == end
    for system, turns in CONVERSATIONS:
        messages = messages_of(system, turns)
        assert template_ids(tokenizer, messages) == ours.prompt_ids(messages), messages

    def reply(messages):
        ids = torch.tensor([template_ids(tokenizer, messages)])
        new_tokens = model.config.n_positions - ids.size(1)
        output = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
        assert output[0, -1] == end  # a reply that ended, not one cut at the context
        return tokenizer.decode(output[0, ids.size(1) :], skip_special_tokens=True)

    options = [f"--out_dir={out}", "--checkpoint=ckpt.pt", "--chat", "--temperature=0", "--device=cpu"]
    for system in ("", "bc"):
        said = io.StringIO()
        sample.main(parse_config(SampleConfig, [*options, "--start=abca", f"--system={system}"]), out=said)
        assert said.getvalue() == reply(messages_of(system, [("abca", None)])) + "\n"
    first = reply(messages_of("", [("abc", None)]))
    second = reply(messages_of("", [("abc", first), ("cab", None)]))
    monkeypatch.setattr(sys, "stdin", io.StringIO("abc\ncab\n/quit\n"))
    said = io.StringIO()
    sample.main(parse_config(SampleConfig, options), out=said)
    assert said.getvalue() == f"{first}\n{second}\n" and first and second  # real replies are compared


CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def chatml_folder(llama_dir, folder):
    """llama_dir's tokenizer with ChatML's two special tokens and template, as a Hugging Face folder ships them."""
    import tokenizers

    tokenizer = tokenizers.Tokenizer.from_file(str(llama_dir / "tokenizer.json"))
    tokenizer.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in ("<|im_start|>", "<|im_end|>")])
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    settings = {"chat_template": CHATML, "bos_token": "<s>", "eos_token": "<|im_end|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    return folder


def test_the_chat_template_of_every_tokenizer_renders_chat_py_s_ids(tmp_path, llama_dir):
    """
    The built-in template's markers written into GPT-2's BPE and into a dataset's tokenizer.json too, at the ids the
    meta gives them, and a Hugging Face template (ChatML) as it came: apply_chat_template gives chat.py's ids for texts
    with spaces and punctuation, and ends a reply at chat.py's end of turn; the dataset's own tokenizer.json stays
    in config.json, so the folder reads back with the checkpoint's tokenizer.
    """
    from recipes.chat import chat_meta

    chatml = chatml_folder(llama_dir, tmp_path / "chatml-source")
    metas = {
        "gpt2": chat.with_chat_tokens(GPT2_META),
        "tokenizer.json": chat.with_chat_tokens({"kind": "lm", **huggingface_tokenizer(llama_dir)}),
        "chatml": chat_meta(str(chatml), []),
    }
    assert metas["chatml"]["chat"]["template"] == CHATML  # the folder's own, which export must write back
    texts = [("Be brief.", [("Who speaks?", " ROMEO, sir."), ("And then?", None)]), ("", [("  two  spaces\n", None)])]
    for name, meta in metas.items():
        folder = tmp_path / name
        export.export(GPT(tiny(vocab_size=meta["vocab_size"])), meta, folder)
        tokenizer, ours = transformers.AutoTokenizer.from_pretrained(folder), chat.ChatFormat.from_meta(meta)
        for system, turns in texts:
            messages = messages_of(system, turns)
            assert template_ids(tokenizer, messages) == ours.prompt_ids(messages), (name, messages)
        assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == ours.end_of_turn[0]
        assert hf.pretrained_meta(folder)["tokenizer"] == meta["tokenizer"]
    # ChatML's end of turn is <|im_end|>, the one the source folder's tokenizer gives
    assert transformers.AutoTokenizer.from_pretrained(chatml).convert_tokens_to_ids("<|im_end|>") == ours.end_of_turn[0]


def test_an_export_warns_where_llama_cpp_or_sglang_would_compute_another_model(tmp_path, capsys):
    """
    llama.cpp's and SGLang's GPT-2 compute tanh GELU whatever activation_function says, llama.cpp converts n_inner as
    4 x n_embd and SGLang ties the head: an export says so for any other activation, width or head, and says nothing
    for GPT-2's own or for the Llama layout.
    """
    warnings = {
        case: export.engine_warnings(tiny(**changes))
        for case, changes in {
            "gelu_tanh": {"activation": "gelu_tanh"},
            "gelu": {"activation": "gelu"},
            "relu-narrow-untied": {"activation": "relu", "d_ff": 48, "tie_embeddings": False},
            "llama": {**LLAMA, "d_ff": 48, "tie_embeddings": False},
        }.items()
    }
    assert warnings["gelu_tanh"] == warnings["llama"] == []
    assert len(warnings["gelu"]) == 1 and "activation='gelu' would run as tanh GELU, close to it" in warnings["gelu"][0]
    relu, narrow, untied = warnings["relu-narrow-untied"]
    assert "activation='relu' would run as tanh GELU, another model" in relu
    assert "4 x n_embd = 128 wide whatever n_inner says" in narrow and "(d_ff=48) would not load" in narrow
    assert "SGLang's GPT-2 ties the head to the embedding" in untied
    save_run(tmp_path / "out", GPT(tiny(activation="relu")), CHAR_META)
    assert export.cli([f"--out_dir={tmp_path / 'out'}", f"--dest={tmp_path / 'hf'}"]) == 0
    printed = capsys.readouterr().out.splitlines()
    # after the character vocabulary's note
    assert printed[2:] == [f"warning: {export.engine_warnings(tiny(activation='relu'))[0]}"]


# -----------------------------------------------------------------------------
# What neither layout computes

REFUSALS = [  # ModelConfig changes, the option the message must name
    ({"arch": "encoder"}, "arch='encoder'"),
    ({"arch": "encoder_decoder"}, "arch='encoder_decoder'"),
    ({"norm_position": "post"}, "norm_position='post'"),
    ({"pos_encoding": "sinusoidal"}, "pos_encoding='sinusoidal'"),
    ({"qk_norm": True}, "qk_norm=True"),  # with learned positions (with rope it is Qwen3's layout)
    ({"logit_softcap": 15.0}, "logit_softcap=15.0"),
    ({**LLAMA, "window_size": 8}, "window_size=8"),
    ({"activation": "swiglu"}, "activation='swiglu'"),  # with learned positions
    ({"norm": "rmsnorm"}, "norm='rmsnorm'"),  # with learned positions
    ({**LLAMA, "activation": "gelu"}, "activation='gelu'"),  # with rope
    ({**LLAMA, "norm": "layernorm"}, "norm='layernorm'"),  # with rope
]


@pytest.mark.parametrize(("changes", "option"), REFUSALS, ids=[option for _, option in REFUSALS])
def test_refusal_names_the_option_and_writes_nothing(tmp_path, changes, option):
    model = build_model(tiny(**changes))
    with pytest.raises(ValueError) as err:
        export.export(model, CHAR_META, tmp_path / "hf")
    message = str(err.value)
    assert message.startswith("cannot export ") and f"{option}:" in message and "\n" not in message
    assert list(tmp_path.iterdir()) == []


def test_export_knows_every_model_setting_or_refuses_it():
    """
    Fails closed: every ModelConfig field is one that changes nothing in a GPT's forward, one the layout writes, or
    one the layout's checks compare; a field added later and listed nowhere fails here, and export refuses it
    unless it is at its default (a subclass with one more field stands for that future option).
    """
    for family, changes in (("gpt2", {}), ("llama", LLAMA), ("llama", {**LLAMA, "qk_norm": True})):
        config = tiny(**changes)
        checked = {name for name, _, _ in hf.layout_checks(config, hf.hf_layout(config))}
        known = hf.NO_EFFECT | hf.LAYOUT_WRITES[family] | checked
        assert [f.name for f in dataclasses.fields(ModelConfig) if f.name not in known] == [], family

    @dataclasses.dataclass
    class Later(ModelConfig):
        new_option: int = 0

    assert hf.hf_layout(Later(**dataclasses.asdict(tiny()))) == "gpt2"  # at its default: nothing changes
    with pytest.raises(ValueError, match=r"^cannot export new_option=1: an option export does not know"):
        hf.hf_layout(Later(**dataclasses.asdict(tiny()), new_option=1))


@pytest.mark.parametrize(
    "changes",
    [
        {"dropout": 0.3},
        {"zero_init_proj": True},
        {"n_encoder_layer": 5},
        {"pad_token_id": 0},
        {"share_embeddings": True},
    ],
    ids=lambda changes: next(iter(changes)),
)
def test_what_export_passes_as_is_changes_nothing_in_a_gpt(changes):
    """NO_EFFECT's settings: the same weights give the same logits (ids without the pad id) with and without them."""
    assert set(changes) <= hf.NO_EFFECT
    torch.manual_seed(0)
    plain = GPT(tiny()).eval()
    other = GPT(tiny(**changes)).eval()
    other.load_state_dict(plain.state_dict())
    x = random_ids(2, 16) % (VOCAB - 1) + 1
    torch.testing.assert_close(other(x)[0], plain(x)[0], rtol=0, atol=0)


def test_every_option_in_the_way_is_named_at_once():
    """RMSNorm and a soft-cap with learned positions: retraining must change both."""
    with pytest.raises(ValueError) as err:
        hf.hf_layout(tiny(norm="rmsnorm", logit_softcap=15.0))
    message = str(err.value)
    assert message.startswith("cannot export logit_softcap=15.0: ") and "; norm='rmsnorm': " in message


# -----------------------------------------------------------------------------
# The folder


def test_earlier_export_is_replaced_anything_else_refused(tmp_path):
    dest = tmp_path / "hf"
    export.export(GPT(tiny()), CHAR_META, dest)
    export.export(GPT(tiny(**LLAMA)), CHAR_META, dest)  # over the earlier export: replaced whole
    assert json.loads((dest / "config.json").read_text())["model_type"] == "llama"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary folder beside it
    (dest / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty and not an earlier export .*notes.txt"):
        export.export(GPT(tiny()), CHAR_META, dest)
    assert (dest / "notes.txt").read_text() == "mine"


def test_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    dest = tmp_path / "hf"
    export.export(GPT(tiny()), CHAR_META, dest)
    before = {p.name: p.read_bytes() for p in dest.iterdir()}

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "save_file", full_disk)
    for target in (dest, tmp_path / "new"):  # over an earlier export, and into a new folder
        with pytest.raises(OSError, match="No space left"):
            export.export(GPT(tiny(**LLAMA)), CHAR_META, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == before


# -----------------------------------------------------------------------------
# The command line


def save_run(out_dir, model, meta):
    """out_dir/best.pt as train.py writes it (weights_state), without training."""
    out_dir.mkdir()
    save_checkpoint(weights_state(model.state_dict(), model.config, TrainConfig(), meta, 10, 1.0), out_dir / "best.pt")


def test_cli_end_to_end_with_gpt2_bpe(tmp_path, capsys):
    torch.manual_seed(0)
    model = with_large_weights(GPT(tiny(vocab_size=50304, activation="gelu_tanh")))  # GPT-2's padded vocabulary
    save_run(tmp_path / "out", model, GPT2_META)
    dest = tmp_path / "hf"
    assert export.cli([f"--out_dir={tmp_path / 'out'}", "--checkpoint=best.pt", f"--dest={dest}"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 1 and printed[0].startswith(f"wrote {dest}: GPT2LMHeadModel")
    # again into the same folder: the earlier export replaced, and said so
    assert export.cli([f"--out_dir={tmp_path / 'out'}", "--checkpoint=best.pt", f"--dest={dest}"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 1 and printed[0].startswith(f"replaced the earlier export in {dest}: GPT2LMHeadModel")
    hf, tokenizer = load_transformers(dest), transformers.AutoTokenizer.from_pretrained(dest)
    prompt = tokenizer("ROMEO: But, soft!", return_tensors="pt")["input_ids"]
    assert prompt[0].tolist() == Tokenizer.from_meta(GPT2_META).encode("ROMEO: But, soft!")
    assert max_logit_difference(model, hf, random_ids(2, 32, vocab=50304)) < 1e-4
    assert_same_greedy_tokens(model, hf, prompt, new_tokens=8)


def test_the_quick_start_s_export_generates_sample_py_s_greedy_text(tmp_path, shakespeare_char_dir, capsys):
    """
    configs/shakespeare.py's model on shakespeare_char, trained a little and exported by the command line: with the
    usual transformers calls (AutoTokenizer, AutoModelForCausalLM, greedy generate) its text is sample.py's at
    --temperature=0, from the checkpoint and from the folder read back.
    """
    quick_start = Path(__file__).resolve().parent.parent / "configs" / "shakespeare.py"
    settings = [f"--data_dir={shakespeare_char_dir.parent}", f"--out_dir={tmp_path / 'out'}", "--max_minutes=0"]
    settings += ["--max_iters=30", "--eval_interval=30", "--eval_iters=1", "--device=cpu", "--dtype=float32"]
    train.main(parse_config(TrainConfig, [str(quick_start), *settings, "--compile=false", "--tensorboard=false"]))
    capsys.readouterr()
    assert export.cli([f"--out_dir={tmp_path / 'out'}", f"--dest={tmp_path / 'hf'}"]) == 0
    # what a character vocabulary does elsewhere is said: an unknown character, and llama.cpp
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert notes == [
        "note: a character the vocabulary lacks reads as ' ' in transformers, lm-eval and vLLM (sample.py and "
        "serve.py refuse the text instead); llama.cpp's converter takes BPE and SentencePiece vocabularies only, not "
        "a character one: for a GGUF, train on GPT-2's BPE (dataset=shakespeare)"
    ]

    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    inputs = tokenizer("ROMEO:", return_tensors="pt")
    new_tokens = model.config.n_positions - inputs["input_ids"].size(1)  # transformers stops at block_size
    output = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
    theirs = tokenizer.decode(output[0])
    assert theirs.startswith("ROMEO:") and len(theirs) == 64
    for source in ({"out_dir": str(tmp_path / "out")}, {"init_from": str(tmp_path / "hf")}):
        settings = {"start": "ROMEO:", "max_new_tokens": new_tokens, "temperature": 0.0, "stream": False}
        assert run_main(sample, SampleConfig, **source, **settings, device="cpu", dtype="float32")[0] == theirs + "\n"


def test_a_tiktoken_encoding_other_than_gpt2s_is_noted_and_kept_in_config_json():
    meta = {**GPT2_META, "tokenizer": {"type": "tiktoken", "encoding": "cl100k_base"}}
    files, note = export.tokenizer_files(meta, 32)
    assert files == {} and note.startswith("no Hugging Face tokenizer written; the vocabulary {'type': 'tiktoken'")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "--dest is required"),
        (["--dest=DEST", "--out_dir=nowhere"], "no checkpoint at nowhere/best.pt"),
        (["--dest=DEST", "--out_dir=ENCODER"], "cannot export arch='encoder': "),
        (["--dest=OUT", "--out_dir=ENCODER"], "--dest=OUT is not empty"),  # train.py's folder is not an export
        (["--dest=DEST", "--out_dri=x"], "unknown key 'out_dri'; did you mean 'out_dir'?"),
    ],
)
def test_cli_mistakes_are_one_line_and_status_2(tmp_path, capsys, args, message):
    save_run(tmp_path / "encoder", build_model(tiny(arch="encoder", pad_token_id=0)), CHAR_META)
    places = {"DEST": tmp_path / "hf", "ENCODER": tmp_path / "encoder", "OUT": tmp_path / "encoder"}
    for name, place in places.items():
        args = [arg.replace(f"={name}", f"={place}") for arg in args]
        message = message.replace(f"={name}", f"={place}")
    assert export.cli(["--checkpoint=best.pt", *args]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and error.startswith("export.py: error: ") and message in error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["encoder"]


# -----------------------------------------------------------------------------
# The way back: train -> export -> sample.py, eval.py and train.py --init_from=FOLDER, as from the checkpoint

# prepare() arguments of one dataset per kind of tokenizer (the text's BPE is trained by prepare_data.py)
ROUND_TRIP_DATA = {
    "char": ("shakespeare_char", {}),
    "gpt2-bpe": ("shakespeare", {}),
    "tokenizer.json": ("text", {"vocab_size": 320, "name": "shakespeare_bpe320"}),
}
LAYOUTS = {"gpt2": {}, "llama": {**LLAMA, "n_kv_head": 1, "tie_embeddings": False}}
RUN = {  # a 2-layer, 32-wide model trained for a few steps on the CPU
    "n_layer": 2,
    "n_head": 2,
    "n_embd": 32,
    "block_size": 32,
    "batch_size": 4,
    "gradient_accumulation_steps": 1,
    "eval_iters": 2,
    "learning_rate": 1e-2,
    "warmup_iters": 0,
    "device": "cpu",
    "dtype": "float32",
    "compile": False,
    "tensorboard": False,
}


@pytest.fixture(scope="module")
def round_trip_root(tmp_path_factory, shakespeare_path):
    """One data root holding the three datasets; the text one from the first 200,000 characters of Shakespeare."""
    import prepare_data

    root = tmp_path_factory.mktemp("data")
    text = root.parent / "shakespeare_start.txt"
    text.write_text(shakespeare_path.read_text(encoding="utf-8")[:200_000], encoding="utf-8")
    for dataset, options in ROUND_TRIP_DATA.values():
        prepare_data.prepare(dataset, data_dir=root, **({"input": str(text)} if dataset == "text" else {}), **options)
    return root


def run_main(module, config_class, **settings):
    """module.main's printed output and result, for a config_class built from settings."""
    out = io.StringIO()
    result = module.main(config_class(**settings), out=out)
    return out.getvalue(), result


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ROUND_TRIP_DATA)
def test_an_export_samples_evaluates_and_trains_as_its_checkpoint(tmp_path, round_trip_root, kind, layout):
    dataset, options = ROUND_TRIP_DATA[kind]
    data = {"dataset": options.get("name", dataset), "data_dir": str(round_trip_root)}
    train.main(TrainConfig(**RUN, **LAYOUTS[layout], **data, out_dir=str(tmp_path / "run"), max_iters=6))
    ckpt, folder = tmp_path / "run" / "ckpt.pt", tmp_path / "hf"
    assert export.cli([f"--out_dir={tmp_path / 'run'}", "--checkpoint=ckpt.pt", f"--dest={folder}"]) == 0
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == layout

    # the same text from the same seed: the folder reads and writes text with the checkpoint's tokenizer
    shown = {}
    for source in (ckpt, folder):
        settings = {"init_from": str(source), "start": "ROMEO:", "max_new_tokens": 40, "seed": 7, "stream": False}
        shown[source] = run_main(sample, SampleConfig, **settings, device="cpu", dtype="float32")[0]
    assert shown[ckpt].startswith("ROMEO:") and len(shown[ckpt]) > 20 and shown[folder] == shown[ckpt]

    # the same loss on the val split of the data it was trained on, which the folder names as the checkpoint does
    scores = {}
    for source in (ckpt, folder):
        settings = {"init_from": str(source), "data_dir": str(round_trip_root), "limit": 8, "json": True}
        scores[source] = run_main(evaluation, EvalConfig, **settings, device="cpu", dtype="float32")[1]
    assert scores[folder]["data"] == f"{data['dataset']} val" and scores[folder]["tokens"] == scores[ckpt]["tokens"]
    assert scores[folder]["loss"] == pytest.approx(scores[ckpt]["loss"], rel=1e-5)

    # a new run from the folder starts where one from the checkpoint does, and trains on the same data
    runs = {}
    for source in (ckpt, folder):
        out_dir = tmp_path / f"from_{source.name}"
        settings = {**RUN, **data, "out_dir": str(out_dir), "init_from": str(source), "max_iters": 1}
        runs[source] = train.main(TrainConfig(**settings, eval_interval=1))
    assert runs[folder]["evals"][0]["val"] == pytest.approx(runs[ckpt]["evals"][0]["val"], rel=1e-5)
    assert (
        load_checkpoint(tmp_path / "from_hf" / "ckpt.pt")["meta"]["tokenizer"]
        == load_checkpoint(ckpt)["meta"]["tokenizer"]
    )

    if kind == "tokenizer.json":  # the BPE trained by prepare_data.py, in the folder as transformers reads it
        meta = load_checkpoint(ckpt)["meta"]
        assert (folder / "tokenizer.json").read_text(encoding="utf-8") == meta["tokenizer"]["json"]
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        assert tokenizer.eos_token == tokenizer.bos_token == "<|endoftext|>"
        text = "ROMEO: café 日本 🤖\n\n  end"
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert ids == Tokenizer.from_meta(meta).encode(text) and tokenizer.decode(ids) == text


def test_an_export_refuses_data_of_another_tokenizer_in_one_line(tmp_path, round_trip_root, capsys):
    data = {"dataset": "shakespeare_char", "data_dir": str(round_trip_root)}
    train.main(TrainConfig(**RUN, **data, out_dir=str(tmp_path / "run"), max_iters=1))
    assert export.cli([f"--out_dir={tmp_path / 'run'}", "--checkpoint=ckpt.pt", f"--dest={tmp_path / 'hf'}"]) == 0
    args = [f"--init_from={tmp_path / 'hf'}", f"--data_dir={round_trip_root}", f"--out_dir={tmp_path / 'new'}"]
    assert train.cli([*args, "--dataset=shakespeare", "--device=cpu", "--block_size=32"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "hf was trained on shakespeare_char (65 characters)" in error and "--dataset=shakespeare_char" in error
    assert not (tmp_path / "new").exists()
    # a damaged nanoformer entry is one line naming it
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "nanoformer": {"meta": {"kind": "lm"}}}))
    assert sample.cli([f"--init_from={tmp_path / 'hf'}", "--device=cpu"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "lacks the tokenizer, vocab_size or special_tokens export.py writes" in error
    # as is a folder without the tokenizer.json its meta names
    meta = load_meta(round_trip_root / "shakespeare_bpe320")
    export.export(GPT(tiny(vocab_size=meta["vocab_size"])), meta, tmp_path / "bpe")
    (tmp_path / "bpe" / "tokenizer.json").unlink()
    assert evaluation.cli([f"--init_from={tmp_path / 'bpe'}", "--device=cpu"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and f"{tmp_path / 'bpe' / 'tokenizer.json'} not found" in error
