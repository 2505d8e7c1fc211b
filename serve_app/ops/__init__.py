"""What operators run beside the service (``llmctl``'s larger commands): the status
report and the local development stack behind ``make run``/``make stop``."""
