"""What `EquivalenceReport.explain` says to do about each cause of an inexact accumulation.

`fix_for` gives the fix for a non-additive module found by `gradaccum._non_additive` (BatchNorm,
random draws, a forward writing its weights, state a forward updates: in train mode, whatever
the mode, or a quantization observer's range); `LOSS_CAUSES` is what is said when no module
explains a gap: the loss itself.

Example:
    >>> fix_for("BatchNorm1d", "normalizes with micro-batch statistics").split(" (")[0]
    'convert it with gradaccum.batchnorm.convert_to_groupnorm(model)'
"""

from __future__ import annotations

__all__ = ["LOSS_CAUSES", "fix_for"]

_FIXES = {
    "BatchNorm": "convert it with gradaccum.batchnorm.convert_to_groupnorm(model) (exact), or "
    "train with Accumulator(..., batchnorm='pooled') (running statistics from the whole window) "
    "or 'frozen' (eval-mode statistics); see docs/batchnorm.md",
    "other": "check with dropout off (eval mode, or p=0 and a stochastic depth probability of 0) "
    "to confirm the rest is exact, or with the noise drawn for the whole batch and passed in it "
    "(eps = torch.randn(B, ...) as a batch tensor); in training, other random draws per "
    "micro-batch are expected noise, not a bug (docs/vision.md); mixup/CutMix drawn in loss_fn "
    "mix only within each micro-batch: mix the whole batch before step() (in the collate "
    "function), its soft targets split with the images",
    "in place": "for nn.Embedding(max_norm=...), renormalize the whole batch's rows once "
    "before the window (with torch.no_grad(): torch.embedding_renorm_(emb.weight, "
    "ids.unique(), max_norm, 2.0)): each micro-batch's renormalization then changes nothing "
    "and reads what the full batch reads; any other forward should leave its parameters alone",
    "state": "check in eval mode (model.eval()) to confirm the rest is exact; in training the "
    "state advances once per micro-batch, which no accumulation undoes: update it once per "
    "window (e.g. from Accumulator's step results) if it must match the full batch",
    "eval state": "its forward updates that state whatever the mode, so eval mode does not help: "
    "stop the update (a flag in the module) to confirm the rest is exact; in training it "
    "advances once per micro-batch, which no accumulation undoes: update it once per window "
    "(e.g. from Accumulator's step results) if it must match the full batch",
    "attribute": "if the forward reads it (a call counter, a hidden state kept between calls), "
    "check with it fixed (reset it in loss_fn, or carry the hidden state in the batch) to "
    "confirm the rest is exact; keep such state in a buffer (register_buffer), which gradaccum "
    "warns of and puts back when a window fails, planning included (a plain attribute it "
    "cannot see); if the forward only records it (a logged value), it is not the cause",
    "frequency": "build it with scale_grad_by_freq=False (the default) to confirm the rest is "
    "exact; to keep the scaling exactly, count each id over the whole batch before splitting it "
    "and scale each lookup's gradient by 1 / its count, passed in the batch "
    "(e = emb(ids); e = e.detach() + (e - e.detach()) * inv_count[..., None]; docs/losses.md, "
    "'Embeddings')",
    "observer": "check with the observers frozen: "
    "model.apply(torch.ao.quantization.disable_observer) (model.eval() does not stop them); in "
    "quantization-aware training the ranges then stay fixed and the step is the full-batch "
    "one, so freeze them once calibrated (the usual QAT schedule); while they observe, each "
    "micro-batch moves them, which no accumulation undoes",
}


# torchvision's detectors (matched by class name: gradaccum does not import torchvision). The
# generic advice, "check with dropout off (eval mode)", does not apply: in eval mode a detector
# returns detections, not losses.
_SAMPLED = (
    "a detector samples anchors and proposals at random per image and averages its losses over "
    "the micro-batch's sampled boxes: the full batch's draws cannot be replayed, so no check of "
    "a detector in training is exact (in eval mode it returns detections, not losses). In "
    "training other draws are expected noise while every image gives as many samples as "
    "rpn_batch_size_per_image and box_batch_size_per_image ask (then each loss is a mean per "
    "image); with fewer anchors or proposals than that (small images, a small "
    "rpn_post_nms_top_n_train) the means divide by counts that vary per image, which "
    "TokenMeanWarning names: lower those two sizes to what every image offers (docs/vision.md)"
)
_DETECTION = {
    "GeneralizedRCNNTransform": "it resizes each image to a size drawn per call when min_size "
    "holds several, and pads each micro-batch to its own largest image: give one min_size and "
    "images of one size (resize or pad them before step()), so every micro-batch is padded as "
    "the full batch is (docs/vision.md)",
    "RegionProposalNetwork": _SAMPLED,
    "gradient hook": "a fixed scaling or mask adds up to the full-batch step; a clamp, a norm "
    "clip or an in-place change of param.grad does not (the Accumulator warns when it sees "
    "one): clip or scale the window's gradient in optimizer.register_step_pre_hook instead "
    "(README, 'Your own gradient processing')",
    "RoIHeads": _SAMPLED,
}


def fix_for(kind: str, reason: str) -> str:
    """The fix a non-additive module of `kind` (found for `reason`) calls for."""
    if kind in _DETECTION:
        return _DETECTION[kind]
    if "BatchNorm" in kind:
        return _FIXES["BatchNorm"]
    if "scale_grad_by_freq" in reason:
        return _FIXES["frequency"]
    if "in place" in reason:
        return _FIXES["in place"]
    if "plain Python state" in reason:
        return _FIXES["attribute"]
    if "observer" in reason:
        return _FIXES["observer"]
    if "even in eval mode" in reason:
        return _FIXES["eval state"]
    return _FIXES["other" if "random" in reason else "state"]


# What `EquivalenceReport.explain` says when no module explains a gap: the loss itself.
LOSS_CAUSES = [
    "cause: no module behaves differently on micro-batches, so the loss is not additive over "
    "items. Either it normalizes by something of the micro-batch (a token, pixel or "
    "masked-position count, the targets' summed class weights of cross_entropy(weight=...), "
    "a max, a mean of per-micro-batch means),",
    "    -> return gradaccum.LossSum(sum of per-item losses, number of items counted) (summed "
    "weights: LossSum.terms(loss=(weighted_sum, summed_weights))); a plain scalar is read as a "
    "mean weighted by the micro-batch's leading dimension.",
    "or each item's loss depends on the other items of its batch (in-batch negatives: "
    "InfoNCE, CLIP; triplet mining; batch statistics, such as an MoE load-balancing loss "
    "computed per forward; a penalty on the parameters' gradient over the batch; Dice, soft "
    "IoU, Lovasz or OHEM over the batch's pixels),",
    "    -> given to loss_fn as it is, the loss sees the micro-batch as its batch. A loss of "
    "per-item outputs (embeddings, logits) is exact with gradient caching: embed the whole batch "
    "once under torch.no_grad(), take the loss's gradient per embedding with "
    "torch.autograd.grad, put it in the batch, and let loss_fn return each micro-batch's "
    "embeddings dotted with their cached gradient (docs/losses.md, 'In-batch negatives'; a "
    "batch Dice or soft IoU, a ratio of window sums, has an exact two-pass recipe there); "
    "otherwise use the largest micro_batch_size that fits.",
    "or it uses a statistic of the batch that needs no gradient (PPO's advantage "
    "normalization, a batch-mean baseline, MoE dispatch fractions, mixup or CutMix partners "
    "drawn in loss_fn),",
    "    -> exact: compute that statistic over the whole batch before splitting it and pass the "
    "result in the batch (advantages normalized up front; the batch mixed in the collate "
    "function, both targets and lam in it; docs/losses.md).",
]
