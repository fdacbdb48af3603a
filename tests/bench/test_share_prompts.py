"""bench/bench_share_prompts.py: its batch is GRPO-shaped and it times the same update with and
without shared prompts (on the tiny model here; the figures come from the bundled one)."""

from __future__ import annotations

import json

import pytest


def test_groups_share_a_prompt_and_the_shared_update_runs_on_fewer_tokens(load_bench):
    bench = load_bench("bench_share_prompts")
    turns = bench.grouped_turns(1000, prompts=3, samples=4, prompt=20, response=8)
    assert len({tuple(t.prompt_ids) for t in turns}) == 3 and len(turns) == 12
    assert sorted({len(t.response_ids) for t in turns}) == [4, 6, 9, 12]  # varied lengths around 8
    results = bench.main(["--model", "tiny", "--prompts", "2", "--samples", "4", "--prompt", "20", "--response", "4",
                          "--reps", "1", "--fp32"])
    # 8 turns of 20 + ~4 tokens; shared: 2 prompts once each
    assert results["plain_tokens"] > 2 * results["shared_tokens"] and results["shared_s"] > 0
    assert results["ratio_plain_over_shared"] == results["plain_s"] / results["shared_s"]


def test_a_runs_trajectories_give_the_turns_of_its_trainable_calls(tmp_path, load_bench):
    bench = load_bench("bench_share_prompts")

    def call(i, role, trainable=True, prompt=(1, 2, 3)):
        return {"id": f"c{i}", "role": role, "trainable": trainable, "prompt_ids": list(prompt),
                "response_ids": [7, 8], "response_logprobs": [-0.1, -0.2]}

    rows = [{"llm_calls": [call(0, "rewriter", trainable=False), call(1, "answerer")]},
            {"llm_calls": [call(2, "rewriter", trainable=False), call(3, "answerer", prompt=(1, 2))]}]
    path = tmp_path / "step_000001.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    turns = bench.run_turns(str(path), "answerer")
    assert [t.id for t in turns] == ["c1", "c3"] and turns[1].prompt_ids == [1, 2]
    assert list(turns[0].old_logprobs) == [-0.1, -0.2]
    with pytest.raises(SystemExit, match="no trainable calls of role 'critic'"):
        bench.run_turns(str(path), "critic")
