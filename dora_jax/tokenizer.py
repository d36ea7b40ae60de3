"""Tokenizer and chat template that travel with the weights (GGUF metadata or a Hugging Face directory).

Wraps a ``tokenizers.Tokenizer`` (the Rust library) and renders chat templates with jinja2 the way
Hugging Face does (sandboxed, ``trim_blocks``, ``lstrip_blocks``). No JAX here.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _RustTokenizer

from dora_jax.textfiles import TextFileError, read_text

_CONTROL, _USER_DEFINED = 3, 4
# Pre-tokenizer splits of common byte-level vocabularies, by GGUF ``tokenizer.ggml.pre``.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
# Values whose split is GPT-2's own (the byte-level pre-tokenizer's regex); a GGUF without the key means it too.
_GPT2_SPLIT = ("default", "gpt-2", "phi-2", "roberta-bpe")
# Each other value names a split this reader does not know: guessing one would tokenize text differently from
# the model's training, so such a file is refused.
KNOWN_PRE = tuple(sorted((*_SPLITS, *_GPT2_SPLIT, "smollm")))
# End-of-turn markers that stop chat generation when the template uses them.
_TURN_ENDS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|endoftext|>")


class TokenizerError(ValueError):
    """Tokenizer files or metadata are missing or unsupported."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class Tokenizer:
    """Text <-> token ids, special ids and the chat template."""

    def __init__(self, tok: _RustTokenizer, *, bos: str | None, eos: str | None, chat_template: str | None,
                 extra_eos: Sequence[int] = (), template_source: str = "chat template"):
        self._tok = tok
        self.bos_token, self.eos_token, self.chat_template = bos, eos, chat_template
        self.template_source = template_source
        self._template = _compile_template(chat_template, template_source) if chat_template else None
        self.bos_id = tok.token_to_id(bos) if bos else None
        eos_id = tok.token_to_id(eos) if eos else None
        ids = [eos_id] if eos_id is not None else []
        for marker in _TURN_ENDS:
            tid = tok.token_to_id(marker)
            if chat_template and marker in chat_template and tid is not None:
                ids.append(tid)
        ids += list(extra_eos)
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))
        self.pad_id = eos_id if eos_id is not None else 0

    # -- construction --------------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, gguf_file: Any) -> "Tokenizer":
        """From ``tokenizer.ggml.*`` metadata of a GGUF file (a ``GGUFFile`` or its metadata dict)."""
        md = getattr(gguf_file, "metadata", gguf_file)
        where = getattr(gguf_file, "path", "GGUF metadata")
        kind = md.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise TokenizerError(f"{where}: tokenizer.ggml.model = {kind!r} is not supported (supported: 'gpt2', "
                                 f"byte-level BPE)")
        tokens = md.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
            raise TokenizerError(f"{where}: tokenizer.ggml.tokens must be a non-empty list of strings")
        for key in ("tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
            if key in md and not isinstance(md[key], list):
                raise TokenizerError(f"{where}: {key} must be a list")
        bad = next((m for m in md.get("tokenizer.ggml.merges", []) if not isinstance(m, str) or " " not in m), None)
        if bad is not None:
            raise TokenizerError(f"{where}: tokenizer.ggml.merges holds {bad!r}; each merge is 'left right'")
        for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
            if key in md and not (isinstance(md[key], int) and 0 <= md[key] < len(tokens)):
                raise TokenizerError(f"{where}: {key} = {md[key]!r} must be a token id in 0 .. {len(tokens) - 1}")
        template = md.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise TokenizerError(f"{where}: tokenizer.chat_template must be a string")
        alphabet = set(_bytes_to_unicode().values())
        spell = _bytes_to_unicode()
        vocab = {t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8")): i
                 for i, t in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges", [])]
        tok = _RustTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        pre = md.get("tokenizer.ggml.pre")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre in _SPLITS:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        elif pre == "smollm":  # SmolLM's own tokenizer splits digits individually before byte-level BPE
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        elif pre is None or pre in _GPT2_SPLIT:
            tok.pre_tokenizer = byte_level
        else:
            raise TokenizerError(f"{where}: tokenizer.ggml.pre = {pre!r} names a pre-tokenizer split this reader "
                                 f"does not know (known: {', '.join(KNOWN_PRE)}); load the model from a Hugging "
                                 "Face directory, whose tokenizer.json spells its split out")
        tok.decoder = decoders.ByteLevel()
        types = md.get("tokenizer.ggml.token_type") or [0] * len(tokens)
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= alphabet])
        user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
        if user:
            tok.add_tokens(user)

        def name(key):
            i = md.get(key)
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        bos = name("tokenizer.ggml.bos_token_id") if md.get("tokenizer.ggml.add_bos_token", False) or \
            "tokenizer.ggml.bos_token_id" in md else None
        return cls(tok, bos=bos, eos=name("tokenizer.ggml.eos_token_id"), chat_template=template,
                   template_source=f"{where} (tokenizer.chat_template)")

    @classmethod
    def from_hf_dir(cls, directory: str) -> "Tokenizer":
        """From ``tokenizer.json`` (+ ``tokenizer_config.json``, ``chat_template.jinja``,
        ``generation_config.json`` when present) in a Hugging Face directory."""
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(path):
            raise TokenizerError(f"{directory}: no tokenizer.json")
        try:
            tok = _RustTokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001 - the Rust error type is not exported
            raise TokenizerError(f"{path}: cannot be read as a tokenizer ({e})") from None
        conf_path = os.path.join(directory, "tokenizer_config.json")
        conf = _read_json(conf_path)
        template, where = conf.get("chat_template"), conf_path
        if isinstance(template, list):  # named templates: take "default"
            if not template or not all(isinstance(t, dict) and isinstance(t.get("template"), str) for t in template):
                raise TokenizerError(f"{conf_path}: chat_template must be a string or a list of "
                                     "{name, template} mappings")
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        elif template is not None and not isinstance(template, str):
            raise TokenizerError(f"{conf_path}: chat_template = {template!r} must be a string or a list of "
                                 "{name, template} mappings")
        jinja = os.path.join(directory, "chat_template.jinja")
        if os.path.isfile(jinja):
            try:
                template, where = read_text(jinja), jinja
            except TextFileError as e:
                raise TokenizerError(str(e)) from None
        gen_path = os.path.join(directory, "generation_config.json")
        gen = _read_json(gen_path).get("eos_token_id")
        extra = [gen] if isinstance(gen, int) else list(gen) if isinstance(gen, list) else [] if gen is None else None
        if extra is None or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < tok.get_vocab_size(
                with_added_tokens=True) for i in extra):
            raise TokenizerError(f"{gen_path}: eos_token_id = {gen!r} must be a token id or a list of them "
                                 f"(0 .. {tok.get_vocab_size(with_added_tokens=True) - 1})")
        return cls(tok, bos=_token_str(conf, "bos_token", conf_path), eos=_token_str(conf, "eos_token", conf_path),
                   chat_template=template, extra_eos=extra, template_source=where)

    # -- use -----------------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Renders a conversation with the model's chat template."""
        if not self.chat_template:
            raise TokenizerError("this tokenizer has no chat template; encode plain text instead")
        if self._template is None or self._template[0] != self.chat_template:  # the attribute was replaced
            self._template = _compile_template(self.chat_template, self.template_source)
        try:
            return self._template[1].render(messages=messages, add_generation_prompt=add_generation_prompt,
                                            bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TokenizerError:
            raise
        except Exception as e:  # noqa: BLE001 - template code is data: whatever it raises, name the template
            raise TokenizerError(f"{self.template_source}: the chat template fails on {len(messages)} "
                                 f"message(s): {type(e).__name__}: {e}") from None

    def save_hf(self, directory: str) -> None:
        """Writes ``tokenizer.json`` and ``tokenizer_config.json`` that ``transformers.AutoTokenizer`` loads."""
        os.makedirs(directory, exist_ok=True)
        self._tok.save(os.path.join(directory, "tokenizer.json"))
        conf = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": self.bos_token,
                "eos_token": self.eos_token, "add_bos_token": False, "clean_up_tokenization_spaces": False}
        if self.chat_template:
            conf["chat_template"] = self.chat_template
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
            json.dump(conf, f, indent=1)


def _compile_template(source: str, where: str) -> tuple[str, Any]:
    """``(source, jinja2 template)`` in the sandbox Hugging Face renders chat templates in."""
    import jinja2
    from jinja2 import ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TokenizerError(f"{where}: the chat template raised: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols])
    env.globals["raise_exception"] = raise_exception
    try:
        return source, env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"{where}: the chat template does not compile (line {e.lineno}: {e.message})") from None


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, for small randomly initialized models that come with no tokenizer.

    It has no end-of-sequence id (responses run to their length budget) and a plain ``Q: ... A:`` chat
    format, so tasks written in text run unchanged on test-sized models.
    """

    eos_ids: tuple[int, ...] = ()
    vocab_size = 256

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        text = "".join(f"{'Q' if m['role'] == 'user' else m['role']}: {m['content']}\n" for m in messages)
        return text + ("A: " if add_generation_prompt else "")


def _read_json(path: str) -> dict[str, Any]:
    """A JSON object from ``path`` ({} when there is no such file)."""
    if not os.path.isfile(path):
        return {}
    try:
        data = json.loads(read_text(path))
    except TextFileError as e:
        raise TokenizerError(str(e)) from None
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_str(conf: dict[str, Any], key: str, path: str) -> str | None:
    """A special token of ``tokenizer_config.json``: a string, ``{"content": string}`` or null."""
    tok = conf.get(key)
    tok = tok.get("content") if isinstance(tok, dict) else tok
    if tok is not None and not isinstance(tok, str):
        raise TokenizerError(f"{path}: {key} = {conf[key]!r} must be a token string (or {{\"content\": string}})")
    return tok


def chat_template_head(tokenizer: Any) -> list[int]:
    """The token ids that every prompt rendered as one user turn (with the generation prompt) starts with,
    whatever the user's text: the template's fixed head (e.g. a default system prompt and the user turn's
    opening). The longest common prefix of the encodings of probe texts that start with
    different kinds of character, so a token that merges with the user's first character is left out. A
    rollout engine prefills this head once per policy version instead of once per prompt."""
    probes = ("a", "Z", "7", " x", "\n", "?", "<", "é")
    seqs = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                           add_generation_prompt=True)) for p in probes]
    n = 0
    while all(len(s) > n for s in seqs) and len({s[n] for s in seqs}) == 1:
        n += 1
    return list(seqs[0][:n])
