"""Bad requests never take ``bitune serve`` down: each gets a 4xx OpenAI error object naming the field, and the
server keeps answering; the API key, the queue bound, disconnects, the exposure warning, SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from bitune.cli import main
from bitune.commands.serve import api_key, exposure_warning
from helpers.gen import save_checkpoint
from helpers.serve import WAIT, free_port, held_steps, http, serving, submitted_jobs, wait_until

openai = pytest.importorskip("openai")
USER = [{"role": "user", "content": "hi"}]
OK = {"model": "tiny", "messages": USER, "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("serve-err"), chat_template=True)[0]


@pytest.fixture(scope="module")
def server(ckpt):
    with serving(ckpt, max_body_bytes=4096) as running:
        yield running


BAD = [  # (path, body, status, param)
    ("chat/completions", b'{"model": "tiny", "messages": [', 400, None),
    ("chat/completions", b"[1, 2]", 400, None),
    ("chat/completions", {"messages": USER}, 400, "model"),
    ("chat/completions", {"model": "tiny"}, 400, "messages"),
    ("chat/completions", {"model": "tiny", "messages": "hi"}, 400, "messages"),
    ("chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("chat/completions", {**OK, "messages": [*USER, {"role": "assistant", "content": "x"}]}, 400, "messages[1].role"),
    ("chat/completions", {**OK, "max_tokens": -1}, 400, "max_tokens"),
    ("chat/completions", {**OK, "max_tokens": 0}, 400, "max_tokens"),
    ("chat/completions", {**OK, "max_tokens": "5"}, 400, "max_tokens"),
    ("chat/completions", {**OK, "max_tokens": 10**12}, 400, "max_tokens"),
    ("chat/completions", {**OK, "max_completion_tokens": 10**6}, 400, "max_completion_tokens"),
    ("chat/completions", {**OK, "temperature": 2.5}, 400, "temperature"),
    ("chat/completions", {**OK, "temperature": -0.1}, 400, "temperature"),
    ("chat/completions", {**OK, "top_p": 0}, 400, "top_p"),
    ("chat/completions", {**OK, "top_p": 1.5}, 400, "top_p"),
    ("chat/completions", {**OK, "n": 2}, 400, "n"),
    ("chat/completions", {**OK, "stop": ["a", ""]}, 400, "stop"),
    ("chat/completions", {**OK, "logprobs": True}, 400, "logprobs"),
    ("chat/completions", {**OK, "tools": []}, 400, "tools"),
    ("chat/completions", {**OK, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("chat/completions", {**OK, "messages": [{"role": "user", "content": "why? " * 40}]}, 400, "messages"),
    ("chat/completions", {**OK, "model": "gpt-4"}, 404, "model"),
    ("completions", {"model": "tiny", "prompt": "ab " * 60}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": ["a", "b"]}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": [1, 9999]}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": "a", "echo": True}, 400, "echo"),
    ("completions", {"model": "tiny", "prompt": ""}, 400, "prompt"),
    # a lone surrogate is valid JSON ("\ud800") but not text: refused before the tokenizer sees it
    ("chat/completions", {**OK, "messages": [{"role": "user", "content": "a \ud800 b"}]}, 400, "messages[0].content"),
    ("chat/completions", {**OK, "messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
     400, "messages[0].content[0].text"),
    ("chat/completions", {**OK, "stop": ["a", "\ud800"]}, 400, "stop[1]"),
    ("completions", {"model": "tiny", "prompt": "a \udc80 b"}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": ["a \udc80 b"]}, 400, "prompt[0]"),
    ("completions", b'{"model": "tiny", "prompt": "a \xff b"}', 400, None),  # not UTF-8
]


@pytest.mark.parametrize("path, body, status, param", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_a_bad_request_gets_an_error_naming_the_field_and_the_server_keeps_serving(server, path, body, status,
                                                                                   param):
    url = server[0]
    code, reply = http(f"{url}/v1/{path}", body)
    assert code == status, reply
    assert set(reply["error"]) == {"message", "type", "param", "code"} and reply["error"]["message"]
    assert reply["error"]["param"] == param
    if param:
        assert param.split("[")[0] in reply["error"]["message"]
    assert http(f"{url}/v1/chat/completions", OK)[0] == 200


def test_an_oversized_body_gets_413(server):
    url = server[0]
    code, reply = http(f"{url}/v1/chat/completions", {**OK, "messages": [{"role": "user", "content": "a" * 5000}]})
    assert code == 413 and "4096 bytes" in reply["error"]["message"]
    assert http(f"{url}/v1/chat/completions", OK)[0] == 200


def test_unknown_route_and_method(server):
    url = server[0]
    assert http(f"{url}/v1/embeddings", OK)[0] == 404
    assert http(f"{url}/v1/chat/completions")[0] == 405


def test_api_key(ckpt):
    with serving(ckpt, api_key="s3cret") as (url, _, _):
        for key in ("wrong", None):
            code, reply = http(f"{url}/v1/chat/completions", OK, {"Authorization": f"Bearer {key}"} if key else {})
            assert code == 401 and reply["error"]["code"] == "invalid_api_key"
        bad = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        assert good.chat.completions.create(**OK).usage.completion_tokens >= 1
        assert http(f"{url}/health")[0] == 200  # health stays open


def test_past_max_queue_a_request_gets_503_and_a_gone_client_frees_its_row(ckpt):
    with serving(ckpt, max_batch_size=1, max_queue=1) as (url, scheduler, _), \
            held_steps(scheduler) as (entered, release):
        jobs = submitted_jobs(scheduler)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=WAIT)
        stream = client.chat.completions.create(**{**OK, "max_tokens": 100}, extra_body={"ignore_eos": True},
                                                stream=True)
        assert entered.wait(WAIT)  # running, its steps held: it cannot end by itself
        answers = []
        waiting = threading.Thread(target=lambda: answers.append(client.chat.completions.create(**OK)))  # 3 tokens
        waiting.start()
        wait_until(lambda: scheduler.waiting == 1, WAIT, "the second request never reached the queue")
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(**OK)
        assert refused.value.status_code == 503 and refused.value.body["code"] == "queue_full"
        stream.close()  # the client goes away: its row leaves at the next step, the waiting request runs
        wait_until(lambda: jobs[0].cancelled, WAIT, "the server never cancelled the gone client's job")
        release.set()
        waiting.join(WAIT)
        assert not waiting.is_alive() and answers[0].usage.completion_tokens >= 1
        assert len(jobs[0].tokens) < 100  # the row left long before the first request could end


def test_api_key_from_the_flag_or_the_environment(monkeypatch):
    monkeypatch.setenv("BITUNE_API_KEY", "from-env")
    assert api_key("flag") == "flag" and api_key(None) == "from-env"
    monkeypatch.setenv("BITUNE_API_KEY", "")
    assert api_key(None) is None
    with pytest.raises(ValueError, match="--api-key is empty"):
        api_key(" ")


def test_exposure_warning():
    assert exposure_warning("0.0.0.0", None) and exposure_warning("::", None) and exposure_warning("example.org", None)
    assert exposure_warning("10.1.2.3", None) and "--api-key" in exposure_warning("10.1.2.3", None)
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert exposure_warning(host, None) is None
    assert exposure_warning("0.0.0.0", "key") is None


def test_the_cli_warns_before_loading_and_refuses_bad_flags(tmp_path, capsys):
    assert main(["serve", "--checkpoint", str(tmp_path / "missing"), "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "without an API key" in err and "not a Bitune checkpoint" in err
    assert main(["serve", "--checkpoint", str(tmp_path), "--max-batch-size", "0"]) == 2
    assert "--max-batch-size 0" in capsys.readouterr().err
    for wait, message in (("-1", "--batch-wait-ms -1.0: must be in [0, "), ("nan", "--batch-wait-ms nan: must be a finite")):
        assert main(["serve", "--checkpoint", str(tmp_path), "--batch-wait-ms", wait]) == 2
        assert message in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--checkpoint", str(tmp_path / "missing"), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"--host 127.0.0.1 --port {port}: cannot listen on 127.0.0.1:{port}" in err and "checkpoint" not in err  # before loading anything
    for name in ("", "  "):
        assert main(["serve", "--checkpoint", str(tmp_path / "missing"), "--served-model-name", name]) == 2
        err = capsys.readouterr().err
        assert "--served-model-name is empty" in err and "not a Bitune checkpoint" not in err


@pytest.mark.slow
def test_sigterm_drains_and_exits_within_seconds(ckpt):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "bitune.cli", "serve", "--checkpoint", str(ckpt), "--port",
                             str(port), "--device", "cpu", "--threads", "1", "--served-model-name", "tiny",
                             "--drain-seconds", str(WAIT)], env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if http(f"{url}/health")[0] == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=WAIT)
        stream = client.chat.completions.create(**{**OK, "max_tokens": 60}, extra_body={"ignore_eos": True},
                                                stream=True, stream_options={"include_usage": True})
        chunks = iter(stream)
        assert next(chunks).choices[0].delta.role == "assistant"  # the opening chunk: the request is submitted
        proc.send_signal(signal.SIGTERM)
        rest = list(chunks)
        assert proc.wait(WAIT) == 0  # drained, then exited (a hang fails here)
        assert rest[-1].usage.completion_tokens == 60  # the answer under way was finished
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


def test_a_verbatim_prompt_model_takes_one_user_message(server):
    from bitune.serve.app import Served
    from bitune.serve.protocol import APIError

    _, _, served = server
    verbatim = Served(served.model, served.tokenizer, "tiny", "none")
    one = [{"role": "user", "content": "hi there"}]
    assert verbatim.chat_prompt(one) == served.tokenizer("hi there")["input_ids"]
    with pytest.raises(APIError, match="one user message") as refused:
        verbatim.chat_prompt([{"role": "system", "content": "be brief."}, *one])
    assert refused.value.status == 400 and refused.value.param == "messages"
