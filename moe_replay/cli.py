"""`moe-replay` command line: one function per subcommand, registered by name.

Add a subcommand with::

    def _configure_greet(p: argparse.ArgumentParser) -> None:
        p.add_argument("--name", required=True)

    @command("greet", "print a greeting", _configure_greet)
    def greet(args: argparse.Namespace) -> int:
        ...
        return 0

Registration happens at import of this module; heavy imports (transformers, vLLM) stay inside
the subcommand functions so `moe-replay --help` is instant.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from .registry import Registry


@dataclass(frozen=True)
class Command:
    """One subcommand: its parser setup and its body (returns the exit code)."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: Registry[Command] = Registry("subcommand")


def command(name: str, help: str, configure: Callable[[argparse.ArgumentParser], None] = lambda p: None):
    """Decorator registering `run` as subcommand `name` (a second use of a name fails)."""

    def deco(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        COMMANDS.add(name, Command(name, help, configure, run))
        return run

    return deco


def _log(msg: str) -> None:
    """Progress goes to stderr so stdout stays machine-readable."""
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# make-model


def _configure_make_model(p: argparse.ArgumentParser) -> None:
    from .models import FAMILIES, SIZES

    p.add_argument("--family", required=True, choices=FAMILIES.names(), help="model family recipe")
    p.add_argument("--out", required=True, help="output directory (HF checkpoint + tokenizer)")
    p.add_argument("--seed", type=int, default=0, help="weight seed; same seed -> identical files")
    p.add_argument("--size", default="tiny", choices=SIZES.names(), help="size preset")


@command("make-model", "build a tiny random-init MoE checkpoint; prints its geometry as JSON", _configure_make_model)
def make_model(args: argparse.Namespace) -> int:
    from .models import build_tiny_model, geometry_of

    t0 = time.perf_counter()
    path = build_tiny_model(args.family, args.out, seed=args.seed, size=args.size)
    _log(f"built {args.family} ({args.size}, seed {args.seed}) in {time.perf_counter() - t0:.1f} s -> {path}")
    print(json.dumps(geometry_of(path).to_dict()))
    return 0


# ---------------------------------------------------------------------------------------------
# demo: the main job (GRPO with real vLLM rollouts in bf16, HF training in fp32, three arms)


def _configure_demo(p: argparse.ArgumentParser) -> None:
    from .demo import DemoConfig

    d = DemoConfig()
    p.add_argument("--out", default="runs/demo", help="output folder: model/, report.json, plots, report.html")
    p.add_argument("--family", default=d.family, help="tiny model family (see make-model)")
    p.add_argument("--steps", type=int, default=d.steps, help="GRPO steps per arm")
    p.add_argument("--prompts", type=int, default=d.prompts_per_step, help="prompts per step")
    p.add_argument("--samples", type=int, default=d.samples_per_prompt, help="GRPO group size")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--estimator-n", type=int, default=None, help="replicas of the multi-sample arm (preset's n if unset)")
    p.add_argument("--arms", default=",".join(d.arms), help="comma-separated arm=preset (or preset) list")
    p.add_argument("--seed", type=int, default=d.seed)


def _parse_arms(text: str) -> dict[str, str]:
    arms = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        arm, _, preset = item.partition("=")
        arms[arm] = preset or arm
    return arms


@command("demo", "run the end-to-end GRPO demo (real vLLM rollouts, HF training, three arms) and write its report",
         _configure_demo)
def demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .demo import DemoConfig, check_presets, run_demo
    from .report import print_arm_table, render_report

    try:
        cfg = DemoConfig(family=args.family, seed=args.seed, steps=args.steps, prompts_per_step=args.prompts,
                         samples_per_prompt=args.samples, max_tokens=args.max_tokens,
                         estimator_n=args.estimator_n, arms=_parse_arms(args.arms))
        check_presets(cfg)
    except ValueError as e:
        _log(f"moe-replay demo: {e}")
        return 2
    out = Path(args.out)
    _log(f"moe-replay demo: {len(cfg.arms)} arms x {cfg.steps} steps, {cfg.prompts_per_step}x{cfg.samples_per_prompt} "
         f"rollouts per step, vLLM {cfg.engine_dtype} rollouts -> HF {cfg.trainer_dtype} training; output in {out}")
    with _progress(len(cfg.arms) * cfg.steps) as advance:
        report = run_demo(cfg, out, progress=lambda arm, step, total: advance(f"{arm}: step {step}/{total}"))
    print_arm_table(report)
    paths = render_report(report, out)
    _log(f"wall {report['wall_s']:.0f} s; report: {out / 'report.json'}, page: {paths['html']}")
    print(json.dumps({arm: a["mean"] for arm, a in report["arms"].items()}))
    return 0


def _progress(total: int):
    """A progress bar on stderr (rich when available, plain lines otherwise); yields advance(msg)."""
    import contextlib

    @contextlib.contextmanager
    def bar():
        try:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        except ImportError:
            yield lambda msg: _log(msg)
            return
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=Console(stderr=True)) as prog:
            task = prog.add_task("starting (build model, start vLLM)", total=total)
            yield lambda msg: prog.update(task, advance=1, description=msg)

    return bar()


# ---------------------------------------------------------------------------------------------
# shared helpers of inspect / report / bench


class _Progress:
    """A progress bar on stderr: rich if installed, else tqdm, else one log line per step."""

    def __init__(self, total: int, description: str, *, enabled: bool = True) -> None:
        self.total, self.description, self.enabled = total, description, enabled
        self._rich = self._tqdm = None
        self._task = None
        self._done = 0

    def __enter__(self) -> "_Progress":
        if not self.enabled:
            return self
        try:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
        except ImportError:
            try:
                from tqdm import tqdm
            except ImportError:
                return self
            self._tqdm = tqdm(total=self.total, desc=self.description, file=sys.stderr)
            return self
        self._rich = Progress(
            SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=Console(file=sys.stderr), transient=False,
        )
        self._rich.start()
        self._task = self._rich.add_task(self.description, total=self.total)
        return self

    def describe(self, text: str) -> None:
        if self._rich is not None:
            self._rich.update(self._task, description=text)
        elif self._tqdm is not None:
            self._tqdm.set_description(text)
        elif self.enabled:
            _log(f"[{self._done + 1}/{self.total}] {text}")

    def advance(self) -> None:
        self.update(self._done + 1)

    def update(self, done: int) -> None:
        step, self._done = done - self._done, done
        if self._rich is not None:
            self._rich.update(self._task, completed=done)
        elif self._tqdm is not None:
            self._tqdm.update(step)

    def finish(self, text: str) -> None:
        """Final description of the bar (nothing in the plain-log fallback)."""
        if self._rich is not None:
            self._rich.update(self._task, description=text)
        elif self._tqdm is not None:
            self._tqdm.set_description(text)

    def log(self, msg: str) -> None:
        if self._rich is not None:
            self._rich.console.print(msg, markup=False, highlight=False)
        elif self._tqdm is not None:
            self._tqdm.write(msg, file=sys.stderr)
        else:
            _log(msg)

    def __exit__(self, *exc) -> None:
        if self._rich is not None:
            self._rich.stop()
        elif self._tqdm is not None:
            self._tqdm.close()


def _fail(command_name: str, msg: str, code: int = 2) -> int:
    """A user error: one clear line on stderr, no traceback."""
    print(f"moe-replay {command_name}: error: {msg}", file=sys.stderr, flush=True)
    return code


def _write_json(path: str, value: object) -> None:
    from pathlib import Path

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")
    tmp.replace(out)


# ---------------------------------------------------------------------------------------------
# inspect


def _configure_inspect(p: argparse.ArgumentParser) -> None:
    from .report.inspect import DEFAULT_SAMPLE

    p.add_argument("store", metavar="STORE", help="trace store directory (or directory://PATH)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--sample", type=int, default=DEFAULT_SAMPLE, metavar="N",
                   help=f"records re-encoded with each route codec for the bytes comparison (default {DEFAULT_SAMPLE})")


@command("inspect", "summarise a trace store: records, tokens, geometries, engines, parts, support sizes, "
                    "bytes per token-layer per codec, damaged records (exit status 1 if any)", _configure_inspect)
def inspect(args: argparse.Namespace) -> int:
    import os

    from .report.inspect import print_store_summary, summarize_store
    from .store import StoreNotFoundError, open_store

    target = args.store
    if target.startswith("memory://"):
        return _fail("inspect", f"{target!r} is an in-process memory store; inspect a directory store (a path)")
    if args.sample < 0:
        return _fail("inspect", f"--sample must be >= 0 records, got {args.sample}")
    path = target.split("://", 1)[1] if "://" in target else target
    if not os.path.exists(path):
        return _fail("inspect", f"no trace store at {path!r}: the path does not exist. Give the directory a "
                                "DirectoryStore writer created (it holds index.bin and seg-*.bin files), "
                                "e.g. the --store directory of a capture run")
    try:
        store = open_store(target, readonly=True)
    except (StoreNotFoundError, ValueError) as err:
        return _fail("inspect", str(err))
    with store:
        with _Progress(len(store), "reading records", enabled=not args.json and sys.stderr.isatty()) as bar:
            summary = summarize_store(store, sample=args.sample, progress=lambda done, total: bar.update(done))
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_store_summary(summary)
    if summary["damaged"]:
        _log(f"{len(summary['damaged'])} damaged record(s) in {path}; exit status 1")
        return 1
    return 0


# ---------------------------------------------------------------------------------------------
# report


def _configure_report(p: argparse.ArgumentParser) -> None:
    p.add_argument("report_json", metavar="REPORT_JSON", help="report written by `moe-replay demo`")
    p.add_argument("--out", metavar="DIR", help="where the PNGs and report.html go (default: the JSON's folder)")


@command("report", "render a demo report JSON into PNG plots and one self-contained HTML page", _configure_report)
def report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .report import ReportSchemaError, load_report, print_arm_table, render_report

    src = Path(args.report_json)
    if not src.is_file():
        return _fail("report", f"no report at {str(src)!r}: {'it is a directory' if src.is_dir() else 'the file does not exist'}; "
                               "give the report JSON a `moe-replay demo` run wrote")
    try:
        data = load_report(src)
    except ReportSchemaError as err:
        return _fail("report", f"{src}: {err}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return _fail("report", "matplotlib is not installed; install the dev extra: pip install 'moe_replay[dev]'")
    t0 = time.perf_counter()
    paths = render_report(data, Path(args.out) if args.out else src.parent)
    print_arm_table(data, file=sys.stderr)
    _log(f"rendered {len(paths) - 1} plots and {paths['html']} in {time.perf_counter() - t0:.1f} s")
    print(json.dumps({name: str(p) for name, p in paths.items()}))
    return 0


# ---------------------------------------------------------------------------------------------
# bench


def _configure_bench(p: argparse.ArgumentParser) -> None:
    p.add_argument("--only", metavar="NAMES", help="comma-separated benchmarks to run, e.g. store,capture,replay,estimator "
                                                   "(default: every script in the benchmarks folder)")
    p.add_argument("--out", metavar="FILE", help="write the collected JSON here (default: print it to stdout)")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="seconds per benchmark before it counts as failed")
    p.add_argument("--benchmarks-dir", metavar="DIR",
                   help="folder of benchmark scripts (default: benchmarks/ of the source checkout moe_replay runs from)")


@command("bench", "run the benchmark scripts one after another and collect their JSON", _configure_bench)
def bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .report.bench import BenchmarksNotFoundError, default_benchmarks_dir, run_benchmarks, select

    bench_dir = Path(args.benchmarks_dir) if args.benchmarks_dir else default_benchmarks_dir()
    only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else None
    if args.only is not None and not only:
        return _fail("bench", f"--only names no benchmark: {args.only!r}")
    if args.timeout is not None and args.timeout <= 0:
        return _fail("bench", f"--timeout must be > 0 seconds, got {args.timeout}")
    try:
        names = select(bench_dir, only)
    except (BenchmarksNotFoundError, ValueError) as err:
        return _fail("bench", str(err))
    if not names:
        return _fail("bench", f"no benchmark scripts (*.py) in {str(bench_dir)!r}")

    failed: list[str] = []
    with _Progress(len(names), "benchmarks") as bar:
        def on_start(name: str) -> None:
            bar.describe(f"running {name}")

        def on_done(result) -> None:
            bar.advance()
            if result.ok:
                bar.log(f"  {result.name}: ok in {result.wall_s:.1f} s")
            else:
                failed.append(result.name)
                bar.log(f"  {result.name}: FAILED ({result.value['error']}) in {result.wall_s:.1f} s")

        results = run_benchmarks(names, bench_dir, timeout_s=args.timeout, on_start=on_start, on_done=on_done)
        bar.finish(f"benchmarks ({len(failed)} failed)" if failed else "benchmarks")
    if args.out:
        _write_json(args.out, results)
        _log(f"wrote {len(results)} benchmark results to {args.out}")
    else:
        print(json.dumps(results, indent=2))
    if failed:
        _log(f"{len(failed)} of {len(names)} benchmarks failed: {', '.join(failed)} (stderr tails in the JSON)")
        return 1
    return 0


# ---------------------------------------------------------------------------------------------


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser. Given `argv`, only the subcommand it names is configured (none for a bare
    `--help` or an unknown name): a `configure` may import heavy modules (make-model's lists the
    model families, which imports torch), and parsing only ever uses the chosen subparser."""
    parser = argparse.ArgumentParser(prog="moe-replay", description=__doc__.split("\n", 1)[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = _chosen_command(argv)
    for name in COMMANDS.names():
        cmd = COMMANDS.get(name)
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        if argv is None or name == chosen:
            cmd.configure(p)
    return parser


def _chosen_command(argv: Sequence[str] | None) -> str | None:
    """The subcommand `argv` names (the first argument not starting with '-'), if registered."""
    if argv is None:
        return None
    first = next((a for a in argv if not a.startswith("-")), None)
    return first if first in COMMANDS else None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    return COMMANDS.get(args.command).run(args)


if __name__ == "__main__":
    sys.exit(main())
