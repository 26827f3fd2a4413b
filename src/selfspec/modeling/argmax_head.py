"""The LM head's argmax, exactly, for about the cost of a bf16 matmul: a screen, then the exact candidates.

A greedy step needs one thing from the LM head: the index of the largest float32 logit, as
``model.generate(do_sample=False)`` computes it. On CPUs with native bf16 (AVX512-BF16 or AMX)
the float32 head is the slowest part of a small model's step, and a verify forward of 2-3 rows
costs 2-3.5 times one row (the fp32 GEMM's small-``m`` kernels: SmolLM2, 49,152 x 576, on an
AMD EPYC: 9.7-10.6 ms for one row, 22 ms for two, 34 ms for three; ``W @ x.T`` over two columns
takes 5.7 ms, the bf16 copy 7.4-8 ms for one to four rows).

:class:`ArgmaxHead` keeps a bf16 copy of the head's weight and, per row:

1. computes every logit a cheaper way (``s``), with a rigorous bound ``b`` on how far each can be
   from the float32 logit ``L`` (Cauchy-Schwarz on the weight rows' norms, precomputed). One or two
   rows are screened in float32 as ``W @ x.T``, a product that streams the weight twice as fast
   as the one-row call here but sums in another order: ``|s - L| <= 2 gamma_K |w| |x|``. More rows
   use the bf16 copy (the inputs' bf16 rounding, float32 accumulation on both sides, the bf16
   output's rounding): ``|s - L| <= (2u + u^2 + 2 gamma_K (1 + u)^2) |w| |x| + u / (1 - u) |s|``
   with ``u = 2^-8``;
2. keeps the candidates, every token whose ``s + b`` reaches ``max(s - b)``: the float32 argmax
   (and every token tied with it) is among them;
3. computes the candidates' float32 logits with the float32 weight rows, in a one-row call whose
   kernel gives each of them the bits the full head's one-row call gives (checked when the
   head is built: :meth:`ArgmaxHead.build` declines where it does not hold).

The logits it returns hold those exact values at the candidates and ``-inf`` elsewhere: their
argmax (first index among ties included) is the full head's. Nothing else may read them: not
sampling, not log-probabilities, not a grammar's mask (which may remove every candidate). The
runner uses it only where the caller says so (``argmax_only``).
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .hardware import native_dtypes

logger = logging.getLogger(__name__)

#: bf16's unit roundoff (8 significant bits).
BF16_UNIT = 2.0**-8
#: float32's unit roundoff.
FP32_UNIT = 2.0**-24
#: The smallest normal float32 (and bf16) magnitude: kernels may flush smaller inputs to zero.
SMALLEST_NORMAL = 2.0**-126
#: Candidate rows are gathered in whole blocks of this many (one-row kernels treat a ragged tail differently).
GATHER_BLOCK = 8
#: The cache line whose offset the one-row kernel's bits depend on (bytes).
ALIGN = 64
#: Relative slack on the bound, above the float32 rounding of computing it.
SLACK = 1e-3
#: Rows screened in float32 (padded to this many); more go through the bf16 copy.
FP32_SCREEN_ROWS = 2


class Screen(NamedTuple):
    """Screened logits of ``q`` rows and what bounds their distance to the float32 logits.

    Attributes:
        logits: ``[q, vocab]`` the screened logits (float32 or bf16).
        best: ``[q]`` each row's largest screened logit, as float32.
        norms: ``[q]`` each row's ``|x|``.
        constant: ``[q]`` what a token's bound adds beyond its weight row's term: the output
            rounding at the row's largest ``|s|`` and the flushed subnormals.
        scaled_norms: ``[vocab]`` each weight row's term per unit ``|x|``.
        largest_norm: the largest of ``scaled_norms``.
        out_scale: the output rounding's relative bound (0 for the float32 screen).
    """

    logits: torch.Tensor
    best: torch.Tensor
    norms: torch.Tensor
    constant: torch.Tensor
    scaled_norms: torch.Tensor
    largest_norm: float
    out_scale: float


class ArgmaxHead:
    """An LM head's exact argmax at a bf16 matmul's cost (see the module docstring).

    Build it with :meth:`build`, which returns ``None`` where it does not apply or would not be exact.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight  # the float32 head, shared with the model (not copied)
        self.screened = 0  # rows screened
        self.candidates = 0  # candidates they kept, in all
        self._buffer: torch.Tensor | None = None
        self._prepare()

    def _prepare(self) -> None:
        """The bf16 copy and the bound's constants, from the float32 weight as it is now."""
        weight = self.weight
        self.screen = weight.to(torch.bfloat16)
        fan_in = weight.shape[1]
        gamma = fan_in * FP32_UNIT / (1 - fan_in * FP32_UNIT)
        self.scale = (2 * BF16_UNIT + BF16_UNIT**2 + 2 * gamma * (1 + BF16_UNIT) ** 2) * (1 + SLACK)
        self.out_scale = BF16_UNIT / (1 - BF16_UNIT) * (1 + SLACK)
        norms = weight.norm(dim=-1)
        self.scaled_norms = self.scale * norms  # [vocab]; ``scale`` carries the slack
        self.largest_norm = float(self.scaled_norms.max())
        # the float32 screen: both sides are float32 dot products, each within gamma_K |w| |x| of the exact one
        self.fp32_scaled_norms = 2 * gamma * (1 + SLACK) * norms
        self.fp32_largest_norm = float(self.fp32_scaled_norms.max())
        self.flushed = fan_in * SMALLEST_NORMAL * 2 * (float(weight.abs().max()) + 1.0)
        self.version = weight._version

    def __repr__(self) -> str:
        vocab, hidden = self.weight.shape
        mean = self.candidates / self.screened if self.screened else 0.0
        return f"ArgmaxHead(vocab={vocab}, hidden={hidden}, screened={self.screened}, mean_candidates={mean:.2f})"

    @classmethod
    def build(cls, head: nn.Module, *, check: bool = True) -> ArgmaxHead | None:
        """An :class:`ArgmaxHead` for ``head``, or ``None`` where it does not apply.

        It applies to a plain float32 ``nn.Linear`` without bias, on a CPU that computes bf16
        natively. ``check`` confirms on random inputs that a candidate gathered in blocks of
        :data:`GATHER_BLOCK` gets the full one-row call's bits, and that the bound holds.
        """
        if type(head) is not nn.Linear or head.bias is not None:
            return None
        weight = head.weight.detach()
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            return None
        if torch.bfloat16 not in native_dtypes(weight.device):
            return None
        built = cls(weight)
        if check and not built.self_check():
            logger.info("exact-argmax head off: this CPU's one-row kernel gives gathered rows other bits")
            return None
        return built

    def self_check(self, rows: int = 4, seed: int = 0) -> bool:
        """Whether gathered candidates get the full one-row call's bits and the bound holds, on random rows."""
        generator = torch.Generator().manual_seed(seed)
        vocab, hidden = self.weight.shape
        for _ in range(rows):
            x = torch.randn(1, hidden, generator=generator)
            full = F.linear(x, self.weight)[0]
            for count in (1, 3, 8, 13):
                ids = torch.randint(0, vocab, (count,), generator=generator)
                if not torch.equal(self._exact(x[0], ids), full[ids]):
                    return False
            flushed = self.flushed * (float(x.abs().max()) + 1.0)
            for block in (x, x.expand(FP32_SCREEN_ROWS + 1, hidden)):  # the float32 screen, then the bf16 one
                screen = self._screen(block)
                screened = screen.logits[0].float()
                bound = self._bounds(screen, screened, torch.arange(vocab), float(screen.norms[0]), flushed)
                if not bool(((screened - full).abs() <= bound).all()):
                    return False
        return True

    def _screen(self, x: torch.Tensor) -> Screen:
        """``[q, hidden]`` float32 rows -> their screened logits ``[q, vocab]`` and what bounds them.

        Up to :data:`FP32_SCREEN_ROWS` rows are screened in float32 over the float32 weight, as
        ``W @ x.T`` over two columns (a zero row pads one): on these CPUs that product streams the
        weight about twice as fast as the one-row call (measured, SmolLM2's 49,152 x 576 head on an
        AMD EPYC: 5.7 ms against 10.6 ms, and 7.4 ms for the bf16 copy), and it sums in another
        order than the one-row call, so its logits are not the exact ones: both are float32 dot
        products, each within ``gamma_K |w| |x|`` of the true value, which bounds their distance.
        More rows go through the bf16 copy, whose cost grows more slowly with the rows.
        """
        rows = x.shape[0]
        if rows <= FP32_SCREEN_ROWS:
            padded = x if rows == FP32_SCREEN_ROWS else torch.cat([x, x.new_zeros(FP32_SCREEN_ROWS - rows, x.shape[1])])
            s = torch.mm(self.weight, padded.t()).t()[:rows]
            scaled_norms, largest_norm, out_scale = self.fp32_scaled_norms, self.fp32_largest_norm, 0.0
        else:
            s = F.linear(x.to(torch.bfloat16), self.screen)
            scaled_norms, largest_norm, out_scale = self.scaled_norms, self.largest_norm, self.out_scale
        low, high = torch.aminmax(s, dim=-1)
        largest = torch.maximum(low.abs(), high.abs()).float()
        norms = x.norm(dim=-1)
        constant = out_scale * largest + self.flushed * (x.abs().amax(dim=-1) + 1.0)
        return Screen(s, high.float(), norms, constant, scaled_norms, largest_norm, out_scale)

    def _bounds(self, screen: Screen, s: torch.Tensor, ids: torch.Tensor, norm: float, flushed: float) -> torch.Tensor:
        """The bound ``|s - L|`` for tokens ``ids`` of one row (``s``: their screened logits, as float32)."""
        return screen.scaled_norms[ids] * norm + screen.out_scale * s.abs() + flushed

    def _exact(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The float32 logits of tokens ``ids`` for one ``[hidden]`` row, with the full one-row call's bits.

        The one-row kernel's bits depend on the number of rows (a ragged tail is summed
        differently) and on where the weight lies in memory (its first vector loads): the rows
        are gathered in whole blocks of :data:`GATHER_BLOCK` into a buffer that starts at the
        weight's own offset from a 64-byte line, and the input row is a fresh (aligned) copy, as
        a decode step's is.
        """
        count = ids.shape[0]
        padded = -(-count // GATHER_BLOCK) * GATHER_BLOCK
        if padded > count:
            ids = torch.cat([ids, ids[:1].expand(padded - count)])
        rows = self._rows(padded)
        torch.index_select(self.weight, 0, ids, out=rows)
        return F.linear(x.clone()[None], rows)[0, :count]

    def _rows(self, count: int) -> torch.Tensor:
        """A ``[count, hidden]`` float32 buffer at the weight's offset from a 64-byte line (reused)."""
        if self._buffer is None or self._buffer.shape[0] < count:
            hidden = self.weight.shape[1]
            capacity = max(count, 4 * GATHER_BLOCK)
            flat = torch.empty(capacity * hidden + ALIGN // 4, dtype=self.weight.dtype)
            shift = (self.weight.data_ptr() - flat.data_ptr()) % ALIGN // flat.element_size()
            self._buffer = flat[shift : shift + capacity * hidden].view(capacity, hidden)
        return self._buffer[:count]

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """``[..., q, hidden]`` normed states -> ``[..., q, vocab]`` float32 logits, ``-inf`` but at the candidates.

        Two passes keep it cheap: every token whose bf16 logit lies within twice the largest
        bound of the row's largest is kept (a superset of the candidates), then the candidates
        are chosen from those with each token's own bound. A row whose screen is not finite (an
        overflow, a NaN) gets the full head's logits.
        """
        if self.weight._version != self.version:  # the weights were changed in place: refresh the copy
            self._prepare()
        shape = normed.shape
        x = normed.reshape(-1, shape[-1]).float()
        screen = self._screen(x)
        s, best, norms = screen.logits, screen.best, screen.norms
        widest = screen.largest_norm * norms + screen.constant  # no token's bound exceeds it
        cut = best - 2 * widest
        near = s >= (cut - cut.abs() * FP32_UNIT * 4)[:, None]
        counts = near.sum(dim=-1).tolist()
        columns = near.nonzero()[:, 1].split(counts)
        flushed = self.flushed * (x.abs().amax(dim=-1) + 1.0)
        finite = (torch.isfinite(best) & torch.isfinite(widest)).tolist()
        out = torch.full(s.shape, -math.inf)
        kept = 0
        for row, (ids, ok) in enumerate(zip(columns, finite, strict=True)):
            if not ok or ids.numel() == 0:
                out[row] = F.linear(x[row : row + 1], self.weight)[0]
                continue
            near_s = s[row, ids].float()
            bound = self._bounds(screen, near_s, ids, float(norms[row]), float(flushed[row]))
            top = (near_s - bound).max()  # the argmax's float32 logit is at least this high
            ids = ids[near_s + bound >= top - top.abs() * FP32_UNIT * 4]
            out[row, ids] = self._exact(x[row], ids)
            kept += ids.numel()
        self.screened += len(columns)
        self.candidates += kept
        return out.reshape(*shape[:-1], out.shape[-1])
