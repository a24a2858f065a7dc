"""Peak memory while loading a model: the streaming loader against reading every tensor first (the old path).

Each way runs in a fresh child process that loads the same model (made here with ``make_tiny``, big enough that the
weights dominate the process: hidden 1024, 12 layers, ~0.75 GB in float32) and reports how far its peak resident
memory (VmHWM, reset before the load) rose above where it stood, over the weights' bytes in the dtype loaded:

    streaming   loader.load_model: the model given memory once, each checkpoint tensor read into place
    dict first  every tensor read into a dict (weights.load_hf_weights), then copied into the model

Goal (issue 61): at most 1.15x the weights. A GPU's peak would come from torch.cuda.max_memory_allocated; not measured.

    .venv/bin/python -m benchmarks.load_memory [--dtype float32|bfloat16] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, torch
from mooncake.engine import loader
from mooncake.engine.model import CausalLM
from mooncake.engine.model_args import ModelArgs
from mooncake.engine.weights import load_hf_config, load_hf_weights
path, way, dtype = sys.argv[1], sys.argv[2], getattr(torch, sys.argv[3])
def status(key):  # bytes, from /proc/self/status
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key + ":"))
torch.ones(1) @ torch.ones(1)  # torch's own start-up allocations, before the baseline
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again here (exec keeps the parent's)
before = status("VmRSS")
if way == "streaming":
    model = loader.load_model(path, dtype, torch.device("cpu"))
else:
    args = ModelArgs.from_hf_config(load_hf_config(path))
    with torch.device("meta"):
        model = CausalLM(args)
    model = model.to(dtype).to_empty(device="cpu")
    model.load_hf_state_dict(load_hf_weights(path, dtype=dtype))
peak = status("VmHWM")
weights = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"rise": peak - before, "weights": weights}))
"""


def measure(path: Path, way: str, dtype: str) -> dict:
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), way, dtype], capture_output=True, text=True, timeout=600, check=True
    )
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    opts = parser.parse_args()
    from mooncake.engine.tiny import make_tiny

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny(
            Path(tmp) / "model",
            "llama",
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=12,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=64,
            max_shard_bytes=256 << 20,
        )
        for way in ("dict first", "streaming"):
            r = measure(path, way.replace(" ", "_"), opts.dtype)
            r["ratio"] = r["rise"] / r["weights"]
            results[way] = r
            print(
                f"{way:>11}: peak rise {r['rise'] / 2**20:7.0f} MiB over {r['weights'] / 2**20:.0f} MiB of "
                f"{opts.dtype} weights = {r['ratio']:.2f}x"
            )
    print(f"streaming / dict first: {results['streaming']['rise'] / results['dict first']['rise']:.2f}x the peak")
    if opts.out:
        opts.out.write_text(json.dumps({"dtype": opts.dtype, **results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
