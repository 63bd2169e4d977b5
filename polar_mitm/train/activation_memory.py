"""Activation checkpointing where memory says so: the activations a micro-batch keeps for the backward pass are
estimated before training, and checkpointing is turned on when they would not fit.

Activations, not weights, make a long sequence's peak (SmolLM2-135M in fp32: ~1.1 MB per token, a 13 GB peak;
checkpointing took 2k tokens from 5.21 to 2.89 GB for 1.6x the step time), yet checkpointing was off unless asked
for. Here the bytes per token are measured on the model being trained, by one short probe forward with grad whose
saved tensors are counted (`saved_activation_bytes`: what autograd keeps for the backward, the weights left out):
per token of the sequence (the trunk) and per scored token (the LM head, which only loss tokens pass). The largest
micro-batch the batch plan will build (its computed tokens, padding included, and its loss tokens) times those gives
the estimate; above `memory_budget_gb` — by default 80% of the memory free on the training device less the gradients
and AdamW state still to come (the rest is for what runs beside it: FREE_MEMORY_SHARE) — checkpointing is turned on,
and the log says so and why. If even checkpointed (a second probe with it on: what it keeps per token, plus one
layer's activations recomputed at a time) they would exceed the budget, the training is refused before it starts
with one line naming the options that shrink a micro-batch, instead of going on to be killed by the kernel.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path

import torch

from polar_mitm.train.batching import micro_batches, real_grid
from polar_mitm.train.scoring import padded_logps

logger = logging.getLogger(__name__)

PROBE_TOKENS = (
    64  # the probe forward's length: long enough that per-token costs dominate, short enough to be free
)
GB = 1e9
ADAM_BYTES_PER_PARAMETER = 8  # two fp32 moments
# The share of the free memory (less the optimizer state) the activations may take when no budget is given. The
# estimate is close (a SmolLM2 micro-batch of 12,785 tokens: 17.17 GB estimated + 1.61 GB of optimizer state; the
# process grew to a 20.8 GB peak), but what is free when training starts is not all the training's: in the loop the
# engine, the gateway and the next sessions run beside it. With all of it as the budget that micro-batch fits (18.3
# GB free while other jobs ran), and in the loop, with vLLM beside it, the kernel killed it at 20.7 GB (stop 56).
FREE_MEMORY_SHARE = 0.8


class MicroBatchTooLarge(ValueError):
    """The largest planned micro-batch cannot fit in the memory budget even with activation checkpointing."""


def saved_activation_bytes(model, input_ids: torch.Tensor, scored: torch.Tensor, autocast=None) -> int:
    """Bytes autograd keeps for the backward of one training forward (TRL's fused head scoring the `scored`
    completion positions): every saved tensor's storage counted once, the parameters' own left out."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    mask = torch.ones_like(input_ids)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        padded_logps(model, input_ids, mask, input_ids.size(1) - 1, None, scored, autocast=autocast)
    return sum(storages.values())


def activation_bytes_per_token(model, device, autocast: Callable | None = None) -> tuple[float, float]:
    """(bytes per sequence token, extra bytes per scored token), measured with two probe forwards of
    `PROBE_TOKENS` tokens: one scoring a single position, one scoring them all (`autocast()`: a fresh autocast
    context for each, as the training forward has)."""
    vocab = int(getattr(model.config, "vocab_size", 1000) or 1000)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, PROBE_TOKENS), generator=generator).to(device)
    one = torch.zeros(1, PROBE_TOKENS - 1, dtype=torch.bool, device=device)
    one[0, -1] = True
    trunk = saved_activation_bytes(model, ids, one, autocast() if autocast else None)
    every = saved_activation_bytes(model, ids, torch.ones_like(one), autocast() if autocast else None)
    return trunk / PROBE_TOKENS, max(every - trunk, 0) / (PROBE_TOKENS - 2)


def checkpointed_bytes_per_token(model, device, autocast: Callable | None = None) -> float:
    """Bytes per sequence token autograd keeps with activation checkpointing on (each checkpointed layer's inputs),
    measured by the same probe with checkpointing turned on for it, then off again (the trainer turns it on itself
    through transformers' `train`). Transformers checkpoints only in training mode."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
    training = model.training
    model.train()
    enable({"use_reentrant": False})
    try:
        per_token, _ = activation_bytes_per_token(model, device, autocast)
    finally:
        disable()
        model.train(training)
    return per_token


def free_memory_bytes(device: torch.device) -> int | None:
    """Memory free for this process's training: CUDA's free memory, or the machine's MemAvailable."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    meminfo = Path("/proc/meminfo")
    if not meminfo.exists():
        return None
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


class ActivationMemoryMixin:
    """`PolarGRPOTrainer`'s choice of activation checkpointing by memory (`_choose_activation_checkpointing`, at the
    end of its init, before transformers' `train` reads `args.activation_checkpointing`)."""

    activation_estimate: dict[str, float] | None = (
        None  # what the choice was made on (see `_estimate_activations`)
    )

    def _choose_activation_checkpointing(self) -> None:
        args = self.args
        if args.activation_checkpointing or args.memory_budget_gb == math.inf:
            return
        if (
            self.is_deepspeed_enabled or self.is_fsdp_enabled
        ):  # sharded weights: no probe forward before prepare
            logger.info(
                "activation checkpointing by memory: not estimated under DeepSpeed/FSDP (set it yourself)"
            )
            return
        estimate = self._estimate_activations()
        over = torch.tensor(float(estimate["bytes"] > estimate["budget"]), device=self.accelerator.device)
        if self.accelerator.reduce(over, reduction="max").item() == 0:  # every process decides alike
            logger.info(
                "activation checkpointing off: the largest micro-batch (%d tokens) needs ~%.2f GB of activations, "
                "within the %.2f GB budget (%s)",
                estimate["tokens"],
                estimate["bytes"] / GB,
                estimate["budget"] / GB,
                estimate["source"],
            )
            return
        self._refuse_what_checkpointing_cannot_fit(estimate)
        args.activation_checkpointing = args.gradient_checkpointing = True
        if self.is_peft:  # what TRL's init does for PEFT when checkpointing is asked for
            self.model.enable_input_require_grads()
        logger.warning(
            "activation checkpointing on: the largest micro-batch (%d tokens, %d scored) needs ~%.2f GB of "
            "activations (%.0f bytes per token + %.0f per scored token, measured), over the %.2f GB budget (%s)",
            estimate["tokens"],
            estimate["scored"],
            estimate["bytes"] / GB,
            estimate["per_token"],
            estimate["per_scored"],
            estimate["budget"] / GB,
            estimate["source"],
        )

    def _refuse_what_checkpointing_cannot_fit(self, estimate: dict[str, float]) -> None:
        """MicroBatchTooLarge when the largest micro-batch's activations exceed the budget even checkpointed: what
        checkpointing keeps per token, one layer recomputed at a time in the backward, and the head's scored tokens."""
        per_token = checkpointed_bytes_per_token(
            self.model, self.accelerator.device, self.accelerator.autocast
        )
        layers = max(int(getattr(self.model.config, "num_hidden_layers", 1) or 1), 1)
        one_layer = max(estimate["per_token"] - per_token, 0) / layers
        needed = estimate["tokens"] * (per_token + one_layer) + estimate["scored"] * estimate["per_scored"]
        estimate["checkpointed_bytes"] = needed
        over = torch.tensor(float(needed > estimate["budget"]), device=self.accelerator.device)
        if self.accelerator.reduce(over, reduction="max").item() == 0:
            return
        raise MicroBatchTooLarge(
            f"the largest micro-batch ({estimate['tokens']:.0f} tokens, {estimate['scored']:.0f} scored) needs "
            f"~{needed / GB:.2f} GB of activations even with activation checkpointing, over the "
            f"{estimate['budget'] / GB:.2f} GB budget ({estimate['source']}): give fewer sequences per micro-batch "
            f"(now {self.args.per_device_train_batch_size}: `grpo --per-device-batch-size`, `loop --batch-size`) "
            "and more --gradient-accumulation-steps to keep the step's size, or --memory-budget-gb if more is free"
        )

    def _estimate_activations(self) -> dict[str, float]:
        """The largest micro-batch's activations and the budget they are held to."""
        per_token, per_scored = activation_bytes_per_token(
            self.model, self.accelerator.device, self.accelerator.autocast
        )
        tokens, scored = self._largest_micro_batch()
        budget, source = self._memory_budget()
        self.activation_estimate = {
            "tokens": tokens,
            "scored": scored,
            "per_token": per_token,
            "per_scored": per_scored,
            "bytes": tokens * per_token + scored * per_scored,
            "budget": budget,
            "source": source,
        }
        return self.activation_estimate

    def _largest_micro_batch(self) -> tuple[int, int]:
        """(tokens computed, loss tokens) of the micro-batch with the most activations in the batch plan."""
        rows, shape, packed = self.train_data.rows, self._batch_shape(), self.packs_micro_batches()
        lengths = [len(row["input_ids"]) for row in rows]
        loss_tokens = [sum(1 for m in row["loss_mask"] if m) for row in rows]
        largest = (0, 0)
        for chunk in self.batch_plan().chunks:
            for share in chunk:
                parts = micro_batches(
                    [lengths[i] for i in share], shape.micro_per_chunk, "tokens" if packed else "grid"
                )
                for part in parts:
                    if part:
                        members = [share[k] for k in part]
                        computed = real_grid(members, lengths, packed)
                        largest = max(largest, (computed, sum(loss_tokens[i] for i in members)))
        return largest

    def _memory_budget(self) -> tuple[float, str]:
        """`memory_budget_gb`, or the free memory less the gradients and AdamW moments the training will add."""
        if self.args.memory_budget_gb is not None:
            return self.args.memory_budget_gb * GB, "memory_budget_gb"
        device = self.accelerator.device
        free = free_memory_bytes(device)
        if free is None:
            return math.inf, "no free-memory reading"
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        state = sum(p.numel() * (p.element_size() + ADAM_BYTES_PER_PARAMETER) for p in trainable)
        return max(free - state, 0) * FREE_MEMORY_SHARE, (
            f"{FREE_MEMORY_SHARE:.0%} of the free {device.type} memory {free / GB:.1f} GB less "
            f"{state / GB:.2f} GB of optimizer state"
        )
