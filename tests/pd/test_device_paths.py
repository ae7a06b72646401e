"""PD's GPU-only branches, with CPU stand-ins for what only a GPU shows: the buffer UCX is handed for device
memory (FP8 KV), the wait before UCX writes into a fresh device buffer, and the decode side letting go of
received buffers once their scatter has run."""
from __future__ import annotations

import asyncio
import struct
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from shared import protocol
from shared.pd import kv_pages
from shared.pd.sides import DecodeSide
from shared.pd.stages import TransferBudget
from shared.pd.ucx import KvReceiver
from shared.protocol import KvDone, KvHeader

LAYOUT = [2, 2, 1, 4]


class _OnGpu:
    """A CPU tensor that says it lives on the GPU: what as_transport_buffer sees of device memory."""
    device = torch.device("cuda", 0)

    def __init__(self, t: torch.Tensor):
        self.t = t

    @property
    def dtype(self) -> torch.dtype:
        return self.t.dtype

    def element_size(self) -> int:
        return self.t.element_size()

    def numel(self) -> int:
        return self.t.numel()

    def view(self, dtype: torch.dtype) -> torch.Tensor:
        return self.t.view(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32,
                                   torch.float8_e4m3fn, torch.float8_e5m2])
def test_device_pages_of_every_kv_dtype_have_a_cuda_array_interface(dtype):
    # torch's __cuda_array_interface__ has no typestr for float8: an FP8 pool's pages handed as they are
    # raised KeyError inside ucxx, failing every transfer with --kv-cache-dtype fp8 and device staging.
    out = kv_pages.as_transport_buffer(_OnGpu(torch.zeros([3, *LAYOUT], dtype=dtype)))
    torch._tensor._dtype_to_typestr(out.dtype)  # what the interface of `out` would describe it as
    assert out.numel() * out.element_size() == 3 * int(np.prod(LAYOUT)) * dtype.itemsize


class _ScriptedEndpoint:
    """A ucxx endpoint stand-in: each receive takes the next message of a script; operations are logged."""

    def __init__(self, incoming: list[bytes], log: list):
        self.incoming, self.log = list(incoming), log

    async def send(self, buf) -> None:
        self.log.append("send")

    async def recv(self, buf) -> None:
        data = self.incoming.pop(0)
        np.asarray(buf).reshape(-1)[:] = np.frombuffer(data, dtype=np.uint8)
        self.log.append(("recv", len(data)))

    def abort(self) -> None:
        self.log.append("abort")


def _frames(msg) -> list[bytes]:
    body = protocol.encode(msg)
    return [struct.pack("!Q", len(body)), body]


def test_receive_into_a_device_buffer_waits_for_its_stream_before_ucx_writes(monkeypatch):
    # A buffer fresh from the caching allocator may be memory of tensors whose kernels are still queued on
    # the stream; UCX's writes are not ordered with them.
    log: list = []

    class QueuedWork:
        def synchronize(self):
            log.append("stream done")

    monkeypatch.setattr(kv_pages, "queued_work", lambda buf: QueuedWork())
    pages = torch.randn([4, *LAYOUT])
    arrived = {}
    receiver = KvReceiver(LAYOUT, "float32", alloc=lambda n: torch.empty([n, *LAYOUT]),
                          on_arrival=lambda tid, done, buf: arrived.__setitem__(tid, buf),
                          on_failure=lambda tid, reason: None)
    receiver.on_offer = lambda tid: receiver.expect(tid, 0, 4)
    ep = _ScriptedEndpoint(_frames(KvHeader(transfer_id="t", prompt_len=4, layout=LAYOUT, dtype="float32"))
                           + [pages.numpy().tobytes()] + _frames(KvDone(transfer_id="t", first_token=3)), log)
    assert asyncio.run(receiver._serve_one(ep))
    assert torch.equal(arrived["t"], pages)
    assert log.index("stream done") < log.index(("recv", pages.numel() * 4))


def test_received_buffers_are_let_go_once_scattered_without_waiting_for_the_next_arrival():
    class Event:
        def __init__(self, done: bool):
            self.done = done

        def query(self) -> bool:
            return self.done

    side = DecodeSide(SimpleNamespace(config=SimpleNamespace(kv_transfer_timeout=60.0)), TransferBudget(0, 1))
    still_read = (Event(False), object(), "t2")
    side._in_use = [(Event(True), object(), "t1"), still_read]
    side.stages.budget.take("t1", 4)
    side.stages.budget.take("t2", 8)
    side.announce()  # every scheduling round
    assert side._in_use == [still_read]
    assert side.stages.budget.in_flight == 8  # the buffer let go is out of the transfer budget too


def test_a_scatter_that_fails_ends_its_request_alone():
    # Raised from the engine's inbox (outside any step), it ended every request of the decode worker.
    def out_of_memory(slots, buf):
        raise torch.OutOfMemoryError("CUDA out of memory")

    ended = []
    engine = SimpleNamespace(config=SimpleNamespace(kv_transfer_timeout=60.0),
                             runner=SimpleNamespace(scatter_kv=out_of_memory),
                             end_request=lambda req, error=None, reason=None: ended.append((req.rid, error)))
    side = DecodeSide(engine)
    req = SimpleNamespace(rid="r", transfer_id="t", input_ids=[5, 6, 7, 8], slots=[0, 1, 2, 3], kv_len=0,
                          finished=False)
    side.stages.awaiting["t"] = (req, float("inf"))
    side.arrived("t", KvDone(transfer_id="t", first_token=3), torch.empty([4, *LAYOUT]))
    assert ended == [("r", "the received KV could not be written: OutOfMemoryError")]
