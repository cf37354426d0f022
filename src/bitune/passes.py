"""Reading a prompt (paper eq. 1-5): one prompt pass, or all prompt passes batched as one forward.

A prompt pass runs the model over prompt tokens with one weight set and one mask kind and keeps only its KV
cache, cut short right after the last layer's keys/values (:class:`bitune.cache.PromptCache`): only K/V reach
the answer. :func:`read_pass` is one pass; :func:`read_passes_batched` runs n passes as one forward over n*B
rows, row block i with pass i's weights (LoRA routing per row) and mask. Both may read on top of a conversation
so far (:class:`Prefill`): the new tokens then also see every real token already cached, and
:func:`continue_conversation` prepares the tokens that continue it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import cache as kv
from .adapters import WeightSets
from .kinds import Layers
from .masks import concat_masks, pass_mask, position_ids


@dataclass
class Prefill:
    """A prompt read by the prompt passes, ready for an answer pass (or the state of a conversation).

    Made by :meth:`BituneModel.prefill`, extended by :meth:`BituneModel.decode_step` and returned by
    ``BituneModel.generate(..., return_state=True)``. Rows are left-padded.

    Attributes:
        cache: KV cache of the tokens read so far (a transformers cache; per layer, keys and values of shape
            (B, n_kv_heads, T, head_dim)), mixed where the variant mixes.
        ids: (B, T) the token ids in the cache.
        mask: (B, T) attention mask of the cached tokens: 1 for real tokens, 0 for left padding.
        last_token: (B, 1) the token that opens the next answer pass (not yet in the cache).
    """

    cache: object
    ids: torch.Tensor
    mask: torch.Tensor
    last_token: torch.Tensor

    def select(self, index: torch.Tensor) -> Prefill:
        """Rows ``index`` of this prefill, as an independent copy (the original can be reused).

        Args:
            index: (B',) integer tensor of the rows to take, in order (repeats allowed).

        Returns:
            A prefill of B' rows, its cache a new one.
        """
        return Prefill(kv.select_rows(self.cache, index), self.ids[index], self.mask[index], self.last_token[index])

    @staticmethod
    def concat(prefills: list[Prefill]) -> Prefill:
        """The rows of several prefills as one (left padding extended to the longest; caches padded alike).

        Args:
            prefills: prefills of one model, each (B_j, T_j) rows.

        Returns:
            A prefill of sum(B_j) rows, in order, and max(T_j) positions; its cache a new one.
        """
        T = max(p.ids.shape[1] for p in prefills)

        def left(x: torch.Tensor) -> torch.Tensor:  # (B, T_j) -> (B, T), zeros in front
            return torch.nn.functional.pad(x, (T - x.shape[1], 0))

        return Prefill(kv.concat_rows([p.cache for p in prefills]), torch.cat([left(p.ids) for p in prefills]),
                       torch.cat([left(p.mask) for p in prefills]), torch.cat([p.last_token for p in prefills]))

    def trimmed(self) -> Prefill:
        """The same rows without the leading positions that are padding in every row (after rows left, say).

        Returns:
            This prefill when no position is padding in every row; else a new one of (B, T - n) ``ids`` and
                ``mask`` that shares the cache, trimmed in place (this prefill is not to be used after).
        """
        n = int(self.mask.any(0).long().argmax()) if self.mask.shape[1] else 0  # positions before any real token
        if n == 0:
            return self
        kv.drop_front(self.cache, n, self.mask.shape[1])
        return Prefill(self.cache, self.ids[:, n:], self.mask[:, n:], self.last_token)


def read_pass(weights: WeightSets, text_config, layers: Layers, ids: torch.Tensor, mask: torch.Tensor,
              weight_set: str, kind: str, history: Prefill | None = None):
    """One prompt pass; returns its cache (per attention layer (B, n_kv, T_history + T, hs) keys and values; per
    recurrent layer its final states).

    Args:
        weights: the weight sets (``BituneModel.weights``).
        text_config: the model's text config (layers, sliding windows).
        layers: the kind of every layer (:mod:`bitune.kinds`): their masks and where the pass may stop.
        ids, mask: (B, T) left-padded tokens the pass reads.
        weight_set: ``"causal"`` or ``"bidir"``.
        kind: the mask, one of ``bitune.config.PASS_MASKS``.
        history: a conversation so far; a copy of its cache is extended (the original is untouched).
    """
    cache, attn, positions = _start(weights, text_config, layers, ids, mask, [kind], history)
    try:
        weights.call(weight_set, input_ids=ids, attention_mask=attn, position_ids=positions, cache=cache,
                           use_cache=True, logits_to_keep=1)
    except kv.PassComplete:
        pass
    kv.detach_stop(cache)
    return cache


def read_passes_batched(weights: WeightSets, text_config, layers: Layers, ids: torch.Tensor, mask: torch.Tensor,
                        passes: tuple[tuple[str, str], ...], history: Prefill | None = None) -> list:
    """n prompt passes as one forward over n*B rows; returns one KV cache per pass, as :func:`read_pass` would.

    Args:
        passes: ``(weight set, mask kind)`` per pass (``BituneConfig.passes``); the weight sets must be
            routable per row (:meth:`bitune.adapters.WeightSets.can_route`).
    """
    B = ids.shape[0]
    rows_ids, rows_mask = ids.repeat(len(passes), 1), mask.repeat(len(passes), 1)  # (nB, T): block i is pass i
    cache, attn, positions = _start(weights, text_config, layers, rows_ids, rows_mask, [k for _, k in passes],
                                    history)
    try:
        weights.call_rows([w for w, _ in passes for _ in range(B)], input_ids=rows_ids, attention_mask=attn,
                                position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1)
    except kv.PassComplete:
        pass
    kv.detach_stop(cache)
    return kv.split_rows(cache, [B] * len(passes))


def continue_conversation(past: Prefill, ids: torch.Tensor, mask: torch.Tensor, text_config,
                          layers: Layers) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens prompt passes read to continue ``past`` with a new prompt (without its last token).

    The token that ended the previous answer is not in ``past.cache`` yet (``past.last_token``): it comes first.

    Args:
        past: the conversation so far, ``B`` rows.
        ids, mask: (B, T) the new prompt without its last token.

    Returns:
        (B, 1 + T) ids and mask.
    """
    if past.ids.shape[0] != ids.shape[0]:
        raise ValueError(f"past holds {past.ids.shape[0]} rows, the prompt batch {ids.shape[0]}")
    if (why := layers.allows("extend")) is not None:
        raise ValueError(f"this model's conversation cannot be extended by a new prompt's passes ({why}): re-read "
                         "it whole (chat mode 'reread')")
    window = getattr(text_config, "sliding_window", None)
    if window and past.ids.shape[1] + ids.shape[1] + 1 >= window:
        raise ValueError(f"this model has sliding-window layers ({window} tokens); a history this long "
                         "cannot be extended: re-read it whole (chat mode 'reread')")
    ids = torch.cat([past.last_token, ids], dim=1)  # (B, 1 + T)
    mask = torch.cat([torch.ones_like(past.last_token), mask], dim=1)
    return ids, mask


def _start(weights: WeightSets, text_config, layers: Layers, ids: torch.Tensor, mask: torch.Tensor,
           kinds: list[str], history: Prefill | None):
    """The cache a forward over ``ids`` (n groups of rows, group g with mask ``kinds[g]``) extends, its 4D mask
    and its position ids."""
    rows = torch.arange(ids.shape[0], device=ids.device) % (history.mask.shape[0] if history is not None else 1)
    cache = kv.extendable_copy(history.cache if history is not None else None, text_config, rows,
                               stop_after=layers.stop())
    past_mask = history.mask[rows] if history is not None else None  # (nB, T_history)
    base = weights.base
    dtype, impl = next(base.parameters()).dtype, base.config._attn_implementation
    group = ids.shape[0] // len(kinds)
    attn = concat_masks([
        pass_mask(mask[g * group:(g + 1) * group], kind, dtype, text_config, impl,
                  past_mask[g * group:(g + 1) * group] if past_mask is not None else None, layers)
        for g, kind in enumerate(kinds)])
    offset = past_mask.sum(1) if past_mask is not None else None
    return cache, attn, position_ids(mask, offset)


__all__ = ["Prefill", "read_pass", "read_passes_batched", "continue_conversation"]
