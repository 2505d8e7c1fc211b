"""A TCP proxy that misbehaves on command: the network between the gateway and one
Redis node. ``latency_s`` delays every chunk each way; ``refuse`` closes new
connections at once; ``reset()`` cuts every open connection with an RST (SO_LINGER
0), as a failing switch or a NAT table flush does.

Each proxy is a process of its own, told what to do over a pipe: in a thread of
the harness it shared the interpreter lock with the load generator, whose
parsing of a hundred answers a second then slowed every Redis call the gateway
made (its admissions timed out with no fault injected)."""

from __future__ import annotations

import asyncio
import multiprocessing
import socket
import struct
from multiprocessing.connection import Connection
from typing import Any


class ChaosProxy:
    def __init__(self, listen_port: int, target_port: int, host: str = "127.0.0.1"):
        self.listen_port, self.target_port, self.host = listen_port, target_port, host
        self._latency_s, self._refuse = 0.0, False
        spawn = multiprocessing.get_context("spawn")  # not a fork of a process running threads
        self._conn, child = spawn.Pipe()
        self._process = spawn.Process(
            target=_serve, args=(listen_port, target_port, host, child), name=f"chaos-proxy-{listen_port}", daemon=True
        )

    def start(self) -> ChaosProxy:
        self._process.start()
        if not self._conn.poll(30):
            raise RuntimeError(f"chaos proxy on {self.listen_port} did not start")
        self._conn.recv()
        return self

    def _ask(self, *command: Any) -> Any:
        self._conn.send(command)
        if not self._conn.poll(10):
            raise RuntimeError(f"chaos proxy on {self.listen_port} does not answer")
        return self._conn.recv()

    @property
    def latency_s(self) -> float:
        return self._latency_s

    @latency_s.setter
    def latency_s(self, value: float) -> None:
        self._latency_s = self._ask("latency", value)

    @property
    def refuse(self) -> bool:
        return self._refuse

    @refuse.setter
    def refuse(self, value: bool) -> None:
        self._refuse = self._ask("refuse", value)

    def reset(self) -> int:
        """Cut every open connection (RST); how many were cut."""
        return self._ask("reset")

    def stop(self) -> None:
        if self._process.is_alive():
            try:
                self._ask("stop")
            except (RuntimeError, OSError):
                pass
            self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)


def _serve(listen_port: int, target_port: int, host: str, conn: Connection) -> None:
    asyncio.run(_Proxy(listen_port, target_port, host, conn).run())


class _Proxy:
    """The proxy's own process: its server and the commands it is sent."""

    def __init__(self, listen_port: int, target_port: int, host: str, conn: Connection):
        self.listen_port, self.target_port, self.host, self.conn = listen_port, target_port, host, conn
        self.latency_s = 0.0
        self.refuse = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._stopped = asyncio.Event()

    async def run(self) -> None:
        server = await asyncio.start_server(self._accept, self.host, self.listen_port, reuse_address=True)
        asyncio.get_running_loop().add_reader(self.conn.fileno(), self._command)
        self.conn.send("ready")
        await self._stopped.wait()
        server.close()
        self._reset()

    def _command(self) -> None:
        try:
            command, *args = self.conn.recv()
        except EOFError:  # the harness is gone
            self._stopped.set()
            return
        if command == "latency":
            self.latency_s = float(args[0])
            self.conn.send(self.latency_s)
        elif command == "refuse":
            self.refuse = bool(args[0])
            self.conn.send(self.refuse)
        elif command == "reset":
            self.conn.send(self._reset())
        elif command == "stop":
            self.conn.send(True)
            self._stopped.set()

    async def _accept(self, client_reader, client_writer) -> None:
        if self.refuse:
            _abort(client_writer)
            return
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(self.host, self.target_port)
        except OSError:
            _abort(client_writer)
            return
        self._writers |= {client_writer, upstream_writer}
        await asyncio.gather(
            self._pipe(client_reader, upstream_writer, client_writer),
            self._pipe(upstream_reader, client_writer, upstream_writer),
        )
        self._writers -= {client_writer, upstream_writer}

    async def _pipe(self, reader, writer, other) -> None:
        try:
            while data := await reader.read(65536):
                if self.latency_s:
                    await asyncio.sleep(self.latency_s)
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            for end in (writer, other):
                if not end.is_closing():
                    end.close()

    def _reset(self) -> int:
        writers = list(self._writers)
        for writer in writers:
            _abort(writer)
        self._writers.clear()
        return len(writers)


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with an RST, not a FIN: the peer sees 'connection reset'."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()
