"""Holding other engines to k3: golden packs (`k3 golden`) and the scenario harness (`k3 conform`)."""
