"""`moe-replay` command line: one function per subcommand, registered by name.

Add a subcommand with::

    def _configure_report(p: argparse.ArgumentParser) -> None:
        p.add_argument("--trace", required=True)

    @command("report", "summarise a trace store", _configure_report)
    def report(args: argparse.Namespace) -> int:
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
# demo (placeholder until the end-to-end capture -> replay -> GRPO demo exists)


def _configure_demo(p: argparse.ArgumentParser) -> None:
    from .models import DEFAULT_FAMILY, FAMILIES

    p.add_argument("--out", default="runs/demo", help="where the demo model is built")
    p.add_argument("--family", default=DEFAULT_FAMILY, choices=FAMILIES.names())
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=12)


@command("demo", "placeholder demo: build the default tiny model and generate with HF transformers", _configure_demo)
def demo(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .models import build_tiny_model, geometry_of, parse_answer, sample_problems

    if args.num_prompts < 1 or args.max_new_tokens < 1:
        raise SystemExit(f"--num-prompts ({args.num_prompts}) and --max-new-tokens ({args.max_new_tokens}) must be >= 1")
    _log("moe-replay demo (placeholder): the longest path that exists so far is")
    _log("  build a tiny local MoE model -> generate with HF transformers.")
    _log("  Not yet wired: vLLM capture, trace store, replay in the trainer, GRPO.")
    t0 = time.perf_counter()
    path = build_tiny_model(args.family, args.out, seed=args.seed)
    geometry = geometry_of(path)
    _log(f"[1/2] built {args.family} at {path} in {time.perf_counter() - t0:.1f} s: {json.dumps(geometry.to_dict())}")

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    problems = sample_problems(args.num_prompts, seed=args.seed)
    batch = tok([p.prompt for p in problems], return_tensors="pt", padding=True)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            **batch, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id
        )
    completions = tok.batch_decode(out[:, batch.input_ids.shape[1]:], skip_special_tokens=True)
    _log(f"[2/2] greedy HF generation of {args.max_new_tokens} tokens x {len(problems)} prompts "
         f"in {time.perf_counter() - t0:.1f} s (random weights: answers are noise)")
    correct = 0
    for p, c in zip(problems, completions):
        ok = parse_answer(c) == p.answer
        correct += ok
        print(f"{p.prompt!r} -> {c!r}  (expected {p.answer}{', correct' if ok else ''})")
    print(json.dumps({"model": str(path), "family": args.family, "prompts": len(problems),
                      "correct": correct, "geometry": geometry.to_dict()}))
    return 0


# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-replay", description=__doc__.split("\n", 1)[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS.names():
        cmd = COMMANDS.get(name)
        cmd.configure(sub.add_parser(name, help=cmd.help, description=cmd.help))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return COMMANDS.get(args.command).run(args)


if __name__ == "__main__":
    sys.exit(main())
