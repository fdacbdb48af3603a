"""Sampling seeds of rollout calls come from what a call is (rollout, branch, prompt, how many
calls of its branch sent that prompt before), never from the order calls reach the gateway."""

import os
import subprocess
import sys
from itertools import permutations
from pathlib import Path

from mas_trainer.adapters.langgraph.tracer import branch_segment
from mas_trainer.engines.base import SamplingParams
from mas_trainer.gateway import RolloutSampling, Router
from mas_trainer.gateway.sampling import call_seed, prompt_digest
from mas_trainer.spec import TrainSpec
from mas_trainer.trace import attributes as A

ROOT = Path(__file__).resolve().parents[2]
PLAIN = SamplingParams()
# three `Send` branches of one superstep, as the tracer names them
BRANCHES = [f"worker@2(__pregel_push,{i},False)" for i in range(3)]


def _seeds(order, seed=7, prompts=None):
    """branch -> seed when the branches' calls arrive in `order`."""
    sampling = RolloutSampling()
    sampling.reseed(seed)
    return {b: sampling.apply(PLAIN, "r1", "worker", branch=b, prompt_ids=(prompts or {}).get(b)).seed for b in order}


def test_the_same_call_gets_the_same_seed_in_another_process():
    here = call_seed(7, "s000001-t00000-r0", BRANCHES[1], prompt_digest([1, 2, 3]), 0)
    code = ("from mas_trainer.gateway.sampling import call_seed, prompt_digest; "
            f"print(call_seed(7, 's000001-t00000-r0', {BRANCHES[1]!r}, prompt_digest([1, 2, 3]), 0))")
    for hash_seed in ("1", "2"):  # Python's own hash() would differ between these two
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                             env={**os.environ, "PYTHONHASHSEED": hash_seed}).stdout
        assert int(out) == here
    assert 0 <= here < 2**31


def test_arrival_order_of_parallel_branches_does_not_matter():
    first = _seeds(BRANCHES)
    assert len(set(first.values())) == 3  # each branch its own seed
    for order in permutations(BRANCHES):
        assert _seeds(order) == first
    # with their prompts too (each Send has its own argument)
    prompts = {b: [10 + i, 11] for i, b in enumerate(BRANCHES)}
    assert _seeds(BRANCHES, prompts=prompts) == _seeds(BRANCHES[::-1], prompts=prompts)
    assert _seeds(BRANCHES, seed=8) != first  # the step's seed still counts


def test_seeds_tell_rollouts_prompts_and_repeated_prompts_apart():
    sampling = RolloutSampling()
    sampling.reseed(7)
    b = BRANCHES[0]
    one = sampling.apply(PLAIN, "r1", "worker", branch=b, prompt_ids=[1, 2]).seed
    again = sampling.apply(PLAIN, "r1", "worker", branch=b, prompt_ids=[1, 2]).seed  # the node asks the same twice
    other_prompt = sampling.apply(PLAIN, "r1", "worker", branch=b, prompt_ids=[1, 3]).seed
    other_rollout = sampling.apply(PLAIN, "r2", "worker", branch=b, prompt_ids=[1, 2]).seed
    assert len({one, again, other_prompt, other_rollout}) == 4
    # a later prompt of the branch does not shift the seeds of the earlier one's repeats
    sampling.reseed(7)
    assert sampling.apply(PLAIN, "r1", "worker", branch=b, prompt_ids=[1, 3]).seed == other_prompt
    assert [sampling.apply(PLAIN, "r1", "worker", branch=b, prompt_ids=[1, 2]).seed for _ in range(2)] == [one, again]


def test_a_retried_call_keeps_its_seed():
    """The OpenAI client's retry of a dropped request is the same call (same span id): same seed."""
    sampling = RolloutSampling()
    sampling.reseed(7)
    first = sampling.apply(PLAIN, "r1", "worker", branch=BRANCHES[0], prompt_ids=[1], call_id="00f0").seed
    assert sampling.apply(PLAIN, "r1", "worker", branch=BRANCHES[0], prompt_ids=[1], call_id="00f0").seed == first
    assert sampling.apply(PLAIN, "r1", "worker", branch=BRANCHES[0], prompt_ids=[1], call_id="00f1").seed != first


def test_without_a_branch_the_node_stands_in():
    sampling = RolloutSampling()
    sampling.reseed(7)
    assert sampling.apply(PLAIN, "r1", "planner").seed == call_seed(7, "r1", "planner")
    assert sampling.apply(PLAIN, "r1", "planner", branch="").seed == call_seed(7, "r1", "planner", "", 1)
    assert sampling.apply(PLAIN, None, "planner", branch=BRANCHES[0]) == PLAIN  # outside any rollout: untouched
    assert sampling.apply(SamplingParams(seed=3), "r1", "planner", branch=BRANCHES[0]).seed == 3  # the request's own


def test_the_router_hands_the_branch_on():
    spec = TrainSpec.build({"worker": "p"}).resolve(["worker"])
    bag = {A.BAGGAGE_ROLLOUT: "r1", A.BAGGAGE_NODE: "worker", A.BAGGAGE_NODE_CALL: "n1", A.BAGGAGE_BRANCH: BRANCHES[2]}
    assert Router(spec).route(bag, "m", ["p"]).branch == BRANCHES[2]
    assert Router(spec).route({A.BAGGAGE_NODE: "worker"}, "m", ["p"]).branch is None


def test_a_branch_names_what_langgraph_decided_not_its_task_id():
    send = {"langgraph_step": 2, "langgraph_node": "worker", "langgraph_path": ("__pregel_push", 1, False),
            "langgraph_checkpoint_ns": "worker:9132028c-a9c6-9fec-a527-8ffd649146c9"}
    assert branch_segment("worker", send) == "worker@2(__pregel_push,1,False)"
    rerun = {**send, "langgraph_checkpoint_ns": "worker:d5b99aab-6641-eb35-42ba-45062d4365fa"}  # another run's task id
    assert branch_segment("worker", rerun) == branch_segment("worker", send)
    assert branch_segment("worker", {**send, "langgraph_path": ("__pregel_push", 2, False)}) != branch_segment("worker", send)
    assert branch_segment("worker", send, attempt=2) == "worker@2(__pregel_push,1,False)#2"
    pull = {"langgraph_step": 1, "langgraph_path": ("__pregel_pull", "planner")}
    assert branch_segment("planner", pull) == "planner@1(__pregel_pull,planner)"
