"""Launched by test_unet_training.py with 2 processes and `dynamo_backend: INDUCTOR` in the
accelerate config: after a bucketed evaluation and save_weights(), is the compiled DDP model still
whole?

Accelerate 1.15's unwrap_model(model) (also inside get_state_dict) re-points torch.compile's
wrapper at the bare model, so DDP drops out of the module tree that training goes on using:
train()/eval() and no_sync() no longer reach it. The recipes unwrap without that side effect.

    accelerate launch --config_file COMPILE.yaml tests/compile_probe.py SHAPES OUT VAL_FRACTION
"""

import sys
from pathlib import Path

import torch
from accelerate.utils import is_compiled_module
from recipe_module import load_recipe  # first: it puts the repository on sys.path
from safetensors import safe_open
from torch.nn.parallel import DistributedDataParallel

from common.accelerator import build_accelerator, close
from common.checkpoint import save_weights

unet = load_recipe("unet")

shapes, out, val_fraction = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
cfg = unet.Config(
    dataset=shapes,
    output_dir=str(out),
    val_fraction=val_fraction,
    bucket_by_size=True,
    num_classes=4,
    in_channels=3,
    base_channels=4,
    num_workers=0,
)
accelerator = build_accelerator()
val_loader = unet.load_data(cfg, accelerator).val_loader
model = unet.build_model({name: getattr(cfg, name) for name in unet.MODEL_SETTINGS})
optimizer = torch.optim.AdamW(model.parameters())
model, optimizer = accelerator.prepare(model, optimizer)


def whole(model, when):
    assert is_compiled_module(model) and isinstance(model._orig_mod, DistributedDataParallel), (
        f"{when}: the compiled model wraps {type(model._orig_mod).__name__}, not DDP"
    )


whole(model, "after prepare")
result = unet.evaluate(model, val_loader, accelerator, cfg, flips="h", weights=None)  # bare
whole(model, "after evaluate")
save_weights(accelerator, model, out / "model.safetensors")
whole(model, "after save_weights")
if accelerator.is_main_process:
    with safe_open(out / "model.safetensors", "pt") as f:
        assert not any(k.startswith("_orig_mod.") for k in f.keys()), list(f.keys())[:3]
print(
    f"rank {accelerator.process_index}: compiled DDP model whole; {result['eval_samples']} "
    f"images evaluated",
    flush=True,
)
del model, optimizer, val_loader
close(accelerator)
