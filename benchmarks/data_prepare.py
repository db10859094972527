"""`k3ray data prepare` throughput: MB/s of text and tokens/s per core, over 1 and 2 Ray workers (tasks at once).

Input: the Python standard library's .py sources as one JSONL file of --mb MiB; tokenizers: `bytes` and a byte-level
BPE tokenizer.json of --vocab tokens trained (before timing) on a few MiB of the same text. Each run prepares into a
fresh folder on a local Ray cluster of 2 CPUs; the time is prepare()'s wall time (tasks, shard writes, manifest);
"per CPU-s" divides by the CPU seconds the tasks used (what a core gives when it is not shared). Prints a table.

    python benchmarks/data_prepare.py [--mb 16] [--vocab 8192] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sysconfig
import tempfile
from pathlib import Path


def make_input(folder: Path, mb: float) -> tuple[Path, list[str]]:
    texts, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(text)
        size += len(text.encode())
        if size >= mb * 2**20:
            break
    out = folder / "input.jsonl"
    with open(out, "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    return out, texts


def train_bpe(folder: Path, texts: list[str], vocab: int) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    sample, size = [], 0
    for t in texts:
        sample.append(t)
        size += len(t)
        if size > 4 * 2**20:
            break
    tok.train_from_iterator(sample, trainer)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def main() -> None:
    import ray
    import tokenizers

    from k3ray.control.prepare import prepare

    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=float, default=16)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="k3ray-prepare-"))
    try:
        inp, texts = make_input(root, args.mb)
        bpe = train_bpe(root, texts, args.vocab)
        size = inp.stat().st_size
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        print(f"input: {size / 1e6:.1f} MB JSONL ({len(texts):,} documents); shards of {size / 8 / 2**20:.1f} MiB "
              f"(8 units); ray {ray.__version__}, tokenizers {tokenizers.__version__}; median of {args.repeats}")
        print(f"{'tokenizer':<14}{'workers':>8}{'seconds':>9}{'MB/s':>8}{'tokens/s':>12}{'tokens/s/core':>15}"
              f"{'scaling':>9}{'MB per CPU-s':>14}{'tokens per CPU-s':>18}")
        for name, spec in (("bytes", "bytes"), (f"BPE {args.vocab}", str(bpe))):
            one = None
            for workers in (1, 2):
                runs = []
                for r in range(args.repeats):
                    out = root / f"out-{workers}-{r}"
                    runs.append(prepare([str(inp)], spec, str(out), shard_mb=size / 8 / 2**20, workers=workers,
                                        progress=False))
                    shutil.rmtree(out)
                secs = statistics.median(s["seconds"] for s in runs)
                cpu = statistics.median(s["task_cpu_seconds"] for s in runs)
                tokens = runs[0]["tokens"]
                one = one or secs
                print(f"{name:<14}{workers:>8}{secs:>9.2f}{size / secs / 1e6:>8.2f}{tokens / secs:>12,.0f}"
                      f"{tokens / secs / workers:>15,.0f}{one / secs:>8.2f}x{size / cpu / 1e6:>14.2f}"
                      f"{tokens / cpu:>18,.0f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
