"""Expert parallelism on torch.distributed: process groups from torchrun (group), the differentiable
all-to-all (transport), the planner that places pairs and replicas (planner), the expert-parallel MoE
dispatch (moe), data-parallel training helpers (data_parallel), the torchrun launcher (launch) and
greedy generation across ranks (generate). See docs/dist.md."""
