"""What the gateway (serve_app) and the model replicas (replicas) agree on:
the model configuration schema and the values that cross a replica call.
Light on purpose (pydantic and the standard library only): the ingress imports
it without loading vLLM, torch or transformers."""
