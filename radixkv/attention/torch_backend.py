"""Pure-torch paged attention: the reference backend (CPU or CUDA).

It reads the KV cache only through FlashInfer's page table (``kv_indptr``, ``kv_indices``,
``kv_last_page_len``) and computes what FlashInfer's paged prefill computes with
``causal=True`` (bottom-right aligned mask), so the FlashInfer backend can be checked against it.

Speed without per-token Python: :meth:`TorchAttentionBackend.plan` splits the requests into a few
*groups* and, for each group, builds once per forward pass the padded index tensors
``q_rows [Bg, Qmax]`` (rows of the flattened batch) and ``kv_slots [Bg, Lmax]`` (KV slot of every
position, from the page table) plus a boolean mask. Each layer then does one gather of K/V, one
``scaled_dot_product_attention`` call and one scatter per group. Groups:

* all decode requests (one new token each) together: ``Qmax = 1``; on the CPU (``row_exact``)
  one group per decode request instead, so that a decode row gets the bits it gets alone;
* the other requests together when padding them to a common ``[Qmax, Lmax]`` wastes at most
  half of the work, otherwise one group per request (the loop is over requests, not tokens); on
  the CPU (``row_exact``) always one group per request, so a prompt's rows do not depend on the
  other prompts prefilled beside it.

Row-count invariance (the verify rows of speculative decoding, docs/model.md): SDPA's result for
one row depends on the padded length and on the rows batched beside it (its blocked reductions),
so a decode row padded into a group differs in the last bits from the same row alone. With
``row_exact`` every decode row is its own unpadded, unmasked SDPA call, the same call a one-row
decode step makes: its output, and the K/V the next layers write from it, are the same bits
whatever else is in the batch (tests/test_verify_rows.py). It is the default on the CPU (where
the model's native GEMMs are row-invariant too); on CUDA the padded group stays (cuBLAS's GEMMs
are not row-invariant, so nothing would be gained).

K/V are read through :meth:`KVPool.gather <radixkv.memory.kv_pool.KVPool.gather>`, which
dequantizes the pool's dtype (bfloat16, float16, fp8 with scales) to the queries' dtype, so every
K/V dtype works and the new tokens attend to their own K/V as stored (rounded), as on every backend.

GQA without copying K/V: the ``G = num_q_heads // num_kv_heads`` query heads sharing a KV head
are folded into the query-length axis, ``[Bg, Hkv, G * Qmax, D]`` against ``[Bg, Hkv, Lmax, D]``
(the mask is repeated per head of the group). A single fresh prefill instead uses SDPA's own
causal kernel with ``enable_gqa``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixkv.attention.base import AttentionBackend
from radixkv.attention.metadata import ForwardBatch
from radixkv.memory.kv_pool import KVPool


@dataclass
class _Group:
    """Padded indices of a set of requests attended together (see module docstring)."""

    q_rows: torch.Tensor  # [Bg, Qmax] int64 rows into the T new tokens (padding -> row 0)
    q_valid: torch.Tensor | None  # [Bg * Qmax] bool, None when nothing is padded
    kv_slots: torch.Tensor  # [Bg, Lmax] int64 slot ids (padding -> slot 0)
    mask: torch.Tensor | None  # [Bg, 1, G * Qmax, Lmax] bool (True = attend), None = no mask
    is_causal: bool  # use SDPA's own causal mask (single fresh prefill)
    flat_rows: torch.Tensor  # [n_valid] int64 output rows, in q_rows order (valid only)


class TorchAttentionBackend(AttentionBackend):
    """Reference paged attention in plain torch; see the module docstring for the method.

    Args:
        kv_pool, num_q_heads, sm_scale: as in :class:`~radixkv.attention.base.AttentionBackend`.
        max_pad_waste: a non-decode group is padded together only when its padded work
            ``Bg * Qmax * Lmax`` is at most ``max_pad_waste`` times the useful work.
        row_exact: one SDPA call per request (module docstring); default (None): on a CPU pool.
    """

    name = "torch"

    def __init__(
        self,
        kv_pool: KVPool,
        num_q_heads: int,
        sm_scale: float | None = None,
        max_pad_waste: float = 2.0,
        row_exact: bool | None = None,
    ) -> None:
        super().__init__(kv_pool, num_q_heads, sm_scale)
        self.max_pad_waste = float(max_pad_waste)
        self.row_exact = kv_pool.device.type == "cpu" if row_exact is None else bool(row_exact)
        self._groups: list[_Group] = []
        self._batch: ForwardBatch | None = None

    # ------------------------------------------------------------------ plan
    def plan(self, batch: ForwardBatch) -> None:
        if batch.page_size != self.page_size:
            raise ValueError(
                f"TorchAttentionBackend.plan: batch.page_size {batch.page_size} != kv_pool.page_size {self.page_size}"
            )
        self._batch = batch
        self._groups = self._plan_groups(batch, range(batch.batch_size))

    def _plan_groups(self, batch: ForwardBatch, reqs) -> list[_Group]:
        """The padded groups (module docstring) covering requests ``reqs`` of ``batch``."""
        extend = batch.extend_lens_cpu.tolist()
        prefix = batch.prefix_lens_cpu.tolist()
        decode = [i for i in reqs if extend[i] == 1]
        rest = [i for i in reqs if extend[i] > 1]
        groups: list[list[int]] = []
        if decode and self.row_exact:
            groups.extend([i] for i in decode)
        elif decode:
            groups.append(decode)
        if len(rest) == 1 or (rest and not self.row_exact and self._pad_pays(rest, extend, prefix)):
            groups.append(rest)
        else:
            groups.extend([i] for i in rest)
        return [self._make_group(batch, g, extend, prefix) for g in groups]

    def _pad_pays(self, reqs: list[int], extend: list[int], prefix: list[int]) -> bool:
        """Whether padding ``reqs`` to one ``[Qmax, Lmax]`` group wastes at most ``max_pad_waste``
        times the useful work."""
        useful = sum(extend[i] * (extend[i] + prefix[i]) for i in reqs)
        padded = len(reqs) * max(extend[i] for i in reqs) * max(extend[i] + prefix[i] for i in reqs)
        return padded <= self.max_pad_waste * useful

    def _make_group(self, batch: ForwardBatch, reqs: list[int], extend: list[int], prefix: list[int]) -> _Group:
        dev = self.device
        ps = self.page_size
        bg = len(reqs)
        q_len = torch.tensor([extend[i] for i in reqs], dtype=torch.int64)
        pre = torch.tensor([prefix[i] for i in reqs], dtype=torch.int64)
        kv_len = q_len + pre
        qmax, lmax = int(q_len.max()), int(kv_len.max())
        qo_start = batch.qo_indptr_cpu.to(torch.int64)[reqs]

        j = torch.arange(qmax)
        q_ok = j[None, :] < q_len[:, None]  # [Bg, Qmax]
        q_rows = torch.where(q_ok, qo_start[:, None] + j[None, :], torch.zeros((), dtype=torch.int64))

        # KV slot of position p of request i: page kv_indices[kv_indptr[i] + p // ps], offset p % ps.
        p = torch.arange(lmax, device=dev)
        kv_ok = p[None, :] < kv_len.to(dev)[:, None]  # [Bg, Lmax]
        kv_start = batch.kv_indptr[torch.tensor(reqs, device=dev)].to(torch.int64)
        page_idx = kv_start[:, None] + torch.div(p, ps, rounding_mode="floor")[None, :]
        page_idx = torch.where(kv_ok, page_idx, torch.zeros((), dtype=torch.int64, device=dev))
        slots = batch.kv_indices.to(torch.int64)[page_idx] * ps + (p % ps)[None, :]
        slots = torch.where(kv_ok, slots, torch.zeros((), dtype=torch.int64, device=dev))

        all_valid = bool(q_ok.all())
        single_fresh = bg == 1 and int(pre[0]) == 0
        uniform_decode = qmax == 1 and bool((kv_len == lmax).all())
        mask = None
        if not single_fresh and not uniform_decode:
            # bottom-right causal: query j sees positions p <= prefix + j, and p < kv_len.
            allowed = (p[None, None, :] <= (pre.to(dev)[:, None, None] + j.to(dev)[None, :, None])) & kv_ok[:, None, :]
            # padded query rows attend to position 0 only (their output is dropped): avoids NaN rows
            allowed[:, :, 0] |= ~q_ok.to(dev)
            mask = allowed.repeat(1, self.group_size, 1).unsqueeze(1)  # [Bg, 1, G*Qmax, Lmax]
        q_valid = None if all_valid else q_ok.reshape(-1).to(dev)
        flat_rows = q_rows.reshape(-1)[q_ok.reshape(-1)].to(dev)
        return _Group(
            q_rows=q_rows.to(dev),
            q_valid=q_valid,
            kv_slots=slots,
            mask=mask,
            is_causal=single_fresh and qmax > 1,
            flat_rows=flat_rows,
        )

    # --------------------------------------------------------------- forward
    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self._batch is None:
            raise RuntimeError(f"{type(self).__name__}.forward called before plan()")
        self.kv_pool.write(layer_id, self._batch.out_slots, k, v)
        # a single unpadded group covers every row in order: no gather of q, no scatter of out
        in_order = len(self._groups) == 1 and self._groups[0].q_valid is None
        return self._attend_groups(layer_id, q, None if in_order else torch.empty_like(q))

    def _attend_groups(self, layer_id: int, q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """Attention of the planned groups' rows, written into ``out`` (``None``: the single
        in-order group's output is returned as it is)."""
        hkv, g, d = self.num_kv_heads, self.group_size, self.head_dim
        for grp in self._groups:
            bg, qmax = grp.q_rows.shape
            lmax = grp.kv_slots.shape[1]
            # the pool's values (dequantized, in q's dtype), the new tokens' own K/V included
            kg, vg = self.kv_pool.gather(layer_id, grp.kv_slots.reshape(-1), q.dtype)
            kg = kg.view(bg, lmax, hkv, d).transpose(1, 2)
            vg = vg.view(bg, lmax, hkv, d).transpose(1, 2)
            if grp.is_causal:
                # one fresh prefill (qmax == lmax): SDPA's own causal kernel, heads not folded
                qg = q if out is None else q.index_select(0, grp.q_rows.reshape(-1))
                qg = qg.reshape(1, qmax, hkv * g, d).transpose(1, 2)
                o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=self.sm_scale, enable_gqa=g > 1)
                o = o.transpose(1, 2).reshape(qmax, hkv * g, d)
            else:
                qg = q if out is None else q.index_select(0, grp.q_rows.reshape(-1))
                qg = qg.reshape(bg, qmax, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(bg, hkv, g * qmax, d)
                o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=grp.mask, scale=self.sm_scale)
                o = o.view(bg, hkv, g, qmax, d).permute(0, 3, 1, 2, 4).reshape(bg * qmax, hkv * g, d)
            if out is None:
                return o
            if grp.q_valid is not None:
                o = o[grp.q_valid]
            out.index_copy_(0, grp.flat_rows, o)
        return out
