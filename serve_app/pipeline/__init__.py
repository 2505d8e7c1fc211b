"""One request from admission to settlement (``gateway.py``): the model catalog,
fair share between keys at a busy model, and the Serve request routers that pick
a replica (prefix affinity)."""
