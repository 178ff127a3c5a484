"""Placement policies: DreamShard's estimated MDP, the policy network, PPO on RLlib and the outer loop."""
