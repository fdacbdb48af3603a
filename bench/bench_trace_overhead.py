"""Tracing overhead: wall time of a 20-node graph traced / the same graph untraced.

Every node makes one ChatOpenAI call to the gateway, whose engine is a fake upstream that
answers after 1 ms. Untraced runs call `graph.ainvoke` directly (no callbacks, no
baggage); traced runs go through the controller (tracer, spans, headers, token ledger).
Runs alternate so drift on the machine hits both alike. Goal: ratio <= 1.03.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import TypedDict


def build_graph(n_nodes: int):
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, StateGraph

    class State(TypedDict):
        text: str

    llm = ChatOpenAI(model="gpt-4o-mini", max_retries=0)

    def make(i: int):
        def node(state: State) -> State:
            return {"text": llm.invoke(f"step {i}: {state['text']}").content}

        return node

    g = StateGraph(State)
    names = [f"n{i}" for i in range(n_nodes)]
    for i, name in enumerate(names):
        g.add_node(name, make(i))
    g.add_edge(START, names[0])
    for a, b in zip(names, names[1:]):
        g.add_edge(a, b)
    g.add_edge(names[-1], END)
    return g.compile()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nodes", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--latency-ms", type=float, default=1.0)
    args = ap.parse_args()

    from mas_trainer.engines.fake import FakeChatFormat, FakeEngine
    from mas_trainer.gateway import PolicyBackend
    from mas_trainer.loop.controller import Controller
    from mas_trainer.loop.session import Session

    def fake_backend(_: str) -> PolicyBackend:
        return PolicyBackend(FakeEngine(latency_s=args.latency_ms / 1000, reply="ok"), FakeChatFormat())

    with Session(backend_factory=fake_backend) as session:
        graph = build_graph(args.nodes)
        app = session.load_app(graph)
        controller = Controller(app, session.ledger)
        task = {"text": "hello"}

        async def untraced() -> float:
            t = time.perf_counter()
            await graph.ainvoke(task)
            return time.perf_counter() - t

        async def traced() -> float:
            t = time.perf_counter()
            traj = await controller.rollout(task)
            assert traj.status == "ok" and len(traj.llm_calls) == args.nodes, traj.error
            return time.perf_counter() - t

        async def run() -> tuple[list[float], list[float]]:
            await untraced(), await traced()  # warm-up: connections, imports
            plain, tr = [], []
            for _ in range(args.rounds):
                plain.append(await untraced())
                tr.append(await traced())
            return plain, tr

        plain, tr = asyncio.run(run())
    p, t = statistics.median(plain), statistics.median(tr)
    print(f"graph: {args.nodes} nodes, 1 LLM call each, fake upstream {args.latency_ms:g} ms, {args.rounds} rounds")
    print(f"untraced: {p * 1000:.1f} ms/rollout (median)")
    print(f"traced:   {t * 1000:.1f} ms/rollout (median)")
    print(f"traced/untraced wall-time ratio: {t / p:.3f} (goal <= 1.03)")


if __name__ == "__main__":
    os.environ.setdefault("OPENAI_API_KEY", "bench")
    main()
