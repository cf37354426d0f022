"""The checks a :class:`~bitune.model.BituneModel` runs on itself: once when it is wrapped
(:func:`check_wrapped`: the prompt passes obey their masks, and which fast paths compute what the passes read one
by one compute) and when it is merged (:func:`checked_merge`). What they decide is stored in ``model.support``
(:class:`bitune.support.Support`); the rules on the plain model, before adapters exist, are
:func:`bitune.support.check_model`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from . import cache as kv
from .adapters import RoutingError
from .fused import fused_logits
from .passes import read_pass
from .support import UnsupportedModelError, agree, evaluating, passes_obey_masks, refuse


def check_wrapped(model) -> None:
    """Tiny prompt passes that check the model and prepare it (:mod:`bitune.support`): they freeze the bidir
    weights that cannot get a gradient (only the prompt passes' keys and values reach the answer, so in the
    last layer everything after K/V (q, o, MLP) is unused by the bidir weights, found by one backward from the
    last layer's K/V), refuse a model whose prompt passes do not obey their masks, and switch off a fast path
    (per-row or per-position routing, the fused forward) that does not compute the plain path's numbers.

    Raises:
        UnsupportedModelError: the bidirectional pass does not see later tokens, or the causal one does.
    """
    weights = "bidir" if "bidir" in model.config.weight_sets else "causal"
    base = model.weights.base
    device = next(base.parameters()).device
    if device.type == "meta" or model.config.single_pass:  # shapes only; or no prompt passes: nothing to check
        return
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    mask = torch.ones(1, 2, dtype=torch.long, device=device)
    try:
        with torch.enable_grad():
            cache = read_pass(model.weights, model.text_config, model.layer_kinds, ids, mask, weights, "bidirectional")
            if weights == "bidir":  # what reaches any cached tensor (the last attention layer's K/V reach all)
                held = [t for i in range(model.num_layers) for t in kv.layer_tensors(cache, i)]
                model.weights.freeze_unreached("bidir", sum(t.float().sum() for t in held))
        with evaluating(model):
            _check_passes(model, device)
            _check_fast_paths(model, device)
    except UnsupportedModelError:
        raise
    except Exception as e:  # noqa: BLE001 - a prompt pass this model cannot run: refused, not a crash later
        first = str(e).splitlines()[0][:200] if str(e) else ""
        raise refuse(base, f"a prompt pass (a forward over a transformers cache with a 4D mask and "
                           f"position ids) fails: {type(e).__name__}: {first}") from e
    if model.support.note:
        logging.getLogger("bitune").warning("%s: %s", type(base).__name__, model.support.note)

def _check_passes(model, device) -> None:
    """Refuse the model if its prompt passes do not obey their masks (:func:`bitune.support.passes_obey_masks`)."""
    sets = model.config.weight_sets

    def first_keys(kind: str, ids: torch.Tensor) -> list[torch.Tensor]:
        weights = "bidir" if kind == "bidirectional" and "bidir" in sets else "causal"
        cache = read_pass(model.weights, model.text_config, model.layer_kinds, ids, torch.ones_like(ids), weights, kind)
        return [kv.layer_kv(cache, i)[0][..., 0, :] for i, k in enumerate(model.layer_kinds.kinds)
                if "keys" in k.sequence]  # attention layers (a recurrent layer is causal by construction)

    vocab = model.weights.base.get_input_embeddings().num_embeddings
    ids = torch.randint(min(3, vocab - 1), vocab, (1, 4), generator=torch.Generator().manual_seed(0)).to(device)
    if (problem := passes_obey_masks(first_keys, ids, vocab)) is not None:
        raise refuse(model.weights.base, problem)

def _check_fast_paths(model, device) -> None:
    """Run a tiny padded batch through every path this model would take and keep only the fast paths that
    agree with the passes read one at a time (:class:`bitune.support.Support`)."""
    p_ids, p_mask, a_ids, a_mask = probe_batch(model, device)
    chosen = model._prompt_passes

    def logits(path: str) -> torch.Tensor:
        model._prompt_passes = path
        if path == "fused":
            return fused_logits(model.weights, model.mixer, model.config.passes, model.text_config, p_ids, p_mask,
                                a_ids, a_mask)
        return model.answer_logits(model.prefill(p_ids, p_mask), a_ids, a_mask)

    try:
        plain = logits("sequential")
        names = [w for w, _ in model.config.passes]
        if model.weights.can_route(names) and len(names) == 2:
            problem = _disagrees(logits, "batched", plain)
            if problem:
                model.weights.route_ok = False
                model.support.note = f"the prompt passes batched as one forward {problem}"
        if model.support.fused and model.weights.can_route(names + ["causal"]):
            problem = _disagrees(logits, "fused", plain)
            if problem:
                model.support.fused = False
                model.support.note = f"the fused forward {problem}"
        if model.support.note:
            model.support.note += "; it runs the prompt passes " + (
                "batched" if model.prefill_path() == "batched" else "one by one")
    finally:
        model._prompt_passes = chosen

def probe_batch(model, device) -> tuple[torch.Tensor, ...]:
    """Two prompts (row 0 left-padded) and answers of random ids: what wrap and merge check paths with."""
    vocab = model.weights.base.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(1)
    p_ids = torch.randint(min(3, vocab - 1), vocab, (2, 5), generator=g).to(device)
    p_mask = torch.ones_like(p_ids)
    p_mask[0, :2] = 0  # row 0 left-padded
    a_ids = torch.randint(min(3, vocab - 1), vocab, (2, 2), generator=g).to(device)
    return p_ids, p_mask, a_ids, torch.ones_like(a_ids)

def _disagrees(logits: Callable[[str], torch.Tensor], path: str, plain: torch.Tensor) -> str | None:
    """What is wrong with ``path``'s logits against the passes read one by one (``plain``), or None."""
    try:
        if agree(logits(path), plain):
            return None
        return ("disagrees with the passes read one by one (the model computes attention or positions outside "
                "transformers' attention interface)")
    except RoutingError as e:
        return f"cannot route LoRA weight sets ({e})"
    except Exception as e:  # noqa: BLE001 - a fast path this model cannot run is switched off
        return f"fails ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})"


def checked_merge(model, bidir_copy: bool = False) -> None:
    """Merge ``model``'s causal set (:meth:`bitune.adapters.WeightSets.merge`), checked on a tiny padded batch:
    where the merged weights do not give the unmerged logits (PEFT's merge of some fused expert layouts is inexact:
    LongCat-Flash), the merge is undone and the model stays unmerged, at the unmerged model's speed and with its
    numbers, and says so (``support.note``, a logged warning)."""
    if model.merged or not model.weights.peft or next(model.parameters()).device.type == "meta":
        model.weights.merge(bidir_copy)
        return
    batch = probe_batch(model, next(model.parameters()).device)
    with evaluating(model):
        before = model.answer_logits(model.prefill(*batch[:2]), *batch[2:])
        model.weights.merge(bidir_copy)
        after = model.answer_logits(model.prefill(*batch[:2]), *batch[2:])
    if not agree(after, before):
        model.weights.unmerge()
        diff = (after.float() - before.float()).abs().max().item()
        model.support.merge = False
        model.support.note = (f"merge() declined: PEFT's merge of this model's adapted layers moves its logits by "
                              f"{diff:.2g}; it runs unmerged")
        logging.getLogger("bitune").warning("%s: %s", type(model.weights.base).__name__, model.support.note)
