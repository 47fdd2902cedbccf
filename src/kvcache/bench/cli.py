"""The command line of ``python -m kvcache bench``, built from the registered sections
(:mod:`.registry`): the run-wide options, each section's own ``--<section>-<option>``
options, the choice of sections, and :func:`main`.

Method: ``docs/benchmark-method.md``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from .._progress import progress_bar
from .geometry import MiB
from .machine import BusyMonitor, available_cpus, machine_info, warn_if_busy
from .registry import Context, Option, Result, Section, Values, at_least, sections
from .report import print_report, write_json, write_plots
from .timing import BANDWIDTH_BUFFER, measure_bandwidth

log = logging.getLogger("kvcache.bench")


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (the usage of every section's options
    would bury them)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


class _Items(argparse.Action):
    """A list option: the words of every use, each split at commas, duplicates dropped."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        items = [item for word in values for item in word]
        setattr(namespace, self.dest, list(dict.fromkeys(items)))


def _words(parse: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    """A parser of one command-line word holding a comma list of what ``parse`` reads."""
    def split(word: str) -> list[Any]:
        return [parse(item) for item in word.split(",") if item.strip()]
    return split


def parse_section(text: str) -> str:
    """The name of a registered section (any case)."""
    names = [s.name for s in sections()]
    if text.lower() not in names:
        raise argparse.ArgumentTypeError(
            f"unknown section {text!r}; choose from {', '.join(names)}")
    return text.lower()


def _show(value: Any) -> str:
    if value is None:
        return "auto"
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value)


def _help(option: Option) -> str:
    quick = option.default_for(True)
    return (f"{option.help} (default {_show(option.default)}"
            + (f", quick {_show(quick)})" if quick != option.default else ")"))


def _dest(section: Section, option: Option) -> str:
    return f"{section.name}:{option.name}"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m kvcache bench``: the run-wide options, then one
    group of options per registered section."""
    known = sections()
    p = _Parser(prog="python -m kvcache bench",
                description="The kvcache benchmark, one section at a time (each section's "
                            "options below).  Method: docs/benchmark-method.md.")
    p.add_argument("--sections", nargs="+", metavar="S", type=_words(parse_section),
                   action=_Items,
                   help=f"sections to run, any of {', '.join(s.name for s in known)} (each "
                        "described with its options below); default all but "
                        + (", ".join(s.name for s in known if not s.default) or "none"))
    p.add_argument("--quick", action="store_true",
                   help="smaller sizes in every section (each option says its --quick default)")
    p.add_argument("--threads", nargs="+", metavar="N", type=_words(at_least(1)), action=_Items,
                   help="thread counts (default: 1 and all available)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random data (default 0)")
    p.add_argument("--bandwidth-mib", type=at_least(1), metavar="MIB",
                   help=f"buffer of the read-bandwidth probe, MiB (default "
                        f"{BANDWIDTH_BUFFER // MiB})")
    p.add_argument("--bodies", nargs="+", metavar="FAM=BODY",
                   help="run kernel family FAM on body BODY for the whole run (e.g. f32=avx2 "
                        "mla=avx2; families f32, q8, prefill, mla; bodies as in show_config), "
                        "as kvcache._core.set_bodies does; refused, before anything runs, for "
                        "a body the build does not hold or the CPU cannot run")
    p.add_argument("--json", metavar="PATH", help="write raw results as JSON")
    p.add_argument("--plot", metavar="PATH", help="write PNG charts (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    old: set[str] = set()
    for section in known:
        group = p.add_argument_group(f"{section.name} section", section.help)
        for option in section.options:
            _add(group, option, section.flag(option), _dest(section, option), _help(option))
            for spelling in set(option.old) - old:            # hidden, read by resolve()
                _add(group, option, spelling, _old_dest(spelling), argparse.SUPPRESS, off=True)
                old.add(spelling)
    return p


def _add(group: argparse._ArgumentGroup, option: Option, flag: str, dest: str, help: str,
         off: bool = False) -> None:
    """``flag`` for ``option`` (``off``: a switch's old spelling, which turns it off)."""
    if option.parse is None and off:
        group.add_argument(flag, dest=dest, action="store_const", const=False, help=help)
    elif option.parse is None:
        group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, help=help)
    elif option.many:
        group.add_argument(flag, dest=dest, nargs="+", type=_words(option.parse),
                           action=_Items, metavar=option.metavar, help=help)
    else:
        group.add_argument(flag, dest=dest, type=option.parse, metavar=option.metavar,
                           help=help)


def _old_dest(spelling: str) -> str:
    return f"old:{spelling}"


@dataclass
class Plan:
    """What a run does: the shared context and the chosen sections with their values."""

    context: Context
    chosen: list[tuple[Section, Values]]

    def tasks(self) -> int:
        """Progress-bar steps: the bandwidth probe (when a section reads it) and every
        section's."""
        return (any(s.bandwidth for s, _ in self.chosen)
                + sum(s.tasks(self.context, v) for s, v in self.chosen))


def resolve(args: argparse.Namespace) -> Plan:
    """The plan of a run from parsed arguments, with the --quick or the full default of every
    option not given."""
    names = args.sections or [s.name for s in sections() if s.default]
    ctx = Context(quick=args.quick, threads=args.threads or sorted({1, available_cpus()}),
                  seed=args.seed,
                  bandwidth_bytes=(args.bandwidth_mib * MiB if args.bandwidth_mib
                                   else BANDWIDTH_BUFFER))
    chosen = [(s, s.values(args.quick, {o.name: _given(args, s, o) for o in s.options}))
              for s in sections() if s.name in names]
    return Plan(ctx, chosen)


def _given(args: argparse.Namespace, section: Section, option: Option) -> Any:
    """The value given for ``option`` (None: not given), by its flag or, with a warning, by
    a deprecated spelling (``Option.old``)."""
    value = getattr(args, _dest(section, option))
    new = section.flag(option) if option.parse is not None else f"--no-{section.flag(option)[2:]}"
    for spelling in option.old:
        old = getattr(args, _old_dest(spelling))
        if old is not None:
            log.warning("%s is deprecated and will be removed in the next release; use %s",
                        spelling, new)
            value = old if value is None else value
    return value


def check_plot_backend() -> str | None:
    """Fail early (before the long run) when --plot is given without matplotlib."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return ("--plot needs matplotlib, which is not installed: "
                "pip install matplotlib (or pip install 'kvcache[bench]')")
    return None


def apply_bodies(pairs: Sequence[str]) -> str | None:
    """Set the kernel body of each ``FAM=BODY`` pair (all or nothing); the error text, or None."""
    from .. import _core
    choice = {}
    for pair in pairs:
        fam, sep, body = pair.partition("=")
        if not sep or not fam or not body:
            return f"--bodies: expected FAM=BODY, got {pair[:40]!r}"
        choice[fam.strip()] = body.strip().lower()
    try:
        _core.set_bodies(choice)
    except ValueError as exc:
        return f"--bodies: {exc}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m kvcache bench``; returns the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(levelname)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.plot:
        err = check_plot_backend()
        if err:
            print(err, file=sys.stderr)
            return 2
    plan = resolve(args)
    if args.bodies:
        err = apply_bodies(args.bodies)
        if err:
            print(err, file=sys.stderr)
            return 2
    ctx = plan.context
    info = machine_info()
    monitor = BusyMonitor()
    bar = progress_bar(plan.tasks(), enabled=not args.no_progress)
    ran: list[tuple[Section, Values, Result]] = []
    try:
        if any(s.bandwidth for s, _ in plan.chosen):
            bar.set_postfix_str("bandwidth probe")
            ctx.bandwidth = measure_bandwidth(ctx.threads, ctx.bandwidth_bytes)
            bar.update()
        for section, values in plan.chosen:
            ran.append((section, values, section.run(ctx, values, bar)))
    finally:
        bar.close()
    warn_if_busy(monitor, info)
    print_report(info, ctx, ran)
    if args.json:
        write_json(args.json, info, ctx, ran)
        print(f"raw results written to {args.json}")
    if args.plot:
        for path in write_plots(args.plot, ctx, ran):
            print(f"chart written to {path}")
    return 0
