"""Our tokenizer and chat template against transformers' tokenizer built from the same GGUF."""

import os

import pytest
import transformers

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
    path = smollm2_gguf_path()
    ref = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return Tokenizer.from_gguf(read_gguf(path)), ref


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
