"""``bitune configs``: the configs shipped in the package (:mod:`bitune.config_files`), listed or copied for editing."""

from __future__ import annotations

import argparse

from ..config_files import copy_config, describe, packaged_names

HELP = "list the packaged configs, or copy one for editing"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = ("The method, task, instruction, study and accelerate configs shipped with bitune. Any "
                          "--config takes one by name (a local file of that name comes first). Examples:\n"
                          "  bitune configs list\n"
                          "  bitune configs copy methods/bitune my_bitune.yaml\n"
                          "  bitune train --config tasks/piqa --config my_bitune.yaml")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    sub.add_parser("list", help="every packaged config by name, with the first line of its comment")
    cp = sub.add_parser("copy", help="copy a packaged config to a new file (never replaces one)")
    cp.add_argument("name", metavar="NAME", help="a packaged config, e.g. methods/bitune (see 'bitune configs list')")
    cp.add_argument("dest", metavar="DEST", help="the new file, or an existing folder to copy it into")


def run(args: argparse.Namespace) -> int:
    if args.action == "list":
        names = packaged_names()
        width = max(map(len, names))
        for name in names:
            print(f"{name:<{width}}  {describe(name)}".rstrip())
        return 0
    path = copy_config(args.name, args.dest)
    print(f"bitune configs: wrote {path}; use it with --config {path}")
    return 0
