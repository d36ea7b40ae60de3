"""The real SmolLM2-135M-Instruct weights (Q4_1 GGUF): our logits and greedy continuation equal transformers'.

transformers dequantizes the same GGUF with its own code (through the ``gguf`` package) and runs its own Llama,
so this checks our GGUF reader, dequantization, q/k un-permutation, tokenizer, chat template and model at once.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from conftest import rel_err
from dora_jax.config import load_config
from dora_jax.models.gguf import smollm2_gguf_path
from dora_jax.models.weights import load_model
from dora_jax.rollout.generate import Generator

pytestmark = pytest.mark.slow

CHATS = [
    [{"role": "user", "content": "What is 17 + 25?"}],
    [{"role": "system", "content": "You are a terse math tutor."},
     {"role": "user", "content": "Compute 9 * 8 and explain in one sentence."}],
    [{"role": "user", "content": "Name three colours."}, {"role": "assistant", "content": "Red, green, blue."},
     {"role": "user", "content": "And three fruits?"}],
]


@pytest.fixture(scope="module")
def reference(torch_threads):
    path = smollm2_gguf_path()
    d, f = os.path.dirname(path), os.path.basename(path)
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    return tok, model


@pytest.fixture(scope="module")
def ours():
    cfg = load_config("smollm2_135m")
    model, tokenizer = load_model(cfg.model, progress=False)
    return model, tokenizer


def test_chat_template_and_tokens(reference, ours):
    ref_tok, _ = reference
    _, tok = ours
    for chat in CHATS:
        text = tok.apply_chat_template(chat, add_generation_prompt=True)
        assert text == ref_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert tok.encode(text) == ref_tok.encode(text, add_special_tokens=False)


def test_logits_match_transformers(reference, ours):
    ref_tok, ref_model = reference
    model, tok = ours
    forward = jax.jit(lambda t: model(t))
    for chat in CHATS:
        ids = tok.encode(tok.apply_chat_template(chat, add_generation_prompt=True))
        with torch.no_grad():
            ref = ref_model(torch.tensor([ids])).logits.numpy()
        assert rel_err(forward(jnp.asarray([ids])), ref) <= 1e-3


def test_greedy_continuation_matches_transformers(reference, ours):
    ref_tok, ref_model = reference
    model, tok = ours
    prompts = [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True)) for c in CHATS]
    completions, _ = Generator(model).generate(prompts, max_new_tokens=32)  # no eos: 32 tokens each
    for ids, c in zip(prompts, completions):
        with torch.no_grad():
            out = ref_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                                     pad_token_id=0, min_new_tokens=32)
        assert c.token_ids == out[0, len(ids):].tolist()
