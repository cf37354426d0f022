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
   (:class:`BituneOutput`'s ``loss``: the one place it is explained).

How the passes execute is a runtime choice (``prompt_passes``) that makes two decisions:
:meth:`BituneModel.forward_path` (a forward: the prompt passes one by one, batched (:mod:`bitune.passes`), or
everything fused into one forward (:mod:`bitune.fused`)) and :meth:`BituneModel.prefill_path` (a prompt read
alone: one by one or batched). Caches live in :mod:`bitune.cache`, masks in :mod:`bitune.masks`, weight sets in
:mod:`bitune.adapters`, checkpoints in :mod:`bitune.checkpoint`.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import CompileConfig

from . import cache as kv
from . import checkpoint
from .adapters import WeightSets
from .config import PROMPT_PASSES, BituneConfig
from .errors import BituneError
from .files import apply_umask, replace_dir
from .fused import fused_logits
from .hub import load_model
from .inputs import check_answer, check_architecture, check_ids, check_prompt, context_room
from .masks import position_ids
from .mixer import Mixer
from .modelcard import Training
from .passes import Prefill, continue_conversation, read_pass, read_passes_batched
from .recompute import checkpoint_layers

BATCHED_PREFILL_MAX_POSITIONS = 256
"""Prompt positions per pass (B x T) up to which ``prompt_passes="auto"`` reads both passes as one batched forward;
beyond it one forward per pass is faster (``bitune bench prefill``: the batched forward's attention over 2B rows
with per-row masks grows faster than two plain passes)."""


@dataclass
class BituneOutput:
    """Result of :meth:`BituneModel.forward` for B examples with answers of up to A tokens, vocabulary size V.

    Attributes:
        loss: the training loss (scalar), the **example mean**: the mean over the B examples of each example's
            mean answer-token cross-entropy (``example_loss.mean()``). Every example weighs the same whatever its
            length (a token mean would let long answers outweigh short ones), as in the authors' batch-1 x
            gradient-accumulation setup. This is what ``bitune train`` and the TRL trainer optimise; this is the
            one place it is explained, the others point here.
        logits: (B, A, V) ``logits[:, t]`` predicts ``answer_ids[:, t]``.
        token_logprobs: (B, A) log-probability of each answer token (0 on padding).
        example_loss: (B,) mean cross-entropy per example.
    """

    loss: torch.Tensor
    logits: torch.Tensor
    token_logprobs: torch.Tensor
    example_loss: torch.Tensor


def decode_compile_config(device: torch.device) -> CompileConfig:
    """What transformers' ``generate`` compiles the decoding forward with: inductor's default mode on CPU (CUDA
    graphs, transformers' default mode, exist only on GPUs)."""
    if device.type == "cpu" and not (shutil.which("g++") or shutil.which("c++")):
        raise BituneError("compiled decoding on CPU needs a C++ compiler (torch.compile's inductor builds its "
                          "kernels with one): install g++, or decode without compile")
    config = CompileConfig(mode="default" if device.type == "cpu" else "reduce-overhead")
    config._compile_all_devices = True  # generate compiles on accelerators only unless this private flag is set
    return config


class BituneModel(nn.Module):
    """A pretrained causal LM turned into a Bitune model. Build with :meth:`wrap` or :meth:`from_pretrained`.

    Args:
        model: a decoder-only transformers causal LM, not yet wrapped by PEFT. It is changed in place: its
            parameters are frozen (trained again with ``method="full"``) and the weight sets' adapters added.
        config: the variant, the training method and their settings.
        prompt_passes: how the passes run, one of ``PROMPT_PASSES`` (a runtime choice, see :attr:`prompt_passes`).

    Attributes:
        config (BituneConfig): the variant, method and settings (what a checkpoint saves).
        weights (WeightSets): the weight sets (:mod:`bitune.adapters`); ``weights.base`` is the transformers model.
        mixer (Mixer | None): the per-layer mixing coefficients (:mod:`bitune.mixer`); None for variants without
            mixing.
        num_layers (int): the number of decoder layers, L.

    Raises:
        ValueError: ``model`` is not a decoder-only transformers causal LM (no ``config`` or ``generate``, an
            encoder-decoder, no ``num_hidden_layers``), is a ``PeftModel`` already, cannot take the config's
            adapters, or keeps no per-layer KV cache; ``prompt_passes`` is not one of ``PROMPT_PASSES``.
    """

    def __init__(self, model: nn.Module, config: BituneConfig, prompt_passes: str = "auto"):
        super().__init__()
        check_architecture(model)
        self.config = config
        self.prompt_passes = prompt_passes
        self.weights = WeightSets(model, config)
        self.text_config = model.config.get_text_config()
        self.num_layers = self.text_config.num_hidden_layers
        self.mixer = Mixer(self.num_layers, config.theta_init, config.init_share) if config.mixes else None
        self._probe()

    @classmethod
    def wrap(cls, model: nn.Module, config: BituneConfig | None = None, prompt_passes: str = "auto",
             merge: bool = False) -> BituneModel:
        """Wrap a transformers causal LM (e.g. from ``AutoModelForCausalLM``) as a Bitune model.

        Args:
            model: a decoder-only transformers causal LM, not yet wrapped by PEFT. It is changed in place: its
                parameters are frozen (trained again with ``method="full"``) and the weight sets' adapters added.
            config: the variant, the training method and their settings; default ``BituneConfig()``: Bitune with
                LoRA rank 8.
            prompt_passes: how the passes run, one of ``PROMPT_PASSES`` (a runtime choice: not saved, and every
                choice computes the same numbers). Default ``"auto"``.
            merge: merge the causal weights for inference at once (:meth:`merge`); off by default, since a
                freshly wrapped model is usually trained next.

        Returns:
            The new model.

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
        """How the passes run (one of ``PROMPT_PASSES``); may be changed at any time, see :meth:`execution`.

        Raises:
            ValueError: set to a value that is not one of ``PROMPT_PASSES``.
        """
        return self._prompt_passes

    @prompt_passes.setter
    def prompt_passes(self, value: str) -> None:
        if not isinstance(value, str) or value not in PROMPT_PASSES:
            raise ValueError(f"prompt_passes={value!r} is not one of {list(PROMPT_PASSES)}")
        self._prompt_passes = value

    def execution(self, answer: bool = True) -> str:
        """The path that runs: :meth:`forward_path` (``answer=True``) or :meth:`prefill_path` (``answer=False``)."""
        return self.forward_path() if answer else self.prefill_path()

    def forward_path(self) -> str:
        """The first decision ``prompt_passes`` makes: how :meth:`forward` (prompt passes and answer pass:
        training, a whole answer's loss) runs: ``"single"`` (the baselines' one causal pass), ``"fused"``,
        ``"batched"`` or ``"sequential"``, from :attr:`prompt_passes`, the variant and the method."""
        if self.config.single_pass:
            return "single"
        names = [w for w, _ in self.config.passes]
        if self.prompt_passes in ("auto", "fused") and self.weights.can_route(names + ["causal"]):
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
        params = {}
        for name in self.config.weight_sets:
            params.update({f"{name}:{k}": p for k, p in self.weights.parameters_of(name).items() if p.requires_grad})
        if self.mixer is not None:
            params.update({f"mixer:{k}": p for k, p in self.mixer.named_parameters()})
        return params

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

    def merge(self) -> BituneModel:
        """Merge the causal weight set into the base weights, in place, for inference.

        The causal prompt pass, the answer pass and every decoding step then run the base model's own linear
        layers; only the bidirectional prompt pass adds the difference to the bidir set (LoRA: a rank-2r product
        of the factors held anyway; DoRA, IA3: one merged copy of the weights the bidir set touches). Generation,
        scoring and every inference path give the unmerged model's numbers to float rounding. A merged model does
        not train: :meth:`unmerge` first (trainers do it). A no-op when merged already, or when there is nothing
        to merge (``method="full"``, ``pretrained``).

        Returns:
            The model itself.
        """
        self.weights.merge()
        return self

    def unmerge(self) -> BituneModel:
        """Undo :meth:`merge`, in place; a no-op when not merged.

        The base weights come back to within float rounding of one add and one subtract: a model that is trained
        after inference and must match training alone bit for bit is never merged (``merge=False``).

        Returns:
            The model itself.
        """
        self.weights.unmerge()
        return self

    def mixing_ratios(self) -> dict[str, torch.Tensor]:
        """The current mixing ratios a_k and a_v of every layer (paper eq. 6-7).

        Returns:
            ``{"k": a_k, "v": a_v}``, each (L,) float32 and detached; empty for variants without mixing.
        """
        return self.mixer.ratios() if self.mixer is not None else {}

    def _probe(self) -> None:
        """One tiny prompt pass that checks the architecture and freezes bidir weights that cannot get a gradient.

        Only the prompt passes' keys and values reach the answer, so in the last layer everything after K/V
        (q, o, MLP) is unused by the bidir weights: they are frozen, found by one backward from the last
        layer's K/V, which works for any architecture.
        """
        weights = "bidir" if "bidir" in self.config.weight_sets else "causal"
        device = next(self.weights.base.parameters()).device
        if device.type == "meta":  # shapes only (memory accounting): nothing can run, nothing is frozen
            return
        ids = torch.zeros(1, 2, dtype=torch.long, device=device)
        mask = torch.ones(1, 2, dtype=torch.long, device=device)
        with torch.enable_grad():
            try:
                cache = read_pass(self.weights, self.text_config, ids, mask, weights, "bidirectional")
                k, v = kv.layer_kv(cache, self.num_layers - 1)
            except (AttributeError, IndexError, TypeError) as e:
                raise ValueError(f"{type(self.weights.base).__name__}: no per-layer attention KV cache "
                                 f"({e}); Bitune cannot mix its prompt features") from e
            if weights != "bidir":
                return
            params = self.weights.parameters_of("bidir")
            grads = torch.autograd.grad(k.sum() + v.sum(), list(params.values()), allow_unused=True)
        for p, g in zip(params.values(), grads):
            if g is None:
                p.requires_grad_(False)

    # ----------------------------------------------------------------------------------------------- passes
    def decoder_layers(self) -> list[nn.Module]:
        """Every decoder layer of the weight sets' models (the causal model's, then the full bidir copy's), found
        by the class names transformers lists in ``_no_split_modules``: the units activation checkpointing and
        FSDP work on.

        Raises:
            BituneError: the model names no decoder layer class, or its layers are not found.
        """
        found = []
        for model in self.weights.models():
            names = set(getattr(model, "_no_split_modules", None) or ())
            layers = [m for m in model.modules() if type(m).__name__ in names]
            if not layers or len(layers) != self.num_layers:
                raise BituneError(f"{type(model).__name__}: no list of {self.num_layers} decoder layers found "
                                  f"(_no_split_modules={sorted(names)}); activation checkpointing and FSDP "
                                  "need one module per decoder layer")
            found += layers
        return found

    def check_no_checkpointing(self) -> None:
        """Refuse transformers' own gradient checkpointing in training: it drops the prompt caches the answer
        reads (it sets ``use_cache=False``). :meth:`enable_checkpointing` is the one that keeps them."""
        if any(getattr(m, "is_activation_checkpointing", False) for m in self.weights.models()) and self.training:
            raise ValueError("transformers' gradient checkpointing (gradient_checkpointing_enable) drops the prompt "
                             "cache in training; turn it off and use BituneModel.enable_checkpointing() "
                             "(the 'gradient_checkpointing: true' setting of bitune train)")

    def enable_checkpointing(self) -> None:
        """Activation checkpointing per decoder layer in training (:mod:`bitune.recompute`): activations inside a
        layer are recomputed in the backward pass; the prompt caches are kept, loss and gradients unchanged."""
        checkpoint_layers(self.decoder_layers())

    @property
    def checkpointing(self) -> bool:
        """Whether :meth:`enable_checkpointing` is on."""
        return any("forward" in layer.__dict__ for layer in self.decoder_layers())

    def prompt_caches(self, ids: torch.Tensor, mask: torch.Tensor, past: Prefill | None = None) -> list:
        """The unmixed caches of this variant's prompt passes over ``ids`` (tokens the passes read)."""
        self.check_no_checkpointing()
        if self.prefill_path(ids.numel()) == "batched":
            return read_passes_batched(self.weights, self.text_config, ids, mask, self.config.passes, past)
        return [read_pass(self.weights, self.text_config, ids, mask, weights, kind, past)
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
            ids, mask = continue_conversation(past, ids, mask, self.text_config)  # (B, P)
        caches = self.prompt_caches(ids, mask, past)
        if self.mixer is not None:
            kv.mix_into(caches[0], caches[1], self.mixer, start=past.ids.shape[1] if past is not None else 0)
        if past is not None:
            ids, mask = torch.cat([past.ids, ids], dim=1), torch.cat([past.mask, mask], dim=1)
        return Prefill(caches[0], ids, mask, prompt_ids[:, -1:])

    def answer_logits(self, prefill: Prefill, answer_ids: torch.Tensor, answer_mask: torch.Tensor,
                      reuse: bool = True) -> torch.Tensor:
        """Causal answer pass on a prefill, with the causal weights: the prompt's last token, then the answer.

        The answers are not checked here (:meth:`forward` checks them).

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
                (:meth:`enable_checkpointing` is Bitune's own).
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
            self.check_no_checkpointing()
            logits = fused_logits(self.weights, self.mixer, self.config.passes, self.text_config, prompt_ids,
                                  prompt_mask, answer_ids, answer_mask)
        else:
            logits = self.answer_logits(self.prefill(prompt_ids, prompt_mask), answer_ids, answer_mask, reuse=False)
        return _answer_loss(logits, answer_ids, answer_mask)

    def causal_logits(self, prompt_ids, prompt_mask, answer_ids, answer_mask) -> torch.Tensor:
        """One plain causal pass of the causal weights over prompt + answer; (B, A, V) answer logits.

        This is the baselines' forward, and the sound reading of any prompt too short for prompt passes.
        """
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
            compile: decode with ``torch.compile`` (default False): the prompt cache is copied into a static cache
                and transformers' ``generate`` compiles the model's forward for the decoding steps. The first
                call of each shape pays the compilation (a minute or more on CPU); see the benchmarks page for what
                it gains. Not with ``return_state``.
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
        if stop_strings and tokenizer is None:
            raise ValueError("generate(stop_strings=...) needs tokenizer=")
        if compile and return_state:
            raise ValueError("generate(compile=True) decodes into a static cache and returns no conversation state; "
                             "drop return_state or compile")
        if compile:
            generate_kwargs["compile_config"] = decode_compile_config(prompt_ids.device)
        check_prompt(prompt_ids, prompt_mask)
        held = past.mask.sum(1) + 1 if past is not None else 0  # (B,) a conversation's positions + its last token
        longest = int((prompt_mask.sum(1) + held).max())  # positions of the longest row before the answer
        max_new_tokens = context_room(self.text_config, longest, max_new_tokens,
                                      "the conversation" if past is not None else "the prompt")
        pre = self.prefill(prompt_ids, prompt_mask, past)
        if stop_strings:
            generate_kwargs.update(stop_strings=stop_strings, tokenizer=tokenizer)
        input_ids = torch.cat([pre.ids, pre.last_token], dim=1)  # (B, T+1); all but the last are cached
        attention_mask = torch.cat([pre.mask, torch.ones_like(pre.last_token)], dim=1)
        cache = pre.cache
        if compile:
            cache = kv.static_copy(cache, self.text_config, input_ids.shape[1] + max_new_tokens)
        out = self.weights.base.generate(input_ids=input_ids, attention_mask=attention_mask, cache=cache,
                                         max_new_tokens=max_new_tokens, do_sample=do_sample, **generate_kwargs)
        new = out[:, input_ids.shape[1]:]
        if not return_state:
            return new
        state = Prefill(pre.cache, out[:, :-1], torch.cat([attention_mask, torch.ones_like(new[:, :-1])], dim=1),
                        out[:, -1:])
        return new, state

    @torch.no_grad()
    def decode_step(self, state: Prefill, pick: Callable[[torch.Tensor], torch.Tensor]) -> Prefill:
        """One decoding step on a prefill, as ``generate`` runs it after :meth:`prefill`: the causal weights read
        each row's pending token (``state.last_token``) on top of the cache, and ``pick`` chooses the next one.

        A batch of rows can be stepped together whatever each row's length (left padding); rows can join
        (:meth:`Prefill.concat`) or leave (:meth:`Prefill.select`) between steps. ``state.cache`` is extended in
        place.

        Args:
            state: the rows so far, B of them (from :meth:`prefill`, or the previous step).
            pick: maps the (B, V) next-token logits to (B,) token ids (greedy: ``lambda logits: logits.argmax(-1)``).

        Returns:
            The state after the step: the pending tokens cached (``ids`` and ``mask`` one position longer,
                (B, T + 1)), the picked tokens pending as the (B, 1) ``last_token``.
        """
        mask = torch.cat([state.mask, torch.ones_like(state.last_token)], dim=1)  # (B, T+1)
        out = self.weights.call("causal", input_ids=state.last_token, attention_mask=mask,
                                position_ids=position_ids(mask)[:, -1:], cache=state.cache, use_cache=True,
                                logits_to_keep=1)
        token = pick(out.logits[:, -1]).reshape(-1, 1).to(state.last_token)  # (B, 1)
        return Prefill(state.cache, torch.cat([state.ids, state.last_token], dim=1), mask, token)

    # ----------------------------------------------------------------------------------------------- checkpoints
    def save_pretrained(self, directory: str | os.PathLike, tensors: dict[str, torch.Tensor] | None = None,
                        training: Training | None = None) -> None:
        """Save the trained state (adapters in PEFT's format, mixer, config) and a model card (``README.md``;
        a user's own README there is kept); see :mod:`bitune.checkpoint` for the format.

        The checkpoint is written into a temporary folder and renamed into place, so an existing one is never
        left half-overwritten. How the passes run (``prompt_passes``) is not saved.

        Args:
            directory: the checkpoint folder (replaced if it exists; its parents are created).
            tensors: the weights to write, named as :meth:`weight_tensors` names them (e.g. gathered from a
                sharded model); default: the model's own.
            training: the run that saved it, for the model card; default: none recorded.
        """
        checkpoint.save(self, directory, tensors, training)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, base: nn.Module | str | None = None,
                        prompt_passes: str = "auto", merge: bool = True, **load_kwargs) -> BituneModel:
        """Load a checkpoint written by :meth:`save_pretrained`, strictly (every tensor must match).

        Args:
            directory: the checkpoint folder.
            base: the base model instance (changed in place, as by :meth:`wrap`), or its name/path; default: the
                ``base_model`` recorded in the config.
            prompt_passes: how the passes run (``bitune.config.PROMPT_PASSES``; a runtime choice). Default
                ``"auto"``.
            merge: merge the causal weights for inference after loading (:meth:`merge`; the checkpoint on disk is
                unchanged); ``False`` keeps PEFT's unmerged layers (to train on, or to compare). Default True.
            **load_kwargs: passed to :func:`bitune.hub.load_model` when ``base`` is a name (``dtype``, ...).

        Returns:
            The model in eval mode (as transformers' ``from_pretrained``).

        Raises:
            ValueError: ``directory`` is not a Bitune checkpoint (no ``bitune_config.json``) or its config is
                invalid; it records no base model and ``base`` is not given; a weight file is missing, corrupt,
                holds NaN or infinite values, or does not match the model (every tensor must).
            BituneError: the base model named cannot be loaded (:func:`bitune.hub.load_model`).
        """
        config = checkpoint.read_config(directory)
        if base is None or isinstance(base, str):
            name = base or config.base_model
            if not name:
                raise ValueError(f"{directory}: the checkpoint does not record its base model; pass base=")
            base, _ = load_model(name, **load_kwargs)
        model = cls(base, config, prompt_passes)
        model.load_weights(directory)
        if merge:
            model.merge()
        return model.eval()  # as transformers' from_pretrained: dropout off until train() is called

    @torch.no_grad()
    def export_merged(self, directory: str | os.PathLike, tokenizer=None) -> Path:
        """Write the decode model of a GPU fleet: the causal weights merged into a standard transformers model
        folder (``config.json`` + ``model.safetensors``, no adapter layers: ``AutoModelForCausalLM.from_pretrained``
        loads it, and its ``generate`` continues any Bitune prefill of this model with the same tokens), plus
        ``bitune/``, this model's checkpoint (:meth:`save_pretrained`: the bidir set, the mixer and the config) for
        the prefill workers that compute the mixed cache. Written to a temporary folder and renamed into place.
        An unmerged model is merged for the export and unmerged after it (its base weights then differ from
        before by float rounding: export a model you will train further from a fresh load).

        Args:
            directory: the output folder (replaced if it exists; its parents are created).
            tokenizer: also saved into the folder, when given (default None).

        Returns:
            The folder, as a ``Path``.

        Raises:
            BituneError: the method is ``full`` (its causal set is a whole model already: ``bitune/causal``).
        """
        if self.config.method == "full" and self.config.weight_sets:
            raise BituneError("method 'full' holds the causal weights as a whole model already (causal/ in its "
                              "checkpoint); there is nothing to merge")
        directory = Path(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        was_merged = self.merged
        self.merge()
        try:
            adapters = {id(p) for name in self.config.weight_sets for p in self.weights.parameters_of(name).values()}
            base = self.weights.base
            state = {}
            for key, tensor in base.state_dict(keep_vars=True).items():
                if id(tensor) in adapters or any(part.startswith(("lora_", "ia3_")) for part in key.split(".")):
                    continue  # PEFT's own per-layer state (DoRA magnitudes, IA3 vectors)
                state[key.replace(".base_layer.", ".")] = tensor.detach().clone()
            config = copy.deepcopy(base.config)
            if hasattr(config, "quantization_config"):
                delattr(config, "quantization_config")
            plain = type(base)(config).to(dtype=next(iter(state.values())).dtype)
            plain.load_state_dict(state, strict=True)
            plain.generation_config = base.generation_config
            tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
            try:
                plain.save_pretrained(tmp, safe_serialization=True)
                if tokenizer is not None:
                    tokenizer.save_pretrained(tmp)
                checkpoint.save(self, tmp / "bitune", destination=directory / "bitune")  # its card shows where
                apply_umask(tmp)
                replace_dir(tmp, directory)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        finally:
            if not was_merged:
                self.unmerge()
        return directory

    def load_weights(self, directory: str | os.PathLike) -> None:
        """Load trained weights from a checkpoint, strictly; see :func:`bitune.checkpoint.load_weights`.

        Raises:
            BituneError: the model is merged (loading adapters under merged weights would mix two states).
        """
        if self.merged:
            raise BituneError("load_weights on a merged model: call unmerge() first")
        checkpoint.load_weights(self, directory)


# --------------------------------------------------------------------------------------------------- loss
def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, A) float32 log-probability of each token ``ids[:, t]`` under ``logits[:, t]`` (B, A, V); 0 where ``mask``
    is 0."""
    logp = F.log_softmax(logits.float(), dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # (B, A)
    return logp * mask.to(torch.float32)


def _answer_loss(logits: torch.Tensor, answer_ids: torch.Tensor, answer_mask: torch.Tensor) -> BituneOutput:
    logp = token_logprobs(logits, answer_ids, answer_mask)  # (B, A)
    example_loss = -logp.sum(1) / answer_mask.to(torch.float32).sum(1)  # (B,)
    return BituneOutput(loss=example_loss.mean(), logits=logits, token_logprobs=logp, example_loss=example_loss)
