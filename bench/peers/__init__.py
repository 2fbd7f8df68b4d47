"""Peers swarm is compared against: plain PyTorch baselines a user would write, and how to start them."""
