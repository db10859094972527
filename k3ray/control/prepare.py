"""`k3ray data prepare`: text files, JSONL and Parquet -> token shards (format: k3ray.io.shards), tokenized in
parallel as Ray tasks.

The input is cut into units in a fixed order (sorted paths; a run of small text files, a byte range of a JSONL file
split at line starts, a range of a Parquet file's row groups), each about --shard-mb of text; unit i becomes shard i.
A shard depends only on its unit and the tokenizer, so the same input gives the same bytes whatever the number of
workers. Ray Data's readers are not used: their blocks are not tied to a fixed layout, which this needs for
determinism and for resuming; plain readers run inside the tasks instead.

Resuming: each finished shard leaves a small journal entry beside it (what unit it came from, with the input files'
sizes and modification times); a second run reuses every shard whose entry still matches and tokenizes the rest. The
manifest is written last and the journal then removed, so a finished folder holds shards and manifest only.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from k3ray.config import ConfigError
from k3ray.io import shards
from k3ray.tokenizer import Tokenizer, load_tokenizer

JSONL = (".jsonl", ".json", ".ndjson")
PARQUET = (".parquet",)


@dataclass(frozen=True)
class Unit:
    """One shard's worth of input: kind 'text' (whole files, one document each), 'jsonl' (lines starting in
    [start, end) of one file) or 'parquet' (row groups [start, end) of one file)."""
    kind: str
    paths: tuple[str, ...]
    start: int = 0
    end: int = 0
    size: int = 0  # bytes of input it covers (progress)

    def stamp(self) -> list:
        """What must not have changed for its shard to be reused: the files' sizes and modification times."""
        return [[p, os.stat(p).st_size, os.stat(p).st_mtime_ns] for p in self.paths]


def input_files(inputs: list[str]) -> list[Path]:
    files = []
    for spec in inputs:
        path = Path(spec)
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        elif path.is_file():
            files.append(path)
        else:
            raise ConfigError(f"--input {spec}: no such file or folder")
    if not files:
        raise ConfigError(f"--input {' '.join(inputs)}: no files")
    return files


def plan_units(files: list[Path], shard_bytes: int) -> list[Unit]:
    units, text, text_size = [], [], 0

    def close_text():
        nonlocal text, text_size
        if text:
            units.append(Unit("text", tuple(text), size=text_size))
        text, text_size = [], 0

    for path in files:
        size = path.stat().st_size
        if path.suffix in JSONL:
            close_text()
            units += [Unit("jsonl", (str(path),), a, min(a + shard_bytes, size), min(shard_bytes, size - a))
                      for a in range(0, max(size, 1), shard_bytes)]
        elif path.suffix in PARQUET:
            close_text()
            import pyarrow.parquet as pq

            try:
                meta = pq.ParquetFile(path).metadata
            except Exception as err:  # noqa: BLE001 - pyarrow raises several kinds for a bad file
                raise ConfigError(f"{path}: not a readable Parquet file ({err})") from None
            groups = [meta.row_group(g).total_byte_size for g in range(meta.num_row_groups)]
            first, acc = 0, 0
            for g, nbytes in enumerate(groups):
                acc += nbytes
                if acc >= shard_bytes or g == len(groups) - 1:
                    units.append(Unit("parquet", (str(path),), first, g + 1, acc))
                    first, acc = g + 1, 0
        else:
            if text_size + size > shard_bytes:
                close_text()
            text.append(str(path))
            text_size += size
    close_text()
    return units


def documents(unit: Unit, field: str):
    """The unit's documents (str), in order."""
    if unit.kind == "text":
        for p in unit.paths:
            yield Path(p).read_bytes().decode("utf-8", errors="replace")
    elif unit.kind == "jsonl":
        path = unit.paths[0]
        with open(path, "rb") as f:
            if unit.start:  # a line belongs to the unit its first byte falls in
                f.seek(unit.start - 1)
                f.readline()
            while (at := f.tell()) < unit.end and (line := f.readline()):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)[field]
                except (ValueError, KeyError, TypeError) as err:
                    raise ConfigError(f"{path} (line at byte {at}): not a JSON object with a {field!r} field "
                                      f"({type(err).__name__}: {err})") from None
                if not isinstance(value, str):
                    raise ConfigError(f"{path} (line at byte {at}): field {field!r} holds {type(value).__name__}, "
                                      f"not text")
                yield value
    else:
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(unit.paths[0])
        if field not in pf.schema_arrow.names:
            raise ConfigError(f"{unit.paths[0]}: no column {field!r} (columns: {', '.join(pf.schema_arrow.names)})")
        for g in range(unit.start, unit.end):
            yield from (v for v in pf.read_row_group(g, columns=[field]).column(field).to_pylist() if v is not None)


def tokenize_unit(unit: Unit, tok: Tokenizer, field: str, batch: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """(tokens uint32 [T], document ends uint64 [D]): every non-empty document, then end-of-text."""
    pieces, lengths, texts = [], [], []

    def flush():
        for ids in tok.encode_batch(texts):
            if ids:
                pieces.append(np.asarray(ids + [tok.eos_id], dtype=np.uint32))
                lengths.append(len(ids) + 1)
        texts.clear()

    for text in documents(unit, field):
        texts.append(text)
        if len(texts) >= batch:
            flush()
    flush()
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, np.uint32)
    return tokens, np.cumsum(np.asarray(lengths, dtype=np.uint64), dtype=np.uint64)


def prepare_unit(unit: Unit, index: int, tokenizer: str, fingerprint: str, field: str, out: str) -> dict:
    """Tokenize one unit and write shard `index` and its journal entry (runs as a Ray task)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one core per task; Ray runs the tasks side by side
    cpu = time.process_time()
    tok = load_tokenizer(tokenizer)
    if tok.fingerprint != fingerprint:
        raise ConfigError(f"{tokenizer}: changed while preparing")
    tokens, ends = tokenize_unit(unit, tok, field)
    entry = shards.write_shard(Path(out), shards.shard_name(index), tokens, ends)
    shards.write_json(_journal(Path(out), index), {"unit": asdict(unit), "stamp": unit.stamp(), "entry": entry})
    return {**entry, "input_bytes": unit.size, "cpu_seconds": time.process_time() - cpu}


def _journal(out: Path, index: int) -> Path:
    return out / f".{shards.shard_name(index)}.done.json"


def _reusable(out: Path, index: int, unit: Unit) -> dict | None:
    try:
        done = json.loads(_journal(out, index).read_text())
        entry = done["entry"]
        if done["unit"] != json.loads(json.dumps(asdict(unit))) or done["stamp"] != unit.stamp():
            return None
        shards.verify_entry(out, entry)
        return entry
    except (OSError, ValueError, KeyError, shards.ShardError):
        return None


def prepare(inputs: list[str], tokenizer: str, output: str, field: str = "text", shard_mb: float = 64.0,
            workers: int | None = None, progress: bool = True) -> dict:
    """Prepare the folder; returns the summary (documents, tokens, shards, input bytes, seconds, reused shards, the
    tasks' CPU seconds)."""
    import ray
    from tqdm import tqdm

    tok = load_tokenizer(tokenizer)
    units = plan_units(input_files(inputs), max(1, int(shard_mb * 2**20)))
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    entries: dict[int, dict] = {i: e for i, u in enumerate(units) if (e := _reusable(out, i, u)) is not None}
    reused = len(entries)
    todo = [i for i in range(len(units)) if i not in entries]
    bar = tqdm(total=sum(u.size for u in units), unit="B", unit_scale=True, disable=not progress,
               desc="prepare", initial=sum(units[i].size for i in entries))
    task = ray.remote(num_cpus=1, max_retries=0)(prepare_unit)
    limit = workers or max(1, int(ray.available_resources().get("CPU", 1)))
    pending, fresh_tokens, cpu_seconds, next_i = {}, 0, 0.0, 0
    try:
        while next_i < len(todo) or pending:
            while next_i < len(todo) and len(pending) < limit:
                i = todo[next_i]
                pending[task.remote(units[i], i, str(tokenizer), tok.fingerprint, field, str(out))] = i
                next_i += 1
            ready, _ = ray.wait(list(pending), num_returns=1)
            i = pending.pop(ready[0])
            result = ray.get(ready[0])
            entries[i] = {k: v for k, v in result.items() if k not in ("input_bytes", "cpu_seconds")}
            fresh_tokens += result["tokens"]
            cpu_seconds += result["cpu_seconds"]
            bar.update(result["input_bytes"])
            bar.set_postfix_str(f"{fresh_tokens / (time.perf_counter() - t0):,.0f} tokens/s")
    except ray.exceptions.RayTaskError as err:  # the task's own error, in one line (an unreadable file names it)
        cause = getattr(err, "cause", None) or err
        message = str(cause) if isinstance(cause, ConfigError) else f"{type(cause).__name__}: {cause}"
        raise ConfigError(message.strip().splitlines()[0]) from None
    finally:
        for ref in pending:
            ray.cancel(ref)
        bar.close()
    listed = [entries[i] for i in range(len(units))]
    total_tokens = sum(e["tokens"] for e in listed)
    if total_tokens == 0:
        raise ConfigError(f"--input {' '.join(inputs)}: no text (every document is empty)")
    manifest = _write_manifest(out, listed, field, tok)
    seconds = time.perf_counter() - t0
    return {"documents": manifest["documents"], "tokens": total_tokens, "shards": len(listed),
            "input_bytes": sum(u.size for u in units), "seconds": seconds, "reused_shards": reused,
            "tokens_per_s": fresh_tokens / seconds if seconds > 0 else 0.0, "task_cpu_seconds": cpu_seconds,
            "output": str(out)}


def _write_manifest(out: Path, listed: list[dict], field: str, tok) -> dict:
    """The folder's manifest of the shards `listed` (in order), written after the shards of an earlier, larger
    input are removed; the per-shard journals go once it is written. Returns the manifest."""
    manifest = {"format": shards.FORMAT, "field": field, "shards": listed, "tokens": sum(e["tokens"] for e in listed),
                "documents": sum(e["documents"] for e in listed),
                "tokenizer": {"name": Path(tok.name).name, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
                              "fingerprint": tok.fingerprint}}
    for stale in out.glob("shard_*.*"):
        if stale.stem not in {e["name"] for e in listed}:
            stale.unlink()
    shards.write_json(out / shards.MANIFEST, manifest)
    for i in range(len(listed)):
        _journal(out, i).unlink(missing_ok=True)
    return manifest


# -- the command: `k3ray data prepare` ----------------------------------------------------------------------------
def add_parser(sub, positive_int) -> None:
    data = sub.add_parser("data", help="prepare training data: text, JSONL, Parquet -> token shards")
    commands = data.add_subparsers(dest="data_command", required=True)
    p = commands.add_parser("prepare", help="tokenize inputs as Ray tasks into memory-mapped shards with a manifest "
                                            "(deterministic; a second run resumes)")
    p.add_argument("--input", nargs="+", required=True, metavar="PATH", help="files or folders (.jsonl/.json, "
                   ".parquet; anything else is a text file, one document each)")
    p.add_argument("--tokenizer", default="bytes", help="'bytes', a tokenizer.json, a tiktoken BPE file, or a folder")
    p.add_argument("--output", required=True, metavar="DIR")
    p.add_argument("--field", default="text", help="the text field of JSONL records / column of Parquet files")
    p.add_argument("--shard-mb", type=float, default=64.0, help="input text per shard (MiB)")
    p.add_argument("--workers", type=positive_int, help="tasks at once (default: the cluster's CPUs)")
    p.add_argument("--address", default=None, help="Ray cluster to join (default: RAY_ADDRESS or a local one)")
    p.add_argument("--json", action="store_true", help="the summary as one JSON line, no progress bar")
    p.set_defaults(func=cmd_data_prepare)


def cmd_data_prepare(args) -> int:
    from k3ray.control.ray_cluster import init_ray

    load_tokenizer(args.tokenizer)  # a bad tokenizer is one line before Ray starts
    init_ray(args.address, args.workers or 1)
    s = prepare(args.input, args.tokenizer, args.output, args.field, args.shard_mb, args.workers,
                progress=not args.json)
    if args.json:
        print(json.dumps(s))
    else:
        print(f"k3ray: prepared {s['documents']:,} documents, {s['tokens']:,} tokens in {s['shards']} shards "
              f"({s['input_bytes'] / 1e6:,.1f} MB of input, {s['reused_shards']} shards reused) in "
              f"{s['seconds']:.1f} s, {s['tokens_per_s']:,.0f} tokens/s -> {s['output']}")
    return 0
