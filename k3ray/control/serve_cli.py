"""`k3ray serve`: its arguments and the command (serve a checkpoint until Ctrl-C or SIGTERM, keeping the front doors
up)."""
from __future__ import annotations

import json
import signal
import sys
import time

from k3ray.config import ConfigError, parse_assignments
from k3ray.control import hf_cli
from k3ray.steering.auth import read_api_key

DOOR_CHECK_S = 5.0  # how often `k3ray serve` looks for front doors that died
STANDBYS = {"auto": "auto", "on": True, "off": False}  # --standbys -> fault_tolerance.standbys


def cmd_serve(args) -> int:
    """Serve a checkpoint until Ctrl-C (or SIGTERM)."""
    t0 = time.perf_counter()
    # none of these imports torch (tests/test_serving_start.py): the checks below and Ray's start come first, and the
    # engine's and the workers' processes import torch and the model code (a released folder's check does too)
    from k3ray.control.ray_cluster import init_ray
    from k3ray.formats.release_folder import is_hf_folder
    from k3ray.io import checkpoint as ckpt
    from k3ray.serve.app import check_exposure, start_serving, stop_serving
    from k3ray.serve.metrics import ServeMetrics
    from k3ray.tokenizer import load_tokenizer

    try:
        api_key = read_api_key(args.api_key_file)
        check_exposure(args.host, api_key, args.insecure)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    overrides = {k.removeprefix("serve."): v for k, v in parse_assignments(args.set, "serve.max_waiting=32").items()}
    # the newest committed step's job (its parts are verified by the engine, while it reads them)
    newest = None if is_hf_folder(args.checkpoint) else ckpt.owner(args.checkpoint)
    if is_hf_folder(args.checkpoint):  # a release folder: checked whole here, before any actor starts
        hf_cli.check_release(args.checkpoint)
    elif newest is None:  # here, before any actor starts: a readable error
        raise ConfigError(f"--checkpoint {args.checkpoint}: no verified checkpoint there (train with "
                          f"checkpoint.every_n_steps, or run `k3ray checkpoint` on a running job)")
    if newest is not None:  # the job's tokenizer is still where it was
        load_tokenizer(newest["config"]["data"].get("tokenizer", "bytes"))
    t_checked = time.perf_counter()
    init_ray(args.address, args.pp * args.ep + args.spares)
    t_ray = time.perf_counter()
    serving = start_serving(args.checkpoint, args.pp, args.ep, args.host, args.port, overrides, args.front_doors,
                            observers=[ServeMetrics(args.name)], spares=args.spares, api_key=api_key,
                            insecure=args.insecure, standbys=STANDBYS[args.standbys])
    started = {"imports_and_checks": t_checked - t0, "ray_start": t_ray - t_checked, **serving.start_seconds,
               "total": time.perf_counter() - t0}
    print(json.dumps({"serving": serving.info["model"], "step": serving.info["step"], "url": f"{serving.url}/v1",
                      "started": {k: round(v, 3) for k, v in started.items()},
                      "engine_started": {k: round(v, 3) for k, v in serving.info["start_seconds"].items()}}),
          flush=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a service manager's stop: as Ctrl-C
    try:
        while True:
            time.sleep(DOOR_CHECK_S)
            if replaced := serving.keep_doors():
                print(f"k3ray serve: {replaced} front doors had died and were started again", file=sys.stderr,
                      flush=True)
    except KeyboardInterrupt:
        stop_serving(serving)
    return 0


def add_parser(sub, count) -> None:
    sv = sub.add_parser("serve", help="serve a durable checkpoint: an OpenAI-compatible HTTP API")
    sv.add_argument("--checkpoint", required=True, help="runs/<job>/checkpoints: the newest verified one is served; "
                    "or a released (Hugging Face) folder: config.json + safetensors")
    sv.add_argument("--pp", type=int, default=1, help="pipeline stages of the serving grid")
    sv.add_argument("--ep", type=int, default=1, help="EP ranks per stage (each also serves its own requests)")
    sv.add_argument("--spares", type=count, default=0,
                    help="hot spares: standby workers (one device each) that take a lost worker's place")
    sv.add_argument("--standbys", choices=list(STANDBYS), default="auto",
                    help="a standby process beside each worker on its device (no resources held) that takes its "
                         "place if its process dies; auto: on GPUs")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--api-key-file", metavar="F", help="every route but /health needs `Authorization: Bearer "
                                                         "<key>` (the key: F's first line; else $K3RAY_API_KEY)")
    sv.add_argument("--insecure", action="store_true", help="serve a non-loopback --host without an API key")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--name", default="serve", help="the k3ray_job label of the serving metrics")
    sv.add_argument("--front-doors", type=int, default=1,
                    help="HTTP processes sharing host:port (the SSE work scales apart from the engine)")
    sv.add_argument("--address", default=None, help="Ray cluster to join (default: RAY_ADDRESS or a local one)")
    sv.add_argument("--set", action="append", default=[], metavar="serve.KEY=VALUE",
                    help="serving limits and pools, e.g. serve.max_waiting=32 serve.token_budget=256")
    sv.set_defaults(func=cmd_serve)
