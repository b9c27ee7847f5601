"""The store's fault harness: seeded episodes of writes, SIGKILLed writers, damage and more writes,
checked after every step (tests/test_store_faults.py runs a few; `benchmarks/store.py --faults`
runs many and prints their counts).

An episode is one store directory (tiny geometry, route chunks of a few rows: `CHUNK_MIN_BYTES`,
segments of `SEGMENT_BYTES`) holding GRPO-like prompt groups (n samples of a prompt share its
chunk) and agentic conversations (turn k re-sends turns 1..k-1: its record shares their chunks).
Each step applies one fault `KIND`:

  kill_frames, kill_index, kill_header   a writer subprocess (tests/store_worker.py put-items)
      SIGKILLs itself part-way through a write of that kind, at a random byte of it (a frames
      write cut inside a chunk's frame included); the records of the put_many calls that
      returned are acknowledged, the others may or may not be there;
  chunk_flip, chunk_zero, record_flip    one byte of a chunk / record frame flipped, or a run of
      a chunk's bytes zeroed;
  segment_truncate, segment_delete, segment_header_flip;
  index_flip, index_truncate, index_delete, index_drop_chunk_entry (one chunk's entry cut out);
  fork, lock_theft                       a write through a writer from a forked child, and through a
      writer whose writer.lock was deleted and taken by a second writer (PROCESS): refused by name.

then checks (`Episode.check`), all against an oracle that knows every frame's bytes before the
damage: the records and chunks whose frames hold a damaged byte are dead, and so is every record
naming a dead chunk. After every step:
  * a survey reader (what `moe-replay inspect` reads) returns every acknowledged record that is
    not dead bit-identical, refuses every dead one with a typed error naming it, and returns no
    record other than the one put (`acknowledged_unreadable`, `unnamed_refusals`, `wrong_reads`,
    `oracle_mismatches`);
  * `moe-replay inspect --json` agrees with the survey and with a writer opened after it: the
    records it counts, the chunks it lists damaged (every dead chunk the store still names, and
    no other), the records each refuses, whether a writer refuses to open, and which chunks a
    writer never names again (`inspect_disagreements`);
  * `moe-replay rescue` copies exactly the readable records, bit-identical; when the writer
    refuses to open, the copy becomes the store (the dead records are then lost, by name);
  * the writer then puts new samples of the prompts and new turns of the conversations whose
    chunks are dead, and fresh ones: every record it acknowledges reads back bit-identical.
Anything raised that is not a `MoeReplayError` is an `untyped_error`. `edge_inputs` tries the bad
arguments (keys and layers of the wrong type) on both stores: each must be refused with a typed error (else
`untyped_errors`), never answered (`silent_coercions`).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moe_replay.cli import main as cli
from moe_replay.errors import MoeReplayError, TraceError
from moe_replay.store import DirectoryStore, MemoryStore, WriterLostError, compact_store, framing
from moe_replay.store.chunks import is_chunk_key, label, parse_key
from moe_replay.trace import RolloutTrace
from tests.trace_factory import TINY_GEOMETRY, random_routes, shared_trace_for

REPO = Path(__file__).resolve().parents[1]
CHUNK_MIN_BYTES = 16
"""Every run of ~12 rows of the tiny geometry becomes a chunk."""
SEGMENT_BYTES = 4096
"""~15 frames a segment: damage to one segment leaves the others whole."""
KILLS = ("kill_frames", "kill_index", "kill_header")
DAMAGE = ("chunk_flip", "chunk_zero", "record_flip", "segment_truncate", "segment_delete", "segment_header_flip",
          "index_flip", "index_truncate", "index_delete", "index_drop_chunk_entry")
PROCESS = ("fork", "lock_theft")
"""Writes from where they may not come: a child forked from the writer's process puts a batch through the
inherited writer; writer.lock is deleted under a live writer, a second writer opens and puts a batch, then
the first puts one. Each refused write is counted (`foreign_writes_refused`); one that returns is
acknowledged, and its records and everyone else's must read back."""
KINDS = KILLS + DAMAGE + PROCESS
GROUP_BASE = 1000
"""shared_trace_for(group * GROUP_BASE + n, group=GROUP_BASE) is sample n of prompt `group`."""
CONV = dict(first=30, gen=16, tool=12, turns=8)
"""A conversation: a 30-token prompt, then 8 turns of 16 sampled tokens, each turn after the first
after a 12-token tool output."""


# -- what is written: regenerable from a spec string in any process ------------------------------------
def item(spec: str, seed: int) -> RolloutTrace:
    """The trace `spec` names: "g<group>.<n>" (sample n of a prompt group) or "c<conv>.<turn>"."""
    kind, rest = spec[0], spec[1:]
    a, b = (int(x) for x in rest.split("."))
    if kind == "g":
        return shared_trace_for(a * GROUP_BASE + b, seed=seed, group=GROUP_BASE)
    return conversation_turn(seed, a, b)


def conversation_turn(seed: int, conv: int, turn: int) -> RolloutTrace:
    """Turn `turn` (1-based) of conversation `conv`: its request re-sends every earlier turn and a
    tool output, and its routes over that context are the earlier turns' (prefix cache)."""
    first, gen, tool = CONV["first"], CONV["gen"], CONV["tool"]
    total = first + CONV["turns"] * (gen + tool)
    rng = np.random.default_rng([seed, 3, conv])
    tokens = rng.integers(0, TINY_GEOMETRY.vocab_size, total)
    routes = random_routes(rng, total, TINY_GEOMETRY)
    prompt = first + (turn - 1) * (gen + tool)
    size = prompt + gen
    logprobs = -np.random.default_rng([seed, 4, conv, turn]).random(gen).astype(np.float32)
    return RolloutTrace(f"c{conv:04d}/t{turn}", tokens[:size], prompt, TINY_GEOMETRY, routes_TLK=routes[:size - 1],
                        logprobs_G=logprobs).validate()


def key_of(spec: str) -> str:
    kind, rest = spec[0], spec[1:]
    a, b = (int(x) for x in rest.split("."))
    return f"g{a:05d}#{b}" if kind == "g" else f"c{a:04d}/t{b}"


# -- the counts ---------------------------------------------------------------------------------------
@dataclass
class Totals:
    trials: Counter = field(default_factory=Counter)
    """Steps per fault kind (a kill step counts only when the writer was killed)."""
    acknowledged_unreadable: int = 0
    untyped_errors: int = 0
    inspect_disagreements: int = 0
    silent_coercions: int = 0
    unnamed_refusals: int = 0
    wrong_reads: int = 0
    oracle_mismatches: int = 0
    records_acknowledged: int = 0
    refused: set = field(default_factory=set)
    """(episode, key) of the acknowledged records found dead (their bytes, or a chunk they name,
    damaged): each refused by name at every later step."""
    foreign_writes_refused: int = 0
    """Writes of the PROCESS kinds refused by name (WriterLostError), before any byte was written."""
    chunk_copies: int = 0
    """Chunks written as a copy of a damaged one (`ChunkKey.copy` > 0)."""
    writer_refusals: int = 0
    """Steps where a writer refused to open and the rescue copy became the store."""
    kills_without_death: int = 0
    failures: list[str] = field(default_factory=list)
    """The first problems found, described (at most 20)."""

    kind: str = ""
    """The fault kind of the step being checked."""
    unreadable: Counter = field(default_factory=Counter)
    """acknowledged_unreadable per fault kind."""

    def fail(self, count: str, what: str) -> None:
        setattr(self, count, getattr(self, count) + 1)
        if count == "acknowledged_unreadable":
            self.unreadable[self.kind] += 1
        if len(self.failures) < 20:
            self.failures.append(f"{count}: {what}")

    def summary(self) -> dict:
        return {
            "kinds": {k: {"trials": self.trials[k], "acknowledged_unreadable": self.unreadable[k]} for k in KINDS
                      if self.trials[k]},
            "trials": sum(self.trials[k] for k in KINDS),
            "edge_inputs": {"calls": self.trials["edge_inputs"]},
            "acknowledged_unreadable": self.acknowledged_unreadable, "untyped_errors": self.untyped_errors,
            "inspect_disagreements": self.inspect_disagreements, "silent_coercions": self.silent_coercions,
            "unnamed_refusals": self.unnamed_refusals, "wrong_reads": self.wrong_reads,
            "oracle_mismatches": self.oracle_mismatches, "records_acknowledged": self.records_acknowledged,
            "records_refused_by_name": len(self.refused), "foreign_writes_refused": self.foreign_writes_refused,
            "chunk_copies": self.chunk_copies,
            "writer_refusals_rescued": self.writer_refusals, "kills_without_death": self.kills_without_death,
            "failures": self.failures,
        }


# -- one episode --------------------------------------------------------------------------------------
Span = tuple[int, int, int]
"""(segment, first byte, stop byte) of a frame, or of damaged bytes (stop = a huge number: to the end)."""
TO_END = 1 << 62


class Episode:
    """One store and what the harness knows of it (see the module doc)."""

    def __init__(self, root: Path, seed: int, totals: Totals) -> None:
        self.dir = root / f"episode-{seed}"
        self.work = root / f"work-{seed}"
        self.seed = seed
        self.rng = np.random.default_rng([seed, 59])
        self.t = totals
        self.acked: set[str] = set()
        self.specs: dict[str, str] = {}
        """key -> spec of every record ever put (acknowledged or not)."""
        self.dead: set[str] = set()
        """Keys of records and chunks whose frames hold damaged bytes."""
        self.groups: dict[int, int] = {}
        """prompt group -> samples put so far."""
        self.convs: dict[int, int] = {}
        """conversation -> turns put so far."""

    # -- writing ------------------------------------------------------------------------------------
    def _new_items(self, count: int, prefer: set[str] = frozenset()) -> list[str]:
        """Specs of records never put: new samples of the prompts and next turns of the
        conversations in `prefer` (keys of dead records: their chunks are damaged) first, then
        a mix of new samples, next turns, new prompts and new conversations."""
        out: list[str] = []
        wanted = sorted({self.specs[k] for k in prefer if k in self.specs})
        for spec in wanted:
            if len(out) >= count:
                break
            out.append(self._next(spec[0], int(spec[1:].split(".")[0])))
        while len(out) < count:
            r = self.rng.random()
            if r < 0.35 and self.groups:
                out.append(self._next("g", int(self.rng.choice(sorted(self.groups)))))
            elif r < 0.6 and any(t < CONV["turns"] for t in self.convs.values()):
                out.append(self._next("c", int(self.rng.choice(sorted(c for c, t in self.convs.items() if t < CONV["turns"])))))
            elif r < 0.85:
                out.append(self._next("g", len(self.groups) and max(self.groups) + 1))
            else:
                out.append(self._next("c", len(self.convs) and max(self.convs) + 1))
        return out

    def _next(self, kind: str, n: int) -> str:
        """The spec of the next record of prompt group / conversation `n` (a new conversation
        once `n` has all its turns)."""
        book = self.groups if kind == "g" else self.convs
        done = book.get(n, 0)
        if kind == "c" and done >= CONV["turns"]:
            return self._next("c", max(self.convs) + 1)
        book[n] = done + 1
        spec = f"g{n}.{done}" if kind == "g" else f"c{n}.{done + 1}"  # sample index from 0, turn from 1
        self.specs[key_of(spec)] = spec
        return spec

    def put(self, store: DirectoryStore, specs: list[str]) -> None:
        traces = [item(s, self.seed) for s in specs]
        before = set(store.chunk_keys())
        store.put_many(traces)
        self.acked.update(t.key for t in traces)
        self.t.records_acknowledged += len(traces)
        self.t.chunk_copies += sum(1 for k in set(store.chunk_keys()) - before if parse_key(k) and parse_key(k).copy)

    def start(self) -> None:
        with DirectoryStore(self.dir, chunk_min_bytes=CHUNK_MIN_BYTES, segment_bytes=SEGMENT_BYTES, durable=False) as w:
            self.put(w, [self._next("g", 0), self._next("g", 0), self._next("g", 1), self._next("c", 0), self._next("c", 0)])

    def kill(self, kind: str) -> bool:
        """A writer subprocess putting three batches, SIGKILLed in its N-th write of `kind`;
        return whether it died."""
        batches = [self._new_items(int(self.rng.integers(2, 5))) for _ in range(3)]
        what = kind.split("_")[1]
        die_at = f"{what}:{int(self.rng.integers(1, 4))}:{self.rng.uniform(0.02, 0.98):.3f}"
        segment_bytes = framing.HEADER.size + 1024 if what == "header" else SEGMENT_BYTES
        spec = ";".join(",".join(b) for b in batches)
        cmd = [sys.executable, "-m", "tests.store_worker", "put-items", str(self.dir), str(self.seed), str(CHUNK_MIN_BYTES),
               str(max(segment_bytes, 1024)), spec, die_at]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
        done = [int(x) for x in proc.stdout.split()]
        acked = [k for b in batches[:len(done)] for k in map(key_of, b)]
        self.acked.update(acked)
        self.t.records_acknowledged += len(acked)
        if proc.returncode not in (0, -9):
            self.t.fail("untyped_errors", f"writer subprocess exit {proc.returncode}: {proc.stderr[-800:]}")
        return proc.returncode == -9

    def foreign_write(self, kind: str) -> None:
        """A PROCESS fault: a write through a writer the store no longer belongs to (see PROCESS)."""
        opts = dict(chunk_min_bytes=CHUNK_MIN_BYTES, segment_bytes=SEGMENT_BYTES, durable=False)
        with DirectoryStore(self.dir, **opts) as w:
            self.put(w, self._new_items(int(self.rng.integers(1, 4))))  # a writer mid-session: offsets set
            if kind == "fork":
                specs = self._new_items(int(self.rng.integers(2, 5)))
                pid = os.fork()
                if pid == 0:  # the child: put through the inherited writer, say how it went, never return
                    code = 4
                    try:
                        w.put_many([item(x, self.seed) for x in specs])
                        code = 0
                    except WriterLostError:
                        code = 3
                    except BaseException:  # noqa: BLE001: reported as the exit code
                        code = 4
                    finally:
                        os._exit(code)
                code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                if code == 0:  # the child's put_many returned: its records are acknowledged
                    self.acked.update(map(key_of, specs))
                    self.t.records_acknowledged += len(specs)
                elif code == 3:
                    self.t.foreign_writes_refused += 1
                else:
                    self.t.fail("untyped_errors", f"fork: the child's put_many exited {code}")
                self._guard("put_many after a fork", self.put, w, self._new_items(int(self.rng.integers(2, 5))))
                return
            (self.dir / framing.LOCK_NAME).unlink()
            with DirectoryStore(self.dir, **opts) as second:  # the lock is gone: a second writer opens
                self._guard("put_many by the second writer", self.put, second, self._new_items(int(self.rng.integers(2, 5))))
                try:
                    self._guard("put_many by the first writer", self.put, w, self._new_items(int(self.rng.integers(2, 5))))
                except WriterLostError:
                    self.t.foreign_writes_refused += 1
                self._guard("put_many by the second writer", self.put, second, self._new_items(int(self.rng.integers(1, 3))))

    # -- damage -------------------------------------------------------------------------------------
    def frames(self) -> tuple[dict[str, Span], dict[str, list[str]]]:
        """(key -> frame span, record -> chunks it names) of every frame the store names."""
        spans, refs = {}, {}
        with DirectoryStore(self.dir, readonly=True, survey=True) as s:
            for key, e in s._entries.items():
                spans[key] = (e.segment, e.offset, e.offset + framing.FRAME.size + e.length)
            for key in s.keys():
                with contextlib.suppress(TraceError):
                    refs[key] = s.record_chunks(key)
        return spans, refs

    def damage(self, kind: str) -> list[Span]:
        """Apply fault `kind` to the store's files; return the byte spans it damaged (none for
        the index: every frame is still intact)."""
        spans, _ = self.frames()
        d, rng = self.dir, self.rng
        segs = sorted(int(p.name[4:10]) for p in d.iterdir() if framing._SEGMENT_RE.match(p.name))
        pick = lambda xs: xs[int(rng.integers(len(xs)))]  # noqa: E731
        if kind in ("chunk_flip", "chunk_zero", "record_flip"):
            sizes = {n: (d / framing.segment_name(n)).stat().st_size for n in segs}
            keys = sorted(k for k, (n, _, b) in spans.items()
                          if is_chunk_key(k) == (kind != "record_flip") and b <= sizes.get(n, -1))
            if not keys:
                return []
            seg, a, b = spans[pick(keys)]
            path = d / framing.segment_name(seg)
            if kind == "chunk_zero":
                lo = int(rng.integers(a, b))
                hi = min(b, lo + int(rng.integers(1, 65)))
                return [(seg, lo, hi)] if _write(path, lo, bytes(hi - lo)) else []
            at = int(rng.integers(a, b))
            _flip(path, at, int(rng.integers(1, 256)))
            return [(seg, at, at + 1)]
        if kind.startswith("segment_"):
            if not segs:
                return []
            seg = pick(segs)
            path = d / framing.segment_name(seg)
            if kind == "segment_delete":
                path.unlink()
                return [(seg, 0, TO_END)]
            if kind == "segment_header_flip":
                _flip(path, int(rng.integers(0, framing.HEADER.size)), int(rng.integers(1, 256)))
                return [(seg, 0, TO_END)]
            size = path.stat().st_size
            at = int(rng.integers(0, size)) if size else 0
            os.truncate(path, at)
            return [(seg, 0 if at < framing.HEADER.size else at, TO_END)]
        index = d / framing.INDEX_NAME
        if not index.exists():
            return []
        size = index.stat().st_size
        if kind == "index_flip" and size:
            _flip(index, int(rng.integers(0, size)), int(rng.integers(1, 256)))
        elif kind == "index_truncate":
            os.truncate(index, int(rng.integers(0, max(size, 1))))
        elif kind == "index_delete":
            index.unlink()
        elif kind == "index_drop_chunk_entry":
            data = index.read_bytes()
            entries = [(k, a, b) for k, a, b in _index_entries(data) if is_chunk_key(k)]
            if entries:
                _, a, b = pick(entries)
                index.write_bytes(data[:a] + data[b:])
        return []

    def mark_dead(self, damaged: list[Span]) -> None:
        """Frames holding a damaged byte are dead, and so is every record naming a dead chunk."""
        if not damaged:
            return
        spans, refs = self._before_damage
        for key, (seg, a, b) in spans.items():
            if any(s == seg and lo < b and a < hi for s, lo, hi in damaged):
                self.dead.add(key)
        for key, chunks in refs.items():
            if any(c in self.dead for c in chunks):
                self.dead.add(key)

    def step(self, kind: str) -> None:
        self.t.kind = kind
        if kind in KILLS:
            if not self.kill(kind):
                self.t.kills_without_death += 1
        elif kind in PROCESS:
            self.foreign_write(kind)
        else:
            self._before_damage = self.frames()
            self.mark_dead(self.damage(kind))
        self.t.trials[kind] += 1
        self.check(kind)

    # -- checks -------------------------------------------------------------------------------------
    def _guard(self, what: str, fn, *args):
        """fn(*args); an exception that is not a MoeReplayError counts as untyped (and returns None)."""
        try:
            return fn(*args)
        except MoeReplayError:
            raise
        except Exception as err:  # noqa: BLE001: counted, described
            self.t.fail("untyped_errors", f"{what}: {type(err).__name__}: {err}\n{traceback.format_exc()[-1500:]}")
            return None

    def _read_all(self, store: DirectoryStore, where: str) -> set[str]:
        """Keys that read back bit-identical; every other key (acknowledged or present) is checked
        to be refused by name, and only if dead (or never acknowledged)."""
        readable = set()
        for key in sorted(self.acked | set(store.keys())):
            spec = self.specs.get(key)
            try:
                got = store.get(key)
            except TraceError as err:
                if err.where.record != key:
                    self.t.fail("unnamed_refusals", f"{where}: {key}: {err}")
                if key in self.acked and key not in self.dead:
                    self.t.fail("acknowledged_unreadable", f"{where}: {key} ({spec}): {err}")
                continue
            except Exception as err:  # noqa: BLE001
                self.t.fail("untyped_errors", f"{where}: get({key!r}): {type(err).__name__}: {err}")
                continue
            if spec is None or not got.equals(item(spec, self.seed)):
                self.t.fail("wrong_reads", f"{where}: {key} reads back other than it was put")
                continue
            if key in self.dead:
                self.t.fail("oracle_mismatches", f"{where}: {key} reads back although its bytes were damaged")
            readable.add(key)
        return readable

    def check(self, kind: str) -> None:
        t, d = self.t, self.dir
        # what inspect says, and what a survey reader reads
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            code = self._guard("moe-replay inspect", cli, ["inspect", "--json", "--sample", "0", str(d)])
        try:
            summary = json.loads(out.getvalue())
        except ValueError:
            t.fail("inspect_disagreements", f"{kind}: inspect printed no JSON (exit {code})")
            return
        try:
            with DirectoryStore(d, readonly=True, survey=True) as s:
                readable = self._read_all(s, f"{kind}: survey")
                chunk_keys = set(s.chunk_keys())
                naming: dict[str, set[str]] = {}
                for key in s.keys():
                    with contextlib.suppress(TraceError):
                        for c in s.record_chunks(key):
                            naming.setdefault(label(c), set()).add(key)
        except MoeReplayError as err:
            t.fail("inspect_disagreements", f"{kind}: a survey reader does not open where inspect did: {err}")
            return
        t.refused.update((self.seed, k) for k in self.acked & self.dead)
        listed = {c["chunk"]: set(c["records"]) for c in summary["chunks"]["damaged"]}
        dead_chunks = {label(k) for k in chunk_keys if k in self.dead}
        self._agree(kind, "records inspect counts", summary["records"], len(readable))
        self._agree(kind, "damaged chunks inspect lists", set(listed), dead_chunks)
        for name, records in listed.items():
            self._agree(kind, f"records {name} refuses", records, naming.get(name, set()))
        refuses = summary["writer"]["refuses"] is not None
        # what rescue copies
        copy = self.work / "rescued"
        shutil.rmtree(copy, ignore_errors=True)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            self._guard("moe-replay rescue", cli, ["rescue", str(d), str(copy)])
        with DirectoryStore(copy, readonly=True) as r:
            self._agree(kind, "records rescue copies", set(r.keys()), readable)
            self._read_all(r, f"{kind}: rescued")
        # what a writer does, then writes after the damage
        try:
            w = DirectoryStore(d, chunk_min_bytes=CHUNK_MIN_BYTES, segment_bytes=SEGMENT_BYTES, durable=False)
        except TraceError as err:
            self._agree(kind, f"whether a writer refuses ({err})", True, refuses)
            t.writer_refusals += 1
            shutil.rmtree(d)
            copy.rename(d)
            self.acked -= self.dead  # lost: refused by name above, and not in the copy
            self.dead = set()
            w = DirectoryStore(d, chunk_min_bytes=CHUNK_MIN_BYTES, segment_bytes=SEGMENT_BYTES, durable=False)
            refused_chunks = set()
        else:
            self._agree(kind, "whether a writer refuses", False, refuses)
            refused_chunks = set(summary["writer"]["refuses_to_reuse_chunks"])
        with w:
            unusable = {label(k) for k in w.chunk_keys() if not w._chunk_usable(k)}
            self._agree(kind, "chunks a writer never names again", unusable, refused_chunks)
            self._agree(kind, "records a writer reads", {x.key for x in w.iter(errors="skip", on_error=lambda e: None)}, readable)
            specs = self._new_items(int(self.rng.integers(3, 7)), prefer=self.dead & self.acked)
            self._guard("put_many after damage", self.put, w, specs)
        with DirectoryStore(d, readonly=True) as r:
            for spec in specs:
                key = key_of(spec)
                try:
                    ok = r.get(key).equals(item(spec, self.seed))
                except TraceError as err:
                    ok = False
                    spec = f"{spec}: {err}"
                if not ok:
                    t.fail("acknowledged_unreadable", f"{kind}: {key} put after the damage: {spec}")

    def _agree(self, kind: str, what: str, got, want) -> None:
        if got != want:
            g = sorted(got) if isinstance(got, set) else got
            w = sorted(want) if isinstance(want, set) else want
            self.t.fail("inspect_disagreements", f"{kind}: {what}: inspect / this view says {g}, the other {w}")


# -- bytes ---------------------------------------------------------------------------------------------
def _flip(path: Path, at: int, mask: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ mask]))


def _write(path: Path, at: int, data: bytes) -> bool:
    """Write `data` at `at`; whether any byte changed."""
    with open(path, "r+b") as f:
        f.seek(at)
        old = f.read(len(data))
        f.seek(at)
        f.write(data)
    return old != data


def _index_entries(data: bytes) -> list[tuple[str, int, int]]:
    """(key, first byte, stop byte) of each intact index entry, in order."""
    out, pos = [], framing.HEADER.size
    while pos + framing.ENTRY.size <= len(data):
        magic, key_len = framing.ENTRY.unpack_from(data, pos)[:2]
        end = pos + framing.ENTRY.size + key_len + framing.CRC.size
        if magic != framing.ENTRY_MAGIC or end > len(data):
            break
        out.append((data[pos + framing.ENTRY.size:end - framing.CRC.size].decode("utf-8", "replace"), pos, end))
        pos = end
    return out


# -- bad arguments ---------------------------------------------------------------------------------------
def edge_inputs(root: Path, totals: Totals) -> None:
    """Bad keys and layers on both stores: each call must raise a MoeReplayError."""
    d = root / "edge"
    shutil.rmtree(d, ignore_errors=True)
    good = item("g0.0", 0)
    bad_keys = [5, None, b"g00000#0", ["g00000#0"], "\ud800", 1.5]
    bad_layers = [["x"], [None], 5, [1.7], "13", [True], 1.0, [np.float64(1.0)], b"\x01", [1, "3"]]
    for store in (MemoryStore(chunk_min_bytes=CHUNK_MIN_BYTES), DirectoryStore(d, chunk_min_bytes=CHUNK_MIN_BYTES)):
        with store:
            store.put(good)
            calls = [(f"get({k!r})", store.get, (k,)) for k in bad_keys]
            calls += [(f"get_many([{k!r}])", store.get_many, ([k],)) for k in bad_keys]
            calls += [(f"get(key, layers={x!r})", store.get, (good.key, x)) for x in bad_layers]
            calls += [(f"get_many([key], layers={x!r})", store.get_many, ([good.key], x)) for x in bad_layers]
            calls += [("get_many('g00000#0')", store.get_many, (good.key,))]
            for k in bad_keys:
                calls.append((f"put(key={k!r})", store.put, (_rekeyed(k),)))
            calls += [("put(a dict)", store.put, ({"key": "x"},)), ("put_many([None])", store.put_many, ([None],))]
            if isinstance(store, DirectoryStore):
                calls += [(f"record_chunks({k!r})", store.record_chunks, (k,)) for k in bad_keys]
                calls += [(f"compact_store(keys={k!r})", _compact, (d, root / "edge-copy", k)) for k in ("g00000#0", [5], [None])]
            for what, fn, args in calls:
                totals.trials["edge_inputs"] += 1
                try:
                    fn(*args)
                except MoeReplayError:
                    continue
                except Exception as err:  # noqa: BLE001
                    totals.fail("untyped_errors", f"{type(store).__name__}.{what}: {type(err).__name__}: {err}")
                    continue
                totals.fail("silent_coercions", f"{type(store).__name__}.{what} returned")


def _compact(src: Path, dst: Path, keys) -> None:
    shutil.rmtree(dst, ignore_errors=True)
    compact_store(src, dst, keys=keys)


def _rekeyed(key) -> RolloutTrace:
    out = item("g0.1", 0)
    out.key = key
    return out


# -- a run ------------------------------------------------------------------------------------------
def run(root: Path, episodes: int, steps: int, seed: int = 0) -> dict:
    """`episodes` episodes of `steps` steps each (kinds dealt round-robin from a shuffled order,
    so every kind comes up), then the edge inputs; the summary dict (Totals.summary) with `wall_s`.
    The store's warnings (a damaged chunk found, a recovery) are what the harness provokes: not logged."""
    logging.getLogger("moe_replay.store").setLevel(logging.ERROR)
    totals, start = Totals(), time.perf_counter()
    order = list(KINDS)
    np.random.default_rng([seed, 0]).shuffle(order)
    n = 0
    for e in range(episodes):
        ep = Episode(root, seed * 10_000 + e, totals)
        ep.work.mkdir(parents=True, exist_ok=True)
        ep.start()
        for _ in range(steps):
            ep.step(order[n % len(order)])
            n += 1
        shutil.rmtree(ep.dir, ignore_errors=True)
        shutil.rmtree(ep.work, ignore_errors=True)
    edge_inputs(root, totals)
    return {**totals.summary(), "episodes": episodes, "steps": steps, "wall_s": round(time.perf_counter() - start, 1)}
