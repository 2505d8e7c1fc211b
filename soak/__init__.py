"""The scale-and-fault soak: the gateway on a `ray up` twin under Zipf traffic from
thousands of keys, with faults on a schedule, judged at the end by a ledger
(soak/ledger.py). `make soak`; docs/operating.md has a run's figures."""
