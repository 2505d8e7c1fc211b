"""The ingress' routes by surface, each a mixin of the Serve ingress class (ingress.py):
OpenAI's API, stored objects, the dialects, the admin API, the console, the probes."""
