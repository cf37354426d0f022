"""``bitune serve`` through the official ``openai`` client: greedy answers equal ``bitune generate`` token for
token, batching changes no answer, streaming, max_tokens, stop strings, seeded sampling, usage."""

from __future__ import annotations

import concurrent.futures as futures

import pytest

from bitune.generation import generate_texts, render, render_messages
from helpers.gen import save_checkpoint
from helpers.serve import WAIT, greedy_tokens, http, serving, wait_until

openai = pytest.importorskip("openai")
PROMPTS = ["what is 2+2?", "name a color.", "hi", "add 3 and 4, then say why.", "list two animals",
           "x", "count to five", "a long question about the sky and the sea?", "ok."]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt, _ = save_checkpoint(tmp_path_factory.mktemp("serve"), chat_template=True)
    with serving(ckpt) as (url, scheduler, served):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        yield client, scheduler, served


def _chat(client, prompt, **kw):
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}], **kw)


def _prompt_ids(served, messages, template=None):
    text, special = render_messages(served.tokenizer, messages, template or served.template)
    return served.tokenizer(text, add_special_tokens=special)["input_ids"]


def test_greedy_chat_equals_bitune_generate_token_for_token(server):
    client, _, served = server
    model, tok = served.model, served.tokenizer
    for prompt in PROMPTS[:3]:
        reply = _chat(client, prompt, max_tokens=12)
        ids = _prompt_ids(served, [{"role": "user", "content": prompt}])
        ref = greedy_tokens(model, ids, served.end_ids["chat"], 12)
        ended = ref[-1] in served.end_ids["chat"]
        assert reply.choices[0].message.content == tok.decode(ref[:-1] if ended else ref, skip_special_tokens=True)
        assert reply.usage.completion_tokens == len(ref) and reply.usage.prompt_tokens == len(ids)
        assert reply.choices[0].finish_reason == ("stop" if ended else "length")
        assert reply.choices[0].message.content.strip() == generate_texts(model, tok, [prompt], "chat", 12)[0]


def test_completions_take_the_text_as_given(server):
    client, _, served = server
    text = "Question: hi\n\nAnswer:"
    reply = client.completions.create(model="tiny", prompt=text, max_tokens=10, temperature=0)
    assert reply.choices[0].text.strip() == generate_texts(served.model, served.tokenizer, [text], "none", 10)[0]
    ids = served.tokenizer(*render(served.tokenizer, text, "none")[:1])["input_ids"]
    assert reply.usage.prompt_tokens == len(ids)
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0)
    assert by_ids.choices[0].text == reply.choices[0].text


def test_a_request_alone_and_among_eight_others_gives_the_same_tokens(server):
    client, scheduler, _ = server
    lengths = [14, 5, 9, 16, 3, 11, 7, 13, 8]
    alone = [_chat(client, p, max_tokens=n) for p, n in zip(PROMPTS, lengths)]
    sizes = []
    step = scheduler.model.decode_step

    def together_first(state, pick):  # the first step waits until every request has arrived: no timing
        if not sizes:
            wait_until(lambda: scheduler.running + scheduler.waiting == len(PROMPTS), WAIT,
                       "the requests never all arrived")
        sizes.append(state.ids.shape[0])
        return step(state, pick)

    scheduler.model.decode_step = together_first
    try:
        with futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(lambda pn: _chat(client, *pn[:1], max_tokens=pn[1]), zip(PROMPTS, lengths)))
    finally:
        scheduler.model.decode_step = step
    for a, b in zip(alone, together):
        assert b.choices[0].message.content == a.choices[0].message.content
        assert b.usage == a.usage and b.choices[0].finish_reason == a.choices[0].finish_reason
    assert max(sizes) > 1  # they were decoded as one batch


def test_streamed_deltas_join_to_the_non_streamed_text(server):
    client, _, _ = server
    for prompt in PROMPTS[:3]:
        whole = _chat(client, prompt, max_tokens=16)
        chunks = list(_chat(client, prompt, max_tokens=16, stream=True, stream_options={"include_usage": True}))
        deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        assert "".join(deltas) == whole.choices[0].message.content
        assert chunks[0].choices[0].delta.role == "assistant"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
        assert not chunks[-1].choices and chunks[-1].usage == whole.usage
        plain = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True))
        joined = "".join(c.choices[0].text for c in plain)
        assert joined == client.completions.create(model="tiny", prompt=prompt, max_tokens=8,
                                                   temperature=0).choices[0].text


def test_max_tokens_one(server):
    client, _, served = server
    reply = _chat(client, PROMPTS[0], max_tokens=1)
    ref = greedy_tokens(served.model, _prompt_ids(served, [{"role": "user", "content": PROMPTS[0]}]),
                        served.end_ids["chat"], 1)
    assert reply.usage.completion_tokens == 1
    assert reply.choices[0].finish_reason == ("stop" if ref[0] in served.end_ids["chat"] else "length")


def test_stop_strings_cut_the_answer_and_are_not_returned(server):
    client, _, _ = server
    free = _chat(client, PROMPTS[1], max_tokens=16).choices[0].message.content
    stop = next(c for c in free[2:] if c.strip())
    cut = _chat(client, PROMPTS[1], max_tokens=16, stop=[stop, "zzzz"])
    assert cut.choices[0].message.content == free[:free.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       _chat(client, PROMPTS[1], max_tokens=16, stop=stop, stream=True) if c.choices)
    assert streamed == free[:free.find(stop)]


def test_seeded_sampling_is_reproducible_alone_and_among_others(server):
    client, _, _ = server
    kw = dict(temperature=1.0, top_p=0.9, max_tokens=16)
    first = _chat(client, PROMPTS[0], seed=7, **kw).choices[0].message.content
    assert _chat(client, PROMPTS[0], seed=7, **kw).choices[0].message.content == first
    with futures.ThreadPoolExecutor(4) as pool:
        runs = list(pool.map(lambda s: _chat(client, PROMPTS[0], seed=s, **kw).choices[0].message.content,
                             [7, 8, 9, 7]))
    assert runs[0] == runs[3] == first
    assert len({first, *runs[1:3]}) > 1  # other seeds give other answers


def test_multi_turn_with_a_system_turn_is_written_with_the_template(server):
    client, _, served = server
    messages = [{"role": "system", "content": "be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello."}, {"role": "user", "content": "and you?"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    ids = _prompt_ids(served, messages)
    assert reply.usage.prompt_tokens == len(ids)
    ref = greedy_tokens(served.model, ids, served.end_ids["chat"], 10)
    ended = ref[-1] in served.end_ids["chat"]
    assert reply.choices[0].message.content == served.tokenizer.decode(ref[:-1] if ended else ref,
                                                                       skip_special_tokens=True)


def test_models_and_health(server):
    client, _, _ = server
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert http(str(client.base_url).replace("/v1/", "/health"))[1]["status"] == "ok"
