"""Independent counts for ledger tests: the aten ops a step actually runs, and the tensors the runner
hands to the model. Nothing here reads costs.py."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

PACKED_GEMVS = (("tokenhaul_int4", "gemv"), ("tokenhaul_int8", "int8_gemv"), ("tokenhaul_bf16", "bf16_gemv"))  # the C++
# GEMVs (namespace, op)


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class TrafficCounter(TorchDispatchMode):
    """Counts from the ops that run, never from costs.py: weight tensors touched (each use of a weight
    in an op with a non-empty result reads all of it; the embedding only the rows indexed), K/V slots
    gathered from (or read in place by attention) and written to the cache tensors, copy-on-write copies,
    matmul and attention FLOPs."""

    def __init__(self, model, kv) -> None:
        super().__init__()
        objs = [model.norm, model.lm_head] + [v for layer in model.layers for v in vars(layer).values()]
        self.weights = {_ptr(t) for o in objs if hasattr(o, "__dict__") for t in vars(o).values()
                        if isinstance(t, torch.Tensor)}
        self.embed = _ptr(model.embed.weight)
        self.kv = {_ptr(t) for t in (*kv.k, *kv.v)}
        self.weight_bytes = self.kv_read = self.kv_write = self.kv_copy = self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if func.namespace == "tokenhaul_kv":  # decode attention reading the cache in place through the table
            self._decode_in_place(args, out)
        elif name in ("index", "index_select") and first is not None and _ptr(first) in (self.kv | {self.embed}):
            if _ptr(first) == self.embed:
                self.weight_bytes += out.nbytes
            else:
                self.kv_read += out.nbytes
        elif name == "index_put_" and _ptr(first) in self.kv:
            self.kv_write += args[2].nbytes
        elif name == "copy_" and first is not None and _ptr(first) in self.kv:
            self.kv_copy += 2 * args[1].nbytes
        elif isinstance(out, torch.Tensor) and out.numel():
            tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
            self.weight_bytes += sum(a.nbytes for a in tensors if _ptr(a) in self.weights)
            if _ptr(out) not in self.kv:  # not a view op: it reads K/V in place from the cache
                self.kv_read += sum(a.numel() * a.element_size() for a in tensors if _ptr(a) in self.kv)
        if name in ("matmul", "mm") and out.numel():
            self.flops += 2 * args[0].numel() * args[1].shape[-1]
        elif (name.startswith(("_weight_int4pack_mm", "_weight_int8pack_mm"))
              or (func.namespace, name) in PACKED_GEMVS) and out.numel():
            self.flops += 2 * args[0].numel() * out.shape[-1]
        elif name == "_int_mm" and out.numel():  # int8 linears: two int8 rows (hi, lo) per activation row
            self.flops += args[0].numel() * args[1].shape[-1]
        elif name == "linear" and out.numel():
            self.flops += 2 * args[0].numel() * args[1].shape[0]
        elif name == "scaled_dot_product_attention":
            B, H, Q, D = args[0].shape
            self.flops += 4 * B * H * Q * args[1].shape[-2] * D
        return out

    def _decode_in_place(self, args, out) -> None:
        """decode_bf16(q, kd, vd, table, mask, ...) / decode_int8(q, kd, ks, vd, vs, table, mask, ...): each row
        reads the blocks of its table from its first visible key's to its last's (all of them with no mask)."""
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        q, table, mask, caches = tensors[0], tensors[-2], tensors[-1], tensors[1:-2]
        B, nb = table.shape
        bs = caches[0].shape[1]
        slot_bytes = sum(t[0, 0].nbytes for t in caches)  # K and V values (and int8 scales) of one slot
        for b in range(B):
            if mask.numel():
                blocks = mask.view(B, nb, bs)[b].any(-1).nonzero().flatten()
                read = int(blocks[-1] - blocks[0] + 1) if len(blocks) else 0
            else:
                read = nb
            self.kv_read += read * bs * slot_bytes
            self.flops += 4 * q.shape[1] * q.shape[2] * q.shape[3] * read * bs


def model_input_bytes(inp) -> int:
    """Bytes of the distinct tensors the runner handed to the model."""
    ts = [inp.input_ids, inp.sample_rows, inp.meta.positions, inp.meta.slot_mapping]
    for g in inp.meta.groups:
        ts += [g.block_table, g.token_index, g.mask, g.mask_local]
    uniq = {id(t): t for t in ts if t is not None}
    return sum(t.nbytes for t in uniq.values())
