"""Model weights in and out: safetensors of the plain module, never pickled code.

    save_weights(accelerator, model, out / "model.safetensors", {"recipe": "mnist"})
    load_weights(model, "model.safetensors")      # also a DDP-era .pt with 'module.' keys
"""

import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from common.config import UserError


def save_weights(accelerator, model, path, metadata=None):
    """Write the unwrapped model's weights from the main process, atomically (temp file + rename)."""
    state = accelerator.get_state_dict(model)  # collective under FSDP/DeepSpeed: every rank calls it
    if accelerator.is_main_process:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        state = {k: v.detach().cpu().contiguous() for k, v in state.items()}
        save_file(state, tmp, metadata={k: str(v) for k, v in (metadata or {}).items()})
        os.replace(tmp, path)
    accelerator.wait_for_everyone()


def _strip_prefix(state, prefix):
    if state and all(k.startswith(prefix) for k in state):
        return {k[len(prefix) :]: v for k, v in state.items()}
    return state


def load_weights(model, path):
    """Load weights saved by save_weights, or a torch.save'd state_dict (weights only, no code).

    Keys written by DDP-era scripts (`module.` prefix) or torch.compile (`_orig_mod.`) are accepted.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"weights file {path} not found: check --weights")
    try:
        if path.suffix == ".safetensors":
            state = load_file(path)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
            if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
                state = state["model"]
    except (SafetensorError, RuntimeError, EOFError, OSError) as e:
        raise UserError(f"cannot read weights file {path} ({str(e).splitlines()[0]}): it is truncated or not a weights file") from None
    state = _strip_prefix(_strip_prefix(state, "module."), "_orig_mod.")
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        first = [line.strip() for line in str(e).splitlines() if line.strip()][1:2]
        raise UserError(
            f"weights in {path} do not fit this model ({first[0] if first else 'shape mismatch'}): "
            f"were they saved by another recipe or with other model settings?"
        ) from None
