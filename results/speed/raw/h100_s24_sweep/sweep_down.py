"""s24: launch configurations of the plain FP4 GEMV on the down_proj (and gate|up) shapes, M = 1 and 8."""
import sys
import torch
from benchmarks import cuda_bench as cb
from benchmarks import kernel_bench as bench
from qerl.kernels import cuda_fp4 as cf

shapes = {"7b-down": (3584, 18944), "14b-down": (5120, 13824), "32b-down": (5120, 27648), "7b-gate_up": (37888, 3584),
          "32b-gate_up": (55296, 5120)}
ms = [int(v) for v in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 8]
only = sys.argv[2].split(",") if len(sys.argv) > 2 else list(shapes)
for name, (n, k) in shapes.items():
    if name not in only:
        continue
    w = bench._Weights("nvfp4", n, k, seed=1)
    ws = cb._cuda_weights("nvfp4", w)
    s, c = n // 16, k // 64
    for m in ms:
        pick = cf._config(ws[0], m, torch.device("cuda"))
        cfgs = {pick}
        for unroll, sw in ((4, 1), (2, 2), (2, 1)):
            maxw = 8 if unroll * sw >= 8 else 16
            for splits in range(4, 17):
                if splits > maxw:
                    continue
                for per in (1, 2):
                    if splits * per <= maxw:
                        cfgs.add((splits, per, unroll, sw))
        res = sorted((cb._time_cuda(ws, m, 40, config=cfg), cfg) for cfg in sorted(cfgs))
        tp = next(t for t, cfg in res if cfg == pick)
        occ = lambda cfg: cf._ext().occupancy(0, 2 if m > 8 else 1, cfg[2], cfg[3], cfg[0] * cfg[1], cfg[0], 0)
        print(f"{name} M={m}: picked {pick} {tp * 1e3:.2f} us (occ {occ(pick)}); best: " +
              "; ".join(f"{cfg} {t * 1e3:.2f} (occ {occ(cfg)})" for t, cfg in res[:6]), flush=True)
    del w, ws
    torch.cuda.empty_cache()
