"""The real SmolLM2-135M-Instruct weights (Q4_1 GGUF): our logits and greedy continuation equal transformers'.

transformers dequantizes the same GGUF with its own code (through the ``gguf`` package) and runs its own Llama,
so this checks our GGUF reader, dequantization, q/k un-permutation, tokenizer, chat template and model at once.
"""

import os

import jax
import jax.numpy as jnp
import pytest
import torch
from flax import nnx

import hf_smollm2
from conftest import rel_err
from dora_jax.config import load_config
from dora_jax.models.weights import load_model

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
    return hf_smollm2.tokenizer(), hf_smollm2.model()


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
    # Weights as arguments, not closed over: constants would put 540 MB into the program.
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    for chat in CHATS:
        ids = tok.encode(tok.apply_chat_template(chat, add_generation_prompt=True))
        with torch.no_grad():
            ref = ref_model(torch.tensor([ids])).logits.numpy()
        assert rel_err(forward(state, jnp.asarray([ids])), ref) <= 1e-3


def test_engine_greedy_with_staggered_inserts_matches_transformers(reference, ours):
    """Prompts join a busy continuous batch at different steps; each greedy continuation still equals
    transformers' greedy continuation of that prompt alone."""
    from flax import nnx

    from dora_jax.rollout.driver import RolloutDriver

    from dora_jax.rollout.engine import Engine, RequestSampling
    from dora_jax.rollout.samples import Request

    _, ref_model = reference
    model, tok = ours
    prompts = [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True)) for c in CHATS]
    prompts.append(tok.encode(tok.apply_chat_template([{"role": "user", "content": "Say hi."}])))
    lengths = [20, 8, 14, 11]
    # Two decode steps per program, so three driver steps are six tokens: each prompt joins while the ones before
    # it still decode.
    driver = RolloutDriver(Engine(model, max_concurrent_decodes=4, max_prefill_length=128, max_target_length=160),
                           decode_steps=2)
    driver.add_version(0, nnx.state(model))
    greedy = RequestSampling(temperature=0.0)
    out = {}
    for i, (ids, n) in enumerate(zip(prompts, lengths)):
        assert i == 0 or sum(driver.in_flight().values()) > 0, f"prompt {i} would join an idle batch"
        driver.submit(Request(i, tuple(ids), max_new_tokens=n, sampling=greedy))
        for _ in range(3):  # the next prompt arrives three steps later
            out.update({t.sample_id: t for t in driver.step()})
    out.update({t.sample_id: t for t in driver.run()})
    assert sorted(out) == [0, 1, 2, 3]
    for i, (ids, n) in enumerate(zip(prompts, lengths)):
        with torch.no_grad():
            ref = ref_model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)
        assert out[i].tokens == ref[0, len(ids):].tolist()


def test_bench_engine_transformers_side_generates_exactly_the_asked_tokens(reference):
    """`bench engine`'s transformers runner (`benchmarks.engine.hf_generate_run`): left-padded prompts of different
    lengths, sampled, each row exactly `new_tokens` long (no early stop, which would inflate the rate);
    repeated calls run again; it records where and on how many threads it ran."""
    from benchmarks.engine import hf_generate_run

    out, threads = {}, torch.get_num_threads()
    try:
        run = hf_generate_run([[1, 2, 3, 4], [5, 6]], 3, "float32", out, model=reference[1])
        assert run() > 0 and run() > 0
    finally:
        torch.set_num_threads(threads)  # the runner takes every core; the tests after it share them
    assert out["hf_device"] == "cpu" and out["torch_threads"] == (os.cpu_count() or 1)
