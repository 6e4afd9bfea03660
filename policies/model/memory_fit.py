"""Will training fit in a chip's HBM? A per-chip memory estimate and the microbatch count that fits.

A pure function of numbers: the model's shape (`policies.model.shape.ModelShape`), the
resolved mesh (`policies.model.sharding.MeshPlan`), the batch, the precision and the remat
policy, against one chip's HBM in bytes. The job spec asks it for every slice a job may
run on, so a job that cannot fit is refused before anything is created; the trainer asks
it for the microbatch count when ``gradient_accumulation: auto``.

The accounting (standard for AdamW training of a pre-norm decoder, as in Rajbhandari et
al., "ZeRO", 2020, and Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models", 2022), per chip, in bytes:

- Model state, each parameter array divided by the mesh axes `PARAM_RULES` shards it over
  (``fsdp`` and ``model``; the ``data`` axis replicates). P is parameters per chip:
  master parameters 4P (float32), gradients 4P (float32), AdamW's two moments 8P
  (float32), a gradient accumulator 4P with more than one microbatch, and the parameters
  cast to the compute dtype 2P when it is bfloat16. With fsdp > 1 a layer's weights are
  all-gathered before use: two layers' worth in the compute dtype (one in use, one in
  flight).
- Activations kept for the backward pass, per token of a microbatch on the chip
  (T = global_batch_size / (data x fsdp) / microbatches x seq_len), in the compute dtype
  (c bytes), for each of the L layers. d is d_model, f d_ff, kv the key/value width
  (n_kv_heads x head_dim), t the ``model`` axis (it splits heads and d_ff; the residual
  stream is replicated over it, no sequence parallelism):

    no remat (``none``, ``everything_saveable``):   A = 4d + (d + (2d + 2kv) x p + 6f) / t
        the block's input, the two norm outputs and the residual after attention (4d); the
        attention output reshaped for its projection's gradient (d); what the attention
        kernel keeps for its backward pass: rotated q and k, v and its output (2d + 2kv), in
        the kernel's [batch, heads, seq, head_dim] layout, whose minor dimension the TPU pads
        to a multiple of 128 lanes: p = ceil(head_dim / 128) x 128 / head_dim (2 for a
        head_dim of 64; `TrainingJob.lanes`); the feed-forward's up-projection, GELU's
        intermediates (its tanh form keeps four) and its output (6f), split over t. These are
        the buffers XLA's TPU compiler keeps from the forward loop to the backward loop of the
        built-in trainer's step (`benchmarks/tpu_compile.py`; q and k before rotation are not
        among them: the rotation's backward needs only the positions), and within 15% of the
        residuals JAX lists for the XLA path on a CPU (`jax.ad_checkpoint.print_saved_residuals`,
        no padding there; a test compares). A mixture of experts
        keeps top_k x 6f / t and the router's 2 x experts instead of 6f / t; a scan layer adds
        2d + 5d / t (its norm output and residual; its two projections, the gate, the gated
        input, the recurrence's output).
    ``full`` (``nothing_saveable``): only each block's input, d: L x d.
    ``dots_with_no_batch_dims_saveable`` and ``dots_saveable``: each block keeps its input
    and every projection's output, 3d + (d + 2kv + f) / t (a mixture of experts:
    top_k x f / t, a scan layer d + 2d / t more). The two policies keep the same here: every
    projection is a dot without batch dimensions, and the attention's batched dots live
    inside its kernel.

  Whatever the policy, the backward pass holds one block's A more while it works on that
  block (the block recomputed with remat, its activations' gradients without), and the
  attention kernel's float32 row statistics for it (the log-sum-exp and the backward's
  rowsum(dO x O), three arrays of [batch, heads, seq, 1] whose minor dimension the TPU pads
  to 128 lanes: 3 x 4 x 128 bytes a head a token, over t). Without remat the compiler's peak
  for the ~100M and ~1B jobs of `benchmarks/tpu_compile.py` on v4 is within 3% of this
  estimate (15-17% over it for the ~100M model when the attention counted 3d + 3kv unpadded
  and no block). With remat the estimate errs high: the ~1B job's logits (float32, 3.9 GiB a
  chip at 16k tokens) and its block's backward are not live at once, and the compiler found
  ``full`` 22% under the estimate (a ~100M model, 6% under).

  Both attention paths (the Pallas flash kernel, the chunked XLA one) are custom VJPs that
  keep only their inputs, output and softmax statistics, never a [seq, seq] score matrix, so
  no policy has a seq^2 term. Logits and their gradient are float32, 8 x vocab_size bytes
  per token, once.

- Usable HBM is 90% of the chip's: XLA's scratch buffers, the program and fragmentation
  take the rest (`USABLE_FRACTION`).

The figures are estimates to refuse what cannot fit and to choose a microbatch count; a
job near the limit should be measured (the trainer reports HBM in use and peak).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from policies.model.shape import ModelShape
from policies.model.sharding import PARAM_RULES, MeshPlan

GIB = 2**30
TPU_LANES = 128  # the TPU's layouts tile an array's minor dimension in multiples of 128 (its vector lanes)
ROW_STATISTICS = 3  # float32 [batch, heads, seq, 1] arrays of the attention's backward for the block it works on
USABLE_FRACTION = 0.9  # of a chip's HBM; the rest is XLA's scratch, the program and fragmentation

# `jax.checkpoint_policies` that take no arguments (a test checks this list against JAX);
# "none" saves everything (no rematerialisation), "full" saves nothing but each block's input.
CHECKPOINT_POLICIES = ("dots_saveable", "dots_with_no_batch_dims_saveable", "checkpoint_dots",
                       "checkpoint_dots_with_no_batch_dims", "nothing_saveable", "everything_saveable")
REMAT_CHOICES = ("none", "full", *CHECKPOINT_POLICIES)
_SAME_AS = {"everything_saveable": "none", "nothing_saveable": "full", "checkpoint_dots": "dots_saveable",
            "checkpoint_dots_with_no_batch_dims": "dots_with_no_batch_dims_saveable"}

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def params_by_role(shape: ModelShape) -> dict[str, int]:
    """Parameter count per role of `policies.model.sharding.PARAM_RULES` (they sum to `shape.num_params()`)."""
    d, f, v, hd, L, e = shape.d_model, shape.d_ff, shape.vocab_size, shape.head_dim, shape.n_layers, shape.moe_experts
    roles = {"embed": v * d, "unembed": d * v, "norm": d + L * (2 + shape.scan_layer) * d,
             "wq": L * d * shape.n_heads * hd, "wk": L * d * shape.n_kv_heads * hd,
             "wv": L * d * shape.n_kv_heads * hd, "wo": L * shape.n_heads * hd * d}
    if e:
        roles.update(router=L * d * e, moe_in=L * e * d * f, moe_out=L * e * f * d)
    else:
        roles.update(w_up=L * d * f, w_down=L * f * d)
    if shape.scan_layer:
        roles.update(scan_in=L * 2 * d * d, scan_out=L * d * d)
    return roles


def params_per_chip(shape: ModelShape, mesh: MeshPlan) -> float:
    """Parameters one chip holds: each role's count over the mesh axes it is sharded on."""
    axes = {"data": mesh.data, "fsdp": mesh.fsdp, "model": mesh.model}
    return sum(n / math.prod(axes[a] for a in PARAM_RULES[role] if a) for role, n in params_by_role(shape).items())


@dataclass(frozen=True)
class TrainingJob:
    """What the estimate needs to know about a job, apart from the mesh and the microbatch count."""

    shape: ModelShape
    seq_len: int
    global_batch_size: int
    compute_dtype: str = "bfloat16"  # "bfloat16" or "float32"; parameters and optimizer state are float32
    remat: str = "none"  # one of REMAT_CHOICES
    lanes: int = TPU_LANES  # the minor-dimension tile of the chip's layouts (1: no padding, as on a CPU)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per chip, by part, for one mesh and microbatch count."""

    microbatches: int
    tokens: int  # tokens of one microbatch on one chip
    params: float  # float32 master parameters
    compute_copy: float  # the parameters in the compute dtype (bfloat16 only), and fsdp's gathered layers
    gradients: float  # float32 gradients, and their accumulator with more than one microbatch
    optimizer: float  # AdamW's two float32 moments
    activations: float  # kept for the backward pass (with the remat policy), and `block`
    logits: float  # float32 logits and their gradient
    block: float = 0.0  # of `activations`: the one block the backward pass works on (recomputed, or its gradients)

    @property
    def total(self) -> float:
        return self.params + self.compute_copy + self.gradients + self.optimizer + self.activations + self.logits

    @property
    def parts(self) -> dict[str, float]:
        return {"parameters": self.params, "compute copy": self.compute_copy, "gradients": self.gradients,
                "optimizer state": self.optimizer, "activations": self.activations, "logits": self.logits}

    @property
    def dominant(self) -> str:
        return max(self.parts.items(), key=lambda kv: kv[1])[0]

    @property
    def model_state(self) -> float:
        """What does not shrink with the microbatch: parameters, their copies, gradients, optimizer."""
        return self.params + self.compute_copy + self.gradients + self.optimizer


def estimate(job: TrainingJob, mesh: MeshPlan, microbatches: int = 1) -> MemoryEstimate:
    """Bytes per chip of training `job` on `mesh` with `microbatches` per step (formulas: module docstring)."""
    s, c = job.shape, DTYPE_BYTES[job.compute_dtype]
    p = params_per_chip(s, mesh)
    copy = 2 * p if job.compute_dtype == "bfloat16" else 0.0
    if mesh.fsdp > 1:  # two layers' weights gathered over fsdp (still split over model)
        whole = replace(mesh, fsdp=1)
        layers = params_per_chip(s, whole) - 2 * s.vocab_size * s.d_model  # embed and unembed are not layers
        copy += 2 * layers / s.n_layers * c
    tokens = mesh.rows_per_shard // microbatches * job.seq_len
    kept, block = _activation_elements_per_token(s, mesh.model, job.remat, job.lanes)
    block_bytes = tokens * (block * c + ROW_STATISTICS * 4 * job.lanes * s.n_heads / mesh.model)
    return MemoryEstimate(microbatches=microbatches, tokens=tokens, params=4 * p, compute_copy=copy,
                          gradients=4 * p * (2 if microbatches > 1 else 1), optimizer=8 * p,
                          activations=tokens * kept * c + block_bytes, logits=tokens * 8 * s.vocab_size,
                          block=block_bytes)


def lane_padding(head_dim: int, lanes: int = TPU_LANES) -> float:
    """How much larger the attention kernel's [batch, heads, seq, head_dim] arrays are in memory than their
    elements: head_dim padded to a multiple of `lanes` (2.0 for 64 on a TPU, 1.0 for 128)."""
    return math.ceil(head_dim / lanes) * lanes / head_dim


def _activation_elements_per_token(s: ModelShape, t: int, remat: str, lanes: int) -> tuple[float, float]:
    """(elements kept per token for the whole model, all layers; elements of the one block the backward pass
    works on), with `remat` (see the module docstring)."""
    d, f, kv, L = s.d_model, s.d_ff, s.n_kv_heads * s.head_dim, s.n_layers
    k = min(s.moe_top_k, s.moe_experts)
    ffn_full = (k * 6 * f) / t + 2 * s.moe_experts if s.moe_experts else 6 * f / t
    ffn_dots = (k * f) / t if s.moe_experts else f / t
    scan_full = 2 * d + 5 * d / t if s.scan_layer else 0.0
    scan_dots = d + 2 * d / t if s.scan_layer else 0.0
    attention = (d + (2 * d + 2 * kv) * lane_padding(s.head_dim, lanes)) / t
    full = 4 * d + attention + ffn_full + scan_full  # one block, nothing recomputed
    policy = _SAME_AS.get(remat, remat)
    if policy == "none":
        return L * full, full
    if policy == "full":
        return L * d, full
    dots = 3 * d + (d + 2 * kv) / t + ffn_dots + scan_dots  # dots_saveable, dots_with_no_batch_dims_saveable
    return L * dots, full


@dataclass(frozen=True)
class Fit:
    """The verdict for one slice: the estimate at the microbatch count chosen (or asked for), against HBM."""

    estimate: MemoryEstimate
    hbm_bytes: float  # one chip's

    @property
    def usable_bytes(self) -> float:
        return self.hbm_bytes * USABLE_FRACTION

    @property
    def fits(self) -> bool:
        return self.estimate.total <= self.usable_bytes

    def summary(self) -> str:
        """'12.3 of 28.8 GiB per chip (activations 8.1 GiB), 2 microbatches'."""
        e = self.estimate
        return (f"{e.total / GIB:.1f} of {self.usable_bytes / GIB:.1f} GiB per chip "
                f"({e.dominant} {e.parts[e.dominant] / GIB:.1f} GiB), {e.microbatches} microbatch"
                + ("es" if e.microbatches != 1 else ""))


def microbatch_counts(mesh: MeshPlan) -> list[int]:
    """The microbatch counts a step can be split into: divisors of each batch shard's rows, smallest first."""
    rows = mesh.rows_per_shard
    small = [m for m in range(1, math.isqrt(rows) + 1) if rows % m == 0]
    return sorted(set(small) | {rows // m for m in small})


def fit(job: TrainingJob, mesh: MeshPlan, hbm_bytes: float, microbatches: int | None = None) -> Fit:
    """The estimate with `microbatches`, or with None ("auto") the fewest that fit; if none fits, the most."""
    if microbatches is not None:
        return Fit(estimate(job, mesh, microbatches), hbm_bytes)
    counts = microbatch_counts(mesh)
    for m in counts:
        verdict = Fit(estimate(job, mesh, m), hbm_bytes)
        if verdict.fits:
            return verdict
    return verdict


def advice(job: TrainingJob, mesh: MeshPlan, hbm_bytes: float, microbatches: int | None) -> list[str]:
    """What would make a job that does not fit fit: each change alone, then all of them together, with the
    GiB per chip each would need. `microbatches` None is "auto", and stays so in every alternative."""
    remat = replace(job, remat="full") if _SAME_AS.get(job.remat, job.remat) != "full" else None
    accumulate = microbatches is not None and microbatches < mesh.rows_per_shard
    shards = mesh.data * mesh.fsdp
    sharded = replace(mesh, data=1, fsdp=shards) if mesh.data > 1 and job.shape.d_model % shards == 0 else None
    bf16 = replace(job, compute_dtype="bfloat16") if job.compute_dtype == "float32" else None

    def kept(m: MeshPlan) -> int | None:  # the user's count where it still divides the rows
        return None if microbatches is None or m.rows_per_shard % microbatches else microbatches

    changes = []
    if remat:
        changes.append(("remat: full", remat, mesh, microbatches))
    if accumulate:
        changes.append(("gradient_accumulation: auto", job, mesh, None))
    if sharded:
        changes.append((f"mesh: {{data: 1, fsdp: {shards}}}", job, sharded, kept(sharded)))
    if bf16:
        changes.append(("precision: {compute: bfloat16}", bf16, mesh, microbatches))
    if len(changes) > 1:
        together = replace(job, remat="full" if remat else job.remat, compute_dtype="bfloat16")
        changes.append((" and ".join(label for label, *_ in changes), together, sharded or mesh, None))
    options = []
    for label, j, m, mb in changes:
        f = fit(j, m, hbm_bytes, mb)
        options.append(f"{label}: {f.estimate.total / GIB:.1f} GiB" + ("" if f.fits else " (still too much)"))
    options.append("a slice with more chips")
    return options
