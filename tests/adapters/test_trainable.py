"""@trainable returns the same graph: invoke/stream/async/checkpointer/interrupts unchanged."""

import operator
from typing import Annotated, TypedDict

import pytest
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt

from mas_trainer import trainable
from mas_trainer.adapters.langgraph import as_graph, node_names, spec_of
from mas_trainer.spec import SpecError


class S(TypedDict):
    x: int
    log: Annotated[list, operator.add]


def _builder(with_interrupt: bool = False) -> StateGraph:
    def plan(s):
        return {"x": s["x"] + 1, "log": ["plan"]}

    def act(s):
        if with_interrupt:
            answer = interrupt("approve?")
            return {"log": [f"act:{answer}"]}
        return {"x": s["x"] * 2, "log": ["act"]}

    inner = StateGraph(S)
    inner.add_node("inner_step", lambda s: {"log": ["inner"]})
    inner.add_edge(START, "inner_step")
    g = StateGraph(S)
    g.add_node("plan", plan)
    g.add_node("act", act)
    g.add_node("sub", inner.compile())
    g.add_edge(START, "plan")
    g.add_edge("plan", "act")
    g.add_edge("act", "sub")
    g.add_edge("sub", END)
    return g


ROLES = {"plan": "p", "act": "q"}


async def _all_results(graph, config=None):
    inp = {"x": 1, "log": []}
    return (
        graph.invoke(inp, config),
        await graph.ainvoke(inp, config),
        list(graph.stream(inp, config)),
        [c async for c in graph.astream(inp, config)],
    )


async def test_decorated_compiled_graph_is_the_same_graph():
    plain = _builder().compile()
    marked = trainable(_builder().compile(), roles=ROLES)
    assert await _all_results(marked) == await _all_results(plain)
    assert spec_of(marked).roles == ROLES


async def test_decorated_builder_and_function_forms():
    builder = trainable(_builder(), roles=ROLES)
    assert isinstance(builder, StateGraph)
    compiled = builder.compile()
    assert spec_of(compiled).roles == ROLES  # found through .builder
    assert compiled.invoke({"x": 1, "log": []}) == _builder().compile().invoke({"x": 1, "log": []})

    @trainable(roles=ROLES, policies={"p": "default", "q": "tiny"})
    def make_graph():
        return _builder()

    graph, spec = as_graph(make_graph)
    assert spec.policies["q"].base_model == "tiny"
    assert graph.invoke({"x": 2, "log": []})["x"] == 6


def test_checkpointer_and_interrupts_unchanged():
    def run(graph):
        cfg = {"configurable": {"thread_id": "t1"}}
        first = graph.invoke({"x": 1, "log": []}, cfg)
        resumed = graph.invoke(Command(resume="yes"), cfg)
        return first["log"], "__interrupt__" in first, resumed["log"]

    plain = run(_builder(with_interrupt=True).compile(checkpointer=InMemorySaver()))
    marked = run(trainable(_builder(with_interrupt=True).compile(checkpointer=InMemorySaver()), roles=ROLES))
    assert plain == marked
    assert marked[1] and marked[2][-2:] == ["act:yes", "inner"]


def test_node_names_include_subgraph_nodes():
    assert node_names(_builder().compile()) == ["plan", "act", "sub", "sub:inner_step"]


def test_mistakes_are_caught_at_decoration_time():
    with pytest.raises(SpecError, match=r"unknown node 'plan_x'; did you mean 'plan'\? valid nodes: plan, act, sub, sub:inner_step"):
        trainable(_builder(), roles={"plan_x": "p"})
    with pytest.raises(SpecError, match="valid policies: p"):
        trainable(_builder(), roles={"plan": "nope"}, policies={"p": "default"})
    with pytest.raises(SpecError, match=r"unknown keyword\(s\) 'rewrad' \(did you mean 'reward'\?\)"):
        trainable(_builder(), roles={"plan": "p"}, rewrad=lambda *a: 1.0)
    with pytest.raises(SpecError, match="both trained"):
        trainable(_builder(), roles={"plan": "p"}, frozen=["plan"])
    with pytest.raises(SpecError, match="expects a StateGraph"):
        trainable(42, roles={})
    # a reward keyed by no role would never run: refused on the graph, and on a factory's graph when it is built
    with pytest.raises(SpecError, match=r"^role_rewards key 'pln' is not a role of the app, so that reward would never run; "
                                        r"did you mean 'plan'\? the app's roles: plan, act, sub, sub:inner_step$"):
        trainable(_builder(), roles={"plan": "p"}, role_rewards={"pln": lambda *a: 1.0})
    factory = trainable(_builder, roles={"plan": "p"}, turn_rewards={"p": lambda *a: 1.0})
    with pytest.raises(SpecError, match=r"^turn_rewards key 'p' is a policy, not a role: .*\(the roles it serves: plan\)"):
        factory()


def test_roles_may_name_subgraph_nodes():
    graph = trainable(_builder().compile(), roles={"inner_step": "p", "sub:inner_step": "p"})
    assert set(spec_of(graph).roles) == {"inner_step", "sub:inner_step"}


def test_roles_may_name_the_node_that_holds_a_subgraph():
    graph = trainable(_builder().compile(), roles={"sub": "p"})
    _, spec = as_graph(graph)
    resolved = spec.resolve(node_names(graph))
    assert (resolved.route("sub:inner_step").role, resolved.route("sub:inner_step").policy) == ("sub", "p")


def test_a_task_without_the_messages_a_messages_graph_requires_is_one_line_before_any_rollout(fake_session):
    from langgraph.graph import END, START, MessagesState, StateGraph

    from mas_trainer import trainable
    from mas_trainer.errors import UserError

    ran = []

    def chat(s):
        ran.append(s)
        return {"messages": [{"role": "assistant", "content": "echo " + s["messages"][-1].content}]}

    g = StateGraph(MessagesState)
    g.add_node("chat", chat)
    g.add_edge(START, "chat")
    g.add_edge("chat", END)
    fake_session.load_app(trainable(g.compile(), roles={"chat": "p"}, policies={"p": "tiny"}))
    [ok] = fake_session.run([{"messages": [{"role": "user", "content": "hi"}]}])
    assert ok.status == "ok" and len(ran) == 1
    with pytest.raises(UserError, match=r"""^task \{"question": "hi"\} has no 'messages', which the graph's input \(MessagesState\) """
                                        r"requires: give each task its conversation"):
        fake_session.run([{"question": "hi"}])
    assert len(ran) == 1  # refused before any rollout ran


def test_no_fork_is_kept_on_every_form_and_checked_against_the_nodes():
    from mas_trainer.adapters.langgraph.trainable import no_fork_of

    builder = trainable(_builder(), roles={"plan": "p"}, no_fork=["act"])
    assert no_fork_of(builder.compile()) == {"act"}  # read through the compiled graph to its builder
    assert no_fork_of(trainable(_builder().compile(), roles={"plan": "p"}, no_fork={"act"})) == {"act"}
    made = trainable(roles={"plan": "p"}, no_fork=("act",))(_builder)
    assert no_fork_of(as_graph(made)[0]) == {"act"}
    assert no_fork_of(trainable(_builder().compile(), roles={"plan": "p"})) == frozenset()
    with pytest.raises(SpecError, match=r"no_fork names unknown node\(s\) 'send_email'; the graph's nodes are .*act"):
        trainable(_builder(), roles={"plan": "p"}, no_fork={"send_email"})


def _two(task, final_state):
    return 1.0


def test_a_reward_of_the_wrong_arity_is_refused_when_decorated():
    """Found at decoration, naming the function, where it is defined and how it is called, not
    after a whole step of rollouts; defaults, *args and callable objects that take three pass."""
    from mas_trainer.rewards.levels import RewardError

    with pytest.raises(RewardError, match=r"^reward (test_trainable\.)?_two \(defined at .*test_trainable.py:\d+\) takes \(task, final_state\), "
                       r"but is called as fn\(task, final_state, trajectory\)"):
        trainable(_builder(), roles={"plan": "p"}, reward=_two)
    with pytest.raises(RewardError, match=r"^role_rewards .*<lambda>.* takes \(task\), but is called as fn\(task, calls, trajectory\)"):
        trainable(_builder(), roles={"plan": "p"}, role_rewards={"plan": lambda task: 1.0})
    with pytest.raises(RewardError, match=r"^turn_rewards .* called as fn\(task, llm_call, trajectory\)"):
        trainable(_builder(), roles={"plan": "p"}, turn_rewards=lambda task, call, traj, extra: 1.0)

    class Judge:
        def __call__(self, task, state, trajectory, *, temperature=0.0):
            return 0.5

    trainable(_builder(), roles={"plan": "p"}, reward=Judge(), role_rewards=lambda *a: 1.0,
              turn_rewards={"plan": lambda task, call, traj=None: 1.0})
