"""OpenAI's wire format as the gateway reads it: request envelopes and operations,
the parameter and media policies, the token reservation a body asks for, SSE
shapes, and the ``Call``/``Reply`` every route and dialect translates to and from."""
