"""Rollout adapters: the controller handle and engine-side receiver for each inference engine."""
