"""Expert parallelism on torch.distributed: process groups from torchrun (group), the differentiable
all-to-all (transport), the planner that places pairs and replicas (planner), routed experts sharded by id
(shard), the expert-parallel MoE dispatch (moe), data-parallel training helpers (data_parallel), the
torchrun launcher (launch), `k3 generate --nproc N` (commands) and greedy generation of many prompts
across ranks (generate). See docs/dist.md."""
