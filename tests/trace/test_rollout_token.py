"""The token that ties a call's baggage to a rollout of this run."""

from mas_trainer.trace.instrument import rollout_token, rollout_token_ok


def test_the_token_binds_every_routing_field_and_checks_in_constant_time():
    fields = ("r1", "planner", "c1", "planner")
    token = rollout_token(*fields)
    assert len(token) == 32 and rollout_token_ok(token, *fields)
    for changed in (("r2", "planner", "c1", "planner"), ("r1", "coder", "c1", "planner"), ("r1", "planner", "c2", "planner"),
                    ("r1", "planner", "c1", "coder"), ("r1", "planner", None, "planner")):
        assert rollout_token(*changed) != token and not rollout_token_ok(token, *changed)
    for bad in (None, "", token.upper(), token[:-1], 12, "é" * 32):
        assert not rollout_token_ok(bad, *fields)
