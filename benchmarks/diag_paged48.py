"""Which paged-decode widths fault at D 48 (a verification trial at a small width hit a misaligned address)."""
import os, subprocess, sys
CHILD = r'''
import sys, torch
sys.path[:0] = ["tests", "."]
import paged_specs as ps, torch_cubridge as tc
import torch_cubridge.verify.gpu as vg
vg.gpu_shapes = lambda p, ex: [vg.example_sizes(p, ex)]
torch.manual_seed(0)
D, P, W = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
args = [a.cuda() for a in ps.pages(3, 8, 2, 3000, D, P, torch.bfloat16)]
f = tc.compile(ps.vllm_heads_first, fallback="raise")
f(*args); torch.cuda.synchronize()
q, kp, vp, table, lens = args
t = torch.randint(0, kp.shape[0], (3, W), device="cuda")
l = torch.randint(1, W * P + 1, (3,), device="cuda")
out = f(q, kp, vp, t, l); torch.cuda.synchronize()
ref = ps.vllm_heads_first(*(x.cpu().double() if x.is_floating_point() else x.cpu() for x in (q, kp, vp, t, l)))
print("width", W, "ok", float((out.cpu().double() - ref).norm() / ref.norm()), f.served)
'''
for D, P, W in [(48, 16, w) for w in (4, 1, 2, 3, 5, 8, 62)] + [(64, 16, 4), (48, 16, 188)]:
    r = subprocess.run([sys.executable, "-c", CHILD, str(D), str(P), str(W)], capture_output=True, text=True, timeout=120)
    print(D, P, W, "rc", r.returncode, (r.stdout.strip().splitlines() or [""])[-1], r.stderr.strip().splitlines()[-1:] if r.returncode else "", flush=True)
