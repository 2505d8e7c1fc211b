"""LLM-aware autoscaling of model deployments.

(A model's ``autoscaling`` block as operators write it, turned into Ray Serve's
``autoscaling_config`` with the policy below plugged in, is part of the model
schema: ``contract/autoscaling.py``.)
- ``policy``: the decision, a pure function of what saturates an LLM engine
  (ongoing requests, the engine's waiting queue, KV-cache use), tested on
  recorded metric sequences.
- ``serve_policy``: the adapter Serve's controller calls every tick; each model
  replica reports the engine metrics it reads (``record_autoscaling_stats``).

Adding and removing nodes for those replicas is Ray's autoscaler's job
(cluster.yaml; the local twin's provider is in ``cluster/``).
"""
