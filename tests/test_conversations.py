"""Conversational (``messages``) training rows: rendered with SmolLM2's and Gemma 3's chat templates and split
into prompt and answer token by token; bad rows rejected with file, row and field."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from bitune import BituneConfig, BituneModel
from bitune.data import ChatExample, Collator, dataset_template, load_examples, tokenize_dataset, tokenize_example
from bitune.data.conversations import end_of_turn_id, render
from bitune.errors import BituneError
from bitune.generation import encode
from bitune.generation import render as render_prompt
from helpers.tokenizer import CONVERSATION, RENDERED, chat_tokenizer

GENERATION_PROMPT = {"smollm2": "<|im_start|>assistant\n", "gemma3": "<start_of_turn>model\n"}
END_OF_TURN = {"smollm2": "<|im_end|>", "gemma3": "<end_of_turn>"}


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def family(request):
    return request.param, chat_tokenizer(request.param)


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_messages_rows_split_token_by_token(family, tmp_path):
    kind, tok = family
    (example,) = load_examples(_write(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}]), "train")
    prompt_text, answer_text, after = RENDERED[kind]
    assert render(tok, example) == (prompt_text, answer_text + after)
    sample = tokenize_example(tok, example)
    prompt, answer = sample["prompt_ids"], sample["answer_ids"]
    assert prompt == tok(prompt_text, add_special_tokens=False)["input_ids"]
    assert tok.decode(prompt) == prompt_text and tok.decode(prompt).endswith(GENERATION_PROMPT[kind])
    assert tok.decode(answer) == answer_text
    assert answer[-1] == end_of_turn_id(tok) == tok.convert_tokens_to_ids(END_OF_TURN[kind])
    assert END_OF_TURN[kind] not in tok.decode(answer[:-1])  # one end-of-turn token, the last
    full = tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert full == prompt_text + answer_text + after
    assert tok(full, add_special_tokens=False)["input_ids"] == prompt + answer + tok(after)["input_ids"]
    if kind == "gemma3":  # the template writes BOS once, and eos is not the end of a turn
        assert prompt.count(tok.bos_token_id) == 1 and tok.eos_token_id not in answer


def test_prompt_is_what_generate_reads_with_the_chat_template(family, tmp_path):
    """Training and ``bitune generate --template chat`` see the same prompt tokens for a one-turn conversation."""
    kind, tok = family
    row = {"messages": [{"role": "user", "content": "Why is the sky blue?"},
                        {"role": "assistant", "content": "It is four."}]}
    (example,) = load_examples(_write(tmp_path / "one.jsonl", [row]), "train")
    text, special = render_prompt(tok, "Why is the sky blue?", "chat")
    ids, _ = encode(tok, [text], special)
    assert tokenize_example(tok, example)["prompt_ids"] == ids[0].tolist()


def test_model_reads_prompt_without_last_token_and_answers_from_it(family, tmp_path):
    """Bitune's split after the chat template: the prompt passes read everything before the generation prompt's
    last token; the answer pass starts with that token and predicts the answer up to the end-of-turn token."""
    kind, tok = family
    (example,) = load_examples(_write(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}]), "train")
    sample = tokenize_example(tok, example)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = BituneModel.wrap(AutoModelForCausalLM.from_config(config).eval(), BituneConfig())
    batch = Collator(tok.pad_token_id)([sample])
    prefill = model.prefill(batch["prompt_ids"], batch["prompt_mask"])
    read, first = tok.decode(prefill.ids[0]), tok.decode(prefill.last_token[0])
    prompt_text, answer_text, _ = RENDERED[kind]
    assert read + first == prompt_text and GENERATION_PROMPT[kind].endswith(first) and first
    assert first + tok.decode(batch["answer_ids"][0]) == first + answer_text
    assert torch.isfinite(model(**batch).loss)


def test_tokenize_dataset_equals_one_by_one_and_drops_long(family, tmp_path):
    kind, tok = family
    short = {"messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "It is four."}]}
    long = {"messages": [{"role": "user", "content": "Hello " * 200}, {"role": "assistant", "content": "Hi"}]}
    path = _write(tmp_path / "chat.jsonl", [short, long, short])
    examples = load_examples(path, "train")
    one = tokenize_example(tok, examples[0])
    limit = len(one["prompt_ids"]) + len(one["answer_ids"])
    kept, dropped = tokenize_dataset(tok, examples, max_length=limit)
    assert (kept, dropped) == ([one, one], 1)


@pytest.mark.parametrize(("row", "match"), [
    ({"messages": [{"role": "user", "content": "Hi"}]}, "row 2 field 'messages' has no assistant turn"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "bot", "content": "Hey"}]},
     "row 2 field 'messages\\[1\\].role' is 'bot', not one of system, user, assistant"),
    ({"messages": [{"role": "user", "content": ["Hi"]}, {"role": "assistant", "content": "Hey"}]},
     "row 2 field 'messages\\[0\\].content' must be a string"),
    ({"messages": [{"role": "user"}, {"role": "assistant", "content": "Hey"}]},
     "row 2 field 'messages\\[0\\].content' is missing"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": 3}]},
     "row 2 field 'messages\\[1\\].content' must be a string"),
    ({"messages": "Hi"}, "row 2 field 'messages' must be a non-empty list"),
    ({"messages": []}, "row 2 field 'messages' must be a non-empty list"),
    ({"messages": ["Hi"]}, "row 2 field 'messages\\[0\\]' must be an object"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hey"},
                   {"role": "user", "content": "?"}]}, "row 2 field 'messages\\[2\\]' follows the last assistant"),
    ({"messages": [{"role": "system", "content": "S"}, {"role": "assistant", "content": "Hey"}]},
     "row 2 field 'messages' has no user turn before the last assistant turn"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " "}]},
     "row 2 field 'messages\\[1\\].content' must be a non-empty string"),
    ({"instruction": "Hi", "output": "Hey"}, "row 2 is a single prompt .* but row 1 is a conversation"),
])
def test_bad_messages_rows_name_file_row_and_field(tmp_path, row, match):
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hey"}]}
    path = _write(tmp_path / "bad.jsonl", [good, row])
    with pytest.raises(BituneError, match=match) as err:
        load_examples(path, "train")
    assert "bad.jsonl" in str(err.value)


def test_template_errors_name_the_row(tmp_path):
    """Gemma 3's template refuses two user turns in a row: the error names the file and row, at tokenization."""
    tok = chat_tokenizer("gemma3")
    row = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                        {"role": "assistant", "content": "c"}]}
    (example,) = load_examples(_write(tmp_path / "d.jsonl", [row]), "train")
    with pytest.raises(BituneError, match="d.jsonl: row 1: the chat template .* rejects.*must alternate"):
        tokenize_dataset(tok, [example])
    tok.chat_template = None
    with pytest.raises(BituneError, match="need a chat template"):
        tokenize_example(tok, example)


def test_each_format_records_its_template(tmp_path):
    chat = _write(tmp_path / "c.jsonl", [{"messages": CONVERSATION}])
    paper = _write(tmp_path / "p.jsonl", [{"instruction": "a", "output": "b"}, {"prompt": "Q: a\nA:", "answer": " b"}])
    verbatim = _write(tmp_path / "v.jsonl", [{"prompt": "Q: a\nA:", "answer": " b"}])
    assert [dataset_template(p) for p in (chat, paper, verbatim, "arc_easy")] == ["chat", "paper", "none", "paper"]
    assert isinstance(load_examples(chat, "train")[0], ChatExample)


@pytest.mark.integration
def test_smollm2_tokenizer_splits_conversations(tmp_path):
    """The real SmolLM2-135M-Instruct tokenizer: the last prompt token is the generation prompt's newline."""
    from bitune.hub import load_model

    _, tok = load_model("smollm2-135m")
    (example,) = load_examples(_write(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}]), "train")
    sample = tokenize_example(tok, example)
    prompt, answer = sample["prompt_ids"], sample["answer_ids"]
    prompt_text, answer_text, after = RENDERED["smollm2"]
    full = tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert tok(full)["input_ids"] == prompt + answer + tok(after)["input_ids"]
    assert tok.decode(prompt) == prompt_text and tok.decode(answer) == answer_text
    assert answer[-1] == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.decode(prompt[:-1]).endswith("<|im_start|>assistant") and tok.decode(prompt[-1:]) == "\n"
