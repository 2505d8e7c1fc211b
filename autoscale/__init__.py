"""Autoscaling configuration and policies for model deployments.

Today each model's Serve ``deployment`` options (``num_replicas`` or
``autoscaling_config``) come straight from its config entry; LLM-aware
policies fed by replica metrics land here.
"""
