"""Several trainable policies as LoRA adapters of ONE base model, in one process
(``learner.shared_base``): one base in memory, one engine, and per policy an adapter, its own
turn store and its own learner (AdamW state and counters).

Full separation (each role its own policy) otherwise costs a base, an engine and a learner
per policy. Here the engine batches rows of every adapter together (the base's matmuls once,
each row's low-rank update for its own adapter: `TorchEngine(adapters=...)`, or vLLM's
multi-LoRA with `engine: vllm`), and each policy's update trains its adapter alone from its
own turns, the base frozen (`TorchLearner(adapter_name=...)`), on the engine's thread between
batches as `policy/local.py` does. Frozen roles stay on the bare base (the controller's own
engine, as in every run).

The controller sees one `WorkerGroupHandle` per policy (`handle(policy)`), so the trainer, the
gateway and checkpoints work as for separate policies; each policy's checkpoint is a plain
peft adapter folder whose base is the shared base's model reference.
"""

from __future__ import annotations

import tempfile
import zlib
from functools import partial
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from mas_trainer.engines.threads import set_torch_threads
from mas_trainer.engines.base import Generation, SamplingParams
from mas_trainer.errors import UserError
from mas_trainer.policy.contract import StepResult, WarmStartExample, WorkerPlan
from mas_trainer.policy.local import LearnerSide
from mas_trainer.policy.turns import Serving, TurnStore

if TYPE_CHECKING:
    from mas_trainer.algo.advantages import TurnRecord
    from mas_trainer.config import WarmStartConfig

__all__ = ["SharedBase", "AdapterPolicy", "shared_groups"]


def shared_groups(plans: Mapping[str, WorkerPlan]) -> tuple[dict[str, dict[str, WorkerPlan]], dict[str, WorkerPlan]]:
    """The plans split into shared bases (group name -> its policies' plans) and the rest."""
    groups: dict[str, dict[str, WorkerPlan]] = {}
    alone = {}
    for name, plan in plans.items():
        if plan.shared_base is not None:
            groups.setdefault(plan.shared_base, {})[name] = plan
        else:
            alone[name] = plan
    return groups, alone


class SharedBase:
    """The host of a shared base's policies (`plans`: policy -> plan, all with one
    ``shared_base``); runs in the controller's process or as one Ray actor. Every method
    takes the policy it acts for."""

    def __init__(self, plans: Mapping[str, WorkerPlan]) -> None:
        import torch

        import mas_trainer.learners.lora as lora
        from mas_trainer.engines.models import adapter_base, is_adapter, load_model
        from mas_trainer.learners.torch_learner import TorchLearner

        if not plans:
            raise ValueError("a shared base needs at least one policy")
        first = next(iter(plans.values()))
        if first.torch_threads:
            set_torch_threads(first.torch_threads)
        self.name = first.shared_base or "shared"
        # resumed: each policy's model is its saved adapter folder, whose base is the shared one
        base = first.reference or (adapter_base(first.model) if is_adapter(first.model) else first.model)
        self.base, self.seed, self.device = base, first.seed, first.device
        model, self.tokenizer = load_model(base, seed=first.seed)
        model = model.to(first.device)
        critics = {}
        for name, plan in plans.items():  # value models copy the plain body, before any adapter is injected
            if plan.advantage.estimator == "gae":
                from mas_trainer.learners.critic import TorchCritic

                critics[name] = TorchCritic(model, plan.critic)
        # peft's adapter names key module dicts and are matched as substrings of its own prefixes
        # ("lora_"): a policy "a" or "x.y" cannot be one, so each adapter gets a name of its own
        self.keys = {name: f"adapter_{i}" for i, name in enumerate(plans)}
        peft_model: Any = model
        for name, plan in plans.items():
            cfg = plan.learner
            # a fresh adapter's A is drawn at random: from the run's seed and the policy's name, so
            # a run (and a run killed before its first checkpoint, started over) draws the same
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(zlib.crc32(f"{plan.seed}:{name}".encode()))
                peft_model = lora.add_named_adapter(peft_model, self.keys[name], rank=cfg.lora_rank, alpha=cfg.lora_alpha,
                                                    target_modules=cfg.target_modules, base_model=base, layers=cfg.lora_layers,
                                                    folder=plan.model if is_adapter(plan.model) else None)
        self.peft = peft_model
        self.engine: Any
        if first.engine == "vllm":
            self.engine = self._vllm_engine(first, plans)
        else:
            from mas_trainer.engines.torch_engine import TorchEngine

            self.engine = TorchEngine(peft_model, self.tokenizer, model_name=self.name, settings=first.engine_settings,
                                      device=first.device, adapters=list(self.keys.values()), threads=first.torch_threads)
        self.adapters: dict[str, LearnerSide] = {}
        for i, (name, plan) in enumerate(plans.items()):
            # one engine: its figures (tokens, busy time) are reported once, under the first policy
            serving = Serving(self.engine, TurnStore(name, plan.max_staleness), adapter=self.keys[name], metered=i == 0)
            learner = TorchLearner(peft_model, plan.learner, adapter_name=self.keys[name], base_model=base)
            self.adapters[name] = LearnerSide(self.engine, serving, learner, critics.get(name), plan, self.tokenizer,
                                              partial(self._sync, name))
        self._open = set(plans)

    def _vllm_engine(self, first: WorkerPlan, plans: Mapping[str, WorkerPlan]) -> Any:
        """vLLM's multi-LoRA on the base's folder, every adapter loaded (B = 0 when fresh)."""
        from mas_trainer.engines.models import materialize
        from mas_trainer.engines.vllm_engine import VllmEngine, VllmSettings

        engine = VllmEngine(materialize(self.base, seed=first.seed), model_name=self.name, tokenizer=self.tokenizer,
                            settings=VllmSettings.of(first.replica, device=first.device, seed=first.seed),
                            adapters=list(self.keys.values()), max_lora_rank=max(p.learner.lora_rank for p in plans.values()))
        for name in plans:
            self._sync_vllm(engine, name, on_thread=False)
        return engine

    def _sync_vllm(self, engine: Any, name: str, *, on_thread: bool) -> None:
        """Policy `name`'s adapter weights into vLLM (added, then replaced in place: `load_inplace`);
        `on_thread`: called on the engine's thread (inside `run_exclusive`), else from outside."""
        from mas_trainer.learners.lora import save_adapter

        with tempfile.TemporaryDirectory(prefix="mas-adapter-") as folder:
            save_adapter(self.peft, self.keys[name], folder)
            if on_thread:
                engine.reload_adapter(self.keys[name], folder)
            else:
                engine.load_adapter(self.keys[name], folder).result()

    def _sync(self, name: str) -> None:
        """After an update, on the engine's thread: vLLM gets the adapter's new weights; the
        embedded engine already generates with the very weights the learner updated."""
        if self.adapters[name].plan.engine == "vllm":
            self._sync_vllm(self.engine, name, on_thread=True)

    def _get(self, policy: str) -> LearnerSide:
        try:
            return self.adapters[policy]
        except KeyError:
            raise UserError(f"shared base {self.name!r} holds no policy {policy!r}; it holds {', '.join(self.adapters)}") from None

    def handle(self, policy: str) -> "AdapterPolicy":
        """The `WorkerGroupHandle` of one policy of this base."""
        self._get(policy)
        return AdapterPolicy(self, policy)

    # --- serving ---------------------------------------------------------------------------
    async def generate(self, policy: str, prompt_ids: Sequence[int], params: SamplingParams,
                       turn_id: str | None = None) -> list[Generation]:
        a = self._get(policy)
        return await a.serving.generate(prompt_ids, params, turn_id, a.learner.updates)

    async def discard(self, policy: str) -> int:
        return self._get(policy).serving.discard()

    def failure(self) -> BaseException | None:
        return getattr(self.engine, "failure", None)

    # --- training and checkpoints: each policy's learner side (`policy/local.py`) ------------
    async def train(self, policy: str, records: Sequence[TurnRecord]) -> StepResult:
        """One update of `policy`'s adapter from its records, on the engine's thread."""
        return await self._get(policy).train(records)

    async def warm_start(self, policy: str, examples: Sequence[WarmStartExample], config: WarmStartConfig) -> dict[str, float]:
        return await self._get(policy).warm_start(examples, config)

    async def save(self, policy: str, folder: str, learner_dir: str) -> None:
        """The policy's adapter as a peft folder; its optimizer and counters in `learner_dir`."""
        await self._get(policy).save(folder, learner_dir)

    async def load(self, policy: str, learner_dir: str) -> int:
        return await self._get(policy).load(learner_dir)

    def close(self, policy: str | None = None) -> None:
        """Close one policy's handle; the engine stops with the last (or with `policy=None`)."""
        self._open.discard(policy) if policy is not None else self._open.clear()
        if not self._open:
            self.engine.close()


class AdapterPolicy:
    """One policy of a `SharedBase` in this process, as a `WorkerGroupHandle`."""

    def __init__(self, host: SharedBase, policy: str) -> None:
        self.host, self.policy = host, policy

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams, turn_id: str | None = None) -> list[Generation]:
        return await self.host.generate(self.policy, prompt_ids, params, turn_id)

    async def discard(self) -> int:
        return await self.host.discard(self.policy)

    async def train(self, records: Sequence[TurnRecord]) -> StepResult:
        return await self.host.train(self.policy, records)

    async def warm_start(self, examples: Sequence[WarmStartExample], config: WarmStartConfig) -> dict[str, float]:
        return await self.host.warm_start(self.policy, examples, config)

    async def save(self, folder: str, learner_dir: str) -> None:
        await self.host.save(self.policy, folder, learner_dir)

    async def load(self, learner_dir: str) -> int | None:
        return await self.host.load(self.policy, learner_dir)

    def failure(self) -> BaseException | None:
        return self.host.failure()

    def close(self) -> None:
        self.host.close(self.policy)
