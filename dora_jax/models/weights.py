"""Loading weights onto a mesh and exporting them as a Hugging Face directory.

Entry points: :func:`open_weights` (``"smollm2"``, a ``.gguf`` file, a Hugging Face directory or a Hub name
``ORG/NAME``, all seen through Hugging Face tensor names and layouts), :func:`load_model` (reads one tensor at a
time straight into its target sharding; the whole model never sits on one device or in host memory) and
:func:`export_hf`. :func:`param_table` maps Hugging Face names to the stacked parameters and back.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm

from dora_jax.config import ConfigError, MeshConfig, ModelConfig
from dora_jax.models.build import abstract_model, state_shardings
from dora_jax.models.decoder import Decoder
from dora_jax.models.hf_io import (REQUIRED, HFCheckpoint, WeightsError, hf_config_from_model,
                                   model_fields_from_hf_config, typed_field, write_safetensors)
from dora_jax.sharding import Rules, create_mesh, serial_jit

# ----------------------------------------------------------------------------------------------------------
# Sources


class GGUFSource:
    """A GGUF file seen through Hugging Face tensor names and layouts (dequantized to float32)."""

    _LAYER = {
        "input_layernorm.weight": "attn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
        "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
        "self_attn.o_proj.weight": "attn_output.weight", "self_attn.o_proj.bias": "attn_output.bias",
        "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    _GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
               "model.norm.weight": "output_norm.weight"}

    def __init__(self, path: str):
        from dora_jax.models.gguf import read_gguf

        self.path = path
        self.file = read_gguf(path)
        self.arch = self.file.metadata.get("general.architecture")
        if self.arch not in ("llama", "qwen2", "qwen3"):
            raise WeightsError(f"{path}: unsupported GGUF architecture {self.arch!r}; supported: llama, qwen2, qwen3")
        if "rope_freqs.weight" in self.file.tensors:
            raise WeightsError(f"{path}: per-frequency rope factors (rope_freqs.weight) are not supported; load "
                               f"the Hugging Face directory of this model instead")

    def _gguf_name(self, hf_name: str) -> str | None:
        if hf_name in self._GLOBAL:
            return self._GLOBAL[hf_name]
        parts = hf_name.split(".", 3)  # model.layers.{i}.rest
        if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in self._LAYER:
            return f"blk.{parts[2]}.{self._LAYER[parts[3]]}"
        return None

    def __contains__(self, hf_name: str) -> bool:
        g = self._gguf_name(hf_name)
        return g is not None and g in self.file.tensors

    def where(self, hf_name: str) -> str:
        return f"{self.path} (tensor {self._gguf_name(hf_name)!r})"

    def shape(self, hf_name: str) -> tuple[int, ...]:
        """The tensor's shape in numpy order, which is the Hugging Face layout (nothing is read)."""
        g = self._gguf_name(hf_name)
        if g is None or g not in self.file.tensors:
            raise WeightsError(f"{self.path}: tensor {g or hf_name!r} not found")
        return self.file.tensors[g].shape

    def get(self, hf_name: str) -> np.ndarray:
        g = self._gguf_name(hf_name)
        if g is None or g not in self.file.tensors:
            raise WeightsError(f"{self.path}: tensor {g or hf_name!r} not found")
        w = self.file.load(g)
        if self.arch == "llama" and (g.endswith("attn_q.weight") or g.endswith("attn_k.weight")):
            # llama.cpp interleaves the rotary halves of q and k rows; undo it to get the rotate-half layout.
            md = self.file.metadata
            heads = md["llama.attention.head_count"] if g.endswith("attn_q.weight") else \
                md.get("llama.attention.head_count_kv", md["llama.attention.head_count"])
            w = w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        return w

    def model_fields(self) -> dict[str, Any]:
        md, a, t = self.file.metadata, self.arch, self.file.tensors
        where = f"{self.path}: metadata"

        def size(key: str, default: Any = REQUIRED) -> int:
            return typed_field(md, f"{a}.{key}", int, where, default, positive=True)

        def number(key: str, default: Any = REQUIRED) -> float:
            return typed_field(md, f"{a}.{key}", float, where, default, positive=True)

        heads, hidden = size("attention.head_count"), size("embedding_length")
        if "token_embd.weight" not in t:
            raise WeightsError(f"{self.path}: no tensor 'token_embd.weight'")
        vocab = md.get(f"{a}.vocab_size") or len(md.get("tokenizer.ggml.tokens", ())) or \
            t["token_embd.weight"].shape[0]
        return dict(
            family=a, vocab_size=int(vocab), hidden_size=hidden,
            intermediate_size=size("feed_forward_length"), num_layers=size("block_count"),
            num_heads=heads, num_kv_heads=size("attention.head_count_kv", heads),
            head_dim=size("attention.key_length", hidden // heads),
            rope_theta=number("rope.freq_base", 10000.0), rope_scaling=None,
            rms_norm_eps=number("attention.layer_norm_rms_epsilon"),
            tie_embeddings="output.weight" not in t, qkv_bias="blk.0.attn_q.bias" in t,
            o_bias="blk.0.attn_output.bias" in t,
            qk_norm="blk.0.attn_q_norm.weight" in t, max_seq_len=size("context_length", 2048),
        )

    def tokenizer(self):
        from dora_jax.tokenizer import Tokenizer

        return Tokenizer.from_gguf(self.file)


class HFSource:
    """A Hugging Face model directory."""

    def __init__(self, directory: str):
        self.path = directory
        self.ckpt = HFCheckpoint(directory)

    def __contains__(self, name: str) -> bool:
        return name in self.ckpt

    def where(self, name: str) -> str:
        return f"{self.ckpt.where(name)} (tensor {name!r})"

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape from its file's header (nothing is read); a non-floating-point tensor is refused,
        naming its dtype."""
        from dora_jax.models.hf_io import FLOAT_CODES

        shape, code = self.ckpt.shape(name), self.ckpt.dtype(name)
        if code not in FLOAT_CODES:
            raise WeightsError(f"{self.where(name)}: dtype {code}, but weights must be floating point "
                               f"({', '.join(FLOAT_CODES)})")
        return shape

    def get(self, name: str) -> np.ndarray:
        return self.ckpt.get(name)

    def model_fields(self) -> dict[str, Any]:
        return model_fields_from_hf_config(self.ckpt.config, os.path.join(self.path, "config.json"))

    def tokenizer(self):
        if not os.path.isfile(os.path.join(self.path, "tokenizer.json")):
            return None
        from dora_jax.tokenizer import Tokenizer

        return Tokenizer.from_hf_dir(self.path)


def is_hub_name(spec: str) -> bool:
    """Whether ``spec`` reads as a Hub model name ``ORG/NAME[@REVISION]`` rather than a local path."""
    name = spec.split("@", 1)[0]
    org, sep, model = name.partition("/")
    ok = lambda part: bool(part) and all(c.isalnum() or c in "-_." for c in part) and part not in (".", "..")  # noqa: E731
    return bool(sep) and ok(org) and ok(model) and not spec.endswith(".gguf") and not os.path.exists(spec)


def hub_snapshot(spec: str) -> str:
    """The local directory of Hub model ``ORG/NAME[@REVISION]`` in huggingface_hub's cache, fetched when online
    (with ``HF_HUB_OFFLINE=1``, from the cache alone).

    Raises:
      WeightsError: naming the model when it is neither on the Hub nor in the cache.
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    repo, _, revision = spec.partition("@")
    try:
        return snapshot_download(repo, revision=revision or None,
                                 allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"])
    except RepositoryNotFoundError:
        raise WeightsError(f"weights {spec!r}: no such model on the Hugging Face Hub (or it is private: log in "
                           "with `hf auth login`)") from None
    except LocalEntryNotFoundError as e:
        where = constants.HF_HUB_CACHE
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else f"the Hub could not be reached ({e})"
        raise WeightsError(f"weights {spec!r}: not in the Hugging Face cache at {where}, and {why}; download it "
                           f"once online (or point HF_HUB_CACHE at a cache that holds it)") from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise WeightsError(f"weights {spec!r}: could not be fetched from the Hugging Face Hub "
                           f"({type(e).__name__}: {e})") from None


def open_weights(spec: str) -> GGUFSource | HFSource:
    """Opens ``"smollm2"``, a ``.gguf`` file, a Hugging Face directory, or a Hub model ``ORG/NAME[@REVISION]``
    (:func:`hub_snapshot`).

    Raises:
      WeightsError: naming the path when it is missing or of an unknown kind.
    """
    if spec == "smollm2":
        from dora_jax.models.gguf import smollm2_gguf_path

        return GGUFSource(smollm2_gguf_path())
    if os.path.isdir(spec):
        return HFSource(spec)
    if os.path.isfile(spec):
        if spec.endswith(".gguf"):
            return GGUFSource(spec)
        raise WeightsError(f"{spec}: not a .gguf file or a Hugging Face directory")
    if is_hub_name(spec):
        return HFSource(hub_snapshot(spec))
    raise WeightsError(f"weights {spec!r} not found (expected 'smollm2', a .gguf file, a Hugging Face directory or "
                       "a Hub model name ORG/NAME)")


def model_config_from_weights(spec: str, **overrides: Any) -> ModelConfig:
    """A ModelConfig describing the weights at ``spec`` (settings such as dtypes may be overridden)."""
    fields = open_weights(spec).model_fields()
    fields.update(weights=spec, **overrides)
    cfg = ModelConfig(**fields)
    try:
        cfg.validate()
    except ConfigError as e:
        raise WeightsError(f"{spec}: the weights describe a model dora-jax cannot build: {e}") from None
    return cfg


# ----------------------------------------------------------------------------------------------------------
# The parameter table: our stacked parameter <-> per-layer Hugging Face tensors.


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    name: str                       # attribute of Decoder
    hf: str                         # Hugging Face name, with {i} for the layer index
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]
    fields: str                     # config fields that decide the shape, for error messages
    hf_shape: tuple[int, ...]       # the shape of one (per-layer) Hugging Face tensor, checked before any change

    @property
    def stacked(self) -> bool:
        return "{i}" in self.hf


def param_table(cfg: ModelConfig) -> list[ParamSpec]:
    D, H, K, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    V, F = cfg.vocab_size, cfg.intermediate_size
    ident = lambda w: w  # noqa: E731
    T = lambda w: w.T  # noqa: E731

    def proj_in(n):  # HF [n*d, D] -> ours [D, n, d]
        return lambda w: w.T.reshape(D, n, d)

    def proj_in_inv(n):
        return lambda w: w.reshape(D, n * d).T

    lay = "model.layers.{i}."
    table = [
        ParamSpec("embed", "model.embed_tokens.weight", ident, ident, "vocab_size, hidden_size", (V, D)),
        ParamSpec("final_norm", "model.norm.weight", ident, ident, "hidden_size", (D,)),
        ParamSpec("attn_norm", lay + "input_layernorm.weight", ident, ident, "hidden_size", (D,)),
        ParamSpec("wq", lay + "self_attn.q_proj.weight", proj_in(H), proj_in_inv(H), "hidden_size, num_heads, head_dim",
                  (H * d, D)),
        ParamSpec("wk", lay + "self_attn.k_proj.weight", proj_in(K), proj_in_inv(K),
                  "hidden_size, num_kv_heads, head_dim", (K * d, D)),
        ParamSpec("wv", lay + "self_attn.v_proj.weight", proj_in(K), proj_in_inv(K),
                  "hidden_size, num_kv_heads, head_dim", (K * d, D)),
        ParamSpec("wo", lay + "self_attn.o_proj.weight", lambda w: w.T.reshape(H, d, D),
                  lambda w: w.reshape(H * d, D).T, "num_heads, head_dim, hidden_size", (D, H * d)),
        ParamSpec("mlp_norm", lay + "post_attention_layernorm.weight", ident, ident, "hidden_size", (D,)),
        ParamSpec("w_gate", lay + "mlp.gate_proj.weight", T, T, "hidden_size, intermediate_size", (F, D)),
        ParamSpec("w_up", lay + "mlp.up_proj.weight", T, T, "hidden_size, intermediate_size", (F, D)),
        ParamSpec("w_down", lay + "mlp.down_proj.weight", T, T, "intermediate_size, hidden_size", (D, F)),
    ]
    if cfg.qkv_bias:
        for n, heads in (("q", H), ("k", K), ("v", K)):
            table.append(ParamSpec(f"b{n}", lay + f"self_attn.{n}_proj.bias",
                                   (lambda h: lambda w: w.reshape(h, d))(heads), lambda w: w.reshape(-1),
                                   "num_heads/num_kv_heads, head_dim, qkv_bias", (heads * d,)))
    if cfg.o_bias:
        table.append(ParamSpec("bo", lay + "self_attn.o_proj.bias", ident, ident, "hidden_size, o_bias", (D,)))
    if cfg.qk_norm:
        table += [ParamSpec("q_norm", lay + "self_attn.q_norm.weight", ident, ident, "head_dim, qk_norm", (d,)),
                  ParamSpec("k_norm", lay + "self_attn.k_norm.weight", ident, ident, "head_dim, qk_norm", (d,))]
    if not cfg.tie_embeddings:
        table.append(ParamSpec("lm_head", "lm_head.weight", T, T, "hidden_size, vocab_size, tie_embeddings", (V, D)))
    return table


_CHECKED = ("family", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
            "head_dim", "tie_embeddings", "qkv_bias", "o_bias", "qk_norm", "rope_theta", "rms_norm_eps", "rope_scaling")


def check_config_matches(cfg: ModelConfig, source: GGUFSource | HFSource) -> None:
    """Raises a ConfigError naming every architecture field where the config and the weights disagree."""
    found = source.model_fields()
    bad = []
    for name in _CHECKED:
        mine, theirs = getattr(cfg, name), found[name]
        if isinstance(mine, float) and isinstance(theirs, float):
            same = math.isclose(mine, theirs, rel_tol=1e-5)
        else:
            same = mine == theirs
        if name == "family" and {mine, theirs} <= {"llama"}:
            same = True
        if not same:
            bad.append(f"model.{name} = {mine!r} but the weights have {theirs!r}")
    if bad:
        raise ConfigError(f"config does not match the weights at {source.path}:\n  " + "\n  ".join(bad))


# ----------------------------------------------------------------------------------------------------------
# Loading and exporting


def _np_dtype(name: str):
    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


def _default_mesh() -> Mesh:
    return create_mesh(MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])


def load_model(cfg: ModelConfig, mesh: Mesh | None = None, rules: Rules = (), *, seed: int = 0,
               progress: bool = True) -> tuple[Decoder, Any]:
    """Builds the model described by ``cfg`` with its weights, directly in the mesh's shardings.

    Args:
      cfg: the model config; ``cfg.weights`` names the source ("" for random init with ``seed``).
      mesh: target mesh (default: one device); rules: logical axis rules (default
        :data:`dora_jax.config.DEFAULT_RULES`); progress: show a progress bar.

    Returns:
      ``(model, tokenizer)``; tokenizer is None when the weights carry none (or for random init).

    Raises:
      WeightsError / ConfigError: naming the file, tensor or config field at fault, before anything is built.
    """
    from dora_jax.config import DEFAULT_RULES
    from dora_jax.models.build import init_model

    mesh = mesh or _default_mesh()
    rules = rules or DEFAULT_RULES
    if not cfg.weights:
        return init_model(cfg, mesh, rules, seed=seed), None
    source = open_weights(cfg.weights)
    check_config_matches(cfg, source)
    tokenizer = source.tokenizer()
    if tokenizer is not None and tokenizer.vocab_size > cfg.vocab_size:  # ids past the embedding: garbage, no error
        raise WeightsError(f"{source.path}: the tokenizer has {tokenizer.vocab_size} tokens but the model's "
                           f"vocabulary (model.vocab_size) is {cfg.vocab_size}; they do not belong together")
    graphdef, abstract_state = abstract_model(cfg)
    shardings = state_shardings(abstract_state, mesh, rules)
    table = param_table(cfg)
    for spec in table:  # all tensors present before any is read
        names = [spec.hf.format(i=i) for i in range(cfg.num_layers)] if spec.stacked else [spec.hf]
        for n in names:
            if n not in source:
                raise WeightsError(f"{source.path}: tensor {n!r} is missing (needed for parameter {spec.name!r})")
            found = tuple(source.shape(n))
            if found != spec.hf_shape:  # in the file's own layout, before any transpose or reshape
                raise WeightsError(f"{source.where(n)}: shape {found}, but the config expects {spec.hf_shape} "
                                   f"(Hugging Face layout [out, in], from model.{spec.fields})")
    dtype = _np_dtype(cfg.param_dtype)
    flat = {}
    total = sum(cfg.num_layers if s.stacked else 1 for s in table)
    bar = tqdm(total=total, desc="loading weights", unit="tensor", disable=not progress)
    for spec in table:
        target = shardings[spec.name].get_value() if isinstance(shardings[spec.name], nnx.Variable) \
            else shardings[spec.name]
        want = tuple(abstract_state[spec.name].get_value().shape)

        def read(hf_name: str, shape: tuple[int, ...]) -> np.ndarray:
            raw = np.asarray(source.get(hf_name))
            if raw.shape != spec.hf_shape:  # a source whose data disagrees with its own header
                raise WeightsError(f"{source.where(hf_name)}: read shape {raw.shape}, but the config expects "
                                   f"{spec.hf_shape} (Hugging Face layout, from model.{spec.fields})")
            arr = spec.to_ours(raw)
            assert arr.shape == shape, (spec.name, arr.shape, shape)  # the table's two layouts agree
            bar.update(1)
            return arr.astype(dtype)

        if spec.stacked:
            layer_sharding = NamedSharding(mesh, P(*tuple(target.spec)[1:]))
            pieces = [jax.device_put(read(spec.hf.format(i=i), want[1:]), layer_sharding)
                      for i in range(cfg.num_layers)]
            flat[spec.name] = serial_jit(lambda *xs: jnp.stack(xs), out_shardings=target)(*pieces)
            del pieces
        else:
            flat[spec.name] = jax.device_put(read(spec.hf, want), target)
    bar.close()
    state = jax.tree.map(lambda v: v, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    for name, arr in flat.items():
        state[name] = state[name].replace(arr)
    return nnx.merge(graphdef, state), tokenizer


def _export_file(name: str) -> bool:
    """Whether ``export_hf`` writes files of this name (what ``overwrite`` may replace)."""
    return name.endswith(".safetensors") or name in (
        "config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json")


def export_hf(model: Decoder, out_dir: str, *, tokenizer: Any = None, dtype: str | None = None,
              overwrite: bool = False, max_shard_bytes: int = 4 << 30) -> str:
    """Writes the model as a Hugging Face directory that ``transformers`` loads; returns ``out_dir``.

    Written under a temporary name and renamed into place when complete. A non-empty ``out_dir`` is replaced only
    with ``overwrite``, and only if it is an earlier export (``config.json`` beside ``*.safetensors``, no other
    files) and does not hold the current directory; otherwise :class:`WeightsError` (:func:`_check_export_target`).
    """
    cfg = model.cfg
    _check_export_target(out_dir, overwrite)
    np_dtype = _np_dtype(dtype or cfg.param_dtype)
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
    try:
        _write_weights(tmp, _export_shards(model, np_dtype, max_shard_bytes))
        _write_config(tmp, cfg, np_dtype, tokenizer)
        _replace_dir(tmp, out_dir, parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _check_export_target(out_dir: str, overwrite: bool) -> None:
    """Raises :class:`WeightsError`, naming the directory and why, for an ``out_dir`` :func:`export_hf` may not
    write or replace."""
    if not out_dir:
        raise WeightsError("export: no output directory given")
    here = os.path.abspath(os.getcwd())
    if not os.path.exists(out_dir):
        return
    if not os.path.isdir(out_dir):
        raise WeightsError(f"{out_dir} exists and is a file, not a directory; choose another directory")
    names = os.listdir(out_dir)
    if names and not overwrite:
        raise WeightsError(f"{out_dir} exists and is not empty; choose another directory or pass "
                           "overwrite=True (--overwrite on the command line) to replace an earlier export")
    if names and not ("config.json" in names and any(n.endswith(".safetensors") for n in names)):
        raise WeightsError(f"{out_dir} is not an earlier export (no config.json beside *.safetensors), so it "
                           f"is not replaced even with overwrite; it holds {', '.join(sorted(names)[:5])}"
                           + (", ..." if len(names) > 5 else ""))
    others = sorted(n + ("/" if os.path.isdir(os.path.join(out_dir, n)) else "") for n in names
                    if not _export_file(n) or os.path.isdir(os.path.join(out_dir, n)))
    if others:
        raise WeightsError(f"{out_dir} holds files an export does not write ({', '.join(others[:5])}"
                           + (", ..." if len(others) > 5 else "") + "), so it is not replaced even with "
                           "overwrite; choose another directory")
    if (here + os.sep).startswith(os.path.abspath(out_dir).rstrip(os.sep) + os.sep):
        raise WeightsError(f"{out_dir} is the current directory (or holds it), so it is not replaced; run from "
                           "elsewhere or choose another directory")


def _export_shards(model: Decoder, np_dtype: Any, max_shard_bytes: int) -> list[dict[str, np.ndarray]]:
    """The model's tensors by Hugging Face name in ``np_dtype``, in shards of at most ``max_shard_bytes`` (a
    larger tensor alone in its shard)."""
    cfg = model.cfg
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for spec in param_table(cfg):
        full = np.asarray(jax.device_get(getattr(model, spec.name)[...]))  # one parameter on the host at a time
        items = ([(spec.hf.format(i=i), full[i]) for i in range(cfg.num_layers)] if spec.stacked
                 else [(spec.hf, full)])
        for name, arr in items:
            arr = np.ascontiguousarray(spec.to_hf(arr).astype(np_dtype))
            if size + arr.nbytes > max_shard_bytes and shards[-1]:
                shards.append({})
                size = 0
            shards[-1][name] = arr
            size += arr.nbytes
    return shards


def _write_weights(tmp: str, shards: list[dict[str, np.ndarray]]) -> None:
    """One ``model.safetensors``, or numbered shards and their ``model.safetensors.index.json``."""
    if len(shards) == 1:
        write_safetensors(os.path.join(tmp, "model.safetensors"), shards[0])
        return
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(os.path.join(tmp, fname), shard)
        weight_map.update({n: fname for n in shard})
    with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)


def _write_config(tmp: str, cfg: ModelConfig, np_dtype: Any, tokenizer: Any) -> None:
    """``config.json`` (with the tokenizer's special ids and its files, when one is given)."""
    ids = None
    if tokenizer is not None:
        tokenizer.save_hf(tmp)
        ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_ids[0] if tokenizer.eos_ids else None}
    hf_cfg = hf_config_from_model(dataclasses.replace(cfg, param_dtype=np.dtype(np_dtype).name), ids)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=2)


def _replace_dir(tmp: str, out_dir: str, parent: str) -> None:
    """Renames ``tmp`` to ``out_dir``; an earlier export there is moved aside, and back if the rename fails."""
    aside = None
    if os.path.exists(out_dir):
        aside = tempfile.mkdtemp(prefix=".replaced-", dir=parent)
        os.replace(out_dir, os.path.join(aside, "old"))
    try:
        os.replace(tmp, out_dir)
    except BaseException:
        if aside:
            os.replace(os.path.join(aside, "old"), out_dir)
        raise
    if aside:
        shutil.rmtree(aside, ignore_errors=True)
