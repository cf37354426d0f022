"""``BituneSFTTrainer`` (TRL's SFTTrainer for a BituneModel): the same tokens, loss, gradients, example order and
weights as ``bitune train`` on the same rows; checkpoints that load and generate; exact resume; 2 processes reach
the weights of 1; every refused option and row refused with one error naming it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, LlamaConfig, TrainerCallback

from bitune import BituneConfig, BituneModel
from bitune.data import load_examples, tokenize_dataset
from bitune.data.collate import Collator, pad_id
from bitune.data.templates import Example
from bitune.errors import BituneError
from bitune.loading import load_bitune
from bitune.train.settings import TrainSettings
from bitune.train.trainer import build_trainer, run_training
from bitune.trl import BituneSFTTrainer, TrainerModel
from helpers.compare import assert_same_weights, trainable
from helpers.models import tiny_model
from helpers.sft import accelerate_launch, fresh_model, rows, sft_config, sft_trainer, write_bitune_rows
from helpers.tokenizer import CONVERSATION, chat_tokenizer, tiny_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def bitune_samples(tmp_path, trl_rows, tokenizer) -> list[dict]:
    """What ``bitune train`` feeds its loop: the rows loaded from a file and tokenized by its code."""
    examples = load_examples(write_bitune_rows(tmp_path / "rows.jsonl", trl_rows), "train")
    return tokenize_dataset(tokenizer, examples, 128)[0]


# ------------------------------------------------------------------------------------------- data
def test_prompt_completion_rows_are_tokenized_as_bitune_train_does(tmp_path):
    trainer = sft_trainer(str(tmp_path / "out"))
    expected = bitune_samples(tmp_path, rows(), tiny_tokenizer())
    got = trainer.train_dataset
    assert got.column_names == ["prompt_ids", "answer_ids"]  # kept apart, not re-tokenized by TRL
    assert got["prompt_ids"] == [s["prompt_ids"] for s in expected]
    assert got["answer_ids"] == [s["answer_ids"] for s in expected]
    assert all(s["answer_ids"][-1] == tiny_tokenizer().eos_token_id for s in expected)
    assert trainer.bitune_model.config.template == "none"


@pytest.mark.parametrize("kind", ["smollm2", "gemma3"])
def test_conversations_are_rendered_as_bitune_train_renders_them(tmp_path, kind):
    """``messages`` rows and conversational prompt-completion rows give ``bitune train``'s chat tokens."""
    tok = chat_tokenizer(kind)
    conversations = [CONVERSATION, CONVERSATION[1:3], [CONVERSATION[0], *CONVERSATION[3:]]]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    expected = tokenize_dataset(tok, load_examples(str(path), "train"), 512)[0]
    model = BituneModel.wrap(AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)))
    data = {"messages": [{"messages": m} for m in conversations],
            "prompt_completion": [{"prompt": m[:-1], "completion": m[-1:]} for m in conversations]}
    for fmt, train_rows in data.items():
        trainer = sft_trainer(str(tmp_path / fmt), train_rows, model=model, tokenizer=tok, max_length=512)
        got = trainer.train_dataset
        assert got["prompt_ids"] == [s["prompt_ids"] for s in expected], fmt
        assert got["answer_ids"] == [s["answer_ids"] for s in expected], fmt
        assert trainer.bitune_model.config.template == "chat"


def batch_order(trainer, batch) -> list[int]:
    """The training rows a batch holds, by their (unique) prompts."""
    prompts = trainer.train_dataset["prompt_ids"]
    return [prompts.index(ids[mask.bool()].tolist()) for ids, mask in zip(batch["prompt_ids"], batch["prompt_mask"])]


def test_trainer_batches_are_the_collators_batches(tmp_path):
    """TRL's data loader hands the trainer exactly what bitune train's Collator pads from the same samples:
    left-padded prompts and right-padded answers, nothing else."""
    trainer = sft_trainer(str(tmp_path / "out"), per_device_train_batch_size=5)
    samples = tokenize_dataset(tiny_tokenizer(), [Example(r["prompt"], r["completion"], template="none")
                                                  for r in rows()])[0]
    for batch in trainer.get_train_dataloader():
        expected = Collator(pad_id(tiny_tokenizer()))([samples[i] for i in batch_order(trainer, batch)])
        assert_same_weights(dict(batch), expected, atol=0)


def test_rows_longer_than_max_length_are_dropped_not_truncated(tmp_path):
    samples = bitune_samples(tmp_path, rows(), tiny_tokenizer())
    limit = sorted(len(s["prompt_ids"]) + len(s["answer_ids"]) for s in samples)[len(samples) // 2]
    trainer = sft_trainer(str(tmp_path / "out"), max_length=limit)
    kept = [s for s in samples if len(s["prompt_ids"]) + len(s["answer_ids"]) <= limit]
    assert 0 < len(kept) < len(rows()) and trainer.dropped == len(rows()) - len(kept)
    assert trainer.train_dataset["prompt_ids"] == [s["prompt_ids"] for s in kept]
    assert trainer.train_dataset["answer_ids"] == [s["answer_ids"] for s in kept]


# ------------------------------------------------------------------------------------------- loss and gradients
def test_loss_and_gradients_equal_bitune_forward(tmp_path):
    """The trainer's loss on a TRL batch and its gradients equal BituneModel's forward on bitune train's batch of
    the same rows (fp32, 1e-6). TRL's fused-LM-head forward stays installed on the model; called without
    ``fused_lm_head=True`` (only SFTTrainer.compute_loss, replaced here, passes it) it runs Bitune's forward."""
    trainer = sft_trainer(str(tmp_path / "out"), per_device_train_batch_size=5)
    assert isinstance(trainer.model, TrainerModel) and "forward" in vars(trainer.model)  # TRL's, passing through
    model = trainer.bitune_model.train()
    batch = next(iter(trainer.get_train_dataloader()))
    order = batch_order(trainer, batch)
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    got = {k: p.grad.clone() for k, p in model.trainable_parameters().items()}
    model.zero_grad()
    samples = bitune_samples(tmp_path, rows(), tiny_tokenizer())
    reference = Collator(pad_id(tiny_tokenizer()))([samples[i] for i in order])
    out = model(reference["prompt_ids"], reference["prompt_mask"], reference["answer_ids"], reference["answer_mask"])
    out.loss.backward()
    torch.testing.assert_close(loss, out.loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(loss, out.example_loss.mean(), rtol=0, atol=1e-6)  # the example mean,
    assert abs(loss - (-out.token_logprobs.sum() / reference["answer_mask"].sum())) > 1e-4  # not TRL's token mean
    assert_same_weights(got, {k: p.grad for k, p in model.trainable_parameters().items()}, atol=1e-6)
    assert all(g.abs().sum() > 0 for g in got.values())  # both adapters and the mixer learn


def test_eval_loss_is_the_mean_over_examples(tmp_path):
    """``evaluate()`` on a conversational eval set: eval_loss is the mean of every example's loss, as bitune
    train's evaluation computes it (batches of 3 over 5 rows: a short last batch)."""
    tok = chat_tokenizer("smollm2")
    conversations = [CONVERSATION, CONVERSATION[1:3], CONVERSATION[:3], [CONVERSATION[1], CONVERSATION[4]],
                     [CONVERSATION[0], *CONVERSATION[3:]]]
    model = BituneModel.wrap(AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)))
    data = Dataset.from_list([{"messages": m} for m in conversations])
    trainer = BituneSFTTrainer(model=model, args=sft_config(str(tmp_path), per_device_eval_batch_size=3,
                                                            max_length=512),
                               train_dataset=data, eval_dataset=data, processing_class=tok)
    got = trainer.evaluate()["eval_loss"]
    assert trainer.evaluate(data)["eval_loss"] == got  # rows passed to evaluate() are tokenized the same way
    assert trainer.evaluate({"a": data})["eval_a_loss"] == got
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    samples = tokenize_dataset(tok, load_examples(str(path), "train"), 512)[0]
    with torch.no_grad():
        expected = model.eval()(*Collator(pad_id(tok))(samples).values()).example_loss.mean()
    assert got == pytest.approx(float(expected), abs=1e-6)


def test_launched_processes_without_a_process_group_are_refused(tmp_path, monkeypatch):
    """On a machine without GPUs transformers groups the processes only with use_cpu=True; without it each one
    would train alone on all the data."""
    args = sft_config(str(tmp_path), use_cpu=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(BituneError, match="launched as 2 processes.*use_cpu=True"):
        BituneSFTTrainer(model=fresh_model(), args=args, train_dataset=Dataset.from_list(rows()),
                         processing_class=tiny_tokenizer())


def test_thetas_are_not_decayed(tmp_path):
    trainer = sft_trainer(str(tmp_path / "out"), weight_decay=0.1)
    optimizer = trainer.create_optimizer()
    model = trainer.bitune_model
    mixer = {id(p) for p in model.mixer.parameters()}
    decay = {g["weight_decay"]: {id(p) for p in g["params"]} for g in optimizer.param_groups}
    assert decay == {0.1: {id(p) for p in model.trainable_parameters().values()} - mixer, 0.0: mixer}


# ------------------------------------------------------------------------------------------- runs
def test_trl_run_matches_bitune_train(tmp_path):
    """6 steps (crossing an epoch) of batch 2 x accumulation 2, length-grouped, weight decay 0.1, clip 1.0: the
    TRL run and bitune train's loop draw the same batches and reach the same weights."""
    trainer = sft_trainer(str(tmp_path / "trl"), max_steps=6)
    trainer.train()
    settings = TrainSettings.from_dict(dict(
        model="tiny", dataset="tiny", output_dir=str(tmp_path / "bitune"), batch_size=2, grad_accum=2, steps=6,
        lr=1e-2, weight_decay=0.1, max_grad_norm=1.0, warmup_ratio=0.0, group_by_length=True, log_every=1, seed=0,
        save_every=None, bitune={"variant": "bitune"}))
    loop = build_trainer(fresh_model(), settings, bitune_samples(tmp_path, rows(), tiny_tokenizer()), None,
                         Collator(pad_id(tiny_tokenizer())), tensorboard=False)
    run_training(loop, settings)
    before = trainable(fresh_model())
    after = trainable(loop.model)
    assert all(not torch.equal(before[k], after[k]) for k in after)
    assert_same_weights(trainable(trainer.bitune_model), after, atol=1e-6)


class StopAt(TrainerCallback):
    """Save a checkpoint at step ``at`` and stop there (an interrupted run)."""

    def __init__(self, at: int):
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            control.should_save = control.should_training_stop = True


def test_resume_continues_exactly(tmp_path):
    """4 steps straight == 2 steps, a checkpoint, a fresh trainer resuming it for the last 2 (bit for bit)."""
    straight = sft_trainer(str(tmp_path / "straight"))
    straight.train()
    stopped = sft_trainer(str(tmp_path / "run"), callbacks=[StopAt(2)])
    stopped.train()
    checkpoint = tmp_path / "run" / "checkpoint-2"
    assert (checkpoint / "bitune_config.json").is_file() and (checkpoint / "optimizer.pt").is_file()
    resumed = sft_trainer(str(tmp_path / "run"))
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 4
    assert_same_weights(trainable(resumed.bitune_model), trainable(straight.bitune_model), atol=0)


def test_saved_model_loads_and_generates_the_same_tokens(tmp_path):
    trainer = sft_trainer(str(tmp_path / "out"), save_strategy="steps", save_steps=2)
    trainer.train()
    final = tmp_path / "out"
    trainer.save_model()  # into output_dir, next to its checkpoint-N folders
    assert sorted(p.name for p in final.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging leftovers
    config = json.loads((final / "bitune_config.json").read_text())
    assert config["template"] == "none" and config["variant"] == "bitune"
    loaded = BituneModel.from_pretrained(final, base=tiny_model()).eval()
    model = trainer.bitune_model.eval()
    assert_same_weights(trainable(loaded), trainable(model), atol=0)
    tok = tiny_tokenizer()
    prompts = tok(["q1: red blue?", "q7: sun moon tree?"], padding=True, padding_side="left", return_tensors="pt")
    args = (prompts["input_ids"], prompts["attention_mask"])
    assert torch.equal(loaded.generate(*args, max_new_tokens=8), model.generate(*args, max_new_tokens=8))


def test_saving_over_another_checkpoint_leaves_none_of_its_parts(tmp_path):
    sft_trainer(str(tmp_path / "a")).save_model(str(tmp_path / "final"))  # bitune: causal/, bidir/, mixer
    assert (tmp_path / "final" / "bidir").is_dir() and (tmp_path / "final" / "mixer.safetensors").is_file()
    baseline = sft_trainer(str(tmp_path / "b"), model=fresh_model("lora"))
    baseline.save_model(str(tmp_path / "final"))
    assert sorted(p.name for p in (tmp_path / "final").iterdir() if not p.name.startswith("tokenizer")) == [
        "README.md", "bitune_config.json", "causal"]
    loaded = BituneModel.from_pretrained(tmp_path / "final", base=tiny_model())
    assert loaded.config.variant == "lora"
    assert_same_weights(trainable(loaded), trainable(baseline.bitune_model), atol=0)


def test_a_named_model_is_loaded_wrapped_and_recorded(tmp_path):
    base = tmp_path / "base"
    tiny_model().save_pretrained(base)
    tiny_tokenizer().save_pretrained(base)
    trainer = BituneSFTTrainer(model=str(base), bitune_config=BituneConfig(variant="no_mixing"),
                               args=sft_config(str(tmp_path / "out"), max_steps=1),
                               train_dataset=Dataset.from_list(rows()))
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    config = json.loads((tmp_path / "final" / "bitune_config.json").read_text())
    assert config["base_model"] == str(base) and config["variant"] == "no_mixing"
    model, _ = load_bitune(checkpoint=str(tmp_path / "final"))  # what bitune generate/eval/chat load
    assert_same_weights(trainable(model), trainable(trainer.bitune_model), atol=0)


@pytest.mark.slow
def test_two_processes_reach_the_weights_of_one(tmp_path):
    """accelerate launch with configs/accelerate/ddp.yaml, 2 gloo processes x batch 1 == 1 process x batch 2 (the
    same global batches; DDP averages the two per-process means). The losses agree to every printed digit; the
    weights to 5e-5 after 4 AdamW steps at lr 1e-2: Adam divides each gradient entry by its running RMS, so the
    float rounding of the all-reduce (1e-7 relative) in entries whose gradient is near zero moves them by up to
    a few 1e-5 (measured: 1.2e-5 on one tensor, 1e-6 or less elsewhere)."""
    one = sft_trainer(str(tmp_path / "one"), per_device_train_batch_size=2)
    one.train()
    job = accelerate_launch(2, "--out", str(tmp_path / "two"), "--batch-size", "1")
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    two = BituneModel.from_pretrained(tmp_path / "two" / "final", base=tiny_model())
    assert_same_weights(trainable(two), trainable(one.bitune_model), atol=5e-5)


# ------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("option, match", [
    ({"packing": True}, "packing=True is refused: Bitune reads each prompt on its own"),
    ({"padding_free": True}, "padding_free=True is refused"),
    ({"activation_checkpointing_kwargs": {"selective": True}}, "'selective': True} is refused"),
    ({"activation_checkpointing_kwargs": {"every_n_layers": 2}}, "every_n_layers and offload are refused"),
    ({"activation_checkpointing_kwargs": {"use_reentrant": True}}, "use_reentrant=True is refused"),
    ({"assistant_only_loss": True}, "assistant_only_loss=True is refused"),
    ({"completion_only_loss": False}, "completion_only_loss=False is refused"),
    ({"loss_type": "dft"}, "loss_type and label_smoothing_factor are refused"),
])
def test_options_bitune_cannot_train_with_are_refused(tmp_path, option, match):
    if "activation_checkpointing_kwargs" in option:
        option = {"activation_checkpointing": True, **option}
    with pytest.raises(BituneError, match=match):
        sft_trainer(str(tmp_path / "out"), **option)


def test_sft_configs_checkpointing_default_trains_with_the_same_loss_and_gradients(tmp_path):
    """SFTConfig's default activation_checkpointing=True maps onto Bitune's own checkpointing (the prompt caches
    kept): the batch's loss and every gradient equal those without it (1e-5), and training runs."""
    from trl import SFTConfig

    assert SFTConfig(output_dir=str(tmp_path / "d"), use_cpu=True, bf16=False).activation_checkpointing  # TRL default
    results = []
    for on in (False, True):
        trainer = sft_trainer(str(tmp_path / f"out{on}"), activation_checkpointing=on, per_device_train_batch_size=4)
        model = trainer.bitune_model.train()
        assert trainer.model.is_activation_checkpointing == on == model.recomputing
        batch = next(iter(trainer.get_train_dataloader()))
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        results.append((loss.detach(), {k: p.grad.clone() for k, p in model.trainable_parameters().items()}))
        model.zero_grad()
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=1e-5)
    assert_same_weights(results[1][1], results[0][1], atol=1e-5)
    trainer = sft_trainer(str(tmp_path / "run"), activation_checkpointing=True)
    trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)


@pytest.mark.parametrize("bad_rows, match", [
    ([{"text": "just some text"}], "field 'text' is plain language-modeling text"),
    ([{"prompt": "q: red?"}], "field 'prompt' without a field 'completion'"),
    ([*rows(3), {"prompt": "q: x?", "completion": None}], "train dataset row 3 field 'completion' is missing"),
    ([*rows(2), {"prompt": "", "completion": " red."}], r"example 2 of the train dataset \(field 'prompt'\): prompt '' "
                                                         "has 1 token"),
    ([{"messages": [{"role": "user", "content": "hi"}]}], "train dataset: row 0 field 'messages' has no assistant"),
    ([{"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "user", "content": "x"}]}],
     "train dataset row 0 field 'completion' must be one assistant turn"),
    ([{"input_ids": [1, 2, 3]}], "pre-tokenized rows"),
])
def test_rows_bitune_cannot_use_are_refused_naming_row_and_field(tmp_path, bad_rows, match):
    with pytest.raises(BituneError, match=match):
        sft_trainer(str(tmp_path / "out"), bad_rows)


def test_a_plain_model_or_peft_config_is_refused(tmp_path):
    data = Dataset.from_list(rows())
    with pytest.raises(BituneError, match="BituneModel or a base model name"):
        BituneSFTTrainer(model=tiny_model(), args=sft_config(str(tmp_path)), train_dataset=data,
                         processing_class=tiny_tokenizer())
    with pytest.raises(BituneError, match="'pretrained' trains nothing"):
        BituneSFTTrainer(model=fresh_model("pretrained"), args=sft_config(str(tmp_path)), train_dataset=data,
                         processing_class=tiny_tokenizer())
    with pytest.raises(BituneError, match="peft_config= is refused"):
        BituneSFTTrainer(model=fresh_model(), args=sft_config(str(tmp_path)), train_dataset=data,
                         processing_class=tiny_tokenizer(), peft_config=object())


# ------------------------------------------------------------------------------------------- the example script
@pytest.mark.integration
def test_readme_script_trains_smollm2_and_its_checkpoint_answers(tmp_path):
    """examples/trl_sft.py (the TRL guide's script) shortened to 2 steps into a temporary folder, then
    ``bitune generate --checkpoint`` on what it wrote (SmolLM2-135M, offline)."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    script = (root / "examples" / "trl_sft.py").read_text()
    assert script.count("max_steps=30") == 1 and script.count('"runs/trl-chat"') == 1
    short = tmp_path / "trl_sft.py"
    short.write_text(script.replace("max_steps=30", "max_steps=2")
                     .replace('"runs/trl-chat"', repr(str(tmp_path / "ck"))))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root / "src")}
    job = subprocess.run([sys.executable, str(short)], cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert job.returncode == 0, job.stderr[-3000:]
    assert json.loads((tmp_path / "ck" / "bitune_config.json").read_text())["template"] == "chat"
    job = subprocess.run([sys.executable, "-m", "bitune.cli", "generate", "--checkpoint", str(tmp_path / "ck"),
                          "--prompt", "What is the capital of France?", "--max-new-tokens", "8"],
                         cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert job.returncode == 0 and job.stdout.strip(), job.stderr[-3000:]


def test_the_trl_guide_shows_the_example_script_as_it_is():
    """The guide (the README's TRL section moved there) includes examples/trl_sft.py itself, as a snippet."""
    root = Path(__file__).resolve().parents[1]
    guide = (root / "docs" / "guides" / "trl.md").read_text()
    assert '\n--8<-- "examples/trl_sft.py"\n```' in guide[guide.index("```python"):]
