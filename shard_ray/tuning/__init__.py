"""Ray Tune sweeps of the cost-model, search and PPO hyperparameters (`shard-ray tune ...`)."""
