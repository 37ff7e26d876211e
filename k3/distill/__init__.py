"""Multi-teacher on-policy distillation (`k3 distill`): teachers, losses, the loop, its config, commands and
plots. See docs/distill.md."""
