"""A TCP proxy that misbehaves on command: the network between the gateway and one
Redis node. ``latency_s`` delays every chunk each way; ``refuse`` closes new
connections at once; ``reset()`` cuts every open connection with an RST (SO_LINGER
0), as a failing switch or a NAT table flush does. Runs its own event loop in a
thread, so the harness' load never shares its loop with the fault."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading


class ChaosProxy:
    def __init__(self, listen_port: int, target_port: int, host: str = "127.0.0.1"):
        self.listen_port, self.target_port, self.host = listen_port, target_port, host
        self.latency_s = 0.0
        self.refuse = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"chaos-proxy-{listen_port}", daemon=True)
        self._server: asyncio.AbstractServer | None = None

    def start(self) -> ChaosProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def serve():
            self._server = await asyncio.start_server(self._accept, self.host, self.listen_port, reuse_address=True)
            self._ready.set()
            await self._server.serve_forever()

        try:
            self._loop.run_until_complete(serve())
        except asyncio.CancelledError:
            pass

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

    def reset(self) -> int:
        """Cut every open connection (RST); how many were cut."""
        done = asyncio.run_coroutine_threadsafe(self._reset(), self._loop)
        return done.result(10)

    async def _reset(self) -> int:
        writers = list(self._writers)
        for writer in writers:
            _abort(writer)
        self._writers.clear()
        return len(writers)

    def stop(self) -> None:
        if self._thread.is_alive():
            self.reset()
            self._loop.call_soon_threadsafe(lambda: [task.cancel() for task in asyncio.all_tasks(self._loop)])
        self._thread.join(10)


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with an RST, not a FIN: the peer sees 'connection reset'."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()
