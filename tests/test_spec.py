import pytest

from mas_trainer.spec import FROZEN_POLICY, SpecError, TrainSpec

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
    with pytest.raises(SpecError, match=r"unknown node 'plannr'; valid nodes: planner, coder"):
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
