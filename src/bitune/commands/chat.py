"""``bitune chat``: a multi-turn chat with a checkpoint in the terminal or from a pipe, one line per user turn
(:class:`bitune.chat.Conversation` carries the conversation; paper A.8)."""

from __future__ import annotations

import argparse
import itertools
import sys

from transformers import set_seed

from ..chat import MODE_ALIASES, MODES, Conversation
from ..errors import BituneError
from ..files import check_output_file, check_replaces_own, check_text
from ..loading import load_bitune
from .options import HelpFormatter, add_model_options, add_sampling_options, merge_mode, model_inputs, sampling_options

COMMANDS = "/reset clears the history, /exit (or /quit) quits, // starts a message with /"
HELP = "multi-turn chat with a checkpoint in the terminal"
MAX_LINE = 1 << 20
"""Longest user line read, in characters (a longer one is an error, never read whole)."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = HelpFormatter
    parser.description = (
        "Chat with a Bitune checkpoint, one line per user turn, from the terminal or a pipe. Commands: /reset "
        "(forget the conversation), /exit or /quit (or end of input); a line starting with // is sent with one / "
        "(other /words are refused as unknown commands). Examples:\n"
        "  bitune chat --checkpoint runs/ultrafeedback/final\n"
        "  bitune chat --checkpoint runs/ultrafeedback/final --mode alternating --save chat.json\n"
        "  printf 'Hi!\\nWhat is 2+2?\\n/exit\\n' | bitune chat --checkpoint runs/ultrafeedback/final\n"
        "Modes (paper A.8): reread re-reads the whole history with both prompt passes every turn; "
        "alternating keeps the cache and reads only each new user turn with both passes. (reread was called "
        "recompute; that name is still read, with a warning.)")
    add_model_options(parser)
    parser.add_argument("--mode", choices=[*MODES, *MODE_ALIASES], default="reread",
                        metavar="{" + ",".join(MODES) + "}", help="how the history is carried")
    parser.add_argument("--template", choices=("auto", "chat", "paper"), default="auto",
                        help="auto: the template the checkpoint was trained with; for a base model (--model) its "
                             "chat template if it has one, else paper ('Question: ...\\n\\nAnswer: ...' turns)")
    parser.add_argument("--save", metavar="FILE.json", help="write the conversation here when the chat ends; an "
                        "existing file is replaced only when it holds an earlier saved conversation")
    add_sampling_options(parser)


def is_conversation(value) -> bool:
    """Whether ``value`` is a conversation :meth:`~bitune.chat.Conversation.save` wrote (``mode``, ``template``,
    ``messages``): the one kind of file ``--save`` replaces."""
    return isinstance(value, dict) and {"mode", "template", "messages"} <= set(value) and \
        isinstance(value["messages"], list)


def read_line(stream, n: int) -> str:
    """Line ``n`` of the user's input ("" at its end), at most :data:`MAX_LINE` characters, valid UTF-8.

    Raises:
        BituneError: the line is longer, or not UTF-8 text (naming stdin and the line number).
    """
    try:
        line = stream.readline(MAX_LINE + 1)
    except UnicodeDecodeError as e:
        raise BituneError(f"stdin line {n}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    if len(line) > MAX_LINE:
        raise BituneError(f"stdin line {n}: longer than {MAX_LINE} characters")
    return check_text(line, f"stdin line {n}")


def run(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1:
        raise BituneError("--max-new-tokens must be >= 1")
    sampling = sampling_options(args)
    if args.mode in MODE_ALIASES:
        print(f"bitune chat: warning: --mode {args.mode} is now called --mode {MODE_ALIASES[args.mode]} "
              f"('{args.mode}' names activation checkpointing); the old name is still read", file=sys.stderr)
        args.mode = MODE_ALIASES[args.mode]
    if args.save is not None:  # "" too: an error, not "do not save"
        check_output_file(args.save, "--save", keep=model_inputs(args))  # before loading
        check_replaces_own(args.save, "--save", "a conversation saved by bitune chat", is_conversation)
    model, tokenizer = load_bitune(args.checkpoint, args.model, args.base, args.dtype, args.device, args.prompt_passes,
                                   merge=merge_mode(args))
    if args.seed is not None:
        set_seed(args.seed)
    conv = Conversation(model, tokenizer, mode=args.mode, template=args.template, max_new_tokens=args.max_new_tokens,
                        stop=args.stop, stream=True, **sampling)
    interactive = sys.stdin.isatty()
    print(f"bitune chat: {args.mode} mode, {conv.template} template ({conv.why})", file=sys.stderr)
    if interactive:
        print(COMMANDS)
    try:
        for n in itertools.count(1):
            if interactive:
                print("> ", end="", flush=True)
            line = read_line(sys.stdin, n)
            if not line:
                break
            text, command = line.rstrip("\n"), line.strip().lower()
            if command in ("/exit", "/quit"):
                break
            if command == "/reset":
                conv.reset()
                print("(conversation reset)", flush=True)
            elif command.startswith("/") and not command.startswith("//"):
                print(f"bitune chat: unknown command {line.strip()!r} (not sent): {COMMANDS}", file=sys.stderr,
                      flush=True)
            elif text.strip():
                conv.say(text.lstrip()[1:] if command.startswith("//") else text)
    finally:
        if args.save is not None:
            conv.save(args.save)
            print(f"bitune chat: conversation saved to {args.save}", file=sys.stderr)
    return 0
