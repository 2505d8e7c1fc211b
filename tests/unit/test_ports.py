"""The ports tests and benchmarks start servers on (tests/ports.py): never one a
stack's own ``bind(0)`` can be handed, never one twice."""

from ports import LOWEST, ephemeral_range, free_port


def test_ports_come_from_below_the_ephemeral_range_and_never_twice():
    low, _ = ephemeral_range()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    if low > LOWEST + 1000:  # this machine has room there (Linux's default: 32768)
        assert all(LOWEST <= port < low for port in ports)
