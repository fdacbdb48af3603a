"""How often a model answers the example apps' agents with a well-formed call of the right tool.

The 18 prompts are the exact first turns (messages, tools) of the agents of `supervisor_pkg.py`,
`swarm_pkg.py` and `tools_agent.py`, captured on scripted fake engines. Each is decoded greedily
and at temperature 1: free (`tool_choice` auto, as these apps ask; the reply parsed for
`<tool_call>` tags as the gateway parses it) and forced (`tool_choice="required"`: under the
gateway's grammar). Prints one line per agent, the table of docs/decorator.md, a JSON line.

    python bench/bench_tool_calls.py [--model default|tiny|PATH] [--quick] [--prompts N] [--samples 8]

The free probe is the slow part: ~21 min on 2 CPU cores with the bundled model.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

APPS = Path(__file__).resolve().parents[1] / "examples" / "langgraph_apps"
MATHY = re.compile(r"\d+\s*(\*|times|plus|\+|/|-)\s*\(?\d|Compute|divided")


def user_text(messages: list[dict]) -> str:
    return next(m["content"] for m in messages if m["role"] == "user")


def expected(policy: str, messages: list[dict]) -> str:
    """The tool the agent should call first on this question."""
    text = user_text(messages)
    mathy = MATHY.search(text)
    return {
        "supervisor_pkg:supervisor": "transfer_to_math_expert" if mathy else "transfer_to_research_expert",
        "supervisor_pkg:math": "calculate", "supervisor_pkg:research": "lookup",
        "swarm_pkg:concierge": "transfer_to_math_expert" if mathy else "convert_length",
        "swarm_pkg:math": "multiply" if "times" in text else "add", "tools_agent:agent": "calculator",
    }[policy]


def scripted(math_tool: str | None = None, other_tool: str | None = None):
    """A first turn that hands off (math questions to `math_tool`); any later turn, or a worker, answers."""
    def reply(messages: list[dict]) -> str:
        if math_tool is None or any(m["role"] == "assistant" for m in messages):
            return "done"
        tool = math_tool if MATHY.search(user_text(messages)) else other_tool
        return f'<tool_call>{json.dumps({"name": tool, "arguments": {}})}</tool_call>' if tool else "done"
    return reply


def capture_prompts() -> list[dict]:
    """Run the three apps on fake engines; keep each agent's first turn on each task."""
    from mas_trainer.engines.fake import FakeChatFormat, FakeEngine, byte_text
    from mas_trainer.gateway import PolicyBackend
    from mas_trainer.loop.session import Session
    hand_off = "transfer_to_math_expert"
    runs = {"supervisor_pkg": {"supervisor": scripted(hand_off, "transfer_to_research_expert"), "math": scripted(),
                               "research": scripted()},
            "swarm_pkg": {"concierge": scripted(hand_off), "math": scripted()}, "tools_agent": {"agent": scripted()}}
    captured: list[dict] = []

    def recorder(policy, script):
        def reply(ids, params, i):
            payload = json.loads(byte_text(ids))
            captured.append({"policy": policy, **payload})
            return script(payload["messages"])
        return FakeEngine(reply=reply)

    for app, scripts in runs.items():
        tasks = [json.loads(line) for line in open(APPS / "data" / f"{app}.jsonl")]
        with Session(backend_factory=lambda m: PolicyBackend(FakeEngine(), FakeChatFormat()), timeout_s=20) as s:
            s.load_app(f"{APPS / app}.py:graph", start_engines=False)
            for policy, script in scripts.items():
                s.attach(policy, PolicyBackend(recorder(f"{app}:{policy}", script), FakeChatFormat()))
            for t in s.run(tasks):
                assert t.status == "ok", t.error
    first: dict[tuple[str, str], dict] = {}
    for c in captured:
        key = (c["policy"], user_text(c["messages"]))
        if c.get("tools") and (key not in first or len(c["messages"]) < len(first[key]["messages"])):
            first[key] = c
    # the i-th prompt of every agent before the (i+1)-th of any, so --prompts N covers as many agents as it can
    return [first[k] for k in sorted(first, key=lambda k: (sum(x[0] == k[0] and x < k for x in first), k))]


async def probe(engine, fmt, prompts, forced: bool, samples: int, max_tokens: int) -> list[dict]:
    from mas_trainer.engines.base import SamplingParams
    from mas_trainer.gateway.protocol import ChatRequest, bound_schema, json_schema_of
    rows: list[dict] = []

    async def one(c):
        ids, schema = fmt.render(c["messages"], c["tools"]), None
        if forced:  # the grammar the gateway decodes under, with its bounds on strings and arrays
            req = ChatRequest(model="m", messages=c["messages"], tools=c["tools"], tool_choice="required")
            schema = bound_schema(json_schema_of(req), max_string_length=200, max_items=16)
        modes = [("greedy", SamplingParams(temperature=0.0, max_tokens=max_tokens, json_schema=schema)),
                 ("temperature 1", SamplingParams(temperature=1.0, max_tokens=max_tokens, n=samples, seed=0, json_schema=schema))]
        for mode, params in modes[: 1 + (samples > 0)]:
            for g in await engine.generate(ids, params):
                if forced:
                    try:
                        names = [json.loads(g.text).get("name")]
                    except ValueError:
                        names = []
                else:
                    names = [x["function"]["name"] for x in fmt.parse(g.text, c["tools"])[1]]
                rows.append(dict(policy=c["policy"], mode=mode, n=1, call=int(bool(names)),
                                 right=int(expected(c["policy"], c["messages"]) in names),
                                 tag=int("<tool_call>" in g.text), name_key=int('"name"' in g.text)))
    await asyncio.gather(*(one(c) for c in prompts))
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="default (bundled SmolLM2-135M-Instruct), tiny, or a path")
    parser.add_argument("--prompts", type=int, default=None, help="at most this many prompts (one per agent first)")
    parser.add_argument("--samples", type=int, default=8, help="samples at temperature 1 per prompt, free decoding")
    parser.add_argument("--forced-samples", type=int, default=4, help="samples at temperature 1 per prompt, forced")
    parser.add_argument("--max-tokens", type=int, default=None, help="new tokens (default 96 free, 64 forced)")
    parser.add_argument("--skip-free", action="store_true", help="run the forced probe only (the free one is slow)")
    parser.add_argument("--quick", action="store_true", help="one prompt per agent, 2 samples at temperature 1")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.samples, args.forced_samples = args.prompts or 6, min(args.samples, 2), min(args.forced_samples, 2)
    from mas_trainer.engines.config import EngineSettings
    from mas_trainer.loop.backends import torch_backend

    cpu = [ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")][:1]
    print(f"{datetime.date.today()}; {(cpu or [platform.machine()])[0]}, {os.cpu_count()} cores; model {args.model}")
    prompts = capture_prompts()[: args.prompts]
    print(f"{len(prompts)} prompts:", ", ".join(f"{p} x{n}" for p, n in collections.Counter(c["policy"] for c in prompts).items()))
    backend = torch_backend(args.model, settings=EngineSettings(max_batch_size=8, engine_bf16=False))
    probes = [("free", False, args.samples, args.max_tokens or 96)] * (not args.skip_free)
    summary, table = {"model": args.model, "prompts": len(prompts)}, []
    try:
        for label, forced, samples, max_tokens in probes + [("forced", True, args.forced_samples, args.max_tokens or 64)]:
            t0 = time.perf_counter()
            rows = asyncio.run(probe(backend.engine, backend.chat, prompts, forced, samples, max_tokens))
            summary[f"{label}_s"] = round(time.perf_counter() - t0, 1)
            print(f"{label} probe: {len(rows)} generations in {summary[f'{label}_s']:.0f} s")
            agg = collections.defaultdict(collections.Counter)
            for r in rows:
                for key in ((r["mode"], ""), (r["mode"], r["policy"])):
                    agg[key].update({k: r[k] for k in ("n", "call", "right", "tag", "name_key")})
            for (mode, policy), a in sorted(agg.items()):
                if policy:
                    print(f'  {label:6s} {mode:13s} {policy:26s} {a["call"]:3d} of {a["n"]:3d} well-formed, {a["right"]:3d} right tool')
                    continue
                note = "" if forced else f' ({a["tag"]} with a <tool_call> tag, {a["name_key"]} with a "name" key)'
                table.append(f'| {label}, {mode} | {a["call"]} of {a["n"]}{note} | {a["right"]} |')
                summary[f"{label}, {mode}"] = dict(a)
    finally:
        backend.engine.close()
    print("\n| decoding | well-formed tool calls | right tool |\n|---|---|---|\n" + "\n".join(table))
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    # langgraph_supervisor lists the supervisor's hand-off tools in set order: fix the hash seed, so
    # every run sends the order measured in docs/decorator.md (research_expert, math_expert)
    if os.environ.get("PYTHONHASHSEED") != "0":
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONHASHSEED": "0"})
    main()
