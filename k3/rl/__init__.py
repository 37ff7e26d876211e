"""Reinforcement learning with verifiable rewards (Kimi K1.5 / K2 style): rollouts through k3's engine,
policy log-probabilities, losses, PTX, SFT, partial rollouts and the `k3 rl` loop. See docs/rl.md."""
