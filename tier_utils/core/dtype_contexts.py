"""The dtype contexts the precision modes run in (core/precision.py): autocast, with the CPU's attention fast path
off; torch's default dtype for a block; and a module's own dtypes put back after a block that converted it."""
from __future__ import annotations

import contextlib

import torch


class Autocast(torch.autocast):
    """torch.autocast, with nn.MultiheadAttention's inference fast path off on a CPU: that path (a padded batch
    through nn.Transformer in eval) checks only CUDA's autocast and fails on the CPU's mixed dtypes (torch 2.13)."""

    def __enter__(self):
        self._fast_path = torch.backends.mha.get_fastpath_enabled()
        if self.device == "cpu":
            torch.backends.mha.set_fastpath_enabled(False)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            torch.backends.mha.set_fastpath_enabled(self._fast_path)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """torch's default dtype set to `dtype` inside the block (a true mode's forward: tensors made without a dtype
    come out in the weights')."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@contextlib.contextmanager
def kept_dtypes(module: torch.nn.Module, exact: bool = False):
    """Each parameter and buffer of `module` back in its own dtype after the block, whatever precisions converted
    it inside (a caller's bf16-stored model stays bf16 after a benchmark ran it as fp32 and bf16-true).

    `exact`: the original tensors themselves are held and put back, bit for bit (an fp32 weight converted to bf16
    inside would otherwise come back rounded to bf16), at the cost of holding them beside the converted ones: for
    a probe that must leave a caller's model as it was (the fit planner's)."""
    params = {name: p.data if exact else p.dtype for name, p in module.named_parameters()}
    buffers = {name: b if exact else b.dtype for name, b in module.named_buffers()}
    try:
        yield module
    finally:
        for name, p in module.named_parameters():
            held = params[name]
            if exact:
                p.data = held
            elif p.dtype != held:
                p.data = p.data.to(held)
        for name, b in module.named_buffers():
            held = buffers[name]
            if (b is not held) if exact else (b.dtype != held):
                owner, _, attr = name.rpartition(".")
                setattr(module.get_submodule(owner), attr, held if exact else b.to(held))
