"""The checks a :class:`~bitune.model.BituneModel` runs on itself; they measure and report, the model decides.

When it is wrapped (:func:`check_wrapped`): whether the prompt passes obey their masks (a model whose passes do
not is refused), which bidir weights no gradient reaches, and which fast paths disagree with the passes read one by
one (:class:`Findings`). When it is merged: the logits on a tiny padded batch before and after
(:func:`probe_logits`, :func:`moved`). The model turns what they find into its paths and notes
(:class:`bitune.support.Support`); the rules on the plain model, before adapters exist, are
:func:`bitune.support.check_model`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from . import cache as kv
from .adapters import RoutingError
from .fused import fused_logits
from .passes import read_pass
from .support import UnsupportedModelError, agree, evaluating, passes_obey_masks, refuse


@dataclass
class Findings:
    """What :func:`check_wrapped` found on a wrapped model (nothing, where it cannot run: meta device, no passes)."""

    unreached: list[str] = field(default_factory=list)
    """The bidir parameters (:meth:`bitune.adapters.WeightSets.parameters_of` names) no gradient reaches."""
    problems: dict[str, str] = field(default_factory=dict)
    """A fast path (``"batched"``, ``"fused"``) -> what is wrong with it against the passes read one by one; a
    path that agrees, or that was not checked, is absent."""


def check_wrapped(model) -> Findings:
    """Tiny prompt passes over a wrapped model: refuse it if its prompt passes do not obey their masks, find the
    bidir weights that cannot get a gradient (only the prompt passes' keys and values reach the answer, so in the
    last layer everything after K/V (q, o, MLP) is unused by the bidir weights, found by one backward from the
    last layer's K/V), and find the fast paths this model would take (per-row or per-position routing, the fused
    forward) that do not compute the plain path's numbers. Changes nothing of the model.

    Raises:
        UnsupportedModelError: the bidirectional pass does not see later tokens, or the causal one does, or a
            prompt pass fails.
    """
    weights = "bidir" if "bidir" in model.config.weight_sets else "causal"
    base = model.weights.base
    device = next(base.parameters()).device
    found = Findings()
    if device.type == "meta" or model.config.single_pass:  # shapes only; or no prompt passes: nothing to check
        return found
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    mask = torch.ones(1, 2, dtype=torch.long, device=device)
    try:
        with torch.enable_grad():
            cache = read_pass(model.weights, model.text_config, model.layer_kinds, ids, mask, weights, "bidirectional")
            if weights == "bidir":  # what reaches any cached tensor (the last attention layer's K/V reach all)
                held = [t for i in range(model.num_layers) for t in kv.layer_tensors(cache, i)]
                found.unreached = model.weights.unreached("bidir", sum(t.float().sum() for t in held))
        with evaluating(model):
            _check_passes(model, device)
            found.problems = _fast_path_problems(model, device)
    except UnsupportedModelError:
        raise
    except Exception as e:  # noqa: BLE001 - a prompt pass this model cannot run: refused, not a crash later
        first = str(e).splitlines()[0][:200] if str(e) else ""
        raise refuse(base, f"a prompt pass (a forward over a transformers cache with a 4D mask and "
                           f"position ids) fails: {type(e).__name__}: {first}") from e
    return found

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

def _fast_path_problems(model, device) -> dict[str, str]:
    """Run a tiny padded batch through every fast path this model could take (:meth:`BituneModel.using` each) and
    say what is wrong with those that disagree with the passes read one at a time."""
    p_ids, p_mask, a_ids, a_mask = probe_batch(model, device)

    def logits(path: str) -> torch.Tensor:
        with model.using(path):
            if path == "fused":
                return fused_logits(model.weights, model.mixer, model.config.passes, model.text_config, p_ids, p_mask,
                                    a_ids, a_mask)
            return model.answer_logits(model.prefill(p_ids, p_mask), a_ids, a_mask)

    plain = logits("sequential")
    names = [w for w, _ in model.config.passes]
    paths = {"batched": model.weights.can_route(names) and len(names) == 2,
             "fused": model.layer_kinds.allows("fused") is None and model.weights.can_route(names + ["causal"])}
    problems = {path: _disagrees(logits, path, plain) for path, checked in paths.items() if checked}
    return {path: problem for path, problem in problems.items() if problem}

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


def probe_logits(model) -> torch.Tensor:
    """(2, 2, V) answer logits of ``model`` as it stands (its prefill path, eval mode, no gradients) on
    :func:`probe_batch`: what :meth:`BituneModel.merge` compares before and after merging."""
    p_ids, p_mask, a_ids, a_mask = probe_batch(model, next(model.parameters()).device)
    with evaluating(model):
        return model.answer_logits(model.prefill(p_ids, p_mask), a_ids, a_mask)

def moved(after: torch.Tensor, before: torch.Tensor) -> float | None:
    """How far ``after`` moved from ``before`` (the largest absolute difference) where the two do not agree to the
    rounding of their dtype (:func:`bitune.support.agree`); None where they agree."""
    if agree(after, before):
        return None
    return (after.float() - before.float()).abs().max().item()
