"""`k3ray convert --from-hf DIR --to CKPT_DIR` and `k3ray export --hf CKPT_DIR OUT | --weights-only CKPT_DIR OUT`:
k3ray checkpoints to and from the released (Hugging Face) format (k3ray.formats.hf); `k3ray init`: a
config's seeded initial weights as a checkpoint."""
from __future__ import annotations

import argparse
import json
import time

from k3ray.config import ConfigError, load_config


def _size(text: str) -> int:
    """'5GB', '500MB', '2GiB', '1e9' -> bytes."""
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    t = text.strip().upper()
    for unit, scale in units.items():
        if t.endswith(unit):
            t, mult = t[:-len(unit)], scale
            break
    else:
        mult = 1
    try:
        value = int(float(t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size such as 5GB, 500MB or 2GiB") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be positive")
    return value


def _readable(fn):
    """Bad input (a folder, a tensor, a checkpoint) is one line and exit 2, as a config error is."""
    def run(args) -> int:
        from k3ray.formats.hf import FORMAT_ERRORS
        from k3ray.io.checkpoint import CheckpointError

        try:
            return fn(args)
        except (*FORMAT_ERRORS, CheckpointError) as err:
            raise ConfigError(str(err).strip().splitlines()[0]) from None
    return run


@_readable
def cmd_convert(args) -> int:
    from k3ray.formats.hf import convert_from_hf

    base = load_config(args.config) if args.config else None
    t0 = time.perf_counter()
    info = convert_from_hf(args.from_hf, args.to, args.pp, args.ep, args.dtype, base)
    print(json.dumps({**info, "seconds": round(time.perf_counter() - t0, 3)}))
    return 0


@_readable
def cmd_export(args) -> int:
    import torch

    from k3ray.formats.hf import export_hf, export_weights_only

    weights = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    if args.hf:
        info = export_hf(args.hf[0], args.hf[1], args.max_shard_size, args.layout, weights)
    else:
        info = export_weights_only(args.weights_only[0], args.weights_only[1], weights)
    print(json.dumps({**info, "seconds": round(time.perf_counter() - t0, 3)}))
    return 0


@_readable
def check_release(path: str) -> None:
    """A release folder's config and tensors fit k3ray's model (names, shapes, dtypes), else ConfigError."""
    from k3ray.formats.hf import read_release

    read_release(path)


@_readable
def cmd_init(args) -> int:
    from k3ray.config import parse_assignments
    from k3ray.train.checkpointing import write_seeded_weights

    cfg = load_config(args.config, parse_assignments(args.set))
    t0 = time.perf_counter()
    info = write_seeded_weights(cfg, args.out)
    print(json.dumps({**info, "seconds": round(time.perf_counter() - t0, 3)}))
    return 0


def add_commands(sub, positive_int) -> None:
    it = sub.add_parser("init", help="a config's seeded initial weights as a weights-only k3ray checkpoint")
    it.add_argument("--config", required=True, help="job config (model section and train.seed)")
    it.add_argument("--out", required=True, metavar="CKPT_DIR", help="a new directory: the checkpoint (step 0), "
                    "for `k3ray serve --checkpoint CKPT_DIR` or `k3ray export --hf CKPT_DIR OUT`")
    it.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    it.set_defaults(func=cmd_init)

    cv = sub.add_parser("convert", help="a released (Hugging Face) checkpoint folder -> a k3ray checkpoint")
    cv.add_argument("--from-hf", required=True, metavar="DIR", help="config.json + safetensors shards (+ index)")
    cv.add_argument("--to", required=True, metavar="CKPT_DIR", help="a new directory: the k3ray checkpoint (step 0) "
                    "and config.yaml, for `k3ray train --config CKPT_DIR/config.yaml --resume` or `k3ray serve`")
    cv.add_argument("--pp", type=positive_int, default=1, help="pipeline stages of the written grid (training "
                    "resumes with this pp; serving loads any)")
    cv.add_argument("--ep", type=positive_int, default=1, help="EP ranks of the written grid (any EP size loads "
                    "it); more ranks make smaller parts, and convert holds one part in memory")
    cv.add_argument("--dtype", choices=["bfloat16", "float32", "float64"], default=None,
                    help="model.dtype of the checkpoint (default: that of the folder's weights)")
    cv.add_argument("--config", default=None, help="a job config whose other sections (data, optimizer, ...) the "
                    "checkpoint records; its model section is replaced by config.json's")
    cv.set_defaults(func=cmd_convert)

    ex = sub.add_parser("export", help="a k3ray checkpoint -> the released format, or its weights alone")
    what = ex.add_mutually_exclusive_group(required=True)
    what.add_argument("--hf", nargs=2, metavar=("CKPT_DIR", "OUT"), help="config.json, safetensors shards "
                      "model-0000N-of-0000M.safetensors and their index (newest verified checkpoint)")
    what.add_argument("--weights-only", nargs=2, metavar=("CKPT_DIR", "OUT"), help="a k3ray checkpoint without "
                      "optimizer state, for `k3ray serve --checkpoint OUT`")
    ex.add_argument("--max-shard-size", type=_size, default="5GB", help="--hf: bytes per shard (default 5GB)")
    ex.add_argument("--layout", choices=["text", "release"], default=None, help="--hf: names `model.…` (text) or "
                    "the release's `language_model.model.…` (default: as converted from, else text)")
    ex.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="weights' dtype")
    ex.set_defaults(func=cmd_export)
