import sys, torch
sys.path.insert(0, '.')
from benchmarks import lora_gemv_bench as lb
from qerl.kernels import cuda_fp4 as cf
m = int(sys.argv[1]) if len(sys.argv) > 1 else 8
which = sys.argv[2] if len(sys.argv) > 2 else "gate|up"
gs = {name: (members, k) for name, members, k in lb.groups("7b", 32)}
members, k = gs[which]
lin = lb._Linear("nvfp4", members, k, seed=1)
x = torch.randn(m, k, device="cuda").bfloat16()
out = torch.empty(m, lin.n, device="cuda", dtype=torch.bfloat16)
for rep in range(3):
    for i in range(len(lin.ws)):
        cf.gemv(x, lin.ws[i], out=out)
    for i in range(len(lin.ws)):
        cf.gemv(x, lin.ws[i], out=out, lora=lin.ops[i])
torch.cuda.synchronize()
print("config", cf._config(lin.ws[0], m, x.device), cf._config(lin.ws[0], m, x.device, lin.ops[0]))
