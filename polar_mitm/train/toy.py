"""A toy RL task on the tiny model, small enough to learn in a minute on CPU: does GRPO move the reward up?

Reward = the fraction of sampled tokens that fall in a target half of the vocabulary: the tokens whose initial
(tied) embedding points along a fixed random direction. A random-weight model samples them about half the time,
and the policy can raise that share by turning its final hidden state toward that direction — a real, learnable
signal with group-relative variance from the first iteration.

Each iteration is the RL loop in miniature: sample a group of rollouts per prompt with the in-process engine at its
current weights → merged sequences with behaviour logprobs and rewards → a few GRPO steps → a checkpoint loaded
back into the engine (`update_weights_from_disk`, new weight_version) → sample again.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from polar_mitm.engine.generation import Engine
from polar_mitm.engine.sampling import SamplingParams
from polar_mitm.storage.merged import MergedSequence

TOY_PROMPTS = (
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Name a colour.",
    "Say hello in French.",
    "What is 2 + 2?",
    "Describe a cat.",
)


@dataclass
class ToyTask:
    """Prompts (token ids), the rewarded token set, and how rollouts are sampled."""

    prompts: list[list[int]]
    target: torch.Tensor  # bool over the vocabulary
    group_size: int = 8
    max_new_tokens: int = 8
    temperature: float = 1.0

    def reward(self, completion_ids: list[int]) -> float:
        """Fraction of the sampled tokens that are in the target set."""
        if not completion_ids:
            return 0.0
        return float(self.target[torch.tensor(completion_ids)].float().mean())


def make_toy_task(
    engine: Engine,
    *,
    n_prompts: int = 4,
    group_size: int = 8,
    max_new_tokens: int = 8,
    temperature: float = 1.0,
    seed: int = 0,
) -> ToyTask:
    """Chat prompts for `engine`'s tokenizer and a target token set from its current output embeddings."""
    prompts = [
        engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for text in TOY_PROMPTS[:n_prompts]
    ]
    embeddings = engine.model.get_output_embeddings().weight.detach().float()
    direction = torch.randn(embeddings.size(1), generator=torch.Generator().manual_seed(seed))
    target = embeddings @ direction > 0
    return ToyTask(
        prompts=prompts,
        target=target,
        group_size=group_size,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
    )


def sample_rollouts(engine: Engine, task: ToyTask, *, seed: int) -> list[MergedSequence]:
    """One group of `task.group_size` single-turn sessions per prompt, as merged sequences with rewards."""
    sequences = []
    for p, prompt in enumerate(task.prompts):
        for g in range(task.group_size):
            params = SamplingParams(
                max_new_tokens=task.max_new_tokens,
                temperature=task.temperature,
                ignore_eos=True,
                sampling_seed=seed * 100_003 + p * 1_009 + g,
            )
            gen = engine.generate(prompt, params)
            n = len(gen.output_ids)
            sequences.append(
                MergedSequence(
                    sequence_id=uuid.uuid4().hex,
                    session_id=f"toy-{seed}-{p}-{g}",
                    task_id=f"toy-prompt-{p}",
                    input_ids=[*prompt, *gen.output_ids],
                    loss_mask=[0] * len(prompt) + [1] * n,
                    logprobs=[0.0] * len(prompt) + list(gen.output_logprobs),
                    prompt_len=len(prompt),
                    request_ids=[gen.request_id],
                    n_turns=1,
                    builder="per_request",
                    weight_version_min=gen.weight_version,
                    weight_version_max=gen.weight_version,
                    reward=task.reward(gen.output_ids),
                    finish_reason=(gen.finish_reason or {}).get("type"),
                )
            )
    return sequences


def mean_reward(sequences: list[MergedSequence]) -> float:
    return sum(s.reward or 0.0 for s in sequences) / max(1, len(sequences))


@dataclass
class ToyRun:
    """Mean reward of the rollouts sampled at each iteration (index 0: the starting weights)."""

    rewards: list[float] = field(default_factory=list)
    weight_versions: list[str] = field(default_factory=list)
    seconds: float = 0.0


def run_toy_grpo(
    model_dir: str | Path,
    work_dir: str | Path,
    *,
    iterations: int = 8,
    steps_per_iteration: int = 2,
    learning_rate: float = 1e-2,
    n_prompts: int = 4,
    group_size: int = 8,
    max_new_tokens: int = 8,
    temperature: float = 1.0,
    loss_type: str = "dapo",
    seed: int = 0,
    on_iteration: Callable[[int, float, str], None] | None = None,
) -> ToyRun:
    """Alternate sampling and GRPO for `iterations` rounds, then sample once more; return the reward curve."""
    import time

    from transformers import PrinterCallback

    from polar_mitm.train.data import build_training_data
    from polar_mitm.train.grpo_config import PolarGRPOConfig
    from polar_mitm.train.grpo_trainer import PolarGRPOTrainer

    start = time.perf_counter()
    work_dir = Path(work_dir)
    engine = Engine(model_dir)
    task = make_toy_task(
        engine,
        n_prompts=n_prompts,
        group_size=group_size,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
    )
    run = ToyRun()
    policy = Path(model_dir)
    for it in range(iterations + 1):
        rollouts = sample_rollouts(engine, task, seed=seed * 1000 + it)
        run.rewards.append(mean_reward(rollouts))
        run.weight_versions.append(engine.weight_version)
        if on_iteration is not None:
            on_iteration(it, run.rewards[-1], engine.weight_version)
        if it == iterations:
            break
        data = build_training_data(rollouts, group_size=group_size)
        out = work_dir / f"iter-{it}"
        config = PolarGRPOConfig(
            output_dir=str(out),
            learning_rate=learning_rate,
            max_steps=steps_per_iteration,
            per_device_train_batch_size=len(data.rows) // 2,
            gradient_accumulation_steps=1,
            lr_scheduler_type="constant",
            loss_type=loss_type,
            beta=0.0,
            temperature=task.temperature,
            report_to=[],
            seed=seed + it,
            disable_tqdm=True,
            check_behaviour_logps=False,
        )
        trainer = PolarGRPOTrainer(str(policy), args=config, train_data=data)
        trainer.remove_callback(PrinterCallback)  # the curve is the output; metrics.jsonl keeps the rest
        trainer.train()
        next_policy = trainer.save_for_engine(out / "policy")
        engine.update_weights_from_disk(next_policy, weight_version=trainer.policy_weight_version())
        if policy != Path(model_dir):
            shutil.rmtree(policy, ignore_errors=True)  # keep only the live checkpoint
        policy = next_policy
    run.seconds = time.perf_counter() - start
    return run
