"""A stand-in for the part of torch.cuda the host KV tier uses (shared/cache/host_pool.py), so that its CUDA branches
run on the CPU: streams, events, cudaHostRegister / Unregister, pinned-ness. The copies themselves run eagerly, in
program order; what the stand-in checks is the order the GPU would be held to.

Every stream and the host carry a vector clock (record, wait_event, wait_stream, an event seen complete, a stream
synchronized), and every access to the tracked memory (the device pool's slots, the staging buffers' rows, the host
pool's rows) is recorded with the clock of the stream it was queued on. Two accesses to the same memory from
different streams, one of them a write, must be ordered by that clock, else it is a race on the GPU (`races`). Every
copy between host and device memory must be non_blocking from or into pinned memory (a blocking one stalls the host,
a pageable one copies synchronously: `bad_copies`), and unpinning must come after every queued copy ended.
"""
from __future__ import annotations

import contextlib
import types

import torch
from torch.overrides import TorchFunctionMode


def _join(a: dict, b: dict) -> dict:
    return {k: max(a.get(k, 0), b.get(k, 0)) for k in a.keys() | b.keys()}


class Stream:
    def __init__(self, cuda: "FakeCuda", device=None, name: str | None = None):
        self.cuda, self.device = cuda, torch.device(device) if device is not None else None
        self.name = name or f"stream{len(cuda.streams)}"
        self.vc: dict = {}
        cuda.streams.append(self)

    def tick(self) -> dict:
        """Queue one operation here: after everything the host saw complete; returns its clock."""
        self.vc = _join(self.vc, self.cuda.host)
        self.vc[self.name] = self.vc.get(self.name, 0) + 1
        return dict(self.vc)

    def wait_event(self, event: "Event") -> None:
        if event.vc is not None:
            self.vc = _join(self.vc, event.vc)

    def wait_stream(self, other: "Stream") -> None:
        self.vc = _join(self.vc, other.tick())

    def synchronize(self) -> None:
        self.cuda.host = _join(self.cuda.host, self.vc)


class Event:
    def __init__(self, cuda: "FakeCuda", enable_timing: bool = False):
        self.cuda, self.timing, self.vc = cuda, enable_timing, None

    def record(self, stream: Stream | None = None) -> None:
        self.vc = (stream or self.cuda.current).tick()

    def query(self) -> bool:
        if not self.cuda.complete:
            return False
        self.synchronize()
        return True

    def synchronize(self) -> None:
        if self.vc is not None:
            self.cuda.host = _join(self.cuda.host, self.vc)

    def elapsed_time(self, other: "Event") -> float:
        assert self.timing and other.timing, "elapsed_time needs two timing events"
        return 0.0


class FakeCuda:
    """`torch.cuda` as host_pool.py uses it, and the checks. `complete`: whether query() reports a copy complete
    (False: copies stay in flight until synchronized)."""

    def __init__(self):
        self.streams: list[Stream] = []
        self.host: dict = {}
        self.default = Stream(self, name="compute")
        self.current = self.default
        self.complete = True
        self.registered: dict[int, int] = {}  # pinned ranges: data_ptr -> bytes
        self.device_ranges: list[tuple[int, int]] = []
        self.bases: list[tuple[int, int, str, int]] = []  # (start, end, name, row bytes) of tracked memory
        self.accesses: dict[tuple[str, int], list] = {}  # (base, row) -> [(lane, clock, is_write)]
        self.races: list[str] = []
        self.bad_copies: list[str] = []
        self.unpinned_in_flight: list[str] = []

    # ---- torch.cuda ---------------------------------------------------------------------------------
    def Stream(self, device=None):
        return Stream(self, device)

    def Event(self, enable_timing: bool = False):
        return Event(self, enable_timing)

    def current_stream(self, device=None) -> Stream:
        return self.current

    @contextlib.contextmanager
    def stream(self, s: Stream):
        prev, self.current = self.current, s
        try:
            yield
        finally:
            self.current = prev

    def cudart(self):
        return types.SimpleNamespace(cudaHostRegister=self._register, cudaHostUnregister=self._unregister)

    def _register(self, ptr: int, nbytes: int, flags: int) -> int:
        if any(p < ptr + nbytes and ptr < p + n for p, n in self.registered.items()):
            return 712  # cudaErrorHostMemoryAlreadyRegistered
        self.registered[ptr] = nbytes
        return 0

    def _unregister(self, ptr: int) -> int:
        if ptr not in self.registered:
            return 713  # cudaErrorHostMemoryNotRegistered
        nbytes = self.registered.pop(ptr)
        for (name, row), seen in self.accesses.items():
            start = next(b[0] for b in self.bases if b[2] == name)
            if ptr <= start < ptr + nbytes and any(c[lane] > self.host.get(lane, 0) for lane, c, _ in seen):
                self.unpinned_in_flight.append(f"{name} row {row}")
        return 0

    def all_ended(self) -> bool:
        """Whether the host has seen every access queued so far end."""
        return all(c[lane] <= self.host.get(lane, 0) for seen in self.accesses.values() for lane, c, _ in seen)

    def is_pinned(self, t: torch.Tensor) -> bool:
        p = t.data_ptr()
        return any(q <= p < q + n for q, n in self.registered.items())

    # ---- torch, as host_pool.py uses it --------------------------------------------------------------
    def torch_namespace(self):
        """host_pool.py's `torch`: device tensors are CPU tensors marked device memory."""
        ns = types.SimpleNamespace(**{k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
        ns.cuda = self
        real_empty = torch.empty

        def empty(*shape, device=None, **kw):
            t = real_empty(*shape, **kw)
            if device is not None and torch.device(device).type == "cuda":
                self.mark_device(t)
            return t

        ns.empty = empty
        return ns

    def to_device(self, values, dtype, device):
        """kernels.h2d.to_device: pinned staging, then a non_blocking copy on the current stream."""
        t = torch.as_tensor(values).to(dtype).clone()
        self.mark_device(t)
        return t

    # ---- tracked memory -------------------------------------------------------------------------------
    def mark_device(self, t: torch.Tensor) -> None:
        self.device_ranges.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))

    def is_device(self, t: torch.Tensor) -> bool:
        p = t.data_ptr()
        return any(a <= p < b for a, b in self.device_ranges)

    def track(self, t: torch.Tensor, name: str, row_bytes: int) -> None:
        self.bases.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name, row_bytes))

    def _rows(self, t: torch.Tensor) -> tuple[str, range] | None:
        if t.numel() == 0:
            return None
        lo = t.data_ptr()
        hi = lo + (sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1) * t.element_size()
        for start, end, name, row in self.bases:
            if start <= lo < end:
                return name, range((lo - start) // row, (hi - 1 - start) // row + 1)
        return None

    def access(self, name: str, rows, write: bool) -> None:
        s = self.current
        clock = s.tick()
        for row in rows:
            seen = self.accesses.setdefault((name, int(row)), [])
            for lane, c, w in seen:
                if lane != s.name and (w or write) and c[lane] > clock.get(lane, 0):
                    self.races.append(f"{name} row {int(row)}: {'write' if w else 'read'} on {lane}, then "
                                      f"{'write' if write else 'read'} on {s.name}, unordered")
            seen.append((s.name, clock, write))

    def access_tensor(self, t: torch.Tensor, write: bool) -> None:
        found = self._rows(t)
        if found is not None:
            self.access(found[0], found[1], write)


class Recorder(TorchFunctionMode):
    """Records the accesses of the ops host_pool.py queues (copies, the pool's gather and scatter) on the current
    stream, and checks the host-device copies."""

    def __init__(self, cuda: FakeCuda, kv: torch.Tensor):
        super().__init__()
        self.cuda, self.kv = cuda, kv

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        cuda = self.cuda
        if func is torch.Tensor.copy_:
            dst, src = args[0], args[1]
            non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
            if cuda.is_device(dst) != cuda.is_device(src):
                host = src if cuda.is_device(dst) else dst
                if not non_blocking or not cuda.is_pinned(host):
                    cuda.bad_copies.append(f"{'non_blocking' if non_blocking else 'blocking'} copy with "
                                           f"{'pinned' if cuda.is_pinned(host) else 'pageable'} host memory")
            cuda.access_tensor(src, False)
            cuda.access_tensor(dst, True)
        elif func in (torch.Tensor.index_select, torch.Tensor.index_copy_) and args[0].data_ptr() == self.kv.data_ptr():
            assert args[1] == 1, "the pool's slots are its dim 1"
            if func is torch.Tensor.index_copy_:
                cuda.access_tensor(args[3], False)
            cuda.access("kv", args[2].tolist(), func is torch.Tensor.index_copy_)
        out = func(*args, **kwargs)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if (isinstance(out, torch.Tensor) and any(map(cuda.is_device, tensors))
                and all(out.untyped_storage().data_ptr() != a.untyped_storage().data_ptr() for a in tensors)):
            cuda.mark_device(out)  # new memory from a device op (the gather's) is on the device
        return out
