"""Settings of the embedded learner (config: ``learner``, ``policies.<name>.learner``) and
critic (``critic``, ``policies.<name>.critic``); torch-free, so the config loads without torch.

Names follow verl's actor config where one exists (``clip_ratio_low``, ``loss_agg_mode``,
``entropy_coeff``, ``kl_penalty``...), so a verl user recognises them; the learner turns
them into a ``verl.workers.config.ActorConfig`` for verl's policy-loss functions.

Checking ``policy_loss`` against verl's registry needs verl imported (seconds), so it
happens when the learner is built, not when the config is parsed.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from mas_trainer.errors import UserError

__all__ = ["LearnerConfig", "CriticConfig", "LOSS_AGG_MODES", "KL_PENALTIES", "at_most", "MAX_PPO_EPOCHS", "MAX_LORA_RANK"]

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# verl's kl_penalty estimators; a trailing "+" (e.g. "k3+") takes the k2 gradient straight through.
KL_PENALTIES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")

MAX_PPO_EPOCHS = 64  # passes over one step's turns; PPO uses 1-4, 64 leaves room for any experiment
MAX_LORA_RANK = 4096  # half the width of a 70B model's layers: past the hidden size a rank only adds weights


def at_most(limit: int, cost: str) -> AfterValidator:
    """The upper bound of a config number that multiplies work (``Annotated[int, at_most(64, "...")]``):
    a larger value is refused in one line naming the bound and what each unit of it costs. Chosen
    generously, it stops a typo or a hostile config (``k=1000000``), never a real run."""

    def check(value: int | None) -> int | None:
        if value is not None and value > limit:
            raise ValueError(f"{value} is over the bound of {limit} ({cost}); use at most {limit}")
        return value

    return AfterValidator(check)


_PPO_EPOCHS_COST = "passes over the turns of one update: each is a forward and backward of every turn"


class LearnerConfig(BaseModel):
    """PPO-style update of one policy with verl's losses (embedded torch learner)."""

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(1e-5, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW (beta1, beta2).")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    max_grad_norm: float | None = Field(
        1.0, gt=0, description="Clip the global gradient norm to this before each step (null: no clipping)."
    )
    ppo_epochs: Annotated[int, at_most(MAX_PPO_EPOCHS, _PPO_EPOCHS_COST)] = Field(
        1, ge=1, description=f"Passes over the turns of one update; old log-probs stay the engine's. At most {MAX_PPO_EPOCHS} "
        "(each is a forward and backward of every turn).")
    mini_batch_size: int = Field(16, ge=1, description="Turns per optimiser step.")
    micro_batch_size: int = Field(
        4, ge=1, description="Most turns per forward/backward (gradient accumulation bounds memory)."
    )
    micro_batch_tokens: int | None = Field(
        None, ge=1, description="Also cap a micro-batch at this many padded tokens (rows x longest row); null: no cap."
    )
    shuffle: bool = Field(True, description="Shuffle turns (seeded) before cutting mini-batches, each epoch.")
    policy_loss: str = Field("vanilla", description="verl policy loss name (get_policy_loss_fn): vanilla, gspo, cispo, ...")
    policy_loss_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra fields of verl's PolicyLossConfig / ActorConfig the loss reads (e.g. dro_beta, tau_pos).",
    )
    clip_ratio_low: float = Field(0.2, ge=0, description="PPO ratio clip below: 1 - clip_ratio_low.")
    clip_ratio_high: float = Field(0.2, ge=0, description="PPO ratio clip above: 1 + clip_ratio_high (0.28 = DAPO clip-higher).")
    clip_ratio_c: float = Field(3.0, gt=1, description="Dual-clip PPO bound for negative advantages.")
    loss_agg_mode: Literal[LOSS_AGG_MODES] = Field("token-mean", description="verl agg_loss mode over a mini-batch.")  # type: ignore[valid-type]
    loss_scale_factor: int | None = Field(
        None, ge=1, description="Divisor of seq-mean-token-sum-norm (null: longest response of the mini-batch)."
    )
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL loss to the frozen reference (0: no reference kept).")
    kl_penalty: str = Field("low_var_kl", description="verl kl_penalty estimator: kl/k1, abs, mse/k2, low_var_kl/k3, '+' suffix.")
    entropy_coeff: float = Field(0.0, description="Weight of the entropy bonus (subtracted from the loss).")
    calculate_entropy: bool = Field(
        False, description="Report the response-token entropy even when entropy_coeff is 0 (costs ~5% of a step)."
    )
    bf16: bool | Literal["auto"] = Field(
        "auto", description="bf16 compute for forward/backward, fp32 weights (auto: where bf16 is fast: GPUs, CPUs with AVX512-BF16/AMX, ~2x faster there; AVX2-only CPUs emulate it ~100x slower)."
    )
    fused_adamw: bool | Literal["auto"] = Field("auto", description="Fused AdamW kernel (auto: where torch has one); torch learner only.")
    seed: int = Field(0, description="Seed of the mini-batch shuffle.")
    old_logprobs: Literal["auto", "recompute", "rollout_correction", "bypass"] = Field(
        "auto", description="Old log-probs of the PPO ratio: recompute = the learner's forward before the update "
        "(verl's default); rollout_correction = recompute and weight tokens by the truncated importance ratio learner/engine "
        "(verl's rollout correction, TIS); bypass = the engine's own (no forward). auto: rollout_correction with "
        "rollout.max_staleness=1, else recompute on the verl learner and bypass on the torch learner.")
    rollout_is_threshold: float = Field(2.0, gt=1, description="rollout_correction: upper truncation of the per-token importance weight.")
    lora_rank: Annotated[int, at_most(MAX_LORA_RANK, "LoRA rank: the adapter's weights, gradients and AdamW state grow with "
                                      "it, and past the model's hidden size it only adds weights")] = Field(
        0, ge=0, description="Train a peft LoRA adapter of this rank instead of every weight (0: full fine-tuning; verl's name; "
        f"at most {MAX_LORA_RANK}: the adapter's weights and optimizer state grow with the rank). "
        "The base stays frozen, so the update computes no weight gradients for it and keeps no AdamW state for it; "
        "checkpoints hold the adapter, and eval/serve/export load base + adapter (see docs/training.md).")
    lora_alpha: float = Field(16.0, gt=0, description="LoRA scaling numerator: the adapter's output is scaled by lora_alpha / lora_rank.")
    target_modules: str | list[str] = Field(
        "all-linear", description="Modules that get an adapter: peft's 'all-linear' (every linear layer but the output head) or a list of names (q_proj, v_proj, ...).")
    lora_layers: int | None = Field(
        None, ge=1, description="Put the adapter on the top N transformer layers only (peft's layers_to_transform; null: every "
        "layer). Nothing below the lowest adapted layer needs a gradient, so the backward pass stops there: an update costs "
        "about a forward pass plus N/L of a backward (see docs/training.md).")
    shared_base: bool = Field(
        False, description="With lora_rank: hold this policy as one LoRA adapter of a base shared with every other "
        "shared_base policy on the same base model, in one process: one base in memory, one engine batching rows of "
        "every adapter, one learner (and AdamW state) per adapter, the base frozen (see docs/shared_base.md).")
    skip_zero_advantage: bool = Field(
        False, description="Leave out of the update every turn whose advantage is zero at every token (e.g. a GRPO group whose rollouts "
        "all scored the same): they add nothing to the policy gradient, only to the token count it is averaged over "
        "(DAPO's filter). A step whose turns all have zero advantage then costs no update at all.")

    share_prompts: bool = Field(
        False, description="Forward and backward each distinct prompt of a micro-batch once: turns with the very same prompt "
        "(a GRPO group's samples) are laid out as one row, the prompt then every response, each response attending to the "
        "prompt and itself only. The same loss and gradient (up to float rounding) for fewer tokens; micro-batches keep "
        "such turns together.")

    @model_validator(mode="after")
    def _layers_need_lora(self) -> "LearnerConfig":
        if self.lora_layers is not None and not self.lora_rank:
            raise ValueError("lora_layers chooses the layers of a LoRA adapter; set lora_rank (e.g. 16) too, or lora_layers=null")
        return self

    @model_validator(mode="after")
    def _shared_base_needs_lora(self) -> "LearnerConfig":
        if self.shared_base and not self.lora_rank:
            raise ValueError("shared_base holds each policy as a LoRA adapter of one base; set lora_rank (e.g. 16) too, "
                             "or shared_base=false")
        return self

    @model_validator(mode="after")
    def _skip_needs_pg_only(self) -> "LearnerConfig":
        if self.skip_zero_advantage and (self.kl_coef > 0 or self.entropy_coeff != 0):
            raise ValueError("skip_zero_advantage would drop turns whose KL or entropy term still has a gradient; "
                             "set kl_coef=0 and entropy_coeff=0, or skip_zero_advantage=false")
        return self

    @field_validator("kl_penalty")
    @classmethod
    def _known_kl(cls, value: str) -> str:
        if value.removesuffix("+") not in KL_PENALTIES:
            raise ValueError(f"unknown kl_penalty {value!r}; valid: {', '.join(KL_PENALTIES)} (optionally with '+')")
        return value

    def actor_config(self) -> Any:
        """verl's ``ActorConfig`` for its policy-loss functions (both learners pass it to them).

        The loss functions read ``clip_ratio*``, ``policy_loss.*``, ``tau_*``, ``loss_agg_mode``
        and ``global_batch_info`` (filled per mini-batch). ``strategy="torch"`` names this
        learner; ``rollout_n`` and the micro-batch fields are required by the dataclass but
        never read by the losses. ``policy_loss_options`` go to ``PolicyLossConfig`` when it
        has the field, else to ``ActorConfig``.
        """
        from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
        from verl.workers.config import ActorConfig, PolicyLossConfig

        if self.policy_loss not in POLICY_LOSS_REGISTRY:
            raise UserError(
                f"unknown policy_loss {self.policy_loss!r}; verl knows: {', '.join(sorted(POLICY_LOSS_REGISTRY))}"
            )
        loss_fields = {f.name for f in dataclasses.fields(PolicyLossConfig)} - {"loss_mode"}
        reserved = set(LearnerConfig.model_fields) | {"policy_loss", "global_batch_info", "strategy", "rollout_n"}
        actor_fields = {f.name for f in dataclasses.fields(ActorConfig)} - reserved
        loss_kw, actor_kw = {}, {}
        for key, value in self.policy_loss_options.items():
            if key in loss_fields:
                loss_kw[key] = value
            elif key in actor_fields:
                actor_kw[key] = value
            else:
                raise UserError(
                    f"unknown policy_loss_options key {key!r}; valid: {', '.join(sorted(loss_fields | actor_fields))}"
                )
        return ActorConfig(
            strategy="torch",
            rollout_n=1,
            ppo_mini_batch_size=self.mini_batch_size,
            ppo_micro_batch_size_per_gpu=self.micro_batch_size,
            ppo_epochs=self.ppo_epochs,
            shuffle=self.shuffle,
            data_loader_seed=self.seed,
            clip_ratio=self.clip_ratio_low,
            clip_ratio_low=self.clip_ratio_low,
            clip_ratio_high=self.clip_ratio_high,
            clip_ratio_c=self.clip_ratio_c,
            loss_agg_mode=self.loss_agg_mode,
            loss_scale_factor=self.loss_scale_factor,
            entropy_coeff=self.entropy_coeff,
            calculate_entropy=self.calculate_entropy or self.entropy_coeff != 0,
            use_kl_loss=self.kl_coef > 0,
            kl_loss_coef=self.kl_coef,
            kl_loss_type=self.kl_penalty,
            use_torch_compile=False,
            policy_loss=PolicyLossConfig(loss_mode=self.policy_loss, **loss_kw),
            **actor_kw,
        )


class CriticConfig(BaseModel):
    """Value model of one policy for GAE (config: ``policies.<name>.critic``)."""

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(1e-5, gt=0, description="AdamW learning rate of the value model.")
    cliprange_value: float = Field(
        0.5, gt=0, description="PPO value clip: a prediction may move this far from the old value before clipping."
    )
    loss_agg_mode: Literal[LOSS_AGG_MODES] = Field("token-mean", description="verl agg_loss mode over a mini-batch.")  # type: ignore[valid-type]
    max_grad_norm: float | None = Field(
        1.0, gt=0, description="Clip the global gradient norm to this before each step (null: no clipping)."
    )
    ppo_epochs: Annotated[int, at_most(MAX_PPO_EPOCHS, _PPO_EPOCHS_COST)] = Field(
        1, ge=1, description="Passes over the turns of one update; old values stay the pre-update ones (the clip's anchor). "
        f"At most {MAX_PPO_EPOCHS} (each is a forward and backward of every turn)."
    )
    mini_batch_size: int = Field(16, ge=1, description="Turns per optimiser step.")
    micro_batch_size: int = Field(
        4, ge=1, description="Most turns per forward/backward (gradient accumulation bounds memory)."
    )
    micro_batch_tokens: int | None = Field(
        None, ge=1, description="Also cap a micro-batch at this many padded tokens (rows x longest row); null: no cap. Torch learner only."
    )
    bf16: bool | Literal["auto"] = Field(
        "auto", description="bf16 autocast for the body's forward/backward (auto: where bf16 is fast, as learner.bf16); the head stays fp32."
    )
    shuffle: bool = Field(True, description="Shuffle turns (seeded) before cutting mini-batches.")
    seed: int = Field(0, description="Seed of the mini-batch shuffle.")
