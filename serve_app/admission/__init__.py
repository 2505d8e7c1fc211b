"""Whether a request runs now: the quota scripts in Redis, the fallback without Redis, and settlement."""
