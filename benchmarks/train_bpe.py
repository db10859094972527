"""Train a byte-level BPE `tokenizer.json` (the `tokenizers` library) on text files on disk, for `k3ray data prepare`.

    python benchmarks/train_bpe.py --input DIR_OR_FILE... --vocab 16384 --out FOLDER [--max-mb 64]

Files are read in sorted order up to --max-mb of text (undecodable bytes replaced); FOLDER gets tokenizer.json and a
tokenizer_config.json naming <|endoftext|> as the end-of-text token.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers


def read_texts(inputs: list[str], max_bytes: int, suffixes: tuple[str, ...]) -> list[str]:
    texts, total = [], 0
    for spec in inputs:
        path = Path(spec)
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for f in files:
            if suffixes and f.suffix not in suffixes:
                continue
            text = f.read_bytes()[:max_bytes - total].decode("utf-8", errors="replace")
            if text:
                texts.append(text)
                total += len(text)
            if total >= max_bytes:
                return texts
    return texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", nargs="+", required=True)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--max-mb", type=float, default=64.0)
    ap.add_argument("--suffix", action="append", default=[], help="only files ending so (e.g. .py); default all")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    texts = read_texts(args.input, int(args.max_mb * 2**20), tuple(args.suffix))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    print(f"{out / 'tokenizer.json'}: {tok.get_vocab_size()} tokens from {len(texts)} files, "
          f"{sum(map(len, texts)) / 2**20:.1f} MiB of text")


if __name__ == "__main__":
    main()
