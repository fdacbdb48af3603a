"""A seeded sample does not depend on what else the engine decodes with it, and the draw
samples exactly the softmax (temperature, top-p) distribution.

The tiny random model's next-token distributions are near-uniform over its whole vocabulary,
the worst case for a batched engine: a row decoded in a batch of other rows gets logits that
differ from its logits alone by float rounding (other kernels for another batch shape, other
padding), and an inverse-CDF draw over a cumulative sum of 49k such probabilities flipped
samples on that rounding within a few tokens.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from mas_trainer.engines.base import SamplingParams  # noqa: E402
from mas_trainer.engines.chat import HFChatFormat  # noqa: E402
from mas_trainer.engines.config import EngineSettings  # noqa: E402
from mas_trainer.engines.models import load_model  # noqa: E402
from mas_trainer.engines.torch_engine import TorchEngine  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", seed=0)


@pytest.fixture(scope="module")
def prompts(tiny):
    fmt = HFChatFormat(tiny[1])
    return [fmt.render([{"role": "user", "content": "word " * (1 + 3 * i)}]) for i in range(8)]


async def test_a_seeded_request_samples_the_same_alone_and_joining_a_batch(tiny, prompts):
    """fp32, the default batch size: a seeded request decoded alone, then joining a running batch
    of 7 other rows (longer and shorter prompts, seeded and unseeded), gives the same tokens.
    With an inverse-CDF draw, seeds 22 and 26 flipped a token here (of 48; x86-64, 2 cores)."""
    model, tok = tiny

    async def steps(eng: TorchEngine, n: int) -> None:
        target = eng.stats["decode_steps"] + n
        while eng.stats["decode_steps"] < target:
            await asyncio.sleep(0.001)

    with TorchEngine(model, tok, model_name="tiny", settings=EngineSettings(max_batch_size=8, engine_bf16=False)) as eng:
        for seed in (3, 22, 26):
            params = SamplingParams(temperature=1.0, max_tokens=48, seed=seed, ignore_eos=True)
            target = prompts[seed % 4 + 2]
            (alone,) = await eng.generate(target, params)
            eng.stats["batch_sizes"].clear()
            others = [asyncio.ensure_future(eng.generate(p, SamplingParams(max_tokens=80, ignore_eos=True,
                                                                           seed=100 + i if i % 2 else None)))
                      for i, p in enumerate(prompts[:7])]
            await steps(eng, 3)
            (joined,) = await eng.generate(target, params)
            await asyncio.gather(*others)
            assert max(eng.stats["batch_sizes"]) == 8  # it did share the batch
            assert joined.token_ids == alone.token_ids, f"seed {seed}"


def _rows(temperature: float, top_p: float, seeds: list[int | None]) -> list:
    """Stand-ins for the engine's rows: what `_draw` reads of them."""
    params = SamplingParams(temperature=temperature, top_p=top_p)
    return [SimpleNamespace(req=SimpleNamespace(params=params),
                            generator=None if s is None else torch.Generator().manual_seed(s)) for s in seeds]


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8)])
@pytest.mark.parametrize("fast_decode", [True, False])
def test_the_draw_samples_the_softmax_distribution(tiny, temperature, top_p, fast_decode):
    """Frequencies over 4000 draws (2000 seeded rows, 2000 from the engine's generator) of a
    fixed 6-token distribution, within a wide band (a frequency's std is under 0.008 here)
    of softmax(logits / temperature), renormalised over the top-p nucleus."""
    model, tok = tiny
    with TorchEngine(model, tok, model_name="tiny", settings=EngineSettings(engine_bf16=False, fast_decode=fast_decode)) as eng:
        logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -30.0])
        probs = torch.softmax(logits / temperature, -1)
        if top_p < 1:
            keep = probs.cumsum(-1) - probs < top_p
            probs = torch.where(keep, probs, 0.0) / probs[keep].sum()
        rows = 200
        picks = []
        for k in range(10):
            batch = logits.repeat(rows, 1)
            picks.append(eng._draw(batch, _rows(temperature, top_p, [k * rows + i for i in range(rows)])))
            picks.append(eng._draw(batch, _rows(temperature, top_p, [None] * rows)))
        freq = torch.bincount(torch.cat(picks), minlength=6).double() / (20 * rows)
    assert (freq - probs.double()).abs().max() < 0.04, (freq, probs)
    assert freq[probs == 0].sum() == 0  # a token top-p removed (or of no mass) is never drawn


def test_a_seeded_draw_does_not_follow_the_rounding_of_its_logits(tiny):
    """The same 2000 seeded rows of a near-uniform 49k-token distribution (an untrained model's),
    drawn again after their logits moved by up to 1e-6 (what decoding a row alone or among other
    rows changes on the tiny model, in fp32): every draw stays. An inverse-CDF draw flipped one."""
    model, tok = tiny
    g = torch.Generator().manual_seed(1)
    row = torch.randn(49152, generator=g) * 0.16
    with TorchEngine(model, tok, model_name="tiny", settings=EngineSettings(engine_bf16=False)) as eng:
        for start in range(0, 2000, 500):
            seeds = list(range(start, start + 500))
            logits = row.repeat(500, 1)
            moved = logits + (torch.rand(logits.shape, generator=g) - 0.5) * 2e-6
            before = eng._draw(logits, _rows(1.0, 1.0, seeds))
            after = eng._draw(moved, _rows(1.0, 1.0, seeds))
            assert torch.equal(before, after), (start, int((before != after).sum()))
