"""The publisher describes its tensors again exactly when their placement changed."""

import torch

from weightsync.tensor_keys import layout_key


def _key(**tensors):
    return layout_key(tensors)


def test_the_same_placement_gives_the_same_key():
    w = torch.randn(4, 4)
    assert _key(w=w, b=torch.zeros(3)[:2]) != _key(w=w)
    same = {"w": w}
    assert layout_key(same) == layout_key({"w": w})
    w.add_(1)  # new values, same memory: nothing to describe again
    assert layout_key(same) == layout_key({"w": w})


def test_any_change_of_address_dtype_shape_or_strides_changes_it():
    w = torch.randn(4, 4)
    before = _key(w=w)
    assert _key(w=w.clone()) != before  # moved
    assert _key(w=w.view(torch.int32)) != before  # another dtype, same bytes
    assert _key(w=w.view(16)) != before  # another shape
    strided = torch.randn(4, 4).t()
    key = _key(w=strided)
    strided.t_()  # the same tensor object, address and shape; strides swapped
    assert _key(w=strided) != key
    odd = torch.randn(8, 4).as_strided((4, 4), (8, 1))
    key = _key(w=odd)
    odd.as_strided_((4, 4), (4, 2))
    assert _key(w=odd) != key
