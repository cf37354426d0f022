"""Multi-turn chat (paper A.8): both modes against single-turn generation, the alternating cache, the CLI."""

from __future__ import annotations

import io
import json

import pytest
import torch

from bitune.cache import layer_kv
from bitune.chat import Conversation
from bitune.cli import main
from bitune.generation import generate_texts
from helpers.gen import CHAT_TEMPLATE, perturbed_bitune, save_checkpoint
from helpers.models import PAD
from helpers.tokenizer import tiny_tokenizer

TURNS = ["what is 2+2?", "and 3+3?", "why?"]


def test_alternating_first_turn_equals_single_turn_generation():
    tok, model = tiny_tokenizer(), perturbed_bitune()
    single = generate_texts(model, tok, [TURNS[0]], max_new_tokens=8, stop=["Question:"])[0]
    for mode in ("alternating", "reread"):
        assert Conversation(model, tok, mode, max_new_tokens=8).say(TURNS[0]) == single


def test_reread_equals_single_turn_generation_on_the_concatenated_history():
    tok, model = tiny_tokenizer(), perturbed_bitune()
    conv = Conversation(model, tok, "reread", max_new_tokens=6)
    answers = [conv.say(t) for t in TURNS]
    history = "\n\n".join(f"Question: {u}\n\nAnswer: {a}" for u, a in zip(TURNS[:2], answers[:2]))
    prompt = f"{history}\n\nQuestion: {TURNS[2]}\n\nAnswer:"
    assert answers[2] == generate_texts(model, tok, [prompt], template="none", max_new_tokens=6,
                                        stop=["Question:"])[0]
    assert [m["content"] for m in conv.history[::2]] == TURNS and [m["content"] for m in conv.history[1::2]] == answers


def _greedy_causal(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    """n greedy tokens of a plain causal forward of the causal weights over ``ids`` (1, T), no cache."""
    for _ in range(n):
        nxt = model.weights.call("causal", input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)  # (1, 1)
        ids = torch.cat([ids, nxt], 1)
    return ids[:, -n:]


def test_alternating_with_zero_mixing_is_a_plain_causal_continuation_of_the_history():
    model = perturbed_bitune()
    with torch.no_grad():
        model.mixer.theta_k.zero_()  # a_k = a_v = 0: the mixed features are the causal ones
        model.mixer.theta_v.zero_()
    g = torch.Generator().manual_seed(0)
    p1, p2 = torch.randint(3, 64, (1, 6), generator=g), torch.randint(3, 64, (1, 4), generator=g)
    opts = dict(max_new_tokens=5, eos_token_id=None, pad_token_id=PAD, return_state=True)
    new1, state = model.generate(p1, torch.ones_like(p1), **opts)
    new2, _ = model.generate(p2, torch.ones_like(p2), past=state, **opts)
    assert torch.equal(new2, _greedy_causal(model, torch.cat([p1, new1, p2], 1), 5))


def test_alternating_mixes_only_the_new_turn_and_leaves_the_history_cache_alone():
    model = perturbed_bitune()
    g = torch.Generator().manual_seed(1)
    p1, p2 = torch.randint(3, 64, (1, 6), generator=g), torch.randint(3, 64, (1, 4), generator=g)
    _, state = model.generate(p1, torch.ones_like(p1), max_new_tokens=4, eos_token_id=None, pad_token_id=PAD,
                              return_state=True)
    mixed = model.prefill(p2, torch.ones_like(p2), past=state)
    with torch.no_grad():
        model.mixer.theta_k.zero_()
        model.mixer.theta_v.zero_()
    causal = model.prefill(p2, torch.ones_like(p2), past=state)
    H = state.ids.shape[1]  # history tokens in the cache
    assert mixed.ids.shape[1] == H + p2.shape[1]  # the previous answer's last token + the new turn but its last
    for layer in range(model.num_layers):
        for a, b in zip(layer_kv(mixed.cache, layer), layer_kv(causal.cache, layer)):  # (1, n_kv, T, hs)
            torch.testing.assert_close(a[:, :, :H], b[:, :, :H], atol=0, rtol=0)
            assert not torch.allclose(a[:, :, H:], b[:, :, H:])


def test_alternating_cache_holds_exactly_the_rendered_chat():
    tok, model = tiny_tokenizer(), perturbed_bitune()
    tok.chat_template = CHAT_TEMPLATE
    no_space = [0, 2, 3, *tok.convert_tokens_to_ids([" ", "\n"])]  # answers without edge whitespace or specials
    conv = Conversation(model, tok, "alternating", max_new_tokens=4, suppress_tokens=no_space, forced_eos_token_id=1)
    assert conv.template == "chat"
    for turn in TURNS[:2]:
        conv.say(turn)
    cached = torch.cat([conv.state.ids[0], conv.state.last_token[0]]).tolist()
    assert tok.decode(cached) + "\n" == conv.render(conv.history)  # "...assistant: a2</s>" + the template's "\n"
    assert conv.render(conv.history).count("</s>") == 4


def test_without_bidirectional_passes_alternating_equals_reread():
    """The pretrained variant reads causally only, so keeping the cache must give what re-reading gives."""
    tok, model = tiny_tokenizer(), perturbed_bitune(variant="pretrained")
    tok.chat_template = CHAT_TEMPLATE
    no_space = [0, 2, 3, *tok.convert_tokens_to_ids([" ", "\n"])]
    conv = {m: Conversation(model, tok, m, max_new_tokens=4, suppress_tokens=no_space, forced_eos_token_id=1)
            for m in ("alternating", "reread")}
    answers = {m: [c.say(t) for t in TURNS] for m, c in conv.items()}
    assert answers["alternating"] == answers["reread"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("chat"))


@pytest.mark.parametrize("mode", ["alternating", "reread"])
def test_chat_cli_reads_a_pipe_answers_two_turns_and_exits(saved, mode, tmp_path, monkeypatch, capsys):
    ckpt, model = saved
    out = tmp_path / "chat.json"
    monkeypatch.setattr("sys.stdin", io.StringIO(f"hello\n/reset\n{TURNS[0]}\n\n{TURNS[1]}\n/exit\nnever read\n"))
    assert main(["chat", "--checkpoint", str(ckpt), "--mode", mode, "--max-new-tokens", "6", "--save", str(out),
                 "--device", "cpu"]) == 0
    printed = capsys.readouterr().out.splitlines()
    saved_chat = json.loads(out.read_text())
    assert saved_chat["mode"] == mode and saved_chat["template"] == "paper"
    messages = saved_chat["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] * 2
    assert [m["content"] for m in messages[::2]] == TURNS[:2]  # /reset forgot "hello"; "never read" was not read
    conv = Conversation(model, tiny_tokenizer(), mode, max_new_tokens=6)
    expected = [conv.say(t) for t in TURNS[:2]]
    assert [m["content"] for m in messages[1::2]] == expected
    assert len(printed) == 4 and printed[1] == "(conversation reset)"  # answer to "hello", reset, two answers
    assert [line.strip() for line in printed[2:]] == expected  # the streamed text is the answer


def test_the_old_mode_name_recompute_is_read_as_reread_with_a_warning(saved, tmp_path, monkeypatch, capsys):
    """'recompute' now names activation checkpointing; the chat mode it once named is 'reread'."""
    ckpt, model = saved
    out = tmp_path / "chat.json"
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{TURNS[0]}\n/exit\n"))
    assert main(["chat", "--checkpoint", str(ckpt), "--mode", "recompute", "--max-new-tokens", "4", "--save",
                 str(out), "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "warning: --mode recompute is now called --mode reread" in err and "bitune chat: reread mode" in err
    assert json.loads(out.read_text())["mode"] == "reread"
    with pytest.warns(DeprecationWarning, match="'recompute' is now called 'reread'"):
        assert Conversation(model, tiny_tokenizer(), "recompute").mode == "reread"


def test_chat_commands_quit_and_unknown_ones_are_not_sent_to_the_model(saved, tmp_path, monkeypatch, capsys):
    ckpt, _ = saved
    out = tmp_path / "chat.json"
    lines = ["/foo", "/", "/reset extra", "//x is a path", "/RESET", f"{TURNS[0]}", "/quit", "never read"]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n"))
    assert main(["chat", "--checkpoint", str(ckpt), "--max-new-tokens", "3", "--save", str(out),
                 "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert all(f"unknown command {c!r} (not sent)" in captured.err for c in ("/foo", "/", "/reset extra"))
    printed = captured.out.splitlines()  # the answer to "/x is a path", the reset, the answer to TURNS[0]
    assert len(printed) == 3 and printed[1] == "(conversation reset)"
    assert [m["content"] for m in json.loads(out.read_text())["messages"][::2]] == [TURNS[0]]  # /RESET forgot "/x"


def test_chat_cli_ends_at_end_of_input(saved, monkeypatch, capsys):
    ckpt, _ = saved
    monkeypatch.setattr("sys.stdin", io.StringIO(TURNS[0]))  # no newline, no /exit
    assert main(["chat", "--checkpoint", str(ckpt), "--max-new-tokens", "3", "--device", "cpu"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1
