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

**FSDP2 for full fine-tuning** (``dist.fsdp=true``, with ``lora=none``): when every weight is trained, replicating
the weights, their gradients and the AdamW moments on every rank (what the all-reduce path does) costs ~16 bytes
per parameter per GPU. ``shard_model`` applies PyTorch's own FSDP2 (``torch.distributed.fsdp.fully_shard``, per
decoder layer, then the root), so gradients and optimizer state are sharded over the ranks (each holds 1/W) and the
backward reduce-scatters the gradients (summed, not averaged: the loss weights are global shares already, as above).
Rollouts, old/reference log-probs and evaluation run inside ``unsharded(model)``: the full weights are gathered once
and kept for the whole phase (no collective inside a forward, so ranks may decode different numbers of tokens and
CUDA graphs / the fused decode are off), then freed before the update. So the peak holds the full BF16 weights once
per rank plus the sharded training state: FSDP saves the gradients and optimizer moments, not the weights. Every
update step runs the same number of forward/backward passes on every rank (a rank with fewer rows pads with
zero-weight passes), which FSDP's collectives need.

    torchrun --nproc_per_node=8 -m qerl.train lora=none quant=bf16 optim.name=adamw dist.fsdp=true ...

The process group gets a timeout (``dist.timeout_s``): a rank that dies or hangs makes the others fail within it
with an error naming the collective, instead of waiting forever (torchrun then stops the job).
A one-process run (no ``WORLD_SIZE`` > 1 in the environment) never touches ``torch.distributed``.
"""

from __future__ import annotations

import contextlib
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

    def describe_device(self, device: torch.device) -> str:
        """``host:device (GPU name)`` of this rank, for env.json."""
        name = ""
        if device.type == "cuda":
            name = f" ({torch.cuda.get_device_name(device)})"
        return f"{platform.node() or socket.gethostname()}:{device}{name}"


_CURRENT = Dist()


# ----------------------------------------------------------------------------------------- FSDP2 (full fine-tuning)

def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (``model.model.layers``: Llama, Qwen2, the toy model)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or len(layers) == 0:
        raise UserError(f"dist.fsdp=true shards a model by its decoder layers (model.model.layers); "
                        f"{type(model).__name__} has none")
    return list(layers)


def shard_model(model: torch.nn.Module, forward_methods: dict | None = None) -> list[torch.nn.Module]:
    """Apply FSDP2 to ``model`` in place: each decoder layer, then the root (embeddings, final norm, LM head). Every
    FSDP module reduce-scatters gradient *sums* (divide factor 1, sum-only collectives, as gloo also needs). Returns
    the FSDP modules, root last. Parameters become DTensors sharded on dim 0 over the default process group.

    ``forward_methods``: name -> function(model, ...) bound to the model under that name and registered as FSDP
    forward methods (``register_fsdp_forward_method``): code that runs the model other than through ``forward``
    (e.g. the inner model and then the LM head on chunks) gets the root's unshard and gradient hooks that way."""
    import types

    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    mods = []
    for layer in decoder_layers(model):
        fully_shard(layer)
        mods.append(layer)
    fully_shard(model)
    mods.append(model)
    for m in mods:
        m.set_gradient_divide_factor(1.0)
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)
    for name, fn in (forward_methods or {}).items():
        setattr(model, name, types.MethodType(fn, model))
        register_fsdp_forward_method(model, name)
    return mods


def is_sharded(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


class unsharded:
    """``with unsharded(model):`` every FSDP module's full parameters gathered once and kept (no reshard after a
    forward, so no collective runs inside one); resharded on exit. A no-op for a model that is not sharded."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.mods: list = []

    def __enter__(self):
        if is_sharded(self.model):
            from torch.distributed.fsdp import FSDPModule
            self.mods = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
            self.model.set_reshard_after_forward(False)
            for m in self.mods:
                m.unshard()
        return self.model

    def __exit__(self, *exc):
        for m in self.mods:
            m.reshard()
            m.set_reshard_after_forward(m is not self.model, recurse=False)  # fully_shard's defaults (root: False)
        self.mods = []
        return False


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> tuple[dict, dict | None]:
    """(model state, optimizer state) as full CPU tensors on rank 0 ({} elsewhere) from an FSDP model; a collective:
    every rank must call it. The optimizer state is keyed by parameter names (``get_optimizer_state_dict``)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(model, options=opts)
    if optimizer is None:
        return msd, None
    if not optimizer.state:
        # No update yet (e.g. step 1 had nothing to learn from): get_optimizer_state_dict would first run torch's
        # zero-gradient initialising step(), which AdamW counts — every later update would get the wrong bias
        # correction. An optimizer without state is its own state_dict: hyperparameters only.
        return msd, optimizer.state_dict()
    return msd, get_optimizer_state_dict(model, optimizer, options=opts)


def load_full_state(model: torch.nn.Module, model_state: dict, optimizer=None, optim_state: dict | None = None) -> None:
    """Shard full (unsharded) model / optimizer states, present on every rank, into an FSDP model and optimizer."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, model_state, options=opts)
    if optimizer is None or optim_state is None:
        return
    if not optim_state.get("state"):
        # saved before the first update (see full_state): restore the hyperparameters only; set_optimizer_state_dict
        # would run the zero-gradient initialising step() and leave AdamW's step count at 1
        for group, saved in zip(optimizer.param_groups, optim_state["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        return
    set_optimizer_state_dict(model, optimizer, optim_state, options=opts)


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


def shutdown(sync: bool = False) -> None:
    """Leave the process group (end of a run); the next ``setup`` joins again.

    ``sync``: meet the other ranks first (a run that ended normally). Without it a rank that finished early could tear
    down its gloo connections while a peer's transport threads still use them, and the peer aborts at exit
    ("terminate called without an active exception"); after an error the peers may never arrive, so no barrier."""
    global _CURRENT
    if _CURRENT.enabled and torch.distributed.is_initialized():
        if sync:
            torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    _CURRENT = Dist()


@contextlib.contextmanager
def leaving():
    """The rest of a run after :func:`setup`: on leaving the block, :func:`shutdown` — meeting the other ranks first
    when the block ended normally (a return included), not after an error."""
    try:
        yield
    except BaseException:
        shutdown()
        raise
    shutdown(sync=True)
