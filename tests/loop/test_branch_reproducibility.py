"""Two runs of an app whose `Send` branches race, with one seed, sample the same thing for the
same call, whichever branch reaches the gateway first, and list the calls in the same order
(map_reduce: a planner, one worker per subtopic in parallel, a reducer). The engine batches
as it does by default (runtime.max_batch_size 8).

Each run is made to race the other way round: the worker calls of a rollout wait for one
another, then go one after the other, in the order of their subtopics in one run and in the
reverse order in the other. Seeds given in arrival order swap between the branches then.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from openai.resources.chat.completions import completions as openai_completions

from mas_trainer.config import RuntimeConfig
from mas_trainer.engines.fake import FakeChatFormat, FakeEngine
from mas_trainer.gateway import PolicyBackend
from mas_trainer.loop.controller import call_order
from mas_trainer.loop.session import Session
from mas_trainer.trace.instrument import instrument_openai
from mas_trainer.trace.schema import LLMCall, NodeCall

ROOT = Path(__file__).resolve().parents[2]
APP = f"{ROOT}/examples/langgraph_apps/map_reduce.py:graph"
WORKER_PROMPT = "Write the paragraph on:"


class RaceTheOtherWay:
    """Holds the worker calls of a rollout until `workers` of them are waiting, then lets them go
    `gap_s` apart, sorted by their prompt (`reverse`: the other way round). One rollout at a time.
    Every call asks for at most `max_tokens` (the app's 200 make an untrained model slow)."""

    def __init__(self, workers: int, gap_s: float = 0.3, *, reverse: bool = False, max_tokens: int = 8,
                 monkeypatch: pytest.MonkeyPatch | None = None) -> None:
        instrument_openai()  # wrap the wrapped method: the call's headers are made after the wait
        self.create = openai_completions.Completions.create
        self.workers, self.gap_s, self.reverse, self.max_tokens = workers, gap_s, reverse, max_tokens
        self.groups: list[list[str]] = []
        self.cond = threading.Condition()
        race = self

        def create(client, *args, **kwargs):
            return race._create(client, *args, **kwargs)

        if monkeypatch is not None:
            monkeypatch.setattr(openai_completions.Completions, "create", create)
        else:
            openai_completions.Completions.create = create

    def next_run(self, reverse: bool) -> None:
        self.groups, self.reverse = [], reverse

    def _create(self, client, *args, **kwargs):
        kwargs.pop("max_tokens", None)
        kwargs["max_completion_tokens"] = self.max_tokens
        text = str(kwargs["messages"][-1]["content"])
        if WORKER_PROMPT in text:
            with self.cond:
                if not self.groups or len(self.groups[-1]) >= self.workers:
                    self.groups.append([])
                group = self.groups[-1]
                group.append(text)
                self.cond.notify_all()
                assert self.cond.wait_for(lambda: len(group) >= self.workers, timeout=60), group
                rank = sorted(group, reverse=self.reverse).index(text)
            time.sleep(self.gap_s * rank)
        return self.create(client, *args, **kwargs)


def _run(session: Session, task: dict, seed: int) -> list:
    """(node, prompt, what was sampled) for every LLM call of the rollout, in the trajectory's order."""
    session.load_app(APP)
    session.reseed(seed)
    (traj,) = session.complete(session.rollouts([task], n=1, ids=["s000001-t00000-r0"]))
    assert traj.status == "ok", traj.error
    calls = [(c.node, c.messages[-1]["content"], c.output_text, c.response_ids) for c in traj.llm_calls]
    assert len({call[:2] for call in calls}) == len(calls) == task["num_subtopics"] + 2
    assert [c.node for c in traj.llm_calls] == ["planner", *["worker"] * task["num_subtopics"], "reducer"]
    assert all(n.branch for n in traj.nodes)  # the tracer records each node call's branch
    return calls


def _seed_echo(prompt_ids, params, index):
    # four lines: the planner's reply makes the four subtopics; every reply tells its seed
    return "\n".join(f"part {k} of sample {params.seed}" for k in range(4))


def test_send_branches_sample_the_same_whichever_runs_first_fake_engine(monkeypatch):
    """The seeds alone, through the gateway and the app's own client (the fake engine's reply
    is its seed): milliseconds a call."""
    race = RaceTheOtherWay(4, gap_s=0.2, max_tokens=200, monkeypatch=monkeypatch)
    runs = []
    for reverse in (False, True):
        race.next_run(reverse)
        with Session(backend_factory=lambda _m: PolicyBackend(FakeEngine(latency_s=0.001, reply=_seed_echo), FakeChatFormat()),
                     timeout_s=300, max_in_flight=8) as session:
            runs.append(_run(session, {"topic": "tides", "num_subtopics": 4}, seed=11))
    assert runs[0] == runs[1]  # the same samples, in the same order, though the workers arrived the other way round
    assert len({text for _, _, text, _ in runs[0]}) == 6  # each call its own seed


def test_send_branches_sample_the_same_whichever_runs_first_tiny_model(monkeypatch):
    """The tiny model, whose near-uniform distributions make any seed mix-up show, in fp32 and
    batched as by default: what else is in the batch moves a row's logits by rounding, which
    the engine's exponential-race draw does not follow (tests/engines/test_batch_invariance.py)."""
    race = RaceTheOtherWay(3, monkeypatch=monkeypatch)
    runs = []
    for reverse in (False, True):
        race.next_run(reverse)
        settings = RuntimeConfig(engine_bf16=False)
        with Session(model="tiny", engine_settings=settings, max_in_flight=4, timeout_s=300) as session:
            runs.append(_run(session, {"topic": "tides", "num_subtopics": 3}, seed=11))
    assert runs[0] == runs[1]


def test_calls_are_listed_by_their_node_calls_then_start_time():
    """Superstep first; a step's Sends by their index (10 after 9); a retry after its first
    attempt; a subgraph's nodes inside their enclosing node call; then start time; calls outside
    a node call with a branch last."""
    def node(id, step, branch, parent=None, attempt=1):
        return NodeCall(id=id, name=branch.split("@")[0], step=step, parent_id=parent, status="ok", attempt=attempt,
                        branch=branch)

    def call(id, node_id, start):
        return LLMCall(id=id, node_id=node_id, node=None, role="r", policy="p", messages=[], output_text="",
                       prompt_ids=[], response_ids=[], response_logprobs=[], finish_reason="stop", start_time=start)

    push = "worker@2(__pregel_push,{},False)"
    nodes = [node("plan", 1, "planner@1(__pregel_pull,planner)"), node("w10", 2, push.format(10)),
             node("w9", 2, push.format(9)), node("w9b", 2, push.format(9) + "#2", attempt=2),
             node("sub", 1, push.format(9) + "|inner@1(__pregel_pull,inner)", parent="w9"),
             node("red", 3, "reducer@3(__pregel_pull,reducer)"), node("other", None, "")]
    nodes[-1].branch = None
    calls = [call("late", None, 0.5), call("red", "red", 1.0), call("w10", "w10", 2.0), call("sub", "sub", 3.0),
             call("w9b", "w9b", 4.0), call("w9-second", "w9", 9.0), call("w9-first", "w9", 8.0),
             call("plan", "plan", 10.0), call("other", "other", 0.1)]
    ordered = [c.id for c in sorted(calls, key=call_order(nodes))]
    assert ordered == ["plan", "w9-first", "w9-second", "sub", "w9b", "w10", "red", "other", "late"]


# --- kill -9 during a step, then --resume --------------------------------------------------

TASK = {"topic": "tides", "num_subtopics": 3, "keywords": ["moon"]}
FIT = ["fit", APP, "model=tiny", "runtime.execution=local", "rollout.tasks_per_step=1", "rollout.n=1", "rollout.max_in_flight=4",
       "steps=2", "save_every=1", "seed=5", "learner.lr=1e-2",
       # bit-exact as tests/loop/test_recovery.py's runs; the engine batches rows as by default
       "learner.bf16=false", "runtime.engine_bf16=false"]
CALLS_PER_STEP = TASK["num_subtopics"] + 2


def _fit_process(args: list[str], reverse: bool, kill_at_call: int) -> None:
    """In a process of its own: `fit` with the workers racing one way, SIGKILLed as its
    `kill_at_call`-th LLM call reaches the policy (0: never)."""
    from mas_trainer.cli import main
    from mas_trainer.policy import local

    RaceTheOtherWay(TASK["num_subtopics"], reverse=reverse)
    generate, seen = local.LocalPolicy.generate, [0]

    async def _generate(self, *a, **kw):
        seen[0] += 1
        if seen[0] == kill_at_call:
            os.kill(os.getpid(), signal.SIGKILL)
        return await generate(self, *a, **kw)

    local.LocalPolicy.generate = _generate
    sys.exit(main(args))


def _fit(out: Path, data: Path, *extra: str, reverse: bool = False, kill_at_call: int = 0) -> subprocess.CompletedProcess:
    spec = json.dumps({"args": [*FIT, "--data", str(data), "--output", str(out), *extra], "reverse": reverse,
                       "kill_at_call": kill_at_call})
    return subprocess.run([sys.executable, __file__, spec], capture_output=True, text=True, cwd=ROOT, timeout=900,
                          env={**os.environ, "MKL_CBWR": "COMPATIBLE"})


def _sampled(out: Path) -> dict[str, list]:
    """trajectory file -> (rollout, node, prompt, response ids) of every call, in the trajectories' order."""
    return {p.name: [(t["rollout_id"], c["node"], json.dumps(c["messages"]), c["response_ids"])
                     for t in map(json.loads, p.read_text().splitlines()) for c in t["llm_calls"]]
            for p in sorted((out / "trajectories").iterdir())}


def _metrics(out: Path) -> list[dict]:
    """The metrics rows less what timing decides: durations (`time/...`, `perf/...`, a policy's
    `policy/NAME/time/...`)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not {"time", "perf"} & set(k.split("/")[:3])} for r in rows]


def test_kill_9_in_a_step_with_send_branches_then_resume_samples_what_the_whole_run_did(tmp_path):
    """The whole run races its workers one way; a run killed in step 2 and resumed from step 1's
    checkpoint races step 2's the other way: step 2 samples the same tokens for every call, lists
    the calls in the same order, so trains on the same batch: the same metrics rows."""
    data = tmp_path / "tasks.jsonl"
    data.write_text(json.dumps(TASK) + "\n")
    whole, out = tmp_path / "whole", tmp_path / "run"
    done = _fit(whole, data)
    assert done.returncode == 0, done.stderr[-3000:]
    killed = _fit(out, data, kill_at_call=CALLS_PER_STEP + 2)  # step 2: the planner done, a worker's call reaches the engine
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 1
    resumed = _fit(out, data, "--resume", reverse=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    runs = _sampled(whole), _sampled(out)
    assert list(runs[0]) == list(runs[1]) == ["step_000001.jsonl", "step_000002.jsonl"]
    assert all(len(calls) == CALLS_PER_STEP for calls in runs[0].values())
    assert runs[0] == runs[1]
    metrics = _metrics(whole), _metrics(out)
    assert [r["step"] for r in metrics[0] if r["kind"] == "train"] == [1, 2]
    assert metrics[0] == metrics[1]


if __name__ == "__main__":
    job = json.loads(sys.argv[1])
    _fit_process(job["args"], job["reverse"], job["kill_at_call"])
