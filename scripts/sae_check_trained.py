"""A trained sparsify SAE read back by sae-lens (in ``.venv-saelens``) and by sparsify, on real activations.

Saves the SAE in sae-lens's format, has ``tests/support/sae_lens_driver.py load`` (sae-lens 6.54's
``SAE.load_from_disk``) encode and decode 60 real activations of the default model at the SAE's site, loads the
training folder with sparsify's ``SparseCoder.load_from_disk``, and prints the largest differences from
steerkit's own encode and decode as JSON.

Usage:  SPARSIFY_DISABLE_TRITON=1 python scripts/sae_check_trained.py sae-smollm2-l12/layers.12 [WORKDIR]
"""
import json
import shutil
import subprocess
import sys
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
from sparsify import SparseCoder

import steerkit

ROOT = Path(__file__).resolve().parents[1]
FOLDER = sys.argv[1]
out = Path(sys.argv[2] if len(sys.argv) > 2 else "sae-check")
shutil.rmtree(out, ignore_errors=True)
(out / "steerkit").mkdir(parents=True)
(out / "steerkit_io").mkdir()
sm = steerkit.load_model()
sae = steerkit.load_sae(FOLDER, model=sm)
texts = ["Call me Ishmael. Some years ago, never mind how long precisely, I thought I would sail about.",
         "The state of the Union is strong, and our economy is growing.", "I just got wonderful news!"]
with sm.record(sae.site) as cache:
    sm.forward(texts, chat=False)
x = cache[sae.site].float().reshape(-1, sm.d_model)
x = x[x.norm(dim=-1) < 1000]  # the padded/attention-sink rows aside
sae.save(out / "steerkit" / "trained", format="saelens")
save_file({"x": x.contiguous()}, out / "steerkit_io" / "trained.safetensors")
r = subprocess.run([str(ROOT / ".venv-saelens/bin/python"), str(ROOT / "tests/support/sae_lens_driver.py"), "load", str(out)], capture_output=True, text=True)
print(r.stdout[-500:], r.stderr[-1500:] if r.returncode else "")
if r.returncode:
    sys.exit(f"sae-lens could not read it: {r.stderr[-1500:]}")
back = load_file(out / "back" / "trained.safetensors")
print(sorted(back))
f = sae.encode(x)
xh = sae.decode(f, x)
res = {"rows": int(x.shape[0])}
for k, v in back.items():
    mine = {"f": f, "y": xh}.get(k)
    if mine is not None:
        res[f"saelens_{k}_max_abs_diff"] = float((mine - v).abs().max())
sc = SparseCoder.load_from_disk(FOLDER, device="cpu")
enc = sc.encode(x)
dense = torch.zeros_like(f).scatter_(-1, enc.top_indices, enc.top_acts.detach())
res["sparsify_encode_max_abs_diff"] = float((dense - f).abs().max())
res["sparsify_decode_max_abs_diff"] = float((sc.decode(enc.top_acts, enc.top_indices).detach() - xh).abs().max())
res["max_abs_latent"] = float(f.abs().max())
print(json.dumps(res))
