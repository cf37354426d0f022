"""Length-grouped training order: batches of examples of similar prompt and answer lengths.

A batch is padded to its longest prompt (twice over in a two-pass variant: once per prompt pass) and to its
longest answer, so randomly drawn batches of prompts of widely spread lengths are mostly padding.
:class:`LengthGroupedSampler` keeps the order random but groups similar lengths, the way transformers'
``LengthGroupedSampler`` does, with two differences: the cost it sorts by is two-dimensional (prompt and answer
lengths) and its randomness comes only from ``seed`` and the epoch, so the order is the same in every process and
after a resume.

Per epoch: shuffle all examples with ``Generator(seed + epoch)``; cut the shuffled list into mega-batches of
``megabatch x batch_size`` examples; arrange each mega-batch into batches twice, sorted by the cost ``2 P + A`` or
by the answer length ``A`` (instruction data: answers spread far wider than prompts), in both cases then by ``P``
within runs of ``refine`` batches, and improve each arrangement by re-splitting pairs of nearby batches
(``_resplit``); keep the cheaper arrangement; shuffle the order of all batches (so length does not drift
monotonically through training). How much padding that leaves on real data is measured by ``bitune bench data``
(numbers in the README's "Speed and memory"; ``tests/test_train_batches.py`` holds the bound on alpaca_demo).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import Sampler


def padding_share(lengths: Sequence[tuple[int, int]], order: Sequence[int], batch_size: int,
                  prompt_reads: int = 2) -> float:
    """Share of the computed positions that are padding when ``order`` is cut into batches of ``batch_size``.

    A batch computes ``prompt_reads x max P + max A`` positions per example (the prompt once per prompt pass:
    ``prompt_reads`` is a count, 2 for Bitune, 1 for one-pass methods), of which ``prompt_reads x P_i + A_i``
    are real.
    """
    real = computed = 0
    for i in range(0, len(order), batch_size):
        batch = [lengths[j] for j in order[i:i + batch_size]]
        P, A = max(p for p, _ in batch), max(a for _, a in batch)
        real += sum(prompt_reads * p + a for p, a in batch)
        computed += len(batch) * (prompt_reads * P + A)
    return 1.0 - real / computed if computed else 0.0


def grouped_order(lengths: Sequence[tuple[int, int]], batch_size: int, generator: torch.Generator,
                  megabatch: int = 100, refine: int = 4) -> list[int]:
    """The example order of one epoch (see the module docstring)."""
    perm = torch.randperm(len(lengths), generator=generator).tolist()
    size = megabatch * batch_size
    batches: list[list[int]] = []
    for start in range(0, len(perm), size):
        block = perm[start:start + size]
        arrangements = [_resplit(_sorted_batches(block, lengths, batch_size, key, refine), lengths, batch_size)
                        for key in (lambda p, a: 2 * p + a, lambda p, a: a)]
        batches += min(arrangements, key=lambda bs: sum(_cost(b, lengths) for b in bs))
    # Full batches in random order; a short final batch (if any) stays last, as a plain sampler would put it.
    full = [b for b in batches if len(b) == batch_size]
    short = [b for b in batches if len(b) < batch_size]
    shuffled = [full[i] for i in torch.randperm(len(full), generator=generator).tolist()]
    return [j for b in shuffled + short for j in b]


def _cost(batch: list[int], lengths: Sequence[tuple[int, int]]) -> int:
    """Positions a batch computes with two prompt passes: B x (2 max P + max A)."""
    return len(batch) * (2 * max(lengths[j][0] for j in batch) + max(lengths[j][1] for j in batch))


def _sorted_batches(block: list[int], lengths, batch_size: int, key, refine: int) -> list[list[int]]:
    """``block`` sorted by ``key(P, A)``, then by P within runs of ``refine`` batches, cut into batches."""
    block = sorted(block, key=lambda j: key(*lengths[j]))
    step = refine * batch_size
    block = [j for s in range(0, len(block), step) for j in sorted(block[s:s + step], key=lambda j: lengths[j][0])]
    return [block[i:i + batch_size] for i in range(0, len(block), batch_size)]


def _resplit(batches: list[list[int]], lengths, batch_size: int, window: int = 4, rounds: int = 5) -> list[list[int]]:
    """Local improvement: for every pair of full batches at most ``window`` apart, pool their examples and split
    them again (sorted by P, by A or by 2 P + A, cut in the middle) where that computes fewer positions; repeated
    until nothing improves (at most ``rounds`` times)."""
    keys = (lambda j: lengths[j][0], lambda j: lengths[j][1], lambda j: 2 * lengths[j][0] + lengths[j][1])
    for _ in range(rounds):
        improved = False
        for d in range(1, window + 1):
            for i in range(len(batches) - d):
                a, b = batches[i], batches[i + d]
                if len(a) < batch_size or len(b) < batch_size:
                    continue
                best = _cost(a, lengths) + _cost(b, lengths)
                for key in keys:
                    pool = sorted(a + b, key=key)
                    cost = _cost(pool[:batch_size], lengths) + _cost(pool[batch_size:], lengths)
                    if cost < best:
                        batches[i], batches[i + d], best, improved = pool[:batch_size], pool[batch_size:], cost, True
        if not improved:
            break
    return batches


class _EpochSeeded(Sampler[int]):
    """A sampler whose only randomness is ``Generator(seed + epoch)``: the same order in every process and after
    a resume. Subclasses define :meth:`order`."""

    def __init__(self, seed: int):
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def epoch_generator(self) -> torch.Generator:  # not `generator`: accelerate reads that attribute
        return torch.Generator().manual_seed(self.seed + self.epoch)

    def order(self) -> list[int]:
        raise NotImplementedError

    def __iter__(self) -> Iterator[int]:
        return iter(self.order())


class LengthGroupedSampler(_EpochSeeded):
    """Indices in length-grouped, seed-determined random order.

    Args:
        lengths: ``(prompt tokens, answer tokens)`` of every example.
        batch_size: examples per batch (per process: every batch of this many consecutive indices is one forward).
        seed: with the epoch (``set_epoch``, which Trainer calls), the only source of randomness.
        megabatch: examples sorted together, in batches (larger: less padding, less randomness).
    """

    def __init__(self, lengths: Sequence[tuple[int, int]], batch_size: int, seed: int, megabatch: int = 100):
        super().__init__(seed)
        self.lengths = [(int(p), int(a)) for p, a in lengths]
        self.batch_size = batch_size
        self.megabatch = megabatch

    def order(self) -> list[int]:
        return grouped_order(self.lengths, self.batch_size, self.epoch_generator(), self.megabatch)

    def __len__(self) -> int:
        return len(self.lengths)


class ShuffledSampler(_EpochSeeded):
    """Indices in uniformly random order, drawn from ``Generator(seed + epoch)`` only (the order torch's
    ``RandomSampler`` gives with that generator), so the same in every process and after a resume.

    Args:
        size: number of examples.
        seed: with the epoch (``set_epoch``), the only source of randomness.
    """

    def __init__(self, size: int, seed: int):
        super().__init__(seed)
        self.size = size

    def order(self) -> list[int]:
        return torch.randperm(self.size, generator=self.epoch_generator()).tolist()

    def __len__(self) -> int:
        return self.size


class RepeatedPrefix(Sampler[int]):
    """The first ``size`` indices of ``base``'s first-epoch order, in that order, in every epoch: training on the
    examples of a run's first steps only, in the same batches, again and again (``data_steps``).

    Args:
        base: the sampler whose epoch-0 order is cut (its batches stay whole when ``size`` is a multiple of the
            global batch).
        size: indices kept.
    """

    def __init__(self, base: _EpochSeeded, size: int):
        if not 0 < size <= len(base):
            raise ValueError(f"size must be in [1, {len(base)}], got {size}")
        self.base, self.size = base, size
        self._order: list[int] | None = None

    def set_epoch(self, epoch: int) -> None:  # every epoch repeats the same order
        pass

    def __iter__(self) -> Iterator[int]:
        if self._order is None:
            self.base.set_epoch(0)
            self._order = self.base.order()[:self.size]
        return iter(self._order)

    def __len__(self) -> int:
        return self.size


__all__ = ["LengthGroupedSampler", "RepeatedPrefix", "ShuffledSampler", "grouped_order", "padding_share"]
