"""bench/bench_update_options.py: it times the shipped learner against each cheaper-update
option on the same turns (on the tiny model here; the figures come from the bundled one)."""

from __future__ import annotations


def test_every_option_is_timed_against_full_fine_tuning(load_bench):
    bench = load_bench("bench_update_options")
    results = bench.main(["--model", "tiny", "--layers", "1", "--reps", "1", "--fp32"])
    opts = results["options"]
    assert set(opts) == {"full", "lora", "lora_top1", "lora+share", "lora_top1+share"}
    assert opts["full"]["ratio_full_over_this"] == 1.0
    for o in opts.values():
        assert o["s_per_update"] > 0
        assert o["ratio_full_over_this"] == opts["full"]["s_per_update"] / o["s_per_update"]
    # an adapter trains far fewer weights than the model; the top layer's adapter half of the 2-layer one's
    params = {name: o["trainable_params"] for name, o in opts.items()}
    assert params["full"] > 10 * params["lora"]
    assert params["lora"] == 2 * params["lora_top1"] == params["lora+share"]
    assert results["turns"] == 32
