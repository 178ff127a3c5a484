"""Cost models of fused compute and all-to-all communication: features, networks, training, simulation."""
