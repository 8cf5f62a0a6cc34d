"""Random packed weights for the kernel tests (importable via pytest's pythonpath)."""

import torch

from qcompiler.layouts.gptq import pack_gptq


def gptq_problem(bits, group, act_order, n_out, n_in, seed=0):
    """A GPTQ-layout weight with random codes, scales and zeros (act-order: ``g_idx`` shuffled),
    and a bias."""
    gen = torch.Generator().manual_seed(seed)
    n_groups = 1 if group == -1 else -(-n_in // group)
    codes = torch.randint(0, 2**bits, (n_out, n_in), generator=gen)
    scales = torch.rand(n_groups, n_out, generator=gen) * 0.1 + 0.01
    zeros = torch.randint(0, 2**bits, (n_groups, n_out), generator=gen).float()
    g_idx = torch.zeros(n_in, dtype=torch.int32) if group == -1 else (torch.arange(n_in) // group).int()
    if act_order:
        g_idx = g_idx[torch.randperm(n_in, generator=gen)]
    w = pack_gptq(codes, scales, zeros, g_idx, bits, group)
    return w, torch.randn(n_out, generator=gen)
