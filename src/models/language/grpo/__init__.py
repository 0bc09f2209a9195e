"""Reinforcement learning with verifiable rewards: GRPO and its DAPO and Dr. GRPO variants."""
