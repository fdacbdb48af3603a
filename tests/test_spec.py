import pytest

from mas_trainer.spec import FROZEN_POLICY, SpecError, TrainSpec, qualified_nodes

NODES = ["planner", "coder", "reflector", "research", "research:search_query", "research:summarize"]


def test_full_sharing_separation_and_partial_sharing():
    shared = TrainSpec.build({"planner": "p", "coder": "p", "reflector": "p"}).resolve(NODES)
    assert {shared.route(n).policy for n in ("planner", "coder", "reflector")} == {"p"}

    separate = TrainSpec.build({"planner": "a", "coder": "b", "reflector": "c"}).resolve(NODES)
    assert [separate.route(n).policy for n in ("planner", "coder", "reflector")] == ["a", "b", "c"]

    partial = TrainSpec.build(
        {"planner": "planner_model", "coder": "worker", "reflector": "worker"},
        {"planner_model": "default", "worker": "tiny"},
    ).resolve(NODES)
    assert partial.route("coder").policy == partial.route("reflector").policy == "worker"
    assert partial.route("planner").policy == "planner_model"
    assert partial.policies["worker"].base_model == "tiny"


def test_unknown_node_lists_valid_nodes():
    with pytest.raises(SpecError, match=r"unknown node 'plannr'; did you mean 'planner'\? valid nodes: planner, coder"):
        TrainSpec.build({"plannr": "p"}).resolve(NODES)


def test_unknown_policy_lists_valid_policies():
    with pytest.raises(SpecError, match=r"unknown policy 'q'; valid policies: p"):
        TrainSpec.build({"planner": "q"}, {"p": "default"})


def test_node_both_trained_and_frozen_is_an_error():
    with pytest.raises(SpecError, match="both trained"):
        TrainSpec.build({"planner": "p"}, frozen=["planner"])


def test_subgraph_nodes_by_qualified_or_unique_bare_name():
    spec = TrainSpec.build({"research:search_query": "s", "summarize": "t"}).resolve(NODES)
    assert spec.route("research:search_query").policy == "s"
    assert spec.route("research:summarize").policy == "t"


def test_unlisted_nodes_inherit_enclosing_node_then_fall_back_to_frozen():
    spec = TrainSpec.build({"research": "p"}).resolve(NODES)
    assert spec.route("research:summarize").policy == "p"
    r = spec.route("coder")
    assert (r.policy, r.trainable) == (FROZEN_POLICY, False)
    assert FROZEN_POLICY in spec.policies and not spec.policies[FROZEN_POLICY].trainable


def test_frozen_and_default_policy():
    spec = TrainSpec.build({"planner": "p"}, frozen=["coder"], default_policy="p").resolve(NODES)
    assert spec.route("coder").policy == FROZEN_POLICY
    assert spec.route("reflector").policy == "p" and spec.route("reflector").trainable


def test_role_names_group_nodes_into_one_role():
    spec = TrainSpec.build({"coder": "w", "reflector": "w"}, role_names={"coder": "dev", "reflector": "dev"}).resolve(NODES)
    assert spec.route("coder").role == spec.route("reflector").role == "dev"


def test_model_override_and_undecorated_default():
    spec = TrainSpec.build({"planner": "p"}).with_base_model("tiny")
    assert spec.policies["p"].base_model == "tiny"
    plain = TrainSpec.one_policy_per_graph("tiny").resolve(NODES)
    assert plain.route("coder").role == "coder" and plain.route("coder").policy == "default"
    assert plain.route("planner").role == "planner"


# what LangGraph's xray listing shows for a create_supervisor graph: only the nodes inside agents
XRAY = ["supervisor:__start__", "supervisor:agent", "supervisor:tools", "supervisor:__end__",
        "math_expert:__start__", "math_expert:model", "math_expert:tools", "math_expert:__end__",
        "research_expert:agent"]


def test_qualified_nodes_list_enclosing_nodes_and_drop_endpoints():
    assert qualified_nodes(["__start__", *XRAY, "__end__"]) == [
        "supervisor", "supervisor:agent", "supervisor:tools", "math_expert", "math_expert:model",
        "math_expert:tools", "research_expert", "research_expert:agent"]
    assert qualified_nodes(["a:b:c", "a:d", "e"]) == ["a", "a:b", "a:b:c", "a:d", "e"]


def test_agent_names_map_every_node_inside_them():
    spec = TrainSpec.build({"supervisor": "sup", "math_expert": "math"}).resolve(XRAY)
    for node in ("supervisor:agent", "supervisor:tools"):
        assert (spec.route(node).role, spec.route(node).policy) == ("supervisor", "sup")
    assert (spec.route("math_expert:model").role, spec.route("math_expert:model").policy) == ("math_expert", "math")
    # an agent nobody listed is frozen, under its own node name
    assert spec.route("research_expert:agent").policy == FROZEN_POLICY
    with pytest.raises(SpecError, match=r"unknown node 'math'; valid nodes: supervisor, supervisor:agent, "
                                        r"supervisor:tools, math_expert, math_expert:model"):
        TrainSpec.build({"math": "p"}).resolve(XRAY)


def test_nearest_listed_enclosing_node_wins():
    spec = TrainSpec.build({"math_expert": "math", "math_expert:model": "model_only", "a": "outer"},
                           role_names={"math_expert:model": "calculator"}).resolve([*XRAY, "a:b:c", "a:b:d"])
    assert (spec.route("math_expert:model").role, spec.route("math_expert:model").policy) == ("calculator", "model_only")
    assert spec.route("math_expert:tools").policy == "math"
    assert spec.route("a:b:c").policy == spec.route("a:b:d").policy == "outer"
    # deeper than any listing (a subgraph invoked inside a node function): still the enclosing node's
    assert spec.route("math_expert:model:inner").policy == "model_only"


def test_misspelt_names_get_a_did_you_mean():
    with pytest.raises(SpecError, match=r"^role 'planner' maps to unknown policy 'wrker'; did you mean 'worker'\? "
                                        r"valid policies: planner, worker$"):
        TrainSpec.build({"planner": "wrker"}, {"planner": "default", "worker": "default"})
    with pytest.raises(SpecError, match=r"^default_policy 'plannr' is not a policy; did you mean 'planner'\? valid policies: planner$"):
        TrainSpec.build({"planner": "planner"}, default_policy="plannr")


def _fn(task, subject, traj):
    return 1.0


def test_reward_keys_must_be_roles_of_the_app():
    """A reward keyed by a name that is no role would never run: one line naming the key, the
    roles and the closest, checked when the spec meets the graph (trainable(), app load)."""
    roles = {"planner": "p", "coder": "w", "reflector": "w"}
    with pytest.raises(SpecError, match=r"^role_rewards key 'plannr' is not a role of the app, so that reward would never "
                                        r"run; did you mean 'planner'\? the app's roles: planner, coder, reflector, research, "
                                        r"research:search_query, research:summarize$"):
        TrainSpec.build(roles, role_rewards={"plannr": _fn}).resolve(NODES)
    with pytest.raises(SpecError, match=r"^turn_rewards key 'w' is a policy, not a role: rewards are keyed by role "
                                        r"\(the roles it serves: coder, reflector\)"):
        TrainSpec.build(roles, turn_rewards={"w": _fn}).resolve(NODES)
    # role names, nodes inside a listed agent (their calls are the agent's role) and grouped roles
    grouped = TrainSpec.build(roles, role_names={"coder": "dev", "reflector": "dev"}, role_rewards={"dev": _fn})
    assert grouped.resolve(NODES).roles == ["planner", "dev", "research", "research:search_query", "research:summarize"]
    with pytest.raises(SpecError, match=r"^role_rewards key 'coder' is a node that plays role 'dev': rewards are keyed by role; "
                                        r"the app's roles: planner, dev, reflector"):
        TrainSpec.build(roles, role_names={"coder": "dev"}, role_rewards={"coder": _fn}).resolve(NODES)
    with pytest.raises(SpecError, match=r"^turn_rewards key 'math_expert:model' is a node that plays role 'math_expert'"):
        TrainSpec.build({"math_expert": "m"}, turn_rewards={"math_expert:model": _fn}).resolve(XRAY)
    # fine: a role, a frozen node's role, an unlisted node under default_policy, one callable for every role
    TrainSpec.build(roles, role_rewards={"planner": _fn, "research:summarize": _fn}, turn_rewards={"coder": _fn}).resolve(NODES)
    TrainSpec.build({"math_expert": "m"}, default_policy="m", role_rewards={"supervisor:agent": _fn}).resolve(XRAY)
    TrainSpec.build(roles, role_rewards=_fn, turn_rewards=_fn).resolve(NODES)


def test_the_frozen_policy_is_listed_only_where_a_node_is_served_by_it():
    """Every node trained: `frozen` only answers calls that name no node, and is not listed."""
    all_trained = TrainSpec.build({n: "p" for n in ("planner", "coder", "reflector", "research")}, {"p": "tiny"}).resolve(NODES)
    assert FROZEN_POLICY in all_trained.policies  # still there for calls that name no node
    assert all_trained.describe_policies() == "p=tiny"
    some_frozen = TrainSpec.build({"planner": "p"}, {"p": "tiny"}, frozen=["coder"]).resolve(NODES)
    assert some_frozen.describe_policies() == "p=tiny, frozen=tiny (coder, reflector, research, research:search_query, research:summarize)"
