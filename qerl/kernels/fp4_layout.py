"""The FP4 weight as the hand-written CUDA kernels read it, and their CPU emulator (no extension needed).

``prepare`` re-lays out a compressed-tensors FP4 weight once (pure torch, any device) so that each lane's 128-bit
load is its ``mma.sync.m16n8k16`` A fragments for one K chunk of 64 (``csrc/fp4_mma_gemv.cu`` has the fragment map
and the decode); ``to_compressed`` turns it back (for saving). ``emulate`` computes the kernels' y = x @ Ŵᵀ on any
device by decoding the re-laid-out tensors lane by lane with the kernel's own bit operations: the CPU oracle of the
GPU tests. ``LoraOperand`` is the LoRA term the GEMV adds in the same launch, with its emulator. The extension's
build and launches are in :mod:`qerl.kernels.cuda_fp4`, which re-exports these names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FORMATS = ("mxfp4", "nvfp4")
GEMV_FORMATS = ("bf16", "mxfp4", "nvfp4")  # the GEMV's weights: the FP4 layouts, and a dense BF16 weight as stored
_FID = {"nvfp4": 0, "mxfp4": 1, "bf16": 2}  # csrc FMT
_GROUP = {"nvfp4": 16, "mxfp4": 32}
MASK = 0x81C081C0  # per bf16 half: sign bit 15, e2m1 magnitude bits 8..6
REST = 0x001B001B  # bits of the fourth register of a word
SPREAD = (1 << 3) + (1 << 8) + (1 << 14)  # three shifted copies of REST's bits, no carries
_P = (6, 7, 8, 15)  # bf16 bit of nibble bit b (m, e0, e1, sign)
# SRC[o][h][b]: bit of the 32-bit word that holds bit b of the nibble feeding half h of A register o.
SRC = (
    tuple(tuple(16 * h + _P[b] for b in range(4)) for h in range(2)),
    tuple(tuple((16 * h + _P[b] + 3) % 32 for b in range(4)) for h in range(2)),
    tuple(tuple((16 * h + _P[b] + 6) % 32 for b in range(4)) for h in range(2)),
    tuple(tuple(16 * h + (3, 4, 0, 1)[b] for b in range(4)) for h in range(2)),
)
NV_BEXP = 119  # NVFP4 scale words are s * 2^119 (448 * 2^119 < bf16 max)


@dataclass
class CudaFP4Weight:
    """A re-laid-out FP4 weight: ``qweight`` (N/16, K/64, 32, 4) int32 (lane-major A fragments), ``scales``
    (N/16, K/64, 32) int16 E4M3 pairs (NVFP4) or (N/16, K/64, 16) int16 E8M0 pairs (MXFP4), the per-tensor
    global scale (NVFP4), the decode exponent ``bexp`` and the accumulator multiplier 2^(126 - bexp).
    Format "bf16" (:func:`dense_weight`, the GEMV only): ``qweight`` is the dense (N, K) bf16 weight itself, no
    scales, multiplier 1."""

    fmt: str
    n: int
    k: int
    qweight: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor | None
    bexp: int
    bword: int
    out_mult: float

    @property
    def nbytes(self) -> int:
        """Bytes the kernel reads per call (packed weights + scales)."""
        return self.qweight.numel() * self.qweight.element_size() + self.scales.numel() * 2


def dense_weight(w: torch.Tensor) -> CudaFP4Weight:
    """A BF16 weight (N, K) as the GEMV's operand, read where it lies (a view, no copy): N % 16 == 0, K % 64 == 0,
    rows contiguous (row stride K) and 16-byte aligned; ValueError naming what does not fit."""
    if w.dim() != 2 or w.dtype != torch.bfloat16:
        raise ValueError(f"dense_weight: a 2-D bfloat16 weight is needed, got {w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    if n % 16 or k % 64 or n == 0:
        raise ValueError(f"dense_weight: the GEMV needs N % 16 == 0 and K % 64 == 0, got ({n}, {k})")
    if w.stride(1) != 1 or w.stride(0) != k or w.data_ptr() % 16:
        raise ValueError(f"dense_weight: rows must be contiguous (strides ({k}, 1)) and 16-byte aligned, got strides "
                         f"{tuple(w.stride())} at offset {w.data_ptr() % 16} mod 16")
    return CudaFP4Weight("bf16", n, k, w, w.new_empty(0, dtype=torch.int16), None, 0, 0, 1.0)


def weight_from(fmt: str, qweight: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor | None,
                bexp: int) -> CudaFP4Weight:
    """A ``CudaFP4Weight`` over re-laid-out tensors with decode exponent ``bexp``: the scale-word bias ``bword``
    (E4M3 -> f16 exponent (bias 15) -> bf16 (bias 127) * 2^B; E8M0 e -> bf16 exponent e + B) and the accumulator
    multiplier 2^(126 - B) follow from it."""
    bword = (((112 + bexp) << 7) if fmt == "nvfp4" else (bexp << 7)) * 0x10001
    return CudaFP4Weight(fmt, 16 * qweight.shape[0], 64 * qweight.shape[1], qweight, scales, global_scale, bexp,
                         bword, 2.0 ** (126 - bexp))


# ----------------------------------------------------------------------------------------- re-layout

def _check_fmt(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown FP4 format {fmt!r}; valid formats: {list(FORMATS)}")


def _unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 (N, K/2) -> nibble codes uint8 (N, K), element 2j from the low nibble."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def _to_i32(v: torch.Tensor) -> torch.Tensor:
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def _to_i16(v: torch.Tensor) -> torch.Tensor:
    return torch.where(v >= 2**15, v - 2**16, v).to(torch.int16)


def pack_words(codes: torch.Tensor) -> torch.Tensor:
    """Nibble codes (N, K) -> int32 (N/16, K/64, 32, 4): word j of lane (g, t) in chunk c holds rows g, g+8 and
    k = 64c + 16t + 4j + {0..3} of its strip, each nibble's bits at ``SRC``."""
    n, k = codes.shape
    s, c = n // 16, k // 64
    # (strip, row half rh, g, chunk, t, j, ob, h) -> (strip, chunk, g, t, j, [ob, rh, h]); A register o = 2 ob + rh
    v = codes.reshape(s, 2, 8, c, 4, 4, 2, 2).permute(0, 3, 2, 4, 5, 6, 1, 7).reshape(s, c, 32, 4, 8)
    words = torch.zeros((s, c, 32, 4), dtype=torch.int64, device=codes.device)
    for o in range(4):
        for h in range(2):
            nib = v[..., 2 * o + h].to(torch.int64)
            for b in range(4):
                words |= ((nib >> b) & 1) << SRC[o][h][b]
    return _to_i32(words)


def _pair_scales(sb: torch.Tensor, groups_per_chunk: int) -> torch.Tensor:
    """Scale bytes (N, K/G) -> int16 (N/16, K/64, 8 * groups_per_chunk): [g, group] -> row g | row g+8 << 8."""
    n, kg = sb.shape
    s, c = n // 16, kg // groups_per_chunk
    v = sb.reshape(s, 2, 8, c, groups_per_chunk).permute(0, 3, 2, 4, 1).to(torch.int64)  # (S, C, g, grp, rh)
    return _to_i16(v[..., 0] | (v[..., 1] << 8)).reshape(s, c, 8 * groups_per_chunk).contiguous()


def prepare(fmt: str, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
            weight_global_scale: torch.Tensor | None = None) -> CudaFP4Weight:
    """Re-lay out a compressed-tensors NVFP4/MXFP4 weight for :func:`gemv` (once, at load time; pure torch).

    NVFP4 blocks with a zero scale get zero codes and scale 1 (their weights are zero either way). MXFP4 picks
    the decode exponent B so that every block with a nonzero code has e + B in [128, 254] (products exact in
    bf16); a ValueError is raised when no B fits (exponents more than 126 apart), for NaN scales (E4M3 0x7F,
    E8M0 255) and for shapes other than N % 16 == 0, K % 64 == 0. Host syncs: a few (load time only).
    """
    _check_fmt(fmt)
    if weight_packed.dim() != 2 or weight_packed.dtype != torch.uint8:
        raise ValueError(f"weight_packed must be uint8 (N, K/2), got {weight_packed.dtype} "
                         f"{tuple(weight_packed.shape)}")
    n, k = weight_packed.shape[0], 2 * weight_packed.shape[1]
    if n % 16 or k % 64 or n == 0 or k == 0:
        raise ValueError(f"{fmt}: the CUDA GEMV needs N % 16 == 0 and K % 64 == 0, got N={n}, K={k}")
    gsz = _GROUP[fmt]
    if tuple(weight_scale.shape) != (n, k // gsz):
        raise ValueError(f"{fmt}: weight_scale has shape {tuple(weight_scale.shape)}, expected {(n, k // gsz)}")
    dev = weight_packed.device
    codes = _unpack_codes(weight_packed)  # (N, K) uint8
    sb = weight_scale.contiguous().view(torch.uint8).to(dev)  # (N, K/G) raw scale bytes
    if fmt == "nvfp4":
        if weight_global_scale is None:
            raise ValueError("nvfp4 needs weight_global_scale (the per-tensor FP32 divisor)")
        if bool(((sb & 0x7F) == 0x7F).any()):
            raise ValueError("nvfp4: weight_scale holds E4M3 NaN (0x7F/0xFF); the CUDA GEMV cannot represent it")
        zero = (sb & 0x7F) == 0  # (N, K/16)
        if bool(zero.any()):
            codes = codes.reshape(n, k // gsz, gsz).masked_fill(zero[..., None], 0).reshape(n, k)
            sb = torch.where(zero, torch.full_like(sb, 0x38), sb)  # 1.0
        bexp = NV_BEXP
        gs = weight_global_scale.detach().reshape(1).to(device=dev, dtype=torch.float32).contiguous()
    else:
        if weight_scale.dtype != torch.uint8:
            raise ValueError(f"mxfp4: weight_scale must be uint8 E8M0 exponents, got {weight_scale.dtype}")
        live = (codes.reshape(n, k // gsz, gsz) & 7).amax(dim=-1) > 0  # blocks with a nonzero magnitude
        bexp = 126
        if bool(live.any()):
            el = sb[live]
            emin, emax = int(el.min()), int(el.max())
            if emax == 255:
                raise ValueError("mxfp4: weight_scale holds the E8M0 NaN exponent 255")
            lo, hi = 128 - emin, 254 - emax
            if lo > hi:
                raise ValueError(f"mxfp4: E8M0 exponents span [{emin}, {emax}], wider than the 126 the CUDA "
                                 "decoder represents exactly")
            bexp = min(max(126, lo), hi)
        sb = sb.clamp(0, 254 - bexp)  # only all-zero blocks move (their scale is irrelevant)
        gs = None
    qweight = pack_words(codes)
    scales = _pair_scales(sb, 64 // gsz)
    return weight_from(fmt, qweight, scales, gs, bexp)


def unpack_words(qweight: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_words`: int32 (N/16, K/64, 32, 4) -> nibble codes uint8 (N, K)."""
    s, c = qweight.shape[0], qweight.shape[1]
    v = qweight.to(torch.int64) & 0xFFFFFFFF
    nibs = torch.zeros((s, c, 32, 4, 8), dtype=torch.int64, device=qweight.device)
    for o in range(4):
        for h in range(2):
            for b in range(4):
                nibs[..., 2 * o + h] |= ((v >> SRC[o][h][b]) & 1) << b
    # (S, C, g, t, j, ob, rh, h) -> (S, rh, g, C, t, j, ob, h) = (N, K)
    return nibs.reshape(s, c, 8, 4, 4, 2, 2, 2).permute(0, 6, 2, 1, 3, 4, 5, 7).reshape(16 * s, 64 * c).to(torch.uint8)


def _unpair_scales(scales: torch.Tensor, groups_per_chunk: int) -> torch.Tensor:
    """The inverse of :func:`_pair_scales`: int16 (N/16, K/64, 8 * groups_per_chunk) -> scale bytes (N, K/G)."""
    s, c = scales.shape[0], scales.shape[1]
    v = (scales.to(torch.int64) & 0xFFFF).reshape(s, c, 8, groups_per_chunk)
    both = torch.stack((v & 0xFF, v >> 8), dim=-1)  # (S, C, g, grp, rh)
    return both.permute(0, 4, 2, 1, 3).reshape(16 * s, c * groups_per_chunk).to(torch.uint8)


def to_compressed(w: CudaFP4Weight) -> dict[str, torch.Tensor]:
    """The compressed-tensors tensors of a re-laid-out weight (pure torch, on its device): ``weight_packed`` (N, K/2)
    uint8, ``weight_scale`` (N, K/G) as E4M3 (``float8_e4m3fn``, NVFP4) or uint8 E8M0 (MXFP4) and NVFP4's
    ``weight_global_scale``. Exactly the tensors :func:`prepare` was given, except where it changed blocks whose
    weights are zero either way (NVFP4 zero scales, MXFP4 exponents past the decode range): NVFP4 blocks with all
    codes zero and scale 1.0 get scale 0 back. :func:`relayout_is_exact` says whether a given weight survives the
    round trip bit for bit (a weight that does not must keep its compressed-tensors copy)."""
    codes = unpack_words(w.qweight)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    g = _GROUP[w.fmt]
    sb = _unpair_scales(w.scales, 64 // g)
    if w.fmt == "nvfp4":
        dead = (codes.reshape(w.n, w.k // g, g) == 0).all(dim=-1) & (sb == 0x38)
        sb = torch.where(dead, torch.zeros_like(sb), sb)
        return {"weight_packed": packed, "weight_scale": sb.view(torch.float8_e4m3fn),
                "weight_global_scale": w.global_scale.reshape(1).clone()}
    return {"weight_packed": packed, "weight_scale": sb}


def relayout_is_exact(fmt: str, w: CudaFP4Weight, weight_packed: torch.Tensor, weight_scale: torch.Tensor) -> bool:
    """True when :func:`to_compressed` of ``w`` (the :func:`prepare` of these tensors) gives them back bit for bit,
    so that the re-laid-out copy alone can stand for the weight (one host sync)."""
    _check_fmt(fmt)
    back = to_compressed(w)
    return (torch.equal(back["weight_packed"], weight_packed.to(back["weight_packed"].device))
            and torch.equal(back["weight_scale"].view(torch.uint8),
                            weight_scale.contiguous().view(torch.uint8).to(back["weight_packed"].device)))


# ----------------------------------------------------------------------------------------- emulator

def _bf16_bits_to_f32(bits: torch.Tensor) -> torch.Tensor:
    """int64 bf16 bit patterns (0..65535) -> float32 values (exact, subnormals included)."""
    return _to_i32(bits << 16).view(torch.float32)


def _scale_words(w: CudaFP4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-lane scale words (S, C, 32) of rows g and g+8 as float32, computed as the kernel does."""
    s16 = w.scales.to(torch.int64) & 0xFFFF
    if w.fmt == "nvfp4":
        lo = (s16 & 0xFF).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float16).view(torch.int16)
        hi = (s16 >> 8).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float16).view(torch.int16)
        h2 = (lo.to(torch.int64) & 0xFFFF) | ((hi.to(torch.int64) & 0xFFFF) << 16)
        t = (((h2 >> 3) & 0x0FFF0FFF) + w.bword) & 0xFFFFFFFF
        t = t | (h2 & 0x80008000)
        sg, sg8 = t & 0xFFFF, t >> 16
    else:
        s16 = s16.repeat_interleave(2, dim=-1)  # lane reads pair lane >> 1
        sg = ((s16 & 0xFF) * 128 + w.bword) & 0xFFFF
        sg8 = ((s16 >> 8) * 128 + w.bword) & 0xFFFF
    return _bf16_bits_to_f32(sg), _bf16_bits_to_f32(sg8)


def _fragment_values(w: CudaFP4Weight) -> torch.Tensor:
    """float32 (S, C, 32 lanes, 4 MMA steps j, 4 A registers o, 2 halves h): the bf16 A operands the kernels feed
    their MMAs, e2m1 * s * 2^(bexp - 126), decoded with the kernels' own bit operations."""
    v = w.qweight.to(torch.int64) & 0xFFFFFFFF  # (S, C, 32, 4)

    def rotr(a, r):
        return ((a >> r) | (a << (32 - r))) & 0xFFFFFFFF

    regs = torch.stack((v & MASK, rotr(v, 3) & MASK, rotr(v, 6) & MASK,
                        (((v & REST) * SPREAD) & 0xFFFFFFFF) & MASK), dim=-1)  # (S, C, 32, 4 j, 4 o)
    nib = _bf16_bits_to_f32(torch.stack((regs & 0xFFFF, regs >> 16), dim=-1))  # (S, C, 32, 4, 4, 2) e2m1*2^-126
    sg, sg8 = _scale_words(w)  # (S, C, 32)
    sw = torch.stack((sg, sg8, sg, sg8), dim=-1)[:, :, :, None, :, None]  # A registers 0, 2: row g
    return (nib * sw).to(torch.bfloat16).to(torch.float32)  # mul.rn.bf16x2


def _decoded_fragments(w: CudaFP4Weight) -> torch.Tensor:
    """float32 (N, K): the bf16 A operands the kernel feeds its MMAs, e2m1 * s * 2^(bexp - 126), in the real K order."""
    dec = _fragment_values(w)
    s, c = dec.shape[0], dec.shape[1]
    # (S, C, g, t, j, ob, rh, h) -> (S, rh, g, C, t, j, ob, h) = (N, K)
    return dec.reshape(s, c, 8, 4, 4, 2, 2, 2).permute(0, 6, 2, 1, 3, 4, 5, 7).reshape(w.n, w.k)


def emulate_weight(w: CudaFP4Weight) -> torch.Tensor:
    """float32 (N, K) weight as the kernel decodes it, before NVFP4's 1/g: fp4 * s or fp4 * 2^(e-127) (a BF16
    weight: itself)."""
    if w.fmt == "bf16":
        return w.qweight.to(torch.float32)
    return _decoded_fragments(w) * (2.0 ** (126 - w.bexp))


def emulate(x: torch.Tensor, w: CudaFP4Weight, lora: LoraOperand | None = None, act: str | None = None) -> torch.Tensor:
    """y (M, N) bf16 = x (M, K) @ Ŵᵀ (+ the LoRA term) computed like the kernel (fp32 sums of the decoded bf16
    operands times 2^(126-B) [/ g], plus :func:`emulate_lora`, one rounding), in pure torch on any device; equal to
    ``gemv`` up to fp32 summation order. ``act="silu_mul"``: silu(y[:, :N/2]) · y[:, N/2:] (M, N/2), rounded as
    the unfused path rounds it (``qerl.kernels.fused.silu_mul_ref``)."""
    _check_act(act)
    wd = w.qweight.to(torch.float32) if w.fmt == "bf16" else _decoded_fragments(w)
    acc = x.to(torch.float32) @ wd.to(x.device).t()  # (M, N)
    mult = torch.tensor(w.out_mult, dtype=torch.float32, device=x.device)
    if w.global_scale is not None:
        mult = mult / w.global_scale.to(x.device)
    y = acc * mult
    if lora is not None:
        y = y + emulate_lora(x, lora)
    y = y.to(torch.bfloat16)
    if act is not None:
        g, u = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(g) * u
    return y


ACTS = ("silu_mul",)  # epilogues of gemv(act=...): silu(first half of the rows) * second half


def _check_act(act: str | None) -> None:
    if act is not None and act not in ACTS:
        raise ValueError(f"act={act!r} is not an epilogue of the FP4 GEMV; valid: None, {', '.join(map(repr, ACTS))}")


# ----------------------------------------------------------------------------------------- LoRA in the GEMV

LORA_MAX_RANKS = 384  # R of one launch (the workspace holds t finished for 24 16-rank strips; csrc kLoraMaxStrips)
LORA_MAX_UNITS = 512  # LoRA CTAs of one launch (16-rank strips x K parts; csrc kLoraMaxUnits)
LORA_DIRECT_PARTS = 4  # K parts per strip up to which one-strip-per-warp variants sum them in the output warps
LORA_MAX_MEMBERS = 3


def lora_workspace_sizes() -> tuple[int, int]:
    """Elements of :func:`lora_workspace`'s two tensors, which the binding's check also requires: fp32
    (LORA_MAX_UNITS + LORA_MAX_RANKS / 16) x 16 x 16 (the LoRA CTAs' partials, then t finished per 16-rank strip) and
    int32 2 + LORA_MAX_RANKS / 16."""
    strips = LORA_MAX_RANKS // 16
    return (LORA_MAX_UNITS + strips) * 256, 2 + strips


@dataclass
class LoraOperand:
    """The LoRA of one linear or one fused group (q|k|v, gate|up), for :func:`gemv` in the same launch:
    out[:, rows of member i] += bf16(x · A[ranks of i]ᵀ) · Bn[rows of i, :rank_i]ᵀ.

    ``a`` (R, K) bf16: the members' lora_A stacked (R = the sum of their ranks); ``bn`` (N, RP) bf16 with RP a
    multiple of 16 >= every member's rank: row n holds its member's scaling · lora_B row, **zero past the member's
    rank** (:func:`lora_bn` builds it); ``members`` ((rows, ranks) per member, in order, <= 3; rows multiples of 16).
    """

    a: torch.Tensor
    bn: torch.Tensor
    members: tuple[tuple[int, int], ...]

    def __post_init__(self):
        self.members = tuple((int(n), int(r)) for n, r in self.members)
        if not 1 <= len(self.members) <= LORA_MAX_MEMBERS:
            raise ValueError(f"LoRA in the GEMV takes 1 to {LORA_MAX_MEMBERS} members, got {len(self.members)}")
        if any(n <= 0 or n % 16 or r < 0 for n, r in self.members):
            raise ValueError(f"LoRA members must be (rows > 0, a multiple of 16; ranks >= 0), got {self.members}")
        r_total, n_total = sum(r for _, r in self.members), sum(n for n, _ in self.members)
        rp = self.bn.shape[1] if self.bn.dim() == 2 else -1
        if (self.a.dim() != 2 or self.a.shape[0] != r_total or self.bn.dim() != 2 or self.bn.shape[0] != n_total
                or rp % 16 or rp < max(r for _, r in self.members)):
            raise ValueError(f"LoRA shapes: a {tuple(self.a.shape)}, bn {tuple(self.bn.shape)} do not match members "
                             f"{self.members} (a (R, K), bn (N, RP) with R = {r_total}, N = {n_total}, RP a multiple "
                             f"of 16 >= every member's rank)")
        if not 1 <= r_total <= LORA_MAX_RANKS:
            raise ValueError(f"LoRA in the GEMV takes 1 to {LORA_MAX_RANKS} ranks in all, got {r_total}")

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    def launch_args(self) -> tuple[int, int, list[int], list[int]]:
        """(bound1, bound2, roff, rk): rows where members 1 and 2 start (N when absent), ranks per member."""
        n_total = sum(n for n, _ in self.members)
        bounds, roff, rk, n0, r0 = [], [], [], 0, 0
        for n, r in self.members:
            bounds.append(n0)
            roff.append(r0)
            rk.append(r)
            n0, r0 = n0 + n, r0 + r
        while len(roff) < LORA_MAX_MEMBERS:
            bounds.append(n_total)
            roff.append(0)
            rk.append(0)
        return bounds[1], bounds[2], roff, rk


def lora_rp(members) -> int:
    """Row length of Bn: the largest member rank rounded up to 16."""
    return max(16, -(-max(r for _, r in members) // 16) * 16)


def lora_bn(bts: list, members, out: torch.Tensor | None = None) -> torch.Tensor:
    """Bn (N, RP) from each member's (scaling · lora_B)ᵀ (rank_i, rows_i) (None for a member without ranks):
    member rows stacked, each row its ranks then zeros (written into ``out`` in place when given)."""
    n_total, rp = sum(n for n, _ in members), lora_rp(members)
    if out is None:
        ref = next(b for b in bts if b is not None)
        out = torch.zeros((n_total, rp), dtype=ref.dtype, device=ref.device)
    else:
        out.zero_()
    n0 = 0
    for (n, r), bt in zip(members, bts, strict=True):
        if r:
            out[n0:n0 + n, :r].copy_(bt.t())
        n0 += n
    return out


def lora_parts(r: int, c: int, warps: int = 8, chunks_per_warp: int = 2, max_units: int = LORA_MAX_UNITS) -> int:
    """K parts per 16-rank strip = LoRA CTAs per strip: each of ``warps`` warps takes ~``chunks_per_warp`` K chunks
    of 64 (one round of loads of two chunks), at most ``max_units`` CTAs in all. Fewer parts, less to sum; more, a
    shorter chain from the launch to t, which on the small linears is the launch's critical path. Measured
    (``benchmarks/lora_gemv_bench.py --chunks 2,4``, H100, M = 1 and 8, `raw/h100_s24_lora`): 2 chunks against 4,
    7B layer 79.6 / 84.6 µs against 81.2 / 86.1, 32B 138.3 / 139.5 against 142.6 / 145.3; q|k|v and o gain
    0.5-2.7 µs each, gate|up and down within ±1.3. (Session 23, with the output CTAs summing every part, 4 had been
    as fast or faster.)"""
    strips = -(-r // 16)
    return max(1, min(c, -(-c // (warps * chunks_per_warp)), max(1, max_units // strips)))


def lora_direct(parts: int, sw: int) -> bool:
    """Whether a launch with ``parts`` K parts per 16-rank strip and ``sw`` strips per warp has its output warps sum
    the parts (csrc ``la.direct``), rather than each strip's last LoRA CTA."""
    return sw == 1 and parts <= LORA_DIRECT_PARTS


def emulate_lora(x: torch.Tensor, lora: LoraOperand) -> torch.Tensor:
    """float32 (M, N): the LoRA term the kernel adds before its one rounding (t = x·Aᵀ summed in fp32 and rounded to
    bf16, as the MMA operand, then each member's ranks times its rows of Bn)."""
    t = (x.float() @ lora.a.to(x.device).float().t()).to(torch.bfloat16).float()
    out = torch.zeros((x.shape[0], lora.bn.shape[0]), dtype=torch.float32, device=x.device)
    n0 = r0 = 0
    for n, r in lora.members:
        if r:
            out[:, n0:n0 + n] = t[:, r0:r0 + r] @ lora.bn[n0:n0 + n, :r].to(x.device).float().t()
        n0, r0 = n0 + n, r0 + r
    return out
