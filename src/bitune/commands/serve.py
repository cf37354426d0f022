"""``bitune serve``: an OpenAI-compatible HTTP API for a checkpoint (or a base model) with continuous batching.

Loads the model like ``bitune generate`` (:func:`bitune.loading.load_bitune`), then runs the app of
:mod:`bitune.serve` under uvicorn. SIGTERM or Ctrl-C stops accepting connections, lets the answers under way
finish for up to ``--drain-seconds``, then ends the rest and exits.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import signal
import socket
import sys

from ..errors import BituneError
from ..inputs import MIN_PROMPT_TOKENS
from .options import HelpFormatter, add_model_options, merge_mode

HELP = "serve a checkpoint over an OpenAI-compatible HTTP API (continuous batching)"
KEY_ENV = "BITUNE_API_KEY"
MAX_BATCH_WAIT_MS = 10_000
"""The longest ``--batch-wait-ms``: a first request may then wait 10 x 10 s for a burst to gather."""
OPTION_RANGES = (("--port", 0, 65535), ("--max-batch-size", 1, 1 << 16), ("--max-queue", 1, 1 << 20),
                 ("--max-body-bytes", 1 << 10, 1 << 40), ("--drain-seconds", 0, 86400),
                 ("--batch-wait-ms", 0, MAX_BATCH_WAIT_MS))
"""Each numeric option's allowed range ``(flag, low, high)``, checked at start: below it no request could be
served (a queue of 0 is always full, a body limit under 1 KiB refuses every request); above it a timer overflows
in the model's thread or the value is no setting anyone means."""
COMPILE_DEFAULT_LEN = 2048
"""``--max-model-len`` with ``--compile`` when not given (capped by the model's positions): the slot cache holds
every position of every slot, so a model's whole context (32k for Qwen2.5) would hold gigabytes."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = HelpFormatter
    parser.description = (
        "Serve a Bitune checkpoint (or a base model) over an OpenAI-compatible HTTP API: GET /health, "
        "GET /v1/models, POST /v1/chat/completions, POST /v1/completions. Requests are batched continuously: new "
        "prompts are read (both prompt passes) between decoding steps and join the running batch. Examples:\n"
        "  bitune serve --checkpoint runs/alpaca/final\n"
        "  bitune serve --model smollm2-135m --port 8001 --api-key s3cret\n"
        "Chat requests are written with the template the checkpoint was trained with, as 'bitune generate' "
        "writes them; /v1/completions takes the prompt text as given.")
    add_model_options(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port")
    parser.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer KEY' on /v1 (default: "
                        f"${KEY_ENV} if set, else no key)")
    parser.add_argument("--served-model-name", default=None, metavar="NAME",
                        help="the model name clients send (default: the --checkpoint or --model argument)")
    parser.add_argument("--template", choices=["paper", "chat", "none"], default=None,
                        help="how chat requests are written (default: the template the checkpoint was trained with)")
    parser.add_argument("--max-batch-size", type=int, default=16, help="requests decoded together at most")
    parser.add_argument("--max-queue", type=int, default=64,
                        help="requests waiting for a batch slot at most (>= 1); more are answered 503")
    parser.add_argument("--batch-wait-ms", type=float, default=20,
                        help="an idle server reads a burst of requests together: it waits while they keep coming, "
                             "each within this many ms of the one before (at most 10x this in all); 0: read each "
                             f"first request at once; at most {MAX_BATCH_WAIT_MS}")
    parser.add_argument("--compile", action="store_true",
                        help="decode with a step compiled by torch.compile over a preallocated slot cache "
                             "(--max-batch-size rows x --max-model-len positions per layer); the step is compiled "
                             "for every batch-size bucket at start (minutes on a CPU), so no request waits on it")
    parser.add_argument("--max-model-len", type=int, default=None, metavar="N",
                        help="positions per request, prompt and answer together (default: the model's; with "
                             f"--compile, at most {COMPILE_DEFAULT_LEN}, since every slot holds them all)")
    parser.add_argument("--compile-buckets", default=None, metavar="B,B,...",
                        help="with --compile, the batch sizes the step is compiled for; a step of n rows runs the "
                             "smallest >= n (default: powers of two and --max-batch-size)")
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413 (>= 1024: a "
                        "smaller limit would refuse every request)")
    parser.add_argument("--drain-seconds", type=int, default=5,
                        help="on SIGTERM/Ctrl-C, time answers under way get to finish")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                        help="uvicorn's log level")


def api_key(flag: str | None) -> str | None:
    """The key clients must send: ``--api-key``, else ``$BITUNE_API_KEY`` if set and non-empty, else None.

    Raises:
        BituneError: the key (named by where it came from) is empty, has leading or trailing whitespace (a client
            sends ``Authorization: Bearer KEY`` with it stripped, so no request could match), or holds a character
            outside printable ASCII (an HTTP header carries no other).
    """
    where, key = ("--api-key", flag) if flag is not None else (f"${KEY_ENV}", os.environ.get(KEY_ENV) or None)
    if key is None:
        return None
    if not key.strip():
        raise BituneError(f"{where} is empty: give a key, or leave {where} unset to serve without one")
    if key != key.strip():
        raise BituneError(f"{where} has whitespace around the key ({key[:1]!r}...{key[-1:]!r}; e.g. a line end read "
                          "from a file): clients send the key stripped, so no request could match; strip it")
    if not all(" " <= c <= "~" for c in key):
        bad = next(c for c in key if not " " <= c <= "~")
        raise BituneError(f"{where} holds {bad!r}: an HTTP header carries printable ASCII only, so no client could "
                          "send this key")
    return key


def exposure_warning(host: str, key: str | None) -> str | None:
    """The warning to print when the server listens beyond this machine without an API key (else None)."""
    if key:
        return None
    if host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host.strip("[]")).is_loopback:
            return None
    except ValueError:
        pass  # a host name other than localhost
    return (f"bitune serve: warning: listening on {host} without an API key: anyone who can reach this port can "
            f"use the model; set --api-key or ${KEY_ENV}")


def check_address(host: str, port: int) -> None:
    """Fail now, with one line, if ``host:port`` cannot be listened on (in use, or not an address here)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            s.bind((host, port))
    except OSError as e:
        raise BituneError(f"--host {host} --port {port}: cannot listen on {host}:{port}: {e.strerror or e}") from e


def check_options(args: argparse.Namespace) -> None:
    """Every option in its range, before anything loads: a value outside it would start a server that answers
    every request with an error (a queue of 0 is always full, a body limit below a request refuses them all, a
    batch wait past a thread's longest wait kills the model's thread).

    Raises:
        BituneError: naming the option, its value and the range.
    """
    for flag, low, high in OPTION_RANGES:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if not math.isfinite(value) or not low <= value <= high:
            raise BituneError(f"{flag} {value}: must be {'' if math.isfinite(value) else 'a finite number '}in "
                              f"[{low}, {high}]")
    if not args.host.strip():
        raise BituneError(f"--host {args.host!r} is empty: give an address to listen on, e.g. 127.0.0.1 (this "
                          "machine) or 0.0.0.0 (every interface)")
    shortest = MIN_PROMPT_TOKENS + 1  # the shortest prompt a request may send, and one answer token
    if args.max_model_len is not None and args.max_model_len < shortest:
        raise BituneError(f"--max-model-len {args.max_model_len}: must be >= {shortest} (a request's prompt has at "
                          f"least {MIN_PROMPT_TOKENS} tokens, and its answer one); below that every request is "
                          "refused")
    args.buckets = None
    if args.compile_buckets is not None:
        if not args.compile:
            raise BituneError("--compile-buckets needs --compile")
        try:
            args.buckets = sorted({int(b) for b in args.compile_buckets.split(",")})
        except ValueError:
            raise BituneError(f"--compile-buckets {args.compile_buckets!r}: give batch sizes, e.g. 1,4,16") from None
        if args.buckets[0] < 1 or args.buckets[-1] > args.max_batch_size:
            raise BituneError(f"--compile-buckets {args.compile_buckets}: each must be in [1, --max-batch-size "
                              f"{args.max_batch_size}]")
        args.buckets = sorted({*args.buckets, args.max_batch_size})
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise BituneError("--served-model-name is empty: clients name the model in every request; give a name or "
                          "leave the option out (default: the checkpoint or model)")


def check_cache_memory(model, slots: int, length: int, length_given: bool) -> None:
    """The compiled slot cache's bytes, computed before it is allocated, against the memory free on the model's
    device (CUDA: free device memory; CPU: available RAM; elsewhere unchecked).

    Raises:
        BituneError: one line naming --max-batch-size and --max-model-len, the bytes needed and free.
    """
    from ..serve.slots import cache_bytes

    param = next(model.parameters())
    need = cache_bytes(model.text_config, slots, length, param.dtype)
    if param.device.type == "cuda":
        import torch

        free = torch.cuda.mem_get_info(param.device)[0]
    elif param.device.type == "cpu":
        import psutil

        free = psutil.virtual_memory().available
    else:
        return
    if need > free:
        given = f"--max-model-len {length}" if length_given else f"--max-model-len {length} (the default)"
        raise BituneError(f"--compile with --max-batch-size {slots} x {given}: the slot cache needs {need} bytes "
                          f"({need / 2**30:.1f} GiB), more than the {free} bytes ({free / 2**30:.1f} GiB) free on "
                          f"{param.device}; lower --max-batch-size or --max-model-len")


def compiled_batch(model, served, args: argparse.Namespace):
    """``--compile``: the slot batch, its step compiled for every bucket now (timed and printed, with the memory
    the slots hold); ``served.context`` becomes the slots' length."""
    from ..decoding import decode_compile_config
    from ..serve.slots import SlotBatch

    if (why := model.layer_kinds.allows("compiled")) is not None:
        raise BituneError(f"--compile: this model's decoding cannot run from the compiled slot cache ({why}); "
                          "serve it without --compile")
    decode_compile_config(next(model.parameters()).device)  # a CPU without a C++ compiler fails here, in one line
    length = served.context if args.max_model_len else min(served.context or COMPILE_DEFAULT_LEN, COMPILE_DEFAULT_LEN)
    served.context = length
    check_cache_memory(model, args.max_batch_size, length, args.max_model_len is not None)
    print(f"bitune serve: compiling the decoding step for batch sizes {args.buckets or 'by default'} over "
          f"{args.max_batch_size} slots x {length} positions...", file=sys.stderr)
    batch = SlotBatch(model, args.max_batch_size, length, args.buckets)
    print(f"bitune serve: compiled in {batch.compile_seconds:.1f} s (buckets {batch.buckets}); the slot cache holds "
          f"{batch.cache.nbytes / 2**20:.0f} MiB", file=sys.stderr)
    return batch


def run(args: argparse.Namespace) -> int:
    check_options(args)
    key = api_key(args.api_key)
    warning = exposure_warning(args.host, key)
    if warning:
        print(warning, file=sys.stderr)
    check_address(args.host, args.port)  # before the model loads
    import uvicorn  # the serve extra: bitune.cli names it when it is missing

    from ..generation import pick_template
    from ..loading import load_bitune
    from ..serve.app import Served, create_app
    from ..serve.scheduler import Scheduler

    model, tokenizer = load_bitune(args.checkpoint, args.model, args.base, args.dtype, args.device,
                                   args.prompt_passes, merge=merge_mode(args))
    template, why = pick_template(model, tokenizer, args.template)
    name = args.served_model_name or args.checkpoint or args.model
    print(f"bitune serve: {name!r} on http://{args.host}:{args.port}/v1, chat requests written with the "
          f"{template} template ({why})", file=sys.stderr)
    served = Served(model, tokenizer, name, template, args.max_model_len)
    batch = None
    if args.compile:
        batch = compiled_batch(model, served, args)
    scheduler = Scheduler(model, tokenizer, args.max_batch_size, args.max_queue, args.batch_wait_ms / 1000,
                          batch=batch)
    app = create_app(served, scheduler, key, args.max_body_bytes)
    # uvicorn turns SIGTERM into a graceful shutdown, then raises the signal again for the handler it found: a
    # no-op one lets a drained server exit 0, as after any finished command.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=args.drain_seconds)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print("bitune serve: stopped", file=sys.stderr)
    return 0
