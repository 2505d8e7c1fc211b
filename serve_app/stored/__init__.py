"""What the gateway keeps for a key and runs later: the Files API and its uploads,
batches and the runner every ingress replica hosts, and the Responses API's stored
conversations; listings paged by their indexes."""
