"""``python -m kvcache bench [...]``, ``python -m kvcache generate [...]``,
``python -m kvcache eval [...]``, ``python -m kvcache config`` and
``python -m kvcache --version``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = ("usage: python -m kvcache {bench,generate,eval,config} [options] | --version\n"
         "  bench      decode-attention benchmark (python -m kvcache bench --help)\n"
         "  generate   decode with a checkpoint (python -m kvcache generate --help)\n"
         "  eval       quality of KV modes / O(1) on a checkpoint and a text "
         "(python -m kvcache eval --help)\n"
         "  config     print show_config()\n"
         "  --version  print the installed version")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    cmd, rest = args[0], args[1:]
    if cmd in ("--version", "-V"):
        from ._version import __version__
        print(f"kvcache {__version__}")
        return 0
    if cmd == "bench":
        from .bench import main as bench_main
        return int(bench_main(rest) or 0)
    if cmd == "generate":
        from .runner import main as generate_main
        return int(generate_main(rest) or 0)
    if cmd == "eval":
        from .evaluate import main as eval_main
        return int(eval_main(rest) or 0)
    if cmd == "config":
        from . import show_config
        show_config()
        return 0
    print(f"unknown command {cmd!r}; try: python -m kvcache --help", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
