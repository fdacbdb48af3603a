"""Served throughput with the engines' torch threads as `engines/threads.py` chooses them, against
one thread and against torch's default (issue 41, point 3).

    .venv/bin/python bench/bench_engine_threads.py [--model default|tiny|PATH] [--policies 1] [--concurrency 8] \\
        [--max-tokens 40] [--reps 3] [--busy 0] [--arms chosen,one,default] [--spin]

An app of `--policies` roles, one policy each, is served by `mas_trainer.serve.build_gateway` (the
`serve app.py:graph` path: one embedded engine per policy in this process) behind the real HTTP
server (`GatewayServer`), and asked over HTTP, greedy, for `--max-tokens` tokens: one request alone,
then `--concurrency` requests to every policy at once. The arms differ only in the engines'
threads, set by $OMP_NUM_THREADS (which the engines honour, `engines/threads.py`): `chosen` unset
(each engine's share of the cores this process may use: the cores over the policies' engines),
`one` 1, `default` torch's own default (read before any engine starts: a thread per physical core,
for each engine). Each arm gets a fresh
gateway (fresh engines) and a warm-up request per policy; the arms alternate within every
repetition, so a change in the machine's load hits each of them. `--busy N` runs N processes that
only spin beside the bench (a loaded machine, reproducibly); the load average is printed anyway.

Prints one line per measurement, the medians and ranges per arm, the ratios of `chosen` to the two
baselines (throughput: higher is better) and a final JSON line. $OMP_WAIT_POLICY is printed too:
libgomp reads it when torch is imported (`import mas_trainer` sets PASSIVE unless it is set or torch
came first), so compare wait policies by running the bench twice: `--spin` imports torch first,
keeping libgomp's default, the wait policy before this change.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

if "--spin" in sys.argv:  # torch first: mas_trainer then leaves libgomp's own wait policy (spin, then sleep)
    import torch

from mas_trainer.engines.threads import available_cores  # before torch: mas_trainer sets libgomp's wait policy (PASSIVE)

import torch  # noqa: E402, F811

TORCH_DEFAULT = torch.get_num_threads()  # before any engine sizes a pool: torch's default for a new thread

from mas_trainer.gateway import GatewayServer  # noqa: E402
from mas_trainer.serve import build_gateway  # noqa: E402

__all__ = ["main"]

APP = '''
from typing import TypedDict
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from mas_trainer import trainable

POLICIES = {policies!r}

class State(TypedDict, total=False):
    text: str

def graph():
    llm = ChatOpenAI(model="unused", max_retries=0)
    g, last = StateGraph(State), START
    for name in POLICIES:  # a relay: each role rewrites the text before it
        g.add_node(name, lambda s: {{"text": llm.invoke(s["text"]).content}})
        g.add_edge(last, name)
        last = name
    g.add_edge(last, END)
    return trainable(g.compile(), roles={{p: p for p in POLICIES}}, policies={{p: "default" for p in POLICIES}},
                     reward=lambda task, state, traj: 0.0)
'''

PROMPTS = ["Write a long story about a dragon who learns to cook.", "Explain in detail how a car engine works.",
           "Describe the history of Rome from its founding.", "Write a poem about the sea and the stars.",
           "Explain photosynthesis step by step.", "Describe a long walk through an autumn forest.",
           "Write a letter to a friend about your holiday by the lake.", "Explain how computers store numbers."]


async def ask(url: str, requests: list[tuple[str, str]], max_tokens: int) -> tuple[float, int]:
    """Wall seconds for `requests` ((policy, prompt) pairs) sent at once, and the tokens they got back."""
    async with httpx.AsyncClient(base_url=url, timeout=1800) as client:
        async def one(policy: str, prompt: str) -> int:
            body = {"model": policy, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0}
            reply = await client.post("/chat/completions", json=body)
            reply.raise_for_status()
            return int(reply.json()["usage"]["completion_tokens"])

        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(p, q) for p, q in requests))
        return time.perf_counter() - start, sum(tokens)


def measure(app: str, model: str, policies: list[str], threads: int | None, args: argparse.Namespace) -> dict:
    """One arm once: a fresh gateway whose engines take `threads` ($OMP_NUM_THREADS; None: their share)."""
    if threads is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    gateway = build_gateway(app, model=model)
    try:
        with GatewayServer(gateway) as server:
            url = server.base_url
            asyncio.run(ask(url, [(p, PROMPTS[0]) for p in policies], 4))  # loads each lazy engine, warms it up
            backends = [gateway.backends[p].engine for p in policies]  # loaded by the warm-up (a frozen policy's stays unloaded)
            engines = [b.get().engine if hasattr(b, "get") else b for b in backends]
            used = sorted({e.threads.n for e in engines})
            load = os.getloadavg()[0]
            single_s, single_tokens = asyncio.run(ask(url, [(policies[0], PROMPTS[1])], args.max_tokens))
            burst = [(p, PROMPTS[i % len(PROMPTS)]) for p in policies for i in range(args.concurrency)]
            burst_s, burst_tokens = asyncio.run(ask(url, burst, args.max_tokens))
    finally:
        for backend in gateway.backends.values():
            backend.engine.close()
    return {"threads": used, "single_s": single_s, "single_tokens": single_tokens, "burst_s": burst_s,
            "burst_tokens": burst_tokens, "burst_tokens_per_s": burst_tokens / burst_s, "load": (load + os.getloadavg()[0]) / 2}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.2f} ({min(values):.2f}-{max(values):.2f})"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="default (bundled SmolLM2-135M), tiny, or a path")
    parser.add_argument("--policies", type=int, default=1, help="roles served, one engine each, in this process")
    parser.add_argument("--concurrency", type=int, default=8, help="requests sent at once to each policy")
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--busy", type=int, default=0, help="processes that only spin, beside the bench")
    parser.add_argument("--arms", default="chosen,one,default")
    parser.add_argument("--spin", action="store_true", help="libgomp's default wait policy (torch imported before mas_trainer)")
    args = parser.parse_args(argv)
    arms = {"chosen": None, "one": 1, "default": TORCH_DEFAULT}
    chosen = [a for a in args.arms.split(",") if a]
    if not chosen or set(chosen) - set(arms):
        parser.error(f"--arms: a comma-separated choice of {', '.join(arms)}")
    if os.environ.get("OMP_NUM_THREADS"):
        parser.error("unset OMP_NUM_THREADS: the bench sets it per arm")
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{date}: {os.cpu_count()} CPUs ({cpu}), {available_cores()} this process may use; torch {torch.__version__}, "
          f"default threads {TORCH_DEFAULT}; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset: spin, then sleep)')}; "
          f"load {os.getloadavg()[0]:.1f}; {args.busy} busy process(es) beside", flush=True)
    policies = [f"p{i}" for i in range(args.policies)]
    folder = Path(tempfile.mkdtemp(prefix="bench_threads_"))
    (folder / "app.py").write_text(APP.format(policies=policies))
    app = f"{folder / 'app.py'}:graph"
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    runs: dict[str, list[dict]] = {a: [] for a in chosen}
    t0 = time.perf_counter()
    try:
        for rep in range(args.reps):
            for arm in chosen if rep % 2 == 0 else chosen[::-1]:
                r = measure(app, args.model, policies, arms[arm], args)
                runs[arm].append(r)
                print(f"rep {rep} {arm:7s} threads {r['threads']}: 1 request {r['single_s']:6.2f}s ({r['single_tokens']} tokens); "
                      f"{len(policies) * args.concurrency} at once {r['burst_s']:6.2f}s ({r['burst_tokens']} tokens, "
                      f"{r['burst_tokens_per_s']:.1f} tokens/s); load {r['load']:.1f}", flush=True)
    finally:
        for spinner in spinners:
            spinner.kill()
    print(f"\n{'arm':8s} {'threads':8s} {'1 request s':>22s} {'burst s':>22s} {'burst tokens/s':>22s}   (median (range) of {args.reps})")
    for arm, rs in runs.items():
        print(f"{arm:8s} {str(rs[0]['threads']):8s} {spread([r['single_s'] for r in rs]):>22s} {spread([r['burst_s'] for r in rs]):>22s} "
              f"{spread([r['burst_tokens_per_s'] for r in rs]):>22s}")
    ratios = {}
    if "chosen" in runs:
        for base in (b for b in ("one", "default") if b in runs):
            tps = statistics.median(r["burst_tokens_per_s"] for r in runs["chosen"]) / statistics.median(r["burst_tokens_per_s"] for r in runs[base])
            single = statistics.median(r["single_s"] for r in runs[base]) / statistics.median(r["single_s"] for r in runs["chosen"])
            ratios[base] = {"burst_throughput": round(tps, 2), "single_speed": round(single, 2)}
            print(f"chosen / {base}: burst throughput {tps:.2f}x, single request {single:.2f}x as fast")
    summary = {"date": date, "cpu": cpu, "cpus": os.cpu_count(), "available_cores": available_cores(), "torch_default": TORCH_DEFAULT,
               "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "model": args.model, "policies": args.policies,
               "concurrency": args.concurrency, "max_tokens": args.max_tokens, "busy": args.busy, "ratios": ratios,
               "runs": {a: [{k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()} for r in rs] for a, rs in runs.items()},
               "total_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
