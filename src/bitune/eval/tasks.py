"""lm-eval tasks for the paper's benchmarks, read offline through :mod:`bitune.data`.

lm-eval's built-in tasks download from the Hugging Face hub; these read the packaged data instead, with the
paper's templates (:mod:`bitune.data.templates`), zero-shot, on the split the paper reports
(``DATASETS[name].eval_split``) unless another is asked for (``split="tuning"``: the one to tune on):

* ``bitune_piqa``, ``bitune_arc_challenge``, ``bitune_arc_easy``, ``bitune_csqa``, ``bitune_siqa``,
  ``bitune_mmlu``: log-likelihood multiple choice over ``Example.choices``. Those start with a space; the tasks
  hold them without it and put the space in the target delimiter, as lm-eval's own tasks do, so each scored
  continuation is still ``" " + choice`` while ``acc_norm`` (log-likelihood divided by the choice's length in
  characters, without the delimiter: lm-eval's definition; its byte-normalised metric is ``acc_bytes``) divides by
  the choice text's own length. Metrics ``acc`` and ``acc_norm``. With a chat template (``bitune eval --template
  chat``) lm-eval drops the delimiter: the choice then follows the generation prompt directly, as a chat answer
  does in training. ``bitune_mmlu`` holds every subject's test questions in one task, so its ``acc`` is the
  question-weighted aggregate over subjects, which is what lm-eval's ``mmlu`` group reports.
* ``bitune_gsm8k``: greedy generation until ``"Question:"`` or eos (at most 256 new tokens); ``exact_match_strict``
  compares the number after ``####`` with the reference, ``exact_match_flexible`` the last number in the text.

Python: :func:`make_task` / :func:`make_tasks` build Task objects for ``lm_eval.simple_evaluate``. lm-eval's CLI:
``--include_path`` the folder printed by ``python -m bitune.eval.tasks`` (one YAML per task, naming
:class:`BituneTask`).
"""

from __future__ import annotations

import re
from pathlib import Path

import datasets
from lm_eval.api.task import ConfigurableTask

from ..data import datasets as bitune_datasets
from ..errors import BituneError, did_you_mean

TASKS: dict[str, str] = {
    "piqa": "multiple_choice",
    "arc_challenge": "multiple_choice",
    "arc_easy": "multiple_choice",
    "csqa": "multiple_choice",
    "siqa": "multiple_choice",
    "mmlu": "multiple_choice",
    "gsm8k": "generate_until",
}
"""Benchmarks (names of :mod:`bitune.data.datasets`) and how lm-eval scores them."""
PREFIX = "bitune_"
"""lm-eval task names are ``bitune_<benchmark>``, apart from lm-eval's own hub-backed tasks."""
TASK_DIR = Path(__file__).with_name("lm_tasks")
"""YAML task files for lm-eval's ``--include_path``."""
MC_DELIMITER = " "
"""Written between a multiple-choice prompt and each choice (lm-eval's default ``target_delimiter``)."""
GSM8K_MAX_NEW_TOKENS = 256
GSM8K_STOP = ["Question:"]

_STRICT = re.compile(r"#### *(-?[$0-9.,]+)")
_NUMBER = re.compile(r"-?[$0-9.,]{2,}|-?[0-9]+")


def task_name(name: str) -> str:
    """``piqa`` or ``bitune_piqa`` -> ``bitune_piqa``; raises a BituneError for an unknown benchmark."""
    short = name.removeprefix(PREFIX)
    if short not in TASKS:
        raise BituneError(f"unknown task {name!r}{did_you_mean(short, TASKS)}; choose from {', '.join(TASKS)}")
    return PREFIX + short


def _normalize_number(text: str) -> str:
    return text.replace("$", "").replace(",", "").rstrip(".").strip()


def extract_strict(text: str) -> str | None:
    """The number after the first ``#### `` (GSM8K's answer format), normalised; None if absent."""
    match = _STRICT.search(text)
    return _normalize_number(match.group(1)) if match else None


def extract_flexible(text: str) -> str | None:
    """The last number in the text, normalised (``$`` and ``,`` dropped, trailing ``.`` removed); None if none."""
    numbers = [n for n in _NUMBER.findall(text) if any(c.isdigit() for c in n)]
    return _normalize_number(numbers[-1]) if numbers else None


def _same_number(pred: str | None, target: str) -> bool:
    if pred is None:
        return False
    try:
        return float(pred) == float(_normalize_number(target))
    except ValueError:
        return pred == _normalize_number(target)


def gsm8k_results(doc: dict, results: list[str]) -> dict[str, float]:
    """lm-eval ``process_results`` for GSM8K: strict and flexible exact match of the generated text."""
    text = results[0]
    return {"exact_match_strict": float(_same_number(extract_strict(text), doc["target"])),
            "exact_match_flexible": float(_same_number(extract_flexible(text), doc["target"]))}


def _load_docs(benchmark: str, split: str | None = None, **_) -> dict:
    """lm-eval ``custom_dataset``: one split of the benchmark (default: the reported one) as a one-split
    ``datasets`` dict."""
    split = bitune_datasets.resolve_split(benchmark, split)
    docs = [{"prompt": e.prompt, "answer": e.answer, "choices": [_unspaced(c, e.id) for c in e.choices or []],
             "gold": e.gold or 0, "id": e.id or str(i), "target": e.target or ""}
            for i, e in enumerate(bitune_datasets.load_examples(benchmark, split))]
    return {"test": datasets.Dataset.from_list(docs)}


def _unspaced(choice: str, id: str | None) -> str:
    """A choice without the leading space the templates give it (the task's target delimiter writes it)."""
    if not choice.startswith(MC_DELIMITER):
        raise BituneError(f"question {id}: choice {choice!r} does not start with {MC_DELIMITER!r}")
    return choice[len(MC_DELIMITER):]


def _prompt(doc: dict) -> str:
    return doc["prompt"]


def _choices(doc: dict) -> list[str]:
    return doc["choices"]


def _gold(doc: dict) -> int:
    return doc["gold"]


def _answer(doc: dict) -> str:
    return doc["answer"]


def task_config(name: str, split: str | None = None) -> dict:
    """The lm-eval task config of ``name`` (``piqa`` or ``bitune_piqa``) on one split: the reported one (None or
    ``"reported"``), the one to tune on (``"tuning"``) or a split name (:func:`bitune.data.datasets.resolve_split`).
    """
    full = task_name(name)
    benchmark = full.removeprefix(PREFIX)
    split = bitune_datasets.resolve_split(benchmark, split)
    common = dict(task=full, custom_dataset=_load_docs, dataset_kwargs={"benchmark": benchmark, "split": split},
                  test_split="test", doc_to_text=_prompt, num_fewshot=0, metadata={"version": 1.0})
    if TASKS[benchmark] == "multiple_choice":
        return dict(common, output_type="multiple_choice", doc_to_choice=_choices, doc_to_target=_gold,
                    target_delimiter=MC_DELIMITER, metric_list=[
                        {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                        {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}])
    return dict(common, output_type="generate_until", doc_to_target=_answer, target_delimiter="",
                process_results=gsm8k_results,
                generation_kwargs={"until": list(GSM8K_STOP), "do_sample": False, "temperature": 0.0,
                                   "max_gen_toks": GSM8K_MAX_NEW_TOKENS},
                metric_list=[{"metric": "exact_match_strict", "aggregation": "mean", "higher_is_better": True},
                             {"metric": "exact_match_flexible", "aggregation": "mean", "higher_is_better": True}])


class BituneTask(ConfigurableTask):
    """A ConfigurableTask built from :func:`task_config`; the YAML files only name the task and this class."""

    def __init__(self, config: dict | None = None):
        config = dict(config or {})
        if "task" not in config:
            raise BituneError("BituneTask needs a config with 'task' (e.g. bitune_piqa)")
        full = task_config(config["task"], (config.get("dataset_kwargs") or {}).get("split"))
        full["metadata"] = {**full["metadata"], **(config.get("metadata") or {})}
        super().__init__(config=full)


def make_task(name: str, split: str | None = None) -> BituneTask:
    """One task object for ``lm_eval.simple_evaluate(tasks=[...])``, on ``split`` (see :func:`task_config`)."""
    return BituneTask({"task": task_name(name), "dataset_kwargs": {"split": split}})


def make_tasks(names: list[str] | str, split: str | None = None) -> list[BituneTask]:
    """Task objects for a list or a comma-separated string of names, each on ``split`` (see :func:`task_config`)."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    if not names:
        raise BituneError("no tasks given")
    return [make_task(n, split) for n in names]


def task_split(task) -> str:
    """The split a task object built here reads."""
    return task.config.dataset_kwargs["split"]


if __name__ == "__main__":
    print(TASK_DIR)
