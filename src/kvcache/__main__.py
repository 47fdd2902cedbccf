"""``python -m kvcache bench [...]``, ``python -m kvcache generate [...]`` and
``python -m kvcache config``."""

import sys


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m kvcache {bench,generate,config} [options]\n"
              "  bench     decode-attention benchmark (python -m kvcache bench --help)\n"
              "  generate  decode with a checkpoint (python -m kvcache generate --help)\n"
              "  config    print show_config()")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        from .bench import main as bench_main
        return bench_main(rest)
    if cmd == "generate":
        from .runner import main as generate_main
        return generate_main(rest)
    if cmd == "config":
        from . import show_config
        show_config()
        return 0
    print(f"unknown command {cmd!r}; try: python -m kvcache --help", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
