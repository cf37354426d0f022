"""Which models Bitune is defined for, checked on the model itself when it is wrapped.

Bitune needs three things of a causal LM: every decoder layer keeps attention keys and values in a transformers
cache (they are what the two prompt passes mix), its attention obeys the 4D mask a prompt pass hands it (so the
bidirectional pass sees later tokens and the causal one does not), and its positions come from ``position_ids``
(left padding and the fused forward restart them). Rather than a list of names that goes stale with every
transformers release, :func:`check_model` asks the model, with a forward over a few tokens, before any adapter
is added; :func:`check_passes` asks the wrapped model the same of its prompt passes, and :func:`fast_paths` which
of the faster execution paths compute what the plain one-pass-at-a-time path computes on it. A model that fails a
requirement is refused with one line naming it and the reason; a fast path that would be wrong is switched off
(the model then runs the path that is right, and says so in :attr:`Support.note`).

:data:`KNOWN_CAUSES` is the one table of what is known about architectures that fail a check: it names the
cause in the error (the probe decides; the table only explains). The Supported models page of the documentation
is generated from the architecture matrix (``scripts/architectures.py``), which runs these checks on a tiny
model of every decoder-only causal LM in the pinned transformers.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache

from .errors import BituneError
from .kinds import KINDS, Layers, layer_kinds


class UnsupportedModelError(BituneError):
    """The model is not one Bitune is defined for (or not one it supports yet); the message says why."""


KNOWN_CAUSES: dict[str, str] = {
    "falcon": "ALiBi position biases built by a module function (alibi=True), which wrap cannot make symmetric",
    "gemma3n_text": "its last layers reuse earlier layers' keys and values (KV sharing)",
    **dict.fromkeys(("rwkv", "mamba", "mamba2", "falcon_mamba", "xlstm"), "a recurrent model without attention"),
    **dict.fromkeys(("recurrent_gemma", "minimax"), "a hybrid whose cache is its own class, not transformers' "
                    "per-layer cache"),
}
"""model_type -> why such models fail a check (named in the refusal; the checks themselves decide)."""


@dataclass
class Support:
    """What wrap found a wrapped model's paths can do (:mod:`bitune.probe`, :mod:`bitune.kinds`).

    Attributes:
        fused: the fused forward (one forward for all passes) is allowed by the layers' kinds and computes what
            the passes one by one compute.
        merge: merging the causal set gives the unmerged logits (checked by :meth:`bitune.model.BituneModel.merge`).
        note: why a path is off ("" when every path is on).
    """

    fused: bool = True
    merge: bool = True
    note: str = ""


def _name(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    return f"{type(model).__name__} ({kind})" if kind else type(model).__name__


def _cause(model: nn.Module, found: str) -> str:
    kind = getattr(getattr(model, "config", None), "model_type", None)
    known = KNOWN_CAUSES.get(kind)
    return f"{found}: {known}" if known else found


def refuse(model: nn.Module, found: str) -> UnsupportedModelError:
    """The one-line refusal of ``model``: its class and type, what the check found and, if known, the cause."""
    return UnsupportedModelError(f"{_name(model)} is not supported by Bitune: {_cause(model, found)}. "
                                 f"{INSTEAD}")


INSTEAD = ("What works instead: the baselines that need no prompt passes ('--config methods/lora', or "
           "variant='lora'); models of a supported family are listed on the Supported models page "
           "(docs/supported-models.md, with what to do if your model is refused)")
"""The second half of every refusal: where a user goes from there."""


@contextmanager
def evaluating(model: nn.Module):
    """Eval mode (no dropout) and no gradients within this block; every module's mode is restored."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, mode in modes:
            m.training = mode


def _probe_ids(model: nn.Module, n: int, seed: int = 0) -> torch.Tensor:
    vocab = model.get_input_embeddings().num_embeddings
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    return torch.randint(min(3, vocab - 1), vocab, (1, n), generator=g).to(device)


def check_model(model: nn.Module, passes: bool = True) -> Layers:
    """Refuse ``model`` (before adapters are added) if it is not a decoder-only transformers causal LM whose every
    decoder layer is of a kind Bitune implements (:mod:`bitune.kinds`: what it keeps in a transformers cache and
    its layer type decide), or if it builds ALiBi biases wrap cannot make symmetric (Falcon with ``alibi=True``;
    Bloom's and MPT's are: :func:`bitune.attention.symmetric_alibi`).

    Args:
        passes: whether the model will read prompts in Bitune's prompt passes; the baselines (one causal pass, the
            model's own masks) need no layer kind and run on any model PEFT runs on: for them a model whose layers
            are of no implemented kind is accepted, its kinds unknown (:attr:`bitune.kinds.Layers.unknown`).

    Returns:
        The kind of every decoder layer (on the meta device, where nothing can run: attention layers).

    Raises:
        UnsupportedModelError: one line naming the model and the reason.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "generate"):
        raise UnsupportedModelError(f"{type(model).__name__} is not a transformers causal LM (no config / generate)")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{_name(model)} is an encoder-decoder model; Bitune needs a decoder-only LM")
    text = config.get_text_config()
    layers = getattr(text, "num_hidden_layers", None)
    if not layers:
        raise UnsupportedModelError(f"{_name(model)}: config has no num_hidden_layers; unsupported architecture")
    if not passes:
        return _kinds_or_unknown(model, text)
    if getattr(text, "alibi", False) is True:  # Falcon's option; Bloom and MPT are alibi_attention layers
        raise refuse(model, "ALiBi attention biases")
    if next(model.parameters()).device.type == "meta":  # shapes only (memory accounting): nothing can run
        return Layers([KINDS["full_attention"]] * layers)
    cache = DynamicCache(config=text)
    ids = _probe_ids(model, 3)
    with evaluating(model):
        try:
            model(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, use_cache=True, logits_to_keep=1)
        except Exception as e:  # noqa: BLE001 - any failure here means the model cannot be read into a cache
            raise refuse(model, f"a forward that fills a transformers KV cache fails "
                                f"({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})") from e
    kinds, why = layer_kinds(cache, text)
    if kinds is None:
        raise refuse(model, why)
    if kinds.stateful and (problem := _continues_from_states(model, text)) is not None:
        raise refuse(model, problem)
    return kinds


def _continues_from_states(model: nn.Module, text) -> str | None:
    """Why the model's recurrent layers cannot continue a forward of several tokens from the states a cache holds
    (Mamba-1 layers scan a multi-token input from a zero state: the answer pass would not read the mixed state), or
    None: the states after reading 6 tokens in two forwards must equal those after one."""
    ids = _probe_ids(model, 6, seed=1)
    caches = []
    with evaluating(model):
        for cut in (6, 4):
            cache = DynamicCache(config=text)
            model(input_ids=ids[:, :cut], attention_mask=torch.ones_like(ids[:, :cut]), cache=cache, use_cache=True)
            if cut < 6:
                model(input_ids=ids[:, cut:], attention_mask=torch.ones_like(ids), cache=cache, use_cache=True,
                      position_ids=torch.arange(cut, 6, device=ids.device)[None])
            caches.append(cache)
    for i, (a, b) in enumerate(zip(*(c.layers for c in caches))):
        for name in ("recurrent_states", "conv_states"):
            for j, x in (getattr(a, name, None) or {}).items():
                y = getattr(b, name)[j]
                if x is not None and (x.float() - y.float()).abs().max().item() > 1e-4 * (x.float().abs().max().item() + 1):
                    return (f"its recurrent layers do not continue a forward of several tokens from the states a "
                            f"cache holds (layer {i}'s {name} after 4 + 2 tokens differ from after 6: the answer "
                            "pass would not read the mixed state)")
    return None


def _kinds_or_unknown(model: nn.Module, text) -> Layers:
    """For a baseline: the layers' kinds where they are known, else layers of unknown kinds (with the reason)."""
    try:
        cache = DynamicCache(config=text)
        ids = _probe_ids(model, 3)
        with evaluating(model):
            model(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, use_cache=True, logits_to_keep=1)
        kinds, why = layer_kinds(cache, text)
    except Exception as e:  # noqa: BLE001 - the baseline runs the model's own forward; the kinds stay unknown
        kinds, why = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return kinds if kinds is not None else Layers([], None, unknown=why)


def passes_obey_masks(first_keys, ids: torch.Tensor, vocab: int) -> str | None:
    """What is wrong with the prompt passes' masks, or None.

    Args:
        first_keys: ``first_keys(kind, ids)`` -> the first position's keys of every layer, for a prompt pass of
            mask ``kind`` over ``ids`` (1, T).
        ids: (1, T) token ids, T >= 2.
        vocab: the vocabulary size (to change the last token to another id).
    """
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % vocab
    for kind in ("causal", "bidirectional"):
        before, after = first_keys(kind, ids), first_keys(kind, changed)
        for i, (a, b) in enumerate(zip(before, after)):
            moved = (a.float() - b.float()).abs().max().item()
            scale = a.float().abs().max().item() + 1e-6
            if kind == "causal" and moved > 1e-3 * scale:
                return f"its causal prompt pass lets layer {i} see a later token"
            if kind == "bidirectional" and i > 0 and moved == 0:
                return (f"its bidirectional prompt pass does not see later tokens in layer {i} (the model's "
                        "attention does not take the pass's 4D mask)")
    return None


def agree(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two paths' logits agree to the rounding of the model's dtype (relative to their size)."""
    tol = 1e-4 if a.dtype == torch.float32 else 5e-2
    return a.shape == b.shape and (a.float() - b.float()).abs().max().item() <= tol * (b.float().abs().max().item() + 1)


__all__ = ["KNOWN_CAUSES", "Support", "UnsupportedModelError", "agree", "check_model", "evaluating", "passes_obey_masks", "refuse"]
