"""Data parallelism over ``torch.distributed`` ranks, launched by ``torchrun`` (one process per GPU).

    torchrun --nproc_per_node=4 -m qerl.train scale=paper model=qwen2.5-14b quant=nvfp4 ...
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 -m qerl.train ...

Every rank holds the same frozen (quantized) base and its own sampler. Group ``i`` of a step's ``B`` prompts lives on
rank ``i % W`` (round robin: whole groups on one rank, and every contiguous minibatch of groups spread evenly over
the ranks). Each rank samples, scores and computes the advantages of its groups; the trainable gradients (LoRA and
trained norms, or every weight under full fine-tuning) are summed over ranks with each micro-batch's loss weighted
by its share of the *global* minibatch (tokens or rows), so one update equals the one-process update of the same
global batch. Metrics are reduced from sums and counts over every rank (``all_*``: every rank gets the same value),
and only rank 0 writes the run directory.

The process group gets a timeout (``dist.timeout_s``): a rank that dies or hangs makes the others fail within it
with an error naming the collective, instead of waiting forever (torchrun then stops the job).
A one-process run (no ``WORLD_SIZE`` > 1 in the environment) never touches ``torch.distributed``.
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
import time
from dataclasses import dataclass, field

import torch

from qerl.errors import UserError

BACKENDS = ("auto", "nccl", "gloo")


@dataclass(frozen=True)
class Dist:
    """This process's place in the job. ``Dist()`` is the one-process run."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1
    backend: str | None = None
    comm_device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # where collective tensors live

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def shard(self, n: int) -> list[int]:
        """The global group indices of this rank among ``n`` (round robin)."""
        return list(range(self.rank, n, self.world))

    # ---------------------------------------------------------------------------------------- collectives
    def _t(self, values, dtype=torch.float64) -> torch.Tensor:
        return torch.as_tensor(values, dtype=dtype).to(self.comm_device)

    def all_sum(self, values: list[float]) -> list[float]:
        """Element-wise sums over ranks (float64)."""
        if not self.enabled:
            return [float(v) for v in values]
        t = self._t(values)
        torch.distributed.all_reduce(t)
        return t.cpu().tolist()

    def all_max(self, values: list[float]) -> list[float]:
        if not self.enabled:
            return [float(v) for v in values]
        t = self._t(values)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return t.cpu().tolist()

    def all_gather_object(self, obj) -> list:
        if not self.enabled:
            return [obj]
        out = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def gather_groups(self, local: list, per_group: int = 1) -> list:
        """The global list of per-row values from each rank's ``local`` list of its groups' rows (``per_group``
        rows per group, groups dealt round robin: global group i is local group i // W of rank i % W)."""
        if not self.enabled:
            return list(local)
        parts = self.all_gather_object(list(local))
        out = []
        for j in range(max(len(p) for p in parts) // per_group):
            for p in parts:
                out += p[j * per_group:(j + 1) * per_group]
        return out

    def gather_keep(self, keep: torch.Tensor) -> torch.Tensor:
        """(b,) bool of this rank's groups -> (W·b,) bool in global group order (every rank holds b groups)."""
        if not self.enabled:
            return keep
        t = keep.to(torch.uint8).to(self.comm_device)
        out = [torch.empty_like(t) for _ in range(self.world)]
        torch.distributed.all_gather(out, t)
        return torch.stack(out, 1).reshape(-1).bool().to(keep.device)  # (b, W) -> index j·W + r

    def broadcast_object(self, obj=None):
        """Rank 0's ``obj`` on every rank."""
        if not self.enabled:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def on_main(self, fn):
        """``fn()`` on rank 0, its result broadcast to every rank; a ``UserError`` it raises is raised on every rank
        (so no rank waits for a result that will not come)."""
        if not self.enabled:
            return fn()
        res = err = None
        if self.main:
            try:
                res = fn()
            except UserError as e:
                err = str(e)
            except BaseException as e:  # still tell the others, then fail here with the real traceback
                self.broadcast_object(("error", f"rank 0 failed: {type(e).__name__}: {e}"))
                raise
        kind, val = self.broadcast_object(("error", err) if err is not None else ("ok", res))
        if kind == "error":
            raise UserError(val)
        return val

    def all_reduce_grads(self, params: list[torch.nn.Parameter], bucket_elems: int = 1 << 25) -> float:
        """Sum the gradients of ``params`` over ranks, in float32 buckets (a missing gradient counts as zero).
        The loss weights are global shares already, so the sum is the one-process gradient.

        Returns the seconds the exchange took (0.0 in a one-process run): on a GPU the device is synchronized
        before (the backward pass is done) and after (the sums have landed), so the figure is the communication
        alone, not the backward pass it would otherwise wait for."""
        if not self.enabled:
            return 0.0
        cuda = [p.device for p in params[:1] if p.device.type == "cuda"]
        if cuda:
            torch.cuda.synchronize(cuda[0])
        t0 = time.perf_counter()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        bucket: list[torch.nn.Parameter] = []
        size = 0
        for p in [*params, None]:
            if p is not None:
                bucket.append(p)
                size += p.numel()
            if bucket and (p is None or size >= bucket_elems):
                flat = torch.cat([q.grad.reshape(-1).float() for q in bucket]).to(self.comm_device)
                torch.distributed.all_reduce(flat)
                flat = flat.to(bucket[0].grad.device)
                i = 0
                for q in bucket:
                    q.grad.copy_(flat[i:i + q.numel()].view_as(q.grad))
                    i += q.numel()
                bucket, size = [], 0
        if cuda:
            torch.cuda.synchronize(cuda[0])
        return time.perf_counter() - t0

    def broadcast_params(self, params: list[torch.nn.Parameter]) -> None:
        """Rank 0's values of ``params`` on every rank (the seeded init is the same everywhere; this makes sure)."""
        if not self.enabled:
            return
        with torch.no_grad():
            for p in params:
                t = p.data.to(self.comm_device)
                torch.distributed.broadcast(t, src=0)
                if t.data_ptr() != p.data.data_ptr():
                    p.data.copy_(t)

    def barrier(self) -> None:
        if self.enabled:
            torch.distributed.barrier()

    def describe_device(self, device: torch.device) -> str:
        """``host:device (GPU name)`` of this rank, for env.json."""
        name = ""
        if device.type == "cuda":
            name = f" ({torch.cuda.get_device_name(device)})"
        return f"{platform.node() or socket.gethostname()}:{device}{name}"


_CURRENT = Dist()


def current() -> Dist:
    """The job this process belongs to (``Dist()`` until ``setup`` joined a process group)."""
    return _CURRENT


def world_from_env() -> tuple[int, int, int, int]:
    """(rank, world size, local rank, local world size) as torchrun sets them; (0, 1, 0, 1) without torchrun."""
    env = os.environ
    world = int(env.get("WORLD_SIZE", "1"))
    rank = int(env.get("RANK", "0"))
    local_rank = int(env.get("LOCAL_RANK", str(rank)))
    local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)))
    return rank, world, local_rank, local_world


def check_launch(n_groups: int | None, group_size: int, batch_size: int, device: str, world: int,
                 local_world: int, cuda_count: int) -> None:
    """The launch errors the user must fix, before any process group exists: the step's groups must split evenly
    over the ranks, and ``device=cuda`` needs a GPU per local rank."""
    if n_groups is not None and n_groups % world:
        fits = [w for w in range(1, n_groups + 1) if n_groups % w == 0]
        raise UserError(f"world size {world} does not divide the {n_groups} prompts (groups) of a step "
                        f"(train.batch_size={batch_size} / algo.group_size={group_size}); whole groups stay on one "
                        f"rank, so use a world size among {fits} or a train.batch_size that is a multiple of "
                        f"{world * group_size}")
    if device.startswith("cuda"):
        if device != "cuda":
            raise UserError(f"device={device!r} puts every rank on one GPU; with {world} ranks use device=cuda "
                            f"(rank r on cuda:LOCAL_RANK), device=auto or device=cpu")
        if cuda_count < local_world:
            raise UserError(f"device=cuda with {local_world} ranks on this node but {cuda_count} GPU(s) visible "
                            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); use "
                            f"--nproc_per_node <= {cuda_count}, or device=cpu")


def setup(device: str, backend: str, timeout_s: float, n_groups: int | None = None, group_size: int = 1,
          batch_size: int = 0) -> tuple[Dist, torch.device | None]:
    """Join the process group torchrun described in the environment; returns this rank's ``Dist`` and device
    (None for a one-process run: the caller resolves it as before). ``n_groups``: a training step's prompts, which
    the ranks must share evenly. Idempotent."""
    global _CURRENT
    rank, world, local_rank, local_world = world_from_env()
    if world <= 1:
        return Dist(), None
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "auto":
        device = "cuda" if cuda else "cpu"
    check_launch(n_groups, group_size, batch_size, device, world, local_world, cuda)
    dev = torch.device("cuda", local_rank) if device == "cuda" else torch.device("cpu")
    if backend not in BACKENDS:
        raise UserError(f"dist.backend={backend!r} is not valid; choose one of {list(BACKENDS)}")
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if backend == "nccl" and dev.type != "cuda":
        raise UserError("dist.backend='nccl' needs device=cuda; use dist.backend=gloo (or auto) on the CPU")
    if _CURRENT.enabled:
        return _CURRENT, dev
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist = torch.distributed
    if not dist.is_initialized():
        kw = {"device_id": dev} if dev.type == "cuda" else {}
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s), **kw)
    _CURRENT = Dist(rank, world, local_rank, local_world, backend, dev if backend == "nccl" else torch.device("cpu"))
    return _CURRENT, dev


def shutdown() -> None:
    """Leave the process group (end of a run); the next ``setup`` joins again."""
    global _CURRENT
    if _CURRENT.enabled and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    _CURRENT = Dist()
