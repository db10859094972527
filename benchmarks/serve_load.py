"""Serving under a bounded load: `k3ray serve` on a local Ray cluster, driven by the `openai` async client at fixed
concurrencies (each of C clients sends its next streaming completion when the previous one ends, `--requests` in
all per level), with the server's defaults for its sizes (token budget, pools). Prints per concurrency output
tokens/s, time to first token (p50 / p99), inter-token latency (p50 / p90 / p99), tokens per engine iteration,
prompt tokens/s and the workers' step time per prompt token.

    python benchmarks/serve_load.py [--checkpoint runs/tiny/checkpoints] [--pp 1 --ep 1] [--concurrency 1 16 64 256]
    python benchmarks/serve_load.py --config configs/gpu2.yaml --set model.n_layers=4 ...   # seeded weights
    python benchmarks/serve_load.py ... --prompt-tokens 200:1200 --max-tokens 32:256        # real prompt lengths

Prompts: without --prompt-tokens, a few short code snippets; with it, request i's prompt is a slice of that many
tokens (drawn uniformly, seeded by --seed and i) of Python's own standard library source read from disk, so every
level and every run serves the same requests. --max-tokens is one number or a range drawn alike.

Shared prefixes (the prefix cache, serve.prefix_cache, switched by --prefix-cache on|off): --system-tokens LO:HI puts
one system prompt of that many tokens (drawn once, seeded) before every request's prompt; --turns LO:HI makes each
request a chat of that many turns, each turn resending the conversation so far with a new user turn of
--prompt-tokens (chat kinds: as messages, the replies as assistant turns, as a chat client sends them; `text`: as one
prompt). TTFT counts every turn; the table adds the prompt tokens served from the cache (usage's
cached_tokens) and the engine's hit rate over the level.

    python benchmarks/serve_load.py ... --system-tokens 1000:2000 --prompt-tokens 50:300 --prefix-cache on
    python benchmarks/serve_load.py ... --turns 4:8 --prompt-tokens 50:300 --max-tokens 64:256 --prefix-cache off

Without --checkpoint: with --config, the config's seeded weights (`k3ray init`) in a temporary directory; else it
first trains the tiny config for a few steps there. On a GPU machine the GPU's busy share (nvidia-smi, sampled every
0.2 s) is printed per level. Every streamed chunk counts once for ITL; "tokens per chunk" says how many tokens the
chunks carried on average (above 1 when the client falls behind and an SSE event carries several).
Agents' requests (`--kind`): `text` (the default) streams completions; `chat` the same prompts as one user turn
through chat completions; `json_schema` those chat requests with `response_format` a JSON schema (an object of a
string, a number list and an enum: the grammar masks every token); `tool_call` with two tools and
`tool_choice: required` (a call forced by the grammar); `chat_tools` the same tools with `tool_choice: none` (the
tool_call prompt, no call: what the tools' declarations alone add). Several kinds run their levels one kind after
another on the same server (repeat them to interleave runs); compare a kind's rows with `chat`'s on the same prompts:

    python benchmarks/serve_load.py ... --concurrency 64 --kind chat json_schema tool_call chat json_schema tool_call
A kind joined by `+` (`chat_tools+tool_call`) mixes them in one level, the requests alternating between them: the
same iterations serve both, so a kind's TTFT against the first kind's in that level says what the kind itself adds
(a level of tool calls alone also runs heavier iterations, their forced output fed besides the sampled tokens, which
every request of the level waits on).
`--front-doors N` serves HTTP from N processes; `--client-procs N` spreads the clients over N processes. The host
CPU table gives each process kind's share of a core during a level and its CPU time per 1000 output tokens: where
the host work per token goes.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import openai
import ray
from real_prompts import draws, span

from k3ray.config import load_config, parse_assignments
from k3ray.control.driver import running_job
from k3ray.control.ray_cluster import init_ray
from k3ray.serve.app import start_serving, stop_serving

SCHEMA = {"type": "object", "required": ["summary", "scores", "verdict"], "properties": {
    "summary": {"type": "string", "maxLength": 2000}, "scores": {"type": "array", "items": {"type": "integer"}},
    "verdict": {"enum": ["keep", "drop", "unsure"]}}}
TOOLS = [{"type": "function", "function": {"name": "search", "description": "search the code base", "parameters": {
             "type": "object", "required": ["query"], "properties": {"query": {"type": "string", "maxLength": 2000},
                                                                     "limit": {"type": "integer"}}}}},
         {"type": "function", "function": {"name": "open_file", "description": "read a file", "parameters": {
             "type": "object", "required": ["path"], "properties": {"path": {"type": "string"}}}}}]
KINDS = {"text": {}, "chat": {},
         "json_schema": {"response_format": {"type": "json_schema",
                                             "json_schema": {"name": "review", "schema": SCHEMA}}},
         "tool_call": {"tools": TOOLS, "tool_choice": "required"},
         "chat_tools": {"tools": TOOLS, "tool_choice": "none"}}
PROMPTS = ["def ", "import os\n", "class Reader(object):\n    def __init__(self", "for i in range(",
           "# Licensed to the PSF\n\"\"\"Helpers for ", "    if not data:\n        return "]


def workload(tokenizer, n: int, prompt_tokens: str | None, max_tokens: str, seed: int,
             system_tokens: str | None = None, turns: str = "1") -> list[list[tuple[str, int]]]:
    """n requests, each a chat of one or more turns (user text, max_tokens); request i's drawn by Random((seed, i)):
    the same whatever n. With system_tokens, one system prompt (seeded by `seed` alone) starts every first turn."""
    lo_t, hi_t = span(turns)
    counts = [random.Random(f"{seed}/turns/{i}").randint(lo_t, hi_t) for i in range(n)]
    if prompt_tokens is None:
        lo_m, hi_m = span(max_tokens)
        flat = [(PROMPTS[i % len(PROMPTS)], random.Random(f"{seed}/{i}").randint(lo_m, hi_m))
                for i in range(sum(counts))]
    else:
        flat = [(plain_text(tokenizer, ids), m)
                for ids, m in draws(tokenizer, sum(counts), prompt_tokens, max_tokens, seed)]
    system = ""
    if system_tokens is not None:
        ids, _ = draws(tokenizer, 1, system_tokens, "1", seed + 10**6)[0]
        system = plain_text(tokenizer, ids)
    chats, at = [], 0
    for c in counts:
        chat = flat[at:at + c]
        chats.append([(system + chat[0][0], chat[0][1]), *chat[1:]])
        at += c
    return chats


def plain_text(tokenizer, ids: list[int]) -> str:
    """The text of drawn token ids without the tokenizer's special tokens (a K3-style tokenizer's chat and tool-call
    markers: a prompt holding one would render turns or calls of its own)."""
    special = special_ids(tokenizer)
    return tokenizer.decode([t for t in ids if t not in special])


@functools.lru_cache(maxsize=2)
def special_ids(tokenizer) -> frozenset[int]:
    return frozenset(t for text in tokenizer.specials for t in tokenizer.encode(text))


def train_checkpoint(root: str) -> None:
    cfg = load_config("configs/tiny.yaml", {"train.eval_every": 0, "parallel.pp": 1, "parallel.ep": 1,
                                            "checkpoint.dir": root, "checkpoint.every_n_steps": 4})
    with running_job(cfg) as controller:
        for s in range(4):
            ray.get(controller.train_step.remote(s), timeout=600)


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


async def clients(url: str, model: str, concurrency: int, requests: list[tuple[str, list[tuple[str, int]]]],
                  fits: tuple[str, int] | None = None) -> dict:
    """`concurrency` clients in this process, sending `requests` ((kind, chat): a KINDS key and turns of (user
    text, max_tokens), each turn's prompt the conversation so far) in order: their TTFTs by kind, ITLs, output,
    prompt and cached prompt tokens, chunks. fits: (tokenizer spec, context): a chat ends before a turn whose
    prompt (the replies as text, tokenized again: an untrained model's bytes may not come back as few tokens) and
    max_tokens would not fit the context, as a client keeping its chats within the model's context does."""
    tokenizer = None
    if fits is not None:
        from k3ray.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(fits[0])
    api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    ttft: dict[str, list[float]] = {}
    itl, tokens, prompt_tokens, cached, chunks = [], [0], [0], [0], [0]
    resent = [0, 0]  # turns after a chat's first: the previous turn's prompt tokens, and the tokens they had cached
    queue = list(reversed(requests))

    async def turn(kind: str, conversation: list[dict], max_tokens: int) -> tuple[str, int, int]:
        """One request: a completion of the conversation's text (`text`), or a chat of its messages. Returns its
        reply, prompt tokens and cached prompt tokens."""
        t0 = time.perf_counter()
        last, reply, usage = None, "", (0, 0)
        common = dict(model=model, max_tokens=max_tokens, temperature=0, stream=True,
                      stream_options={"include_usage": True})
        if kind == "text":
            stream = await api.completions.create(prompt="".join(m["content"] for m in conversation), **common)
        else:
            stream = await api.chat.completions.create(messages=conversation, **common, **KINDS[kind])
        async for chunk in stream:
            if chunk.usage is not None:
                tokens[0] += chunk.usage.completion_tokens
                prompt_tokens[0] += chunk.usage.prompt_tokens
                details = chunk.usage.prompt_tokens_details
                usage = (chunk.usage.prompt_tokens, details.cached_tokens if details is not None else 0)
                cached[0] += usage[1]
            text = _chunk_text(chunk.choices[0]) if chunk.choices else ""
            if not text:  # the chat role chunk (sent on admission) and empty deltas carry no output yet
                continue
            chunks[0] += 1
            reply += text
            now = time.perf_counter()  # one chunk per engine iteration that gave this request a token
            if last is None:
                ttft.setdefault(kind, []).append(now - t0)
            else:
                itl.append(now - last)
            last = now
        return (reply, *usage)

    async def client() -> None:
        # a chat resends its conversation as messages, the replies as assistant turns (a completion: as one text)
        while queue:
            conversation: list[dict] = []
            kind, chat = queue.pop()
            for i, (user, max_tokens) in enumerate(chat):
                conversation.append({"role": "user", "content": user})
                if i and tokenizer is not None and len(tokenizer.encode("".join(
                        m["content"] for m in conversation))) + 16 * len(conversation) + max_tokens + 16 > fits[1]:
                    break  # 16 a message: the chat template's tokens around it
                reply, prompt, hit = await turn(kind, conversation, max_tokens)
                if i:
                    resent[0] += previous
                    resent[1] += hit
                previous = prompt
                conversation.append({"role": "assistant", "content": reply})

    await asyncio.gather(*(client() for _ in range(concurrency)))
    await api.close()
    return {"ttft": ttft, "itl": itl, "tokens": tokens[0], "prompt_tokens": prompt_tokens[0], "cached": cached[0],
            "chunks": chunks[0], "resent": resent}


def _chunk_text(choice) -> str:
    """The text a streamed choice carries: a completion's, a chat delta's content or its tool calls' pieces."""
    delta = getattr(choice, "delta", None)
    if delta is None:
        return choice.text or ""
    calls = "".join((c.function.name or "") + (c.function.arguments or "") for c in delta.tool_calls or ()
                    if c.function is not None)
    return (delta.content or "") + calls


def client_process(job: tuple) -> dict:
    """One process's clients. An error comes back as a plain RuntimeError with the server's message: the openai
    client's errors do not pickle, and a pool then reports only that a process died."""
    try:
        return asyncio.run(clients(*job))
    except Exception as err:
        raise RuntimeError(f"{type(err).__name__}: {err}") from None


def level(pool: ProcessPoolExecutor | None, procs: int, engine, url: str, model: str, concurrency: int,
          requests: list[list[tuple[str, int]]], kind: str = "text", fits: tuple[str, int] | None = None) -> dict:
    """One concurrency level, its clients spread over the pool's processes (one process's openai client parses
    a few thousand SSE events per second: more would measure the client). `kind`: a KINDS key, or several joined by
    `+`, which the requests take in turn."""
    procs = 1 if pool is None else min(procs, concurrency)
    kinds = kind.split("+")
    tagged = [(kinds[i % len(kinds)], chat) for i, chat in enumerate(requests)]
    jobs = [(url, model, len(range(i, concurrency, procs)), tagged[i::procs], fits) for i in range(procs)]
    busy = GpuBusy()
    stats0 = ray.get(engine.stats.remote())
    cpu0 = process_cpu_seconds()
    t0 = time.perf_counter()
    parts = [client_process(jobs[0])] if pool is None else list(pool.map(client_process, jobs))
    wall = time.perf_counter() - t0
    cpu = {k: v - cpu0.get(k, 0.0) for k, v in process_cpu_seconds().items()}
    stats = ray.get(engine.stats.remote())
    iterations = max(stats["iterations"] - stats0["iterations"], 1)
    phases = {k: (v - stats0["phase_seconds"][k]) / iterations for k, v in stats["phase_seconds"].items()}
    by_kind = {k: [x for p in parts for x in p["ttft"].get(k, [])] for k in kinds}
    ttft = [x for xs in by_kind.values() for x in xs]
    itl = [x for p in parts for x in p["itl"]]
    tokens, chunks = sum(p["tokens"] for p in parts), sum(p["chunks"] for p in parts)
    prompt_tokens = sum(p["prompt_tokens"] for p in parts)
    cache0, cache = stats0.get("prefix_cache", {}), stats.get("prefix_cache", {})
    looked = cache.get("lookup_tokens", 0) - cache0.get("lookup_tokens", 0)
    hit_rate = (cache.get("hit_tokens", 0) - cache0.get("hit_tokens", 0)) / looked if looked else None
    run = sum(stats["tokens_per_rank"]) - sum(stats0["tokens_per_rank"])  # prompt and decode tokens the workers ran
    worker_s = stats["phase_seconds"]["worker"] - stats0["phase_seconds"]["worker"]
    paths0 = stats0.get("worker_paths", {})
    paths = {k: (v["iterations"] - paths0.get(k, {}).get("iterations", 0),
                 v["seconds"] - paths0.get(k, {}).get("seconds", 0.0)) for k, v in stats.get("worker_paths", {}).items()}
    return {"concurrency": concurrency, "requests": len(requests), "tokens": tokens, "seconds": wall,
            "gpu_busy": busy.stop(), "tokens_per_chunk": tokens / max(chunks, 1),
            "tokens_per_s": tokens / wall, "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
            "ttft_by_kind": {k: (len(xs), pct(xs, 50), pct(xs, 99)) for k, xs in by_kind.items()},
            "itl_p50": pct(itl, 50), "itl_p90": pct(itl, 90), "itl_p99": pct(itl, 99), "cpu": cpu, "wall": wall,
            "iterations": iterations, "phases": phases, "tokens_per_iteration": run / iterations,
            "prompt_tokens_per_s": prompt_tokens / wall, "worker_us_per_prompt_token": 1e6 * worker_s
            / max(prompt_tokens, 1), "preemptions": stats.get("preemptions", 0) - stats0.get("preemptions", 0),
            "cached_share": sum(p["cached"] for p in parts) / max(prompt_tokens, 1), "hit_rate": hit_rate,
            "cached_bytes": cache.get("cached_bytes"),
            "resent": [sum(p["resent"][j] for p in parts) for j in range(2)],
            "worker_paths": {k: v for k, v in paths.items() if v[0] > 0}}


def process_cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) used so far by each kind of process on this machine that serves: Ray's actors by
    class (ray::ServingEngine, ray::Worker, the Serve replica and proxy), the raylet and GCS, and this client."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")[0].decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(pid) == os.getpid() or int(fields[1]) == os.getpid():
            name = "clients (this benchmark)"
        elif cmd.startswith("ray::"):
            name = re.split(r"[.\s]", cmd, maxsplit=1)[0]
        elif os.path.basename(cmd) in ("raylet", "gcs_server"):
            name = os.path.basename(cmd)
        else:
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


class GpuBusy:
    """The GPU's busy share (nvidia-smi utilization.gpu, every 0.2 s) from construction to `stop`; None without one."""

    def __init__(self):
        self.samples: list[float] = []
        self.done = threading.Event()
        self.thread = None
        if shutil.which("nvidia-smi"):
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()

    def _sample(self) -> None:
        while not self.done.wait(0.2):
            out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True).stdout.split()
            if out:
                self.samples.append(float(out[0]))

    def stop(self) -> float | None:
        self.done.set()
        if self.thread is None:
            return None
        self.thread.join()
        return sum(self.samples) / len(self.samples) if self.samples else None


def request_kind(text: str) -> str:
    """--kind: a KINDS key, or keys joined by '+' (mixed in one level)."""
    unknown = [k for k in text.split("+") if k not in KINDS]
    if unknown:
        raise argparse.ArgumentTypeError(f"{unknown[0]!r}: not one of {', '.join(KINDS)}")
    return text


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint")
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--requests", type=int, default=0,
                    help="requests (chats) per level (default: max(4C, 16); with --turns max(C, 16))")
    ap.add_argument("--max-tokens", default="32", help="N or LO:HI (drawn per request, seeded)")
    ap.add_argument("--prompt-tokens", help="LO:HI: prompts of that many tokens of Python's stdlib source (seeded); "
                                            "default: short code snippets")
    ap.add_argument("--seed", type=int, default=0, help="the prompt and max_tokens draws")
    ap.add_argument("--system-tokens", help="LO:HI: one system prompt of that many tokens before every request")
    ap.add_argument("--turns", default="1", help="N or LO:HI turns per request, each resending the conversation")
    ap.add_argument("--prefix-cache", choices=["on", "off"], help="serve.prefix_cache (default: the config's, on)")
    ap.add_argument("--kind", type=request_kind, nargs="+", default=["text"],
                    help="the requests: completions, chat, chat with a JSON schema, chat with a required tool call; "
                         "several: each kind's levels in turn on the same server; A+B: A and B mixed in one level")
    ap.add_argument("--config", help="serve this config's seeded weights (no --checkpoint)")
    ap.add_argument("--set", action="append", default=[], help="config override, with --config")
    ap.add_argument("--token-budget", type=int, help="serve.token_budget (default: the server's, by device)")
    ap.add_argument("--pages-per-rank", type=int, help="serve.pages_per_rank (default: the server's, by device)")
    ap.add_argument("--stream-interval", type=int, default=1, help="serve.stream_interval")
    ap.add_argument("--overlap", choices=["on", "off"], help="serve.overlap (default: the config's: on for pp=1)")
    ap.add_argument("--stepwise-prefill-max", type=int, help="serve.stepwise_prefill_max (default: the config's)")
    ap.add_argument("--iteration-target-ms", type=float,
                    help="serve.iteration_target_ms (default: the config's, none: an iteration may fill the budget)")
    ap.add_argument("--graphs-at-start-s", type=float,
                    help="serve.graphs_at_start_s (default: the config's): seconds of decode graph captures at start")
    ap.add_argument("--front-doors", type=int, default=1, help="HTTP front-door processes")
    ap.add_argument("--client-procs", type=int, default=1, help="processes the clients are spread over")
    args = ap.parse_args()
    root = args.checkpoint
    if root is None:
        root = tempfile.mkdtemp(prefix="k3ray-serve-bench-")
        if args.config:
            from k3ray.train.checkpointing import write_seeded_weights

            cfg = load_config(args.config, parse_assignments(args.set))
            t0 = time.perf_counter()
            info = write_seeded_weights(cfg, root)
            print(f"[serve_load] seeded weights of {args.config} ({info['parameters'] / 1e9:.2f} B parameters, "
                  f"{info['bytes'] / 1e9:.1f} GB) in {time.perf_counter() - t0:.0f}s", flush=True)
    init_ray(None, args.pp * args.ep + 2)
    if root is not None and not args.checkpoint and not args.config:
        train_checkpoint(root)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    top = max(args.concurrency)
    serve_cfg = {"max_waiting": top, "stream_interval": args.stream_interval,  # queue room for every client
                 **({} if args.token_budget is None else {"token_budget": args.token_budget}),
                 **({} if args.pages_per_rank is None else {"pages_per_rank": args.pages_per_rank}),
                 **({} if args.overlap is None else {"overlap": args.overlap == "on"}),
                 **({} if args.prefix_cache is None else {"prefix_cache": args.prefix_cache == "on"}),
                 **({} if args.stepwise_prefill_max is None else {"stepwise_prefill_max": args.stepwise_prefill_max}),
                 **({} if args.iteration_target_ms is None else {"iteration_target_ms": args.iteration_target_ms}),
                 **({} if args.graphs_at_start_s is None else {"graphs_at_start_s": args.graphs_at_start_s})}
    t_start = time.perf_counter()
    serving = start_serving(root, args.pp, args.ep, port=port, serve_overrides=serve_cfg,
                            front_doors=args.front_doors)
    url, info = serving.url, serving.info
    overlap = ray.get(serving.engine.__ray_call__.remote(lambda e: e.loop.overlap))
    sizes = ray.get(serving.engine.__ray_call__.remote(lambda e: e.cfg.serve.model_dump()))
    stepwise = sizes.get("stepwise_prefill_max")
    multi_turn = span(args.turns)[1] > 1
    fits = (info["tokenizer"], ray.get(serving.engine.__ray_call__.remote(lambda e: e.cfg.model.max_seq_len))) \
        if multi_turn else None
    started = ray.get(serving.engine.__ray_call__.remote(lambda e: e.start_seconds))
    print("[serve_load] the engine started in " + ", ".join(f"{k} {v:.1f} s" for k, v in started.items()),
          flush=True)
    from k3ray.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(info["tokenizer"])
    pool = ProcessPoolExecutor(args.client_procs, mp_context=get_context("spawn")) if args.client_procs > 1 else None
    try:
        if pool is not None:  # every client process started (Python, the openai import) before any level
            list(pool.map(time.sleep, [0.5] * args.client_procs))
        print(f"[serve_load] serving after {time.perf_counter() - t_start:.0f}s", flush=True)

        def run_level(concurrency: int, requests: list[list[tuple[str, int]]], kind: str) -> dict:
            t0 = time.perf_counter()
            row = level(pool, args.client_procs, serving.engine, url, info["model"], concurrency, requests,
                        kind, fits)
            print(f"[serve_load] {kind}, concurrency {concurrency}: {row['tokens_per_s']:,.0f} tok/s, "
                  f"{time.perf_counter() - t0:.1f}s", flush=True)
            return {**row, "kind": kind}

        for kind in dict.fromkeys(args.kind):  # warm-up, nothing shared: each kind's first grammar compiled
            run_level(1, [[(p, 4)] for p, _ in (c[0] for c in workload(tokenizer, 2, args.prompt_tokens, "4",
                                                                       args.seed + 1))], kind)
        print(f"[serve_load] first answers done {time.perf_counter() - t_start:.0f}s after the start", flush=True)
        rows = [run_level(c, workload(tokenizer, args.requests or max(c if multi_turn else 4 * c, 16),
                                      args.prompt_tokens, args.max_tokens, args.seed, args.system_tokens, args.turns),
                          kind)
                for kind in args.kind for c in args.concurrency]
    finally:
        if pool is not None:
            pool.shutdown()
        stop_serving(serving)
    print(f"k3ray serve, {info['model']} (checkpoint step {info['step']}), pp={args.pp} x ep={args.ep}, "
          f"requests: {', '.join(dict.fromkeys(args.kind))}, prompts "
          f"{args.prompt_tokens or 'short'} tokens, system prompt {args.system_tokens or 'none'}, turns {args.turns}, "
          f"max_tokens={args.max_tokens} (seed {args.seed}), prefix cache "
          f"{'on' if sizes.get('prefix_cache') else 'off'}, greedy, "
          f"streaming, stream_interval={args.stream_interval}, {args.front_doors} front doors, clients in "
          f"{args.client_procs} processes, overlap {'on' if overlap else 'off'}, prompts of up to {stepwise} tokens "
          f"stepwise; server sizes: token_budget {sizes.get('token_budget')}, slots {sizes.get('slots_per_rank')}, "
          f"pages {sizes.get('pages_per_rank')} x {sizes.get('page_size')} tokens per rank, iteration target "
          f"{sizes.get('iteration_target_ms') or 'none'} ms")
    print("| kind | concurrency | requests | output tokens/s | TTFT p50 / p99 (ms) | ITL p50 / p90 / p99 (ms) | tokens per "
          "iteration | prompt tokens/s | worker us per prompt token | preempted | tokens per chunk | GPU busy | "
          "cached prompt share | hit rate | cache held MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        busy = "-" if r["gpu_busy"] is None else f"{r['gpu_busy']:.0f} %"
        print(f"| {r['kind']} | {r['concurrency']} | {r['requests']} | {r['tokens_per_s']:,.1f} | {1e3 * r['ttft_p50']:.1f} / "
              f"{1e3 * r['ttft_p99']:.1f} | {1e3 * r['itl_p50']:.2f} / {1e3 * r['itl_p90']:.2f} / "
              f"{1e3 * r['itl_p99']:.2f} "
              f"| {r['tokens_per_iteration']:.1f} | {r['prompt_tokens_per_s']:,.0f} | "
              f"{r['worker_us_per_prompt_token']:.1f} | {r['preemptions']} | {r['tokens_per_chunk']:.2f} | {busy} | "
              f"{100 * r['cached_share']:.0f} % | "
              + ("-" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.0f} %") + " | "
              + ("-" if r["cached_bytes"] is None else f"{r['cached_bytes'] / 1e6:,.1f}") + " |", flush=True)
    for r in rows:
        if r["resent"][0]:
            print(f"{r['kind']} c={r['concurrency']}: the turns after a chat's first had {r['resent'][1]:,} prompt "
                  f"tokens cached, {r['resent'][1] / r['resent'][0]:.1%} of the {r['resent'][0]:,} of the "
                  f"conversation they resent (the previous turn's prompt; its reply too where the text it came back "
                  f"as re-tokenizes the same)")
    print("\nHost CPU per process kind: share of one core during the level (CPU seconds / wall seconds), and CPU ms "
          "per 1000 output tokens")
    names = sorted({k for r in rows for k, v in r["cpu"].items() if v > 0.05 * r["wall"]})
    print("| process | " + " | ".join(f"{r['kind']} c={r['concurrency']} core share / ms per 1k tok" for r in rows)
          + " |")
    print("|---|" + "---|" * len(rows))
    for name in names:
        cells = [f"{r['cpu'].get(name, 0) / r['wall']:.2f} / {1e6 * r['cpu'].get(name, 0) / max(r['tokens'], 1):,.0f}"
                 for r in rows]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\nThe engine's iterations (ms each, means over the level): its wall time, and in it scheduling, "
          "waiting for the grid (of which the workers' own step), completing and waking the streams; host = schedule "
          "+ complete + wake, " + ("run while the workers run the iteration before (overlap: hidden where shorter "
                                   "than the step)" if overlap else "between the workers' steps (overlap off)"))
    print("| kind | concurrency | iterations | wall | schedule | grid wait | worker step | complete | wake | host |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        p = r["phases"]
        print(f"| {r['kind']} | {r['concurrency']} | {r['iterations']} | {1e3 * r['wall'] / r['iterations']:.2f} | "
              + " | ".join(f"{1e3 * p[k]:.2f}" for k in ("schedule", "grid", "worker", "complete", "wake"))
              + f" | {1e3 * (p['schedule'] + p['complete'] + p['wake']):.2f} |")
    print("\nThe workers' step by how they ran it (k3ray.parallel.serving `step_path`; the slowest rank's): share of "
          "the iterations, mean ms, share of the workers' time")
    print("| kind | concurrency | path | iterations | mean ms | share of worker time |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        total = sum(t for _, t in r["worker_paths"].values()) or 1.0
        for path, (n, t) in sorted(r["worker_paths"].items(), key=lambda kv: -kv[1][1]):
            print(f"| {r['kind']} | {r['concurrency']} | {path} | {n / r['iterations']:.0%} | {1e3 * t / n:.2f} | "
                  f"{t / total:.0%} |")
    kinds, levels = list(dict.fromkeys(args.kind)), list(dict.fromkeys(args.concurrency))
    median = {(k, c): statistics.median(r["tokens_per_s"] for r in rows if (r["kind"], r["concurrency"]) == (k, c))
              for k in kinds for c in levels}
    print("output tok/s (median of a kind's runs) against its first level: " + ", ".join(
        f"{k} c={c}: {median[k, c] / median[k, levels[0]]:.2f}x" for k in kinds for c in levels))
    if "chat" in kinds:
        print("against chat's at the same concurrency: " + ", ".join(
            f"{k} c={c}: {median[k, c] / median['chat', c]:.2f}x" for k in kinds if k != "chat" for c in levels))
    mixed = [r for r in rows if "+" in r["kind"]]
    if mixed:
        print("\nTTFT by kind within a mixed level (the same iterations serve every kind): p50 / p99 ms, and p50 "
              "against the level's first kind")
        print("| level | concurrency | kind | requests | TTFT p50 / p99 (ms) | p50 against the first kind |")
        print("|---|---|---|---|---|---|")
        for r in mixed:
            first = next(iter(r["ttft_by_kind"].values()))
            for i, (k, (n, p50, p99)) in enumerate(r["ttft_by_kind"].items()):
                ratio = f"{p50 / first[1]:.2f}x" if i else "-"
                print(f"| {r['kind']} | {r['concurrency']} | {k} | {n} | {1e3 * p50:.1f} / {1e3 * p99:.1f} | "
                      f"{ratio} |")

if __name__ == "__main__":
    main()
