"""Other systems' plans and ours: TorchRec's planner and ShardingPlan."""
