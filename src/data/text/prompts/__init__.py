"""Prompts for reinforcement learning with verifiable rewards (`data=prompts`, GRPO)."""
