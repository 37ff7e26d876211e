"""Small-scale training of K3-shaped models: routing balance, synthetic data, the training loop, export."""
