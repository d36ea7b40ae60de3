"""Our tokenizer and chat template against transformers' tokenizer built from the same GGUF."""

import pytest
import transformers

import hf_smollm2
from dora_jax.models.gguf import read_gguf, smollm2_gguf_path
from dora_jax.tokenizer import ByteTokenizer, Tokenizer, TokenizerError, chat_template_head

TEXTS = ["12345+678=", "What is 17 + 25?", "  leading spaces\n\nnew lines\t tab", "héllo wörld 日本語",
         "emoji 🙂🚀 ok", "<|im_start|>user\nhi<|im_end|>\n", "x=3.14159; y = -2e10", "The   quick  fox   ",
         "don't I'll we've", " 1 22 333 4444 55555"]
CHATS = [[{"role": "user", "content": "What is 2+3?"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "7*6?"}]]


@pytest.fixture(scope="module")
def pair():
    return Tokenizer.from_gguf(read_gguf(smollm2_gguf_path())), hf_smollm2.tokenizer()


def test_encode_decode(pair):
    ours, ref = pair
    for s in TEXTS:
        ids = ours.encode(s)
        assert ids == ref.encode(s, add_special_tokens=False), s
        assert ours.decode(ids, skip_special_tokens=False) == s
    assert len(ours.encode("<|im_start|>")) == 1
    assert ours.decode(ours.encode("<|im_start|>hi"), skip_special_tokens=True) == "hi"


def test_special_ids(pair):
    """End of sequence is the file's ``tokenizer.ggml.eos_token_id`` (read here by the ``gguf`` package) and the
    ``<|im_end|>`` token by both tokenizers. (transformers' own ``eos_token_id`` is not the reference: 5.17
    reported the file's BOS there, 5.23 reports the file's EOS.)"""
    import gguf

    ours, ref = pair
    field = gguf.GGUFReader(smollm2_gguf_path()).fields["tokenizer.ggml.eos_token_id"]
    file_eos = int(field.parts[field.data[0]][0])
    assert ours.eos_ids[0] == file_eos == ours.encode("<|im_end|>")[0] == ref.convert_tokens_to_ids("<|im_end|>")
    assert ours.vocab_size == 49152 == len(ref)


def test_chat_template(pair):
    ours, ref = pair
    for chat in CHATS:
        for gen in (True, False):
            assert ours.apply_chat_template(chat, add_generation_prompt=gen) == \
                ref.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)


def test_chat_template_head(pair):
    """The head is the encoding of the template text before the user's text (derived here from transformers'
    rendering, cut at the user turn's opening), minus the newline token that merges with a user text starting
    with a newline; every prompt of TEXTS starts with it, transformers' token ids included."""
    ours, ref = pair
    head = chat_template_head(ours)
    rendered = ref.apply_chat_template([{"role": "user", "content": "X"}], add_generation_prompt=True, tokenize=False)
    opening = rendered[:rendered.index("<|im_start|>user") + len("<|im_start|>user")]
    assert head == ref.encode(opening, add_special_tokens=False)
    assert len(head) == 23  # "<|im_start|>system\n" + the default system prompt + "<|im_end|>\n<|im_start|>user"
    for text in TEXTS:
        ids = ref.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        assert ids[:len(head)] == head and len(ids) > len(head), text
    # Without merges (bytes), the head is every character before the user's text: "Q: ".
    assert chat_template_head(ByteTokenizer()) == list(b"Q: ")


def test_save_hf_round_trip(pair, tmp_path):
    ours, _ = pair
    ours.save_hf(str(tmp_path))
    loaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    again = Tokenizer.from_hf_dir(str(tmp_path))
    for s in TEXTS:
        assert loaded.encode(s, add_special_tokens=False) == ours.encode(s) == again.encode(s)
    assert again.eos_ids == ours.eos_ids
    assert again.apply_chat_template(CHATS[1]) == ours.apply_chat_template(CHATS[1])


def test_errors(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.ggml.model = 'llama' is not supported"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": []})
    with pytest.raises(TokenizerError, match=f"{tmp_path}: no tokenizer.json"):
        Tokenizer.from_hf_dir(str(tmp_path))


def _tiny_gguf_metadata(**changes):
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab", "<eos>"],
          "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.token_type": [1, 1, 1, 3],
          "tokenizer.ggml.eos_token_id": 3, "tokenizer.chat_template": "{% for m in messages %}{{ m.content }}"
                                                                       "{% endfor %}"}
    md.update(changes)
    return {k: v for k, v in md.items() if v is not KeyError}


@pytest.mark.parametrize("changes,message", [
    (dict(), None),
    ({"tokenizer.ggml.tokens": KeyError}, "tokenizer.ggml.tokens must be a non-empty list of strings"),
    ({"tokenizer.ggml.merges": ["abc"]}, r"tokenizer.ggml.merges holds 'abc'; each merge is 'left right'"),
    ({"tokenizer.ggml.eos_token_id": "one"}, r"tokenizer.ggml.eos_token_id = 'one' must be a token id in 0 .. 3"),
    ({"tokenizer.ggml.bos_token_id": 9}, r"tokenizer.ggml.bos_token_id = 9 must be a token id in 0 .. 3"),
    ({"tokenizer.chat_template": "{% if %}"}, r"GGUF metadata \(tokenizer.chat_template\): the chat template does "
                                              r"not compile \(line 1: "),
    ({"tokenizer.ggml.pre": "tekken"}, r"GGUF metadata: tokenizer.ggml.pre = 'tekken' names a pre-tokenizer split "
                                       r"this reader does not know \(known: .*, gpt-2, .*, qwen2, "),
])
def test_bad_gguf_tokenizer_metadata_is_named(changes, message):
    md = _tiny_gguf_metadata(**changes)
    if message is None:
        tok = Tokenizer.from_gguf(md)
        assert tok.encode("ab") == [2] and tok.eos_ids == (3,) and tok.apply_chat_template(CHATS[0]) == "What is 2+3?"
        return
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_gguf(md)


def test_every_known_pre_tokenizer_split_loads():
    from dora_jax.tokenizer import KNOWN_PRE

    for pre in (None, *KNOWN_PRE):
        assert Tokenizer.from_gguf(_tiny_gguf_metadata(**{"tokenizer.ggml.pre": pre})).encode("ab") == [2], pre


def test_bad_hf_tokenizer_files_are_named(tmp_path):
    import json

    Tokenizer.from_gguf(_tiny_gguf_metadata()).save_hf(str(tmp_path))
    conf = json.loads((tmp_path / "tokenizer_config.json").read_text())

    def write(name, content):
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())

    cases = [
        ("tokenizer_config.json", "[1, 2]", r"tokenizer_config.json: expected a JSON object, got list"),
        ("tokenizer_config.json", json.dumps(dict(conf, chat_template=[])), r"chat_template must be a string or a list"),
        ("tokenizer_config.json", json.dumps(dict(conf, chat_template=5)), r"chat_template = 5 must be a string"),
        ("tokenizer_config.json", json.dumps(dict(conf, eos_token=5)), r"eos_token = 5 must be a token string"),
        ("tokenizer_config.json", b'{"eos_token": "\xff"}', r"tokenizer_config.json: line 1 is not UTF-8 text"),
        ("generation_config.json", "[3]", r"generation_config.json: expected a JSON object, got list"),
        ("generation_config.json", '{"eos_token_id": "abc"}', r"eos_token_id = 'abc' must be a token id"),
        ("generation_config.json", '{"eos_token_id": [3, 99]}', r"eos_token_id = \[3, 99\] must be a token id"),
        ("chat_template.jinja", "{% if %}", r"chat_template.jinja: the chat template does not compile \(line 1"),
        ("chat_template.jinja", b"\xff{{ x }}", r"chat_template.jinja: line 1 is not UTF-8 text"),
    ]
    for name, content, message in cases:
        saved = (tmp_path / name).read_bytes() if (tmp_path / name).exists() else None
        write(name, content)
        with pytest.raises(TokenizerError, match=message):
            Tokenizer.from_hf_dir(str(tmp_path))
        if saved is None:
            (tmp_path / name).unlink()
        else:
            write(name, saved)
    # A template that compiles but fails on the conversation names the template, not a jinja2 traceback.
    write("chat_template.jinja", "{{ messages[5].content }}")
    tok = Tokenizer.from_hf_dir(str(tmp_path))
    with pytest.raises(TokenizerError, match=r"chat_template.jinja: the chat template fails on 1 message\(s\): "
                                             r"UndefinedError"):
        tok.apply_chat_template(CHATS[0])
