"""The token that ties a call's baggage to a rollout of this run."""

from mas_trainer.trace.instrument import rollout_token, rollout_token_ok


def test_the_token_binds_every_routing_field_and_checks_in_constant_time():
    fields = ("r1", "planner", "c1", "planner", "b7ad6b7169203331")
    token = rollout_token(*fields)
    assert len(token) == 32 and rollout_token_ok(token, *fields)
    for changed in (("r2", "planner", "c1", "planner", "b7ad6b7169203331"), ("r1", "coder", "c1", "planner", "b7ad6b7169203331"),
                    ("r1", "planner", "c2", "planner", "b7ad6b7169203331"), ("r1", "planner", "c1", "coder", "b7ad6b7169203331"),
                    ("r1", "planner", None, "planner", "b7ad6b7169203331"),
                    ("r1", "planner", "c1", "planner", "b7ad6b7169203332")):  # another call of the same node
        assert rollout_token(*changed) != token and not rollout_token_ok(token, *changed)
    for bad in (None, "", token.upper(), token[:-1], 12, "é" * 32):
        assert not rollout_token_ok(bad, *fields)
