"""The ``bitune_*`` multiple-choice tasks score like lm-eval's own: same continuations, same ``acc`` and
``acc_norm`` (log-likelihood over the choice text's length, the delimiter not counted) on the same
log-likelihoods, checked against lm-eval's ARC-Easy task definition."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")

import yaml  # noqa: E402
from lm_eval.api.model import LM  # noqa: E402
from lm_eval.api.task import ConfigurableTask  # noqa: E402

from bitune.data import sources  # noqa: E402
from bitune.eval.tasks import make_task  # noqa: E402

DESIGNED = {" a": -1.0, " bbbb": -3.0}
"""Per character of the choice text 'a' scores -1.0, 'bbbb' -0.75 (lm-eval picks 'bbbb'); counting the space
as well gives -0.5 and -0.6 (that would pick 'a')."""


def loglik(continuation: str) -> float:
    """A fixed log-likelihood per continuation text, whatever the context."""
    return DESIGNED.get(continuation, -(zlib.crc32(continuation.encode()) % 997) / 97.0)


class FixedLM(LM):
    """lm-eval's smallest model: each continuation gets :func:`loglik`; records what it was asked."""

    def __init__(self):
        super().__init__()
        self.continuations: dict[str, list[str]] = {}

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        for r in requests:
            self.continuations.setdefault(r.task_name, []).append(r.args[1])
        return [(loglik(r.args[1]), False) for r in requests]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError

    def generate_until(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError


def lm_eval_arc_easy(docs: list[dict]) -> ConfigurableTask:
    """lm-eval's own ``arc_easy`` task (its YAML, unchanged but for the data: the same questions, hub format)."""
    config = yaml.safe_load((Path(lm_eval.__file__).parent / "tasks" / "arc" / "arc_easy.yaml").read_text())
    config.pop("tag", None)
    hub_docs = [{"id": d["id"], "question": d["query"].removeprefix("Question: ").removesuffix("\nAnswer:"),
                 "choices": {"text": d["choices"], "label": [chr(65 + i) for i in range(len(d["choices"]))]},
                 "answerKey": chr(65 + d["gold"])} for d in docs]

    def load(**_):
        import datasets

        return {"test": datasets.Dataset.from_list(hub_docs)}

    return ConfigurableTask(config={**config, "custom_dataset": load, "training_split": None,
                                    "validation_split": None, "task": "lm_eval_arc_easy"})


def compare(docs: list[dict], monkeypatch) -> tuple[dict, dict, FixedLM]:
    monkeypatch.setattr(sources, "olmo_task_docs", lambda task, split: docs)
    lm = FixedLM()
    results = lm_eval.simple_evaluate(model=lm, tasks=[make_task("arc_easy"), lm_eval_arc_easy(docs)],
                                      bootstrap_iters=0)["results"]
    return results["bitune_arc_easy"], results["lm_eval_arc_easy"], lm


def test_acc_norm_equals_lm_eval_arc_on_the_same_logliks(monkeypatch):
    words = ["iron", "wood", "a glass jar", "it", "the sun and the moon", "x", "water vapour", "ice"]
    docs = [{"id": "designed", "query": "Question: Which?\nAnswer:", "choices": ["a", "bbbb"], "gold": 1}]
    docs += [{"id": str(i), "query": f"Question: q{i}?\nAnswer:", "choices": [words[(i + k) % 8] for k in range(4)],
              "gold": i % 4} for i in range(40)]
    ours, theirs, lm = compare(docs, monkeypatch)
    assert sorted(lm.continuations["bitune_arc_easy"]) == sorted(lm.continuations["lm_eval_arc_easy"])
    assert all(c.startswith(" ") for c in lm.continuations["bitune_arc_easy"])  # the scored text is unchanged
    for metric in ("acc,none", "acc_norm,none"):
        assert ours[metric] == theirs[metric]
    assert ours["acc,none"] != ours["acc_norm,none"]  # the normalisation matters on these questions


def test_designed_question_is_right_only_by_lm_eval_normalisation(monkeypatch):
    docs = [{"id": "designed", "query": "Question: Which?\nAnswer:", "choices": ["a", "bbbb"], "gold": 1}]
    ours, theirs, _ = compare(docs, monkeypatch)
    assert (ours["acc,none"], ours["acc_norm,none"]) == (theirs["acc,none"], theirs["acc_norm,none"]) == (0.0, 1.0)


@pytest.mark.integration
def test_real_arc_easy_validation_matches_lm_eval(monkeypatch):
    """All 570 ARC-Easy validation questions (offline data) with fixed log-likelihoods."""
    docs = sources.olmo_task_docs("arc_easy", "validation")
    assert len(docs) == 570
    ours, theirs, _ = compare(docs, monkeypatch)
    assert ours["acc_norm,none"] == theirs["acc_norm,none"] and ours["acc,none"] == theirs["acc,none"]
