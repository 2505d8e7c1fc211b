"""Autoscaling configuration and policies for model deployments.

``policy`` decides replica counts from what saturates an LLM engine (ongoing
requests, the engine's waiting queue, KV-cache use), as a pure function tested
on recorded metric sequences. Wiring it into Ray Serve's custom autoscaling
policy (fed by each replica's engine stats) comes next; until then each model's
Serve ``deployment`` options (``num_replicas`` or ``autoscaling_config``) apply.
"""
