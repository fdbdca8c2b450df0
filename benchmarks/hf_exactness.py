"""The exactness table of `gradaccum.hf`: model x helper x gap, with the negative controls.

Every row runs the cases of `tests/integrations/test_hf.py` (tiny Hugging Face models built from
configs, float64, batches of 7 rows split 3 + 3 + 1 with uneven padding):

- `params`: parameters after 3 AdamW steps with clipping, against the plain full-batch steps;
- `grad`: the first batch's gradient (`accumulate_grad`), against the full-batch gradient;
- `outputs.loss`: the same 3 steps with the model's own loss, a mean, weighted by rows;
- `unshifted count`: the gradient with the causal-LM count taken before the shift.

Gaps are max |ours - reference| / max |reference| over the tensors (the largest one).

Usage (from the repository root):
    .venv/bin/python benchmarks/hf_exactness.py
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integrations import test_hf as cases
from tests.reference import relative_gap

from gradaccum.loss import TokenMeanWarning


def main() -> int:
    torch.set_num_threads(1)
    header = f"{'model / helper':<28} {'params':>9} {'grad':>9} {'outputs.loss':>13}"
    print(f"{header} {'unshifted':>10}")
    for name, case in cases.CASES.items():
        reference = cases._reference(name)
        params = relative_gap(cases._run_ours(case, case[2]), reference)
        full = cases._gradients(case, None, None)
        grad = relative_gap(cases._gradients(case, case[2], cases.MICRO), full)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TokenMeanWarning)
            rows = relative_gap(cases._run_ours(case, cases._model_mean), reference)
        unshifted = "-"
        if name.endswith("causal_lm"):
            naive = cases._gradients(case, cases._naive_causal, cases.MICRO)
            unshifted = f"{relative_gap(naive, full):.1e}"
        print(f"{name:<28} {params:>9.1e} {grad:>9.1e} {rows:>13.1e} {unshifted:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
