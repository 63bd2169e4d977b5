"""`PolarGRPOConfig`: TRL's `GRPOConfig` plus what training on recorded merged sequences needs.

TRL's fields keep their meaning wherever they still apply (`loss_type`, `epsilon`, `epsilon_high`, `beta`,
`scale_rewards`, `importance_sampling_level`, `num_iterations`, …). Fields about generation do not apply: the
completions were sampled by the engine behind the gateway, and are read from merged shards.

Every field carries its help in `metadata["help"]`: each field added here becomes a `polar-mitm grpo` option with
that help (`polar_mitm/train/config_options.py`; TRL's own fields are options only where its `TRL_OPTIONS` lists them), and a
`polar-mitm loop` option too (the loop sets a few itself: `LOOP_SETS` in loop/config.py).

TRL options that act only on the generation step this trainer replaces are refused when set (`NO_EFFECT_ON_RECORDED`):
accepting them would silently do nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, get_args

from trl import GRPOConfig

from polar_mitm.train.advantages import AdvantageEstimator
from polar_mitm.train.kl import KL_ESTIMATORS, KLEstimator

STALE_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none")
ADVANTAGE_ESTIMATORS = get_args(AdvantageEstimator)  # the one set: train/advantages.py
TorchDtype = Literal["fp32", "bf16", "fp16", "auto"]
TORCH_DTYPES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "auto": "auto"}
FRESH_RATIO_CAP = 2.0  # default `delta`: the same bound as the stale rows' TIS cap (`stale_is_clip_max`)
CISPO_EPSILON_HIGH = 5.0  # CISPO's IS-weight cap (ScaleRL's ε_max; TRL's docs recommend it too)
REFERENCE_AT_START = "start"
PER_SEQUENCE_LOSSES = ("grpo", "sapo")  # TRL averages each sequence's tokens, then the sequences

_SAMPLING = (
    "the engine behind the gateway sampled the completions: set sampling on the gateway (polar_top_p, …)"
)
_VLLM = "the engine behind the gateway samples; nothing is generated in the trainer"
# TRL fields that act only on the generation step this trainer replaces: set to anything but TRL's default, refused.
NO_EFFECT_ON_RECORDED: dict[str, str] = {
    "mask_truncated_completions": "recorded sequences are cut by --max-length as exact prefixes, and calls the engine "
    "cut (finish_reason length) are kept or excluded by merge, not by the trainer",
    "top_p": _SAMPLING,
    "top_k": _SAMPLING,
    "min_p": _SAMPLING,
    "repetition_penalty": _SAMPLING,
    "generation_kwargs": _SAMPLING,
    "chat_template_kwargs": "prompts are the recorded token ids; no chat template is applied",
    "cache_implementation": _VLLM,
    "use_vllm": _VLLM,
    "use_transformers_continuous_batching": _VLLM,
    "use_transformers_paged": _VLLM,
    "max_tool_calling_iterations": "tool calls ran in the harness during the rollout",
    "log_completions": "rows carry token ids, not the prompt/completion texts TRL's completion log prints",
    "num_generations_eval": "groups are the recorded task_id groups; nothing is generated for evaluation",
    "reward_weights": "the reward is the recorded one (one reward per session)",
}


@dataclass
class PolarGRPOConfig(GRPOConfig):
    r"""Configuration for [`PolarGRPOTrainer`]: GRPO on pre-recorded (merged) rollouts.

    Defaults that differ from TRL's `GRPOConfig`: `bf16=False` (exact fp32 logprobs; turn it on for large models on
    GPU) and `activation_checkpointing=False` (turned on anyway where the activations would exceed
    `memory_budget_gb`), `logging_steps=1`, `save_strategy="no"` (the command
    saves the final model), `report_to=["tensorboard"]`, and `num_generations` is set for TRL from the batch shape
    (recorded groups are formed by `task_id`, not by the sampler — see `group_size`).
    """

    # -- TRL defaults we change ------------------------------------------------------------------------------------
    bf16: bool | None = field(
        default=False,
        metadata={
            "help": "bf16 autocast. Off by default: importance ratios need logprobs that match the engine's, "
            "and bf16 shifts them by ~1e-2."
        },
    )
    activation_checkpointing: bool | None = field(
        default=False,
        metadata={
            "help": "Recompute activations in the backward pass (saves memory on long sequences, for ~1.6x the step "
            "time). Off, it is still turned on where memory says so: when the estimated activation memory of "
            "the largest micro-batch exceeds `memory_budget_gb` (see there); the log says when it is chosen."
        },
    )
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={"help": "Deprecated alias of `activation_checkpointing` (transformers 5)."},
    )
    logging_steps: float = field(default=1, metadata={"help": "Log metrics every N optimizer steps."})
    save_strategy: str = field(
        default="no",
        metadata={
            "help": "Intermediate checkpoints (`no` | `steps` | `epoch`); the final model is always saved."
        },
    )
    report_to: str | list[str] | None = field(
        default_factory=lambda: ["tensorboard"],
        metadata={
            "help": "Integrations to log to (TensorBoard by default; metrics.jsonl is always written)."
        },
    )
    temperature: float = field(
        default=1.0,
        metadata={
            "help": "Fallback sampling temperature, for rows without a recorded one (merged schema v1 / record "
            "schema v1; counted as `unknown_temperature_sequences` in the data summary). Rows with a "
            "recorded temperature are scored at their own: each token's logits are divided by the "
            "temperature of the call that sampled it, so ratios are 1 on fresh data whatever the "
            "harness sent."
        },
    )
    num_generations: int | None = field(
        default=None,
        metadata={
            "help": "Set from the batch shape for TRL's checks; not a group size here (see `group_size`)."
        },
    )
    shuffle_dataset: bool | None = field(
        default=True,
        metadata={"help": "Shuffle the order of the generation batches (whole groups; each epoch)."},
    )
    delta: float | None = field(
        default=FRESH_RATIO_CAP,
        metadata={
            "help": "Cap of the ratio pi_theta / pi_anchor in the clipped loss (TRL's two-sided clip, INTELLECT-2). "
            "On by default: for rows sampled by the starting weights the anchor is the engine's recorded "
            "logprob, and where the advantage is negative PPO's min takes the unclipped ratio, so without "
            "a cap an engine/trainer gap of g nats weighs a token exp(g). Tokens over the cap get no "
            "gradient (counted as off_policy/frac_over_delta). Must exceed 1 + epsilon_high; `inf` turns it "
            "off. CISPO, SAPO and VESPO bound their weights themselves and ignore it."
        },
    )
    epsilon_high: float | None = field(
        default=None,
        metadata={
            "help": f"Upper clip range of the ratio (default: epsilon). With loss_type cispo it is the cap of "
            f"CISPO's importance weight instead, default {CISPO_EPSILON_HIGH:g} (ScaleRL's epsilon_max): "
            f"CISPO clips the weight at epsilon_high itself, so inheriting epsilon = 0.2 would clip every "
            f"token above ratio 0.2."
        },
    )

    # -- the model ----------------------------------------------------------------------------------------------------
    torch_dtype: TorchDtype = field(
        default="fp32",
        metadata={
            "help": "Dtype the weights are loaded and trained in: fp32 (exact logprobs, fp32 master weights), bf16, "
            "fp16, or auto (the checkpoint's). Checkpoints are written, and pushed to the engine, in the "
            "checkpoint's own dtype or this one, whichever is narrower: a bf16 model stays bf16 on disk and "
            "on the push even when trained in fp32 (the trainer's own copy in output_dir keeps fp32)."
        },
    )
    attn_implementation: str | None = field(
        default=None,
        metadata={
            "help": "Attention kernel the model is loaded with (eager | sdpa | flash_attention_2 | flex_attention | "
            "…; default: transformers' choice for the model and device)."
        },
    )
    reference_model: str | None = field(
        default=None,
        metadata={
            "help": "KL reference (beta > 0): a checkpoint directory, or `start` (the weights this training starts "
            "from, the default of `polar-mitm grpo`). `polar-mitm loop` passes the run's initial model, so "
            "the reference stays the initial policy across iterations. With LoRA the reference is the base "
            "model (the adapter disabled)."
        },
    )

    memory_budget_gb: float | None = field(
        default=None,
        metadata={
            "help": "GB the activations of one micro-batch may take before activation checkpointing is turned on "
            "(estimated as its tokens x the model's activation bytes per token, measured on the model with a "
            "short probe forward at the start). Default: 80% of the memory free on the training device (CUDA: "
            "free GPU memory; CPU: MemAvailable) less the gradients and AdamW state; the rest is for what runs "
            "beside it. A micro-batch over the budget even checkpointed is refused before training. `inf`: never "
            "turn it on by memory. Ignored when activation_checkpointing is set."
        },
    )

    kl_estimator: KLEstimator = field(
        default="k2",
        metadata={
            "help": "The KL penalty's estimator (beta > 0), with d = log pi - log pi_ref on the loss tokens: k1 = d, "
            "k2 = d^2 / 2, k3 = exp(-d) + d - 1 (TRL's). Their values all estimate KL(pi || pi_ref); as a loss "
            "their gradients differ: k2's is the gradient of KL(pi || pi_ref) (the reverse KL, the default), "
            "k3's that of KL(pi_ref || pi) (the forward KL), k1's is 0 in expectation (noise only). Stale rows "
            "take the same importance weight as their policy term, and the KL term the policy term's "
            "normaliser. Logged per step as `kl` (this estimator) and `kl/k1`, `kl/k2`, `kl/k3`."
        },
    )

    # -- one optimizer across trainings -----------------------------------------------------------------------------
    run_state_dir: str | None = field(
        default=None,
        metadata={
            "help": "Carry one optimizer across separate trainings (the loop's iterations): at the start, load the "
            "AdamW moments and step counts, the LR scheduler's position and (LoRA) the adapter from this "
            "directory when it holds them; at the end, save them there. The weights themselves are the "
            "model you start from."
        },
    )
    lr_schedule_trainings: int = field(
        default=1,
        metadata={
            "help": "The LR schedule (warmup included) runs once over this many trainings: the loop passes its "
            "--iterations. The first training sets its length in steps (its own steps × this); each later "
            "one re-plans the rest of it over its own steps × the trainings left, so however many steps "
            "each training takes, the LR decays continuously to the schedule's end at the last step. Past "
            "its end (more trainings than planned) the LR stays at its last value, with a warning."
        },
    )
    lr_schedule_steps: int | None = field(
        default=None,
        metadata={
            "help": "The LR schedule's length in optimizer steps over the whole run (warmup included), when "
            "known: one schedule step per optimizer step, no re-planning (see lr_schedule_trainings). Steps "
            "past it keep the last LR, with a warning."
        },
    )

    # -- loss normalisers (train/normalisers.py) ---------------------------------------------------------------------
    dr_grpo_constant: int | None = field(
        default=None,
        metadata={
            "help": "Dr. GRPO's constant L, the completion budget in loss tokens: loss_type dr_grpo divides each "
            "optimizer step's sum of token losses by L x the step's row capacity (per-device batch x "
            "processes x gradient_accumulation_steps), so every token weighs the same in every step and "
            "training. Default: the most loss tokens of a row in the run's first training, fixed then and "
            "recorded in run_state_dir (run_state.json) for the later trainings to reuse."
        },
    )
    token_normaliser: Literal["step", "run"] = field(
        default="step",
        metadata={
            "help": "What the token-level losses (dapo, bnpo, cispo, vespo) divide an optimizer step's sum of token "
            "losses by. `step` (DAPO's token mean): the step's own loss tokens — every token of a step weighs "
            "the same, but steps hold length-sorted groups, so a token of a step of short rows weighs more "
            "than one of a step of long rows (4.6x between the 3 steps of benchmarks/bench_train_step.py). "
            "`run`: a constant of the run, the expected loss tokens per step (`loss_tokens_per_step`), so "
            "every token weighs the same in every step and training."
        },
    )
    loss_tokens_per_step: float | None = field(
        default=None,
        metadata={
            "help": "The constant of token_normaliser=run. Default: the loss tokens of the run's first training "
            "divided by its optimizer steps, fixed then and recorded in run_state_dir (run_state.json) for "
            "the later trainings to reuse."
        },
    )

    # -- recorded data ---------------------------------------------------------------------------------------------
    group_size: int | None = field(
        default=None,
        metadata={
            "help": "Sessions expected per task_id group (the rollouts per task). Groups of another size are "
            "counted and reported (strict_group_size makes that an error)."
        },
    )
    strict_group_size: bool = field(
        default=False,
        metadata={"help": "Fail when a group does not have exactly `group_size` sessions."},
    )
    advantage_estimator: str = field(
        default="mean_std",
        metadata={
            "help": "`mean_std`: (r - group mean) / group std (see `scale_rewards`); `leave_one_out`: r - mean "
            "of the other sessions of the group (RLOO). Every sequence of a session gets its session's "
            "advantage; groups with equal rewards get 0."
        },
    )
    max_length: int | None = field(
        default=None,
        metadata={
            "help": "Cut sequences to their first `max_length` tokens (an exact causal prefix: each kept token "
            "keeps its own logprob). Sequences with no sampled token left are dropped."
        },
    )

    keep_truncated_sampling: bool = field(
        default=False,
        metadata={
            "help": "Keep greedy, top-p/top-k/min-p-truncated and grammar-constrained calls in the loss. "
            "Off by default: their "
            "recorded logprobs are of the full tempered distribution, not of the (argmax or "
            "renormalised) distribution that drew the token, so the importance ratio is biased. They "
            "stay in the sequence as context and are counted (`excluded_*` in data_stats.json). Kept "
            "greedy calls are scored at T=1, as engines record them. Applied when the training data "
            "is built (`build_training_data(keep_truncated_sampling=...)`)."
        },
    )
    session_weighting: bool = field(
        default=True,
        metadata={
            "help": "With per-sequence loss types (`grpo`, `sapo`: every sequence weighs the same), give each "
            "session one unit of weight shared by its sequences (per_request rows, broken "
            "prefix_merging chains), scaled so the mean row weight is 1. Without it a session split "
            "into 30 sequences counts 30 times. Token-level losses (`dapo`, `bnpo`, `dr_grpo`, `cispo`, "
            "`luspo`, `vespo`) weigh tokens and need no correction. The KL term takes the same weights."
        },
    )

    # -- batching (train/batching.py, train/packing.py) ------------------------------------------------------------
    keep_zero_advantage_groups: bool = field(
        default=False,
        metadata={
            "help": "Train on groups whose advantages are all 0 (equal rewards, one session, no task_id). Off by "
            "default (dynamic sampling): they have no policy gradient, but their tokens would count in "
            "the loss normaliser and shrink every other group's update; they are counted "
            "(zero_advantage_* in data_stats.json). Kept anyway when no other group is left (`polar-mitm loop` "
            "then skips that iteration's training instead)."
        },
    )
    batch_layout: Literal["auto", "packed", "padded"] = field(
        default="auto",
        metadata={
            "help": "Micro-batch layout: `padded` trims each micro-batch to its own longest row; `packed` puts its "
            "rows end to end in one row with position ids restarting per sequence (no padding; "
            "FlashAttention varlen, or sdpa run per sequence). `auto`: packed where the loss weighs "
            "tokens alone (dapo, bnpo, cispo with token-level ratios) and the attention is sdpa or "
            "FlashAttention (measured faster on CPU too: benchmarks/bench_train_step.py), else padded."
        },
    )

    # -- behaviour logprob check -----------------------------------------------------------------------------------
    behaviour_logp_tolerance: float = field(
        default=0.1,
        metadata={
            "help": "Rows whose mean |recomputed - recorded| logprob over their sampled tokens exceeds this "
            "(in nats) are reported (logp_diff/frac_over_threshold, behaviour_check.json). fp32 on the "
            "engine's weights gives ~1e-6; bf16 ~1e-2."
        },
    )
    drop_mismatched_rows: bool = field(
        default=False,
        metadata={
            "help": "Leave rows above `behaviour_logp_tolerance` out of the loss (their loss mask is zeroed)."
        },
    )

    # -- staleness / off-policy correction -------------------------------------------------------------------------
    policy_weight_version: str | None = field(
        default=None,
        metadata={
            "help": "The engine weight_version of the starting weights. Default: the newest weight_version in "
            "the data. Each optimizer step counts as one more version, so a rollout's staleness is "
            "(this + steps taken) - its weight_version."
        },
    )
    stale_correction: str = field(
        default="token_truncate",
        metadata={
            "help": "Off-policy correction for stale rollouts (staleness > 0): anchor the PPO ratio on the "
            "current weights' logprobs and weight each token by pi_current / pi_behaviour, truncated "
            "at `stale_is_clip_max` (`*_truncate`) or zeroed above it (`*_mask`), per token or per "
            "sequence. Fresh rollouts always use the recorded behaviour logprobs as the ratio anchor. "
            "`none`: the behaviour logprobs anchor every rollout (plain clipped ratio)."
        },
    )
    max_staleness: int | None = field(
        default=None,
        metadata={
            "help": "Mask sampled tokens more than K weight versions older than the weights being trained (each "
            "token's own version: a call may span a push); counted as staleness/masked_tokens. Default: none "
            "masked."
        },
    )
    stale_is_clip_max: float = field(
        default=2.0,
        metadata={"help": "Upper bound C of the stale-rollout importance weight."},
    )
    stale_is_clip_min: float | None = field(
        default=None,
        metadata={"help": "Optional lower bound of the stale-rollout importance weight."},
    )
    check_behaviour_logps: bool = field(
        default=True,
        metadata={
            "help": "Before the first step, recompute the logprobs of every row sampled by the starting weights "
            "(staleness 0) and compare them with the recorded ones: per row, the mean |recomputed - "
            "recorded| over its sampled tokens, near 0 when tokens, weights and temperatures line up. "
            "Every step then logs its rows' values (logp_diff/fresh_mean, fresh_max, "
            "frac_over_threshold, frac_checked), and behaviour_check.json lists the worst rows. Costs "
            "one no-grad forward pass over those rows."
        },
    )

    # -- outputs ---------------------------------------------------------------------------------------------------
    save_merged: bool = field(
        default=True,
        metadata={"help": "With LoRA, also write the merged full model to `<output_dir>/merged`."},
    )
    # Read by `polar_mitm.train.sync.EnginePushCallback`, which the trainer's caller attaches (`attach_engine_push`).
    push_to_engine: str | None = field(
        default=None,
        metadata={
            "help": "Engine base URL (SGLang or `polar-mitm serve`): after training (and every "
            "`push_every_steps`), save the weights and call its /update_weights_from_disk."
        },
    )
    push_every_steps: int = field(
        default=0,
        metadata={"help": "Push to the engine every N optimizer steps (0 = only at the end)."},
    )
    metrics_file: str = field(
        default="metrics.jsonl",
        metadata={"help": "Per-step metrics, one JSON object a line, in output_dir."},
    )

    def __post_init__(self) -> None:
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage_estimator must be one of {ADVANTAGE_ESTIMATORS}")
        if self.stale_correction not in STALE_CORRECTION_MODES:
            raise ValueError(f"stale_correction must be one of {STALE_CORRECTION_MODES}")
        if self.max_length is not None and self.max_length < 2:
            raise ValueError("max_length must be at least 2")
        if self.behaviour_logp_tolerance < 0:
            raise ValueError("behaviour_logp_tolerance must be >= 0")
        if self.group_size is not None and self.group_size < 2:
            raise ValueError("group_size must be at least 2 (a group of one has no baseline)")
        self._refuse_generation_options()
        self._set_off_policy_bounds()
        self._set_model_loading()
        if self.lr_schedule_trainings < 1:
            raise ValueError("lr_schedule_trainings must be at least 1")
        if self.lr_schedule_steps is not None and self.lr_schedule_steps < 1:
            raise ValueError("lr_schedule_steps must be at least 1")
        self._check_normalisers()
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}")
        # Every row carries its own columns to the trainer: TRL must not drop them.
        self.remove_unused_columns = False
        if self.num_generations is None:
            # TRL checks that the generation batch divides into prompt groups of num_generations ≥ 2. Our groups are
            # formed by task_id before training, so any divisor works: the per-device generation batch divides the
            # global one whatever the number of processes.
            steps = self.steps_per_generation or self.gradient_accumulation_steps
            local = self.per_device_train_batch_size * steps
            if self.generation_batch_size is not None:
                local = self.generation_batch_size
            if local < 2:
                raise ValueError(
                    "a generation batch needs at least 2 sequences per device: raise "
                    "per_device_train_batch_size or gradient_accumulation_steps"
                )
            self.num_generations = local
        super().__post_init__()

    def _check_normalisers(self) -> None:
        if self.dr_grpo_constant is not None and self.dr_grpo_constant < 1:
            raise ValueError("dr_grpo_constant must be at least 1")
        if self.token_normaliser not in ("step", "run"):
            raise ValueError("token_normaliser must be `step` or `run`")
        if self.loss_tokens_per_step is not None and self.loss_tokens_per_step <= 0:
            raise ValueError("loss_tokens_per_step must be > 0")
        if self.memory_budget_gb is not None and self.memory_budget_gb <= 0:
            raise ValueError("memory_budget_gb must be > 0 (inf: never by memory)")

    def _refuse_generation_options(self) -> None:
        """One line naming a TRL option that would do nothing here, and why (see NO_EFFECT_ON_RECORDED)."""
        defaults = {f.name: f for f in dataclasses.fields(GRPOConfig)}
        for name, reason in NO_EFFECT_ON_RECORDED.items():
            default = defaults[name]
            expected = (
                default.default_factory() if default.default is dataclasses.MISSING else default.default
            )
            if getattr(self, name) != expected:
                raise ValueError(f"{name} does nothing on recorded rollouts: {reason}")

    def _set_off_policy_bounds(self) -> None:
        """CISPO's own weight cap; the fresh-row ratio cap must sit above PPO's clip range."""
        if self.loss_type == "cispo" and self.epsilon_high is None:
            self.epsilon_high = CISPO_EPSILON_HIGH
        high = self.epsilon_high if self.epsilon_high is not None else self.epsilon
        if self.delta is not None and self.loss_type != "cispo" and self.delta <= 1 + high:
            raise ValueError(
                f"delta ({self.delta:g}) must exceed 1 + epsilon_high ({1 + high:g}): below it the cap would "
                f"clip the ratios PPO keeps"
            )

    def _set_model_loading(self) -> None:
        """`torch_dtype` and `attn_implementation` reach TRL as `model_init_kwargs` (policy and reference alike)."""
        if self.torch_dtype not in TORCH_DTYPES:
            raise ValueError(f"torch_dtype must be one of {tuple(TORCH_DTYPES)}")
        kwargs = dict(self.model_init_kwargs or {})
        if self.torch_dtype != "fp32":  # TRL loads in float32 unless told otherwise
            kwargs.setdefault("dtype", TORCH_DTYPES[self.torch_dtype])
        if self.attn_implementation is not None:
            kwargs.setdefault("attn_implementation", self.attn_implementation)
        self.model_init_kwargs = kwargs or self.model_init_kwargs
