"""The ``bitune`` lm-eval model type: parity with lm-eval's ``hf`` model, cache reuse, rolling, generation."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

from bitune import BituneModel  # noqa: E402
from bitune.errors import BituneError  # noqa: E402
from bitune.eval.lm import BituneLM  # noqa: E402
from helpers.models import perturb_adapters, tiny_bitune  # noqa: E402
from helpers.tokenizer import tiny_tokenizer  # noqa: E402

# Several choices per context, an empty context, a 1-character context, trailing spaces, mixed lengths.
PAIRS = [
    ("question: 2+2=?\nanswer:", " 4"), ("question: 2+2=?\nanswer:", " five"), ("question: 2+2=?\nanswer:", " (2)"),
    ("is the sky blue? ", "yes"), ("is the sky blue? ", "no, it is green"),
    ("", "hello world"), ("a", " b c"), ("x", "y"),
    ("q: which? (0) cat (1) dog\na:", " (0)"), ("q: which? (0) cat (1) dog\na:", " (1)"),
    ("long context " * 4, " end"),
]


def requests(pairs):
    return [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]


def bitune_model(variant: str, seed: int = 0) -> BituneModel:
    model = tiny_bitune(seed=seed, variant=variant)
    return (perturb_adapters(model) if variant != "pretrained" else model).eval()


@pytest.mark.parametrize("add_bos", [True, False])
@pytest.mark.parametrize("variant", ["pretrained", "lora"])
def test_loglikelihood_matches_hf(variant, add_bos):
    tok = tiny_tokenizer(add_bos=add_bos)
    model = bitune_model(variant)
    ours = BituneLM(model=model, tokenizer=tok, batch_size=3).loglikelihood(requests(PAIRS), disable_tqdm=True)
    hf = HFLM(pretrained=model.weights.base, tokenizer=tok, batch_size=4)
    theirs = hf.loglikelihood(requests(PAIRS), disable_tqdm=True)
    assert len(ours) == len(PAIRS)
    for (a, ga), (b, gb) in zip(ours, theirs):
        assert a == pytest.approx(b, abs=1e-4)
        assert ga == gb


def test_greedy_flag_is_true_for_the_argmax_continuation():
    tok = tiny_tokenizer()
    model = bitune_model("pretrained")
    lm = BituneLM(model=model, tokenizer=tok)
    ctx = tok.encode("abc")
    with torch.no_grad():
        logits = model.weights.base(torch.tensor([ctx])).logits[0, -1]
    best = tok.decode([int(logits.argmax())])
    (_, greedy), = lm.loglikelihood(requests([("abc", best)]), disable_tqdm=True)
    assert greedy


def test_context_cache_reuse_matches_scoring_each_choice_alone():
    """bitune variant: one prefill per context shared by all choices == every choice scored from scratch."""
    tok = tiny_tokenizer()
    model = bitune_model("bitune")
    shared = BituneLM(model=model, tokenizer=tok, batch_size=4).loglikelihood(requests(PAIRS), disable_tqdm=True)
    alone = [BituneLM(model=model, tokenizer=tok, batch_size=1).loglikelihood(requests([p]), disable_tqdm=True)[0]
             for p in PAIRS]
    for (a, ga), (b, gb) in zip(shared, alone):
        assert a == pytest.approx(b, abs=1e-5)
        assert ga == gb


def test_continuations_split_over_rows_and_passes_score_the_same():
    """Choices of one context spread over several answer passes, few contexts per pass: same scores."""
    tok = tiny_tokenizer()
    model = bitune_model("bitune")
    one_pass = BituneLM(model=model, tokenizer=tok, batch_size=4).loglikelihood(requests(PAIRS), disable_tqdm=True)
    lm = BituneLM(model=model, tokenizer=tok, batch_size=4)
    lm.ANSWER_TOKENS, lm.ANSWER_KEYS = 8, 15  # at most 8 positions and one context of 10 keys per pass
    parts = lm._answer_passes([[0, 1], [2], [3]], [[1, 2, 3, 4]] * 3 + [[5]], cached=10)
    assert parts == [[[0, 1], [], []], [[], [2], []], [[], [], [3]]]
    split = lm.loglikelihood(requests(PAIRS), disable_tqdm=True)
    for (a, ga), (b, gb) in zip(split, one_pass):
        assert a == pytest.approx(b, abs=1e-5)
        assert ga == gb


def test_bitune_scores_through_the_model_forward():
    """For a multi-token context the score is the model's own forward on (context, continuation)."""
    tok = tiny_tokenizer()
    model = bitune_model("bitune")
    lm = BituneLM(model=model, tokenizer=tok)
    (score, _), = lm.loglikelihood(requests([("question: hi\nanswer:", " yes")]), disable_tqdm=True)
    ctx, cont = lm._encode_pair("question: hi\nanswer:", " yes")
    p = torch.tensor([ctx])
    a = torch.tensor([cont])
    with torch.no_grad():
        out = model(p, torch.ones_like(p), a, torch.ones_like(a))
    assert score == pytest.approx(float(out.token_logprobs.sum()), abs=1e-5)


def test_loglikelihood_rolling_matches_hf():
    tok = tiny_tokenizer()
    model = bitune_model("lora")
    docs = [Instance("loglikelihood_rolling", {}, (s,), i) for i, s in enumerate(["abc def", "x" * 150, "q"])]
    ours = BituneLM(model=model, tokenizer=tok, max_length=64).loglikelihood_rolling(docs, disable_tqdm=True)
    theirs = HFLM(pretrained=model.weights.base, tokenizer=tok, max_length=64).loglikelihood_rolling(
        docs, disable_tqdm=True)
    assert ours == pytest.approx(theirs, abs=1e-4)


@pytest.mark.parametrize("variant", ["pretrained", "bitune"])
def test_generate_until_stops_and_matches_greedy_decoding(variant):
    tok = tiny_tokenizer()
    model = bitune_model(variant)
    lm = BituneLM(model=model, tokenizer=tok, batch_size=2)
    prompts = ["question: 1+1\nanswer:", "hi", "a"]
    gen = {"until": ["Question:"], "max_gen_toks": 12, "do_sample": False}
    outs = lm.generate_until([Instance("generate_until", {}, (p, gen), i) for i, p in enumerate(prompts)],
                             disable_tqdm=True)
    assert len(outs) == 3 and all(isinstance(o, str) for o in outs)
    # unbatched, unstopped greedy decoding agrees with the batched result up to the first stop string
    ids = torch.tensor([tok.encode(prompts[0])])
    ref = model.generate(ids, torch.ones_like(ids), max_new_tokens=12)
    text = tok.decode(ref[0], skip_special_tokens=True)
    assert text.split("Question:")[0] == outs[0]
    # a stop string cuts the text
    stop = {"until": [outs[0][:2]], "max_gen_toks": 12, "do_sample": False} if len(outs[0]) >= 2 else None
    if stop:
        cut = lm.generate_until([Instance("generate_until", {}, (prompts[0], stop), 0)], disable_tqdm=True)
        assert cut == [""]


def test_generation_stays_within_the_models_positions():
    """max_length past the model's positions is refused; a long prompt is cut so prompt + max_gen_toks fit."""
    tok, model = tiny_tokenizer(), bitune_model("bitune")
    with pytest.raises(BituneError, match="max_length=129 exceeds the model's 128 positions"):
        BituneLM(model=model, tokenizer=tok, max_length=129)
    lm = BituneLM(model=model, tokenizer=tok, max_length=40)
    seen = []
    real = model.generate
    model.generate = lambda ids, mask, **kw: seen.append((int(mask.sum(1).max()), kw["max_new_tokens"])) or real(
        ids, mask, **kw)
    gen = {"until": ["Question:"], "max_gen_toks": 30, "do_sample": False}
    lm.generate_until([Instance("generate_until", {}, ("long context " * 20, gen), 0)], disable_tqdm=True)
    assert seen == [(10, 30)]  # the prompt cut to 40 - 30 tokens
