"""Training on merged sequences: GRPO built on TRL, SFT export."""
