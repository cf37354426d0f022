"""Bitune (paper section 2): read the prompt twice, mix the two KV caches, answer causally on top.

Read :mod:`bitune.reference` first: the method in ~40 lines of plain Hugging Face forwards. This module computes
the same numbers (tests hold every path to the reference) with the prompt passes cut short after the last
layer's keys/values, both passes batched as one forward, or everything fused into one forward.

For a batch of left-padded prompts x_1..x_P and right-padded answers y_1..y_A:

1. prompt passes over x_1..x_{P-1}: the causal pass with the causal weights, the bidirectional pass with the bidir
   weights (eq. 1-5; the ablations change masks or weights, see ``BituneConfig.passes``);
2. per layer, K = K_causal (1 - a_k) + K_bidir a_k and V likewise (eq. 6-7, :mod:`bitune.mixer`);
3. answer pass over x_P, y_1..y_{A-1}, causal, causal weights, on the mixed cache, positions continuing from
   the prompt; the loss is the cross-entropy of y_1..y_A (eos included), padding excluded, as the example mean
   (:class:`bitune.outputs.BituneOutput`'s ``loss``: the one place it is explained).

How the passes execute is a runtime choice (``prompt_passes``) that makes two decisions:
:meth:`BituneModel.forward_path` (a forward: the prompt passes one by one, batched (:mod:`bitune.passes`), or
everything fused into one forward (:mod:`bitune.fused`)) and :meth:`BituneModel.prefill_path` (a prompt read
alone: one by one or batched). Caches live in :mod:`bitune.cache`, masks in :mod:`bitune.masks`, weight sets in
:mod:`bitune.adapters`, checkpoints in :mod:`bitune.checkpoint`, decoding in :mod:`bitune.decoding`, the output
and loss in :mod:`bitune.outputs`, recompute in :mod:`bitune.recompute`, the merged export in :mod:`bitune.export`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from . import cache as kv
from . import checkpoint, decoding, probe, recompute
from .adapters import WeightSets
from .attention import open_own_masks, symmetric_alibi
from .config import PROMPT_PASSES, BituneConfig
from .errors import BituneError
from .fused import fused_logits
from .inputs import check_answer, check_ids, check_prompt
from .masks import position_ids
from .mixer import Mixer
from .modelcard import Training
from .outputs import BituneOutput, answer_loss, token_logprobs
from .passes import Prefill, continue_conversation, read_pass, read_passes_batched
from .support import Support, UnsupportedModelError, check_model

BATCHED_PREFILL_MAX_POSITIONS = 256
"""Prompt positions per pass (B x T) up to which ``prompt_passes="auto"`` reads both passes as one batched forward;
beyond it one forward per pass is faster (``bitune bench prefill``: the batched forward's attention over 2B rows
with per-row masks grows faster than two plain passes)."""


class BituneModel(nn.Module):
    """A pretrained causal LM turned into a Bitune model. Build with :meth:`wrap` (which explains the arguments and
    the errors) or :meth:`from_pretrained`.

    Attributes:
        config (BituneConfig): the variant, method and settings (what a checkpoint saves).
        weights (WeightSets): the weight sets (:mod:`bitune.adapters`); ``weights.base`` is the transformers model.
        mixer (Mixer | None): the per-layer mixing coefficients (:mod:`bitune.mixer`); None for variants without
            mixing.
        num_layers (int): the number of decoder layers, L.
    """

    def __init__(self, model: nn.Module, config: BituneConfig, prompt_passes: str = "auto"):
        super().__init__()
        self.layer_kinds = check_model(model, passes=not config.single_pass)
        """The kind of every decoder layer (:mod:`bitune.kinds`): what it keeps, how its states mix, its paths."""
        self.config = config
        self.prompt_passes = prompt_passes
        flags = {name: p.requires_grad for name, p in model.named_parameters()}
        # the passes' masks decide what a layer reads (GPT-Neo's own buffers opened; ALiBi symmetric where a 4D
        # mask is given, which a baseline's prompt read gives too)
        restore = open_own_masks(model) if not config.single_pass else symmetric_alibi(model)
        try:
            self._build(model, config)
        except UnsupportedModelError:  # a refusal leaves the caller's model as it was given
            if self.weights.peft:
                self.weights.model.unload()  # PEFT's own removal of its layers (nothing merged)
            for name, p in model.named_parameters():
                p.requires_grad_(flags.get(name, p.requires_grad))
            restore()
            raise

    def _build(self, model: nn.Module, config: BituneConfig) -> None:
        """The weight sets, the mixer and the paths that wrap's checks leave on (:meth:`__init__`)."""
        self.weights = WeightSets(model, config)
        self.text_config = model.config.get_text_config()
        self.num_layers = self.text_config.num_hidden_layers
        states = tuple(c for c in ("s", "c") if c in self.layer_kinds.mixes and config.mixes_states)
        self.mixer = (Mixer(self.num_layers, config.theta_init, config.init_share, states) if config.mixes
                      else None)
        off = self.layer_kinds.allows("fused")  # a kind of layer that rules the fused forward out (no warning)
        self.support = Support(fused=off is None)
        """Which fast paths compute the plain path's numbers on this model (:mod:`bitune.support`)."""
        self._take_findings(probe.check_wrapped(self))
        if off is not None:
            self.support.note = "; ".join(filter(None, [self.support.note, f"the fused forward is off: {off}"]))

    def _take_findings(self, found: probe.Findings) -> None:
        """Freeze the bidir weights no gradient reaches and switch off the fast paths that disagree with the passes
        read one by one (:func:`bitune.probe.check_wrapped` found them), saying why in a logged warning."""
        self.weights.freeze("bidir", found.unreached)
        names, note = [w for w, _ in self.config.passes], ""
        if problem := found.problems.get("batched"):
            self.weights.route_ok = False  # no routing of weight sets by row or position on this model
            note = f"the prompt passes batched as one forward {problem}"
        if (problem := found.problems.get("fused")) and self.weights.can_route(names + ["causal"]):
            self.support.fused = False
            note = f"the fused forward {problem}"
        if note:
            with self.using("batched"):
                note += "; it runs the prompt passes " + ("batched" if self.prefill_path() == "batched" else "one by one")
            logging.getLogger("bitune").warning("%s: %s", type(self.weights.base).__name__, note)
            self.support.note = note

    @classmethod
    def wrap(cls, model: nn.Module, config: BituneConfig | None = None, prompt_passes: str = "auto",
             merge: bool = False) -> BituneModel:
        """Wrap a transformers causal LM (e.g. from ``AutoModelForCausalLM``) as a Bitune model; returns it.

        Args:
            model: a decoder-only transformers causal LM, not yet wrapped by PEFT. It is changed in place: its
                parameters are frozen (trained again with ``method="full"``) and the weight sets' adapters added.
            config: the variant, the training method and their settings; default ``BituneConfig()``: Bitune with
                LoRA rank 8.
            prompt_passes: how the passes run, one of ``PROMPT_PASSES`` (a runtime choice: not saved, and every
                choice computes the same numbers). Default ``"auto"``.
            merge: merge the causal weights for inference at once (:meth:`merge`); off by default, since a
                freshly wrapped model is usually trained next.

        Raises:
            ValueError: ``model`` is not a decoder-only transformers causal LM (no ``config`` or ``generate``, an
                encoder-decoder, no ``num_hidden_layers``), is a ``PeftModel`` already, cannot take the config's
                adapters, or keeps no per-layer KV cache; ``prompt_passes`` is not one of ``PROMPT_PASSES``.
        """
        model = cls(model, config or BituneConfig(), prompt_passes)
        if merge:
            model.merge()
        return model

    @property
    def prompt_passes(self) -> str:
        """How the passes run (one of ``PROMPT_PASSES``, else a ValueError); may be changed at any time; it decides
        :meth:`forward_path` and :meth:`prefill_path`."""
        return self._prompt_passes

    @prompt_passes.setter
    def prompt_passes(self, value: str) -> None:
        if not isinstance(value, str) or value not in PROMPT_PASSES:
            raise ValueError(f"prompt_passes={value!r} is not one of {list(PROMPT_PASSES)}")
        self._prompt_passes = value

    @contextmanager
    def using(self, prompt_passes: str) -> Iterator[BituneModel]:
        """Run with ``prompt_passes`` (one of ``PROMPT_PASSES``) within this block, then put back the choice made
        before: how wrap's checks run each path they compare (:mod:`bitune.probe`)."""
        before = self.prompt_passes
        self.prompt_passes = prompt_passes
        try:
            yield self
        finally:
            self.prompt_passes = before

    def forward_path(self) -> str:
        """The first decision ``prompt_passes`` makes: how :meth:`forward` (prompt passes and answer pass:
        training, a whole answer's loss) runs: ``"single"`` (the baselines' one causal pass), ``"fused"``,
        ``"batched"`` or ``"sequential"``, from :attr:`prompt_passes`, the variant and the method."""
        if self.config.single_pass:
            return "single"
        names = [w for w, _ in self.config.passes]
        if self.prompt_passes in ("auto", "fused") and self.support.fused and self.weights.can_route(names + ["causal"]):
            return "fused"
        return self.prefill_path()

    def prefill_path(self, positions: int | None = None) -> str:
        """The second decision ``prompt_passes`` makes: how :meth:`prefill` reads a prompt alone (generation,
        evaluation, serving): ``"batched"`` (both prompt passes as one forward over 2B rows; also what ``fused``
        reads prompts with) or ``"sequential"`` (one forward per pass).

        Args:
            positions: the positions each pass reads (B x T, padding included), when known: with ``"auto"``, a
                read of more than :data:`BATCHED_PREFILL_MAX_POSITIONS` runs sequentially, which is faster there
                (``bitune bench prefill``). Default None: the choice for any size.

        Returns:
            ``"batched"`` or ``"sequential"``.
        """
        names = [w for w, _ in self.config.passes]
        if len(names) != 2 or self.prompt_passes == "sequential" or not self.weights.can_route(names):
            return "sequential"
        if self.prompt_passes == "auto" and positions is not None and positions > BATCHED_PREFILL_MAX_POSITIONS:
            return "sequential"
        return "batched"

    # ----------------------------------------------------------------------------------------------- parameters
    def trainable_parameters(self) -> dict[str, nn.Parameter]:
        """Every parameter this variant trains: its weight sets and the mixing thetas.

        Returns:
            The parameters that require a gradient, by name: ``"causal:<name>"`` and ``"bidir:<name>"`` (PEFT's
                parameter names, or the model's with ``method="full"``), ``"mixer:theta_k"`` and
                ``"mixer:theta_v"`` (each (L,)); empty for ``pretrained``.
        """
        return {k: p for k, p in self.weight_tensors().items() if p.requires_grad}

    def weight_tensors(self) -> dict[str, nn.Parameter]:
        """Every tensor a checkpoint holds, named as in :meth:`trainable_parameters` (which is the subset that
        requires a gradient): both weight sets whole, frozen parts included, and the mixing thetas."""
        params = {f"{name}:{k}": p for name in self.config.weight_sets for k, p in self.weights.parameters_of(name).items()}
        if self.mixer is not None:
            params.update({f"mixer:{k}": p for k, p in self.mixer.named_parameters()})
        return params

    # ----------------------------------------------------------------------------------------------- merging
    @property
    def merged(self) -> bool:
        """Whether the causal weights are merged into the base weights (inference; :meth:`merge`)."""
        return self.weights.merged

    def merge(self, bidir_copy: bool = False) -> BituneModel:
        """Merge the causal weight set into the base weights, in place, for inference
        (:meth:`bitune.adapters.WeightSets.merge` says what it does; ``bidir_copy`` also holds the bidir set
        merged, in a copy of the adapted weights). Returns the model itself.

        The merge checks itself on a tiny padded batch: where the merged weights do not give the unmerged logits
        (PEFT's merge of some fused expert layouts is inexact: LongCat-Flash), it is undone and the model stays
        unmerged, at the unmerged model's speed and with its numbers, and says so (``support.note``, a logged
        warning; :func:`bitune.probe.moved`)."""
        checked = not self.merged and self.weights.peft and next(self.parameters()).device.type != "meta"
        before = probe.probe_logits(self) if checked else None
        self.weights.merge(bidir_copy)
        if before is not None and (by := probe.moved(probe.probe_logits(self), before)) is not None:
            self.weights.unmerge()
            self.support.merge = False
            self.support.note = (f"merge() declined: PEFT's merge of this model's adapted layers moves its logits by "
                                 f"{by:.2g}; it runs unmerged")
            logging.getLogger("bitune").warning("%s: %s", type(self.weights.base).__name__, self.support.note)
        return self

    def unmerge(self) -> BituneModel:
        """Undo :meth:`merge`, in place (:meth:`bitune.adapters.WeightSets.unmerge`). Returns the model itself."""
        self.weights.unmerge()
        return self

    def mixing_ratios(self) -> dict[str, torch.Tensor]:
        """The current mixing ratios a_k and a_v of every layer (paper eq. 6-7): ``{"k": a_k, "v": a_v}``, each (L,)
        float32 and detached; empty for variants without mixing."""
        return self.mixer.ratios() if self.mixer is not None else {}

    # ----------------------------------------------------------------------------------------------- passes
    def decoder_layers(self) -> list[nn.Module]:
        """Every decoder layer of the weight sets' models (the causal model's, then the full bidir copy's): the units
        recompute and FSDP work on (:func:`bitune.recompute.decoder_layers`)."""
        return recompute.decoder_layers(self.weights.models(), self.num_layers)

    def enable_recompute(self) -> None:
        """Recompute each decoder layer's activations in the backward pass in training (activation checkpointing,
        :mod:`bitune.recompute`): the prompt caches are kept, loss and gradients unchanged."""
        recompute.checkpoint_layers(self.decoder_layers())

    @property
    def recomputing(self) -> bool:
        """Whether :meth:`enable_recompute` is on."""
        return recompute.recomputing(self.decoder_layers())

    def prompt_caches(self, ids: torch.Tensor, mask: torch.Tensor, past: Prefill | None = None) -> list:
        """The unmixed caches of this variant's prompt passes over ``ids`` (tokens the passes read)."""
        recompute.refuse_transformers_checkpointing(self.weights.models(), self.training)
        if self.prefill_path(ids.numel()) == "batched":
            return read_passes_batched(self.weights, self.text_config, self.layer_kinds, ids, mask, self.config.passes,
                                       past)
        return [read_pass(self.weights, self.text_config, self.layer_kinds, ids, mask, weights, kind, past)
                for weights, kind in self.config.passes]

    def prefill(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, past: Prefill | None = None) -> Prefill:
        """Read a batch of left-padded prompts: prompt passes over all but the last token, then mixing.

        Args:
            prompt_ids: (B, P) left-padded token ids, every prompt at least 2 real tokens.
            prompt_mask: (B, P) 1 for real tokens, 0 for padding.
            past: a conversation so far, B rows (from ``generate(..., return_state=True)``); the new prompt is read
                on top of it with both passes (the paper's "alternating" multi-turn mode, A.8) after the token
                that ended the previous answer. Default None: a fresh prompt.

        Returns:
            The prefill: the mixed cache of the P - 1 tokens read, their (B, P - 1) ``ids`` and ``mask`` (with
                ``past``: (B, T + P), the conversation's T tokens, its last token and the new ones), and the
                prompts' last tokens (B, 1) as ``last_token``, which the answer pass reads first.

        Raises:
            ValueError: the prompts are not (B, P) and left-padded with at least 2 real tokens each, a token id
                is not an integer in the vocabulary, ``past`` holds another number of rows, a model with
                sliding-window layers would read a conversation as long as its window, or transformers' gradient
                checkpointing is on in training.
        """
        check_prompt(prompt_ids, prompt_mask)
        check_ids(self.weights.base, prompt_ids)
        ids, mask = prompt_ids[:, :-1], prompt_mask[:, :-1]  # (B, P-1)
        if past is not None:
            ids, mask = continue_conversation(past, ids, mask, self.text_config, self.layer_kinds)  # (B, P)
        caches = self.prompt_caches(ids, mask, past)
        if self.mixer is not None:
            kv.mix_into(caches[0], caches[1], self.mixer, self.layer_kinds,
                        start=past.ids.shape[1] if past is not None else 0)
        if past is not None:
            ids, mask = torch.cat([past.ids, ids], dim=1), torch.cat([past.mask, mask], dim=1)
        return Prefill(caches[0], ids, mask, prompt_ids[:, -1:])

    def answer_logits(self, prefill: Prefill, answer_ids: torch.Tensor, answer_mask: torch.Tensor,
                      reuse: bool = True) -> torch.Tensor:
        """Causal answer pass on a prefill, with the causal weights: the prompt's last token, then the answer. The
        answers are not checked here (:meth:`forward` checks them).

        Args:
            prefill: the prompts read (:meth:`prefill`), B rows.
            answer_ids: (B, A) right-padded answer ids.
            answer_mask: (B, A) 1 for real answer tokens, 0 for padding.
            reuse: keep ``prefill`` intact (the pass extends a copy), so it can score more answers; ``False``
                extends ``prefill.cache`` in place. Default True.

        Returns:
            (B, A, V) logits: ``logits[:, t]`` predicts ``answer_ids[:, t]``.
        """
        cache = kv.select_rows(prefill.cache, torch.arange(answer_ids.shape[0])) if reuse else prefill.cache
        ids = torch.cat([prefill.last_token, answer_ids[:, :-1]], dim=1)  # (B, A)
        step_mask = torch.cat([torch.ones_like(prefill.last_token), answer_mask[:, :-1]], dim=1)  # (B, A)
        full_mask = torch.cat([prefill.mask, step_mask], dim=1)  # (B, P-1+A)
        pos = position_ids(full_mask)[:, -ids.shape[1]:]  # (B, A)
        out = self.weights.call("causal", input_ids=ids, attention_mask=full_mask, position_ids=pos,
                                cache=cache, use_cache=True)
        return out.logits

    def forward(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, answer_ids: torch.Tensor,
                answer_mask: torch.Tensor) -> BituneOutput:
        """Loss and logits of the answers given the prompts: the prompt passes, mixing and the answer pass.

        The path is :meth:`forward_path`; every path computes the same numbers.

        Args:
            prompt_ids: (B, P) left-padded prompt ids (at least 2 real tokens each).
            prompt_mask: (B, P) 1 for real prompt tokens, 0 for padding.
            answer_ids: (B, A) right-padded answer ids, eos included (at least 1 real token each).
            answer_mask: (B, A) 1 for real answer tokens, 0 for padding.

        Returns:
            The loss (example mean), the (B, A, V) logits, the (B, A) token log-probabilities and the (B,)
                per-example losses.

        Raises:
            ValueError: the prompts are not (B, P) and left-padded with at least 2 real tokens each; the answers
                are not (B, A), one per prompt, right-padded with at least 1 real token each; a token id is not an
                integer in the vocabulary; or transformers' gradient checkpointing is on in training
                (:meth:`enable_recompute` is Bitune's own).
            BituneError: the model is merged (:meth:`merge`) and asked to train (training mode, gradients on).
        """
        check_prompt(prompt_ids, prompt_mask)
        check_answer(prompt_ids, answer_ids, answer_mask)
        check_ids(self.weights.base, prompt_ids, answer_ids)
        if self.merged and self.training and torch.is_grad_enabled():
            raise BituneError("this model's causal weights are merged for inference and cannot be trained: call "
                              "unmerge() first, or load it with merge=False")
        path = self.forward_path()
        if path == "single":
            logits = self.causal_logits(prompt_ids, prompt_mask, answer_ids, answer_mask)
        elif path == "fused":
            recompute.refuse_transformers_checkpointing(self.weights.models(), self.training)
            logits = fused_logits(self.weights, self.mixer, self.config.passes, self.text_config, prompt_ids,
                                  prompt_mask, answer_ids, answer_mask)
        else:
            logits = self.answer_logits(self.prefill(prompt_ids, prompt_mask), answer_ids, answer_mask, reuse=False)
        return answer_loss(logits, answer_ids, answer_mask)

    def causal_logits(self, prompt_ids, prompt_mask, answer_ids, answer_mask) -> torch.Tensor:
        """One plain causal pass of the causal weights over prompt + answer; (B, A, V) answer logits: the
        baselines' forward, and the sound reading of any prompt too short for prompt passes."""
        ids = torch.cat([prompt_ids, answer_ids], dim=1)  # (B, P+A)
        mask = torch.cat([prompt_mask, answer_mask], dim=1)  # (B, P+A)
        A = answer_ids.shape[1]
        out = self.weights.call("causal", input_ids=ids, attention_mask=mask, position_ids=position_ids(mask),
                                use_cache=False, logits_to_keep=A + 1)
        return out.logits[:, :-1]  # (B, A, V)

    # ----------------------------------------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_new_tokens: int = 128,
                 do_sample: bool = False, tokenizer=None, stop_strings: list[str] | None = None,
                 past: Prefill | None = None, return_state: bool = False, compile: bool = False,
                 **generate_kwargs):
        """Decode answers from the mixed prompt cache with transformers' ``generate``.

        The prompt passes prefill the cache once (:meth:`prefill`); ``generate`` then feeds the prompt's last
        token and decodes token by token with the causal weights, exactly as a plain model does.

        Args:
            prompt_ids: (B, P) left-padded prompts, at least 2 real tokens each.
            prompt_mask: (B, P) 1 for real tokens, 0 for padding.
            max_new_tokens: upper bound on generated tokens (default 128); capped so that no row passes the
                model's maximum position (``max_position_embeddings``; :func:`bitune.generation.max_new_tokens_for`
                says how many fit, so a caller can tell the user).
            do_sample: sample instead of greedy decoding (default False).
            tokenizer: the model's tokenizer; needed for ``stop_strings``.
            stop_strings: stop a row once its text ends with one of these.
            past: a conversation to continue, B rows (the state returned with ``return_state``; see
                :meth:`prefill`). Default None: fresh prompts.
            return_state: also return the conversation state after this answer (answers stay causal in it).
            compile: decode with ``torch.compile`` from a static copy of the cache (:func:`bitune.decoding.decode`;
                default False). The first call of each shape pays the compilation (a minute or more on CPU); see
                the benchmarks page for what it gains. Not with ``return_state``.
            **generate_kwargs: passed on to transformers' ``generate``: sampling options (``temperature``,
                ``top_p``, ``top_k``, ...), ``streamer``, ``eos_token_id``, ``pad_token_id``, ...

        Returns:
            (B, N) the generated tokens only, padded with the pad token after a row stops; with ``return_state``,
                the pair ``(tokens, state)``, ``state`` a :class:`~bitune.passes.Prefill` to pass as ``past``.

        Raises:
            ValueError: ``stop_strings`` without ``tokenizer``; the prompts are not (B, P) and left-padded with
                at least 2 real tokens each; a token id is not an integer in the vocabulary; ``past`` holds
                another number of rows, or is as long as the window of a model with sliding-window layers.
            BituneError: a prompt (with ``past``, the conversation) fills the model's positions already.
        """
        generate_kwargs.update(decoding.generate_options(prompt_ids.device, compile, return_state, stop_strings, tokenizer,
                                                         self.layer_kinds.allows("compiled")))
        check_prompt(prompt_ids, prompt_mask)
        max_new_tokens = decoding.room(self.text_config, prompt_mask, past, max_new_tokens)
        pre = self.prefill(prompt_ids, prompt_mask, past)
        new, state = decoding.decode(self.weights.base, self.text_config, pre, max_new_tokens, do_sample, compile,
                                     **generate_kwargs)
        return (new, state) if return_state else new

    def decode_step(self, state: Prefill, pick: Callable[[torch.Tensor], torch.Tensor]) -> Prefill:
        """One decoding step on a prefill, as :meth:`generate` runs it after :meth:`prefill`: the causal weights
        read each row's pending token and ``pick`` maps the (B, V) logits to the next (B,) tokens; ``state.cache``
        is extended in place. See :func:`bitune.decoding.decode_step`."""
        return decoding.decode_step(self.weights, state, pick)

    # ----------------------------------------------------------------------------------------------- checkpoints
    def save_pretrained(self, directory: str | os.PathLike, tensors: dict[str, torch.Tensor] | None = None,
                        training: Training | None = None, tokenizer=None) -> None:
        """Save the trained state (adapters in PEFT's format, mixer, config), a model card and, if given, the
        tokenizer's files into ``directory`` (replaced whole, through a temporary folder renamed into place);
        :func:`bitune.checkpoint.save` explains ``tensors`` and ``training``. How the passes run is not saved."""
        checkpoint.save(self, directory, tensors, training, tokenizer=tokenizer)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, base: nn.Module | str | None = None,
                        prompt_passes: str = "auto", merge: bool | str = True, **load_kwargs) -> BituneModel:
        """Load a checkpoint written by :meth:`save_pretrained`, strictly (every tensor must match), in eval mode (as
        transformers' ``from_pretrained``).

        Args:
            directory: the checkpoint folder.
            base: the base model instance (changed in place, as by :meth:`wrap`), or its name/path; default: the
                ``base_model`` recorded in the config.
            prompt_passes: how the passes run (``bitune.config.PROMPT_PASSES``; a runtime choice). Default
                ``"auto"``.
            merge: merge the causal weights for inference after loading (:meth:`merge`; the checkpoint on disk is
                unchanged); ``"both"`` also holds the bidir weights merged (:meth:`merge` with ``bidir_copy``);
                ``False`` keeps PEFT's unmerged layers (to train on, or to compare). Default True.
            **load_kwargs: passed to :func:`bitune.hub.load_model` when ``base`` is a name (``dtype``, ...).

        Raises:
            ValueError: ``directory`` is not a Bitune checkpoint (no ``bitune_config.json``) or its config is
                invalid; it records no base model and ``base`` is not given; a weight file is missing, corrupt,
                holds NaN or infinite values, or does not match the model (every tensor must).
            BituneError: the base model named cannot be loaded (:func:`bitune.hub.load_model`).
        """
        config = checkpoint.read_config(directory)
        model = cls(checkpoint.base_model(directory, config, base, **load_kwargs), config, prompt_passes)
        model.load_weights(directory)
        if merge:
            model.merge(bidir_copy=merge == "both")
        return model.eval()  # as transformers' from_pretrained: dropout off until train() is called

    def load_weights(self, directory: str | os.PathLike) -> None:
        """Load trained weights from a checkpoint, strictly (:func:`bitune.checkpoint.load_weights`); a BituneError
        on a merged model (loading adapters under merged weights would mix two states)."""
        if self.merged:
            raise BituneError("load_weights on a merged model: call unmerge() first")
        checkpoint.load_weights(self, directory)


__all__ = ["BituneModel", "BituneOutput", "Prefill", "token_logprobs", "BATCHED_PREFILL_MAX_POSITIONS"]
