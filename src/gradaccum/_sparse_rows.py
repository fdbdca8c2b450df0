"""SciPy sparse matrices in a batch: split by rows (or columns) like a dense array; tensors too.

Tabular and recommendation pipelines hand `scikit-learn` features (one-hot, TF-IDF) and
extreme multi-label targets to the model as `scipy.sparse` matrices. Such a leaf used to be a
constant, given whole to every micro-batch: each micro-batch's forward ran on all B rows
against its own few targets, and failed with a shape error far from the cause. They are
split along `batch_dim` (0 or 1: they are 2-D), in their own format, through the compressed
format that slices that axis cheaply. SciPy is never imported here: it is recognized by its
module name.

Example:
    >>> import scipy.sparse
    >>> x = scipy.sparse.random(5, 3, density=0.5, format="coo", random_state=0)
    >>> rows = sparse_slicer(x, 0)
    >>> rows(1, 3).shape, rows(1, 3).format
    ((2, 3), 'coo')
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["is_scipy_sparse", "sparse_slicer", "sparse_take", "tensor_slicer"]


def tensor_slicer(tensor: torch.Tensor, dim: int) -> Callable[[int, int], Any]:
    """Items [start, stop) of `tensor` along `dim`: a view, or for sparse COO a copy."""
    if tensor.layout is torch.sparse_coo:  # a sparse tensor has no views: a copy of its rows
        return lambda start, stop: tensor.narrow_copy(dim, start, stop - start)
    if dim == 0:
        return lambda start, stop: tensor[start:stop]
    return lambda start, stop: tensor.narrow(dim, start, stop - start)


def is_scipy_sparse(node: object) -> bool:
    """Whether `node` is a `scipy.sparse` matrix or array (known without importing SciPy)."""
    module = type(node).__module__ or ""
    return module.startswith("scipy.sparse") and hasattr(node, "tocsr") and hasattr(node, "shape")


def _compressed(node: Any, dim: int) -> Any:
    if dim not in (0, 1):
        raise ValueError(
            f"a scipy.sparse matrix is 2-D: it cannot be split along batch_dim={dim}; convert "
            "it to a torch sparse COO tensor (torch.sparse_coo_tensor) with the items at that "
            "dimension."
        )
    return node.tocsr() if dim == 0 else node.tocsc()


def sparse_slicer(node: Any, dim: int) -> Callable[[int, int], Any]:
    """A slicer of `node`'s rows (`dim` 0) or columns (1) `[start, stop)`, in its format."""
    whole, form = _compressed(node, dim), node.format
    if dim == 0:
        return lambda start, stop: whole[start:stop].asformat(form)
    return lambda start, stop: whole[:, start:stop].asformat(form)


def sparse_take(node: Any, order: list[int], dim: int) -> Any:
    """`node` with its rows (or columns) in `order`, in its format (as it is if not B of them)."""
    if node.shape[dim] != len(order):  # a wrong batch: `agreed_size` raises
        return node
    whole = _compressed(node, dim)
    return (whole[order] if dim == 0 else whole[:, order]).asformat(node.format)
