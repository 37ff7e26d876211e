"""Reinforcement learning with verifiable rewards (Kimi K1.5 / K2 style): tasks, losses, rollouts through
k3's engine, partial rollouts and the `k3 rl` loop. See docs/rl.md."""
