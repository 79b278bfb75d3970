"""Batch structures: calling, sizing, splitting and describing, checked against hand-built references."""

import pytest
import torch
from torch import nn

from dlperf.batch import batch_size, call_loss, call_model, describe, map_tensors, split_tree, tensors_of
from dlperf.errors import UsageError, user_code_line


class TwoInputs(nn.Module):
    def forward(self, a, b):
        return a + b


class DictInput(nn.Module):
    def forward(self, batch):
        return {"sum": batch["x"].sum(1), "ids": batch["ids"] * 2}


def test_call_model_unpacks_tuples_only():
    a, b = torch.randn(3, 2), torch.randn(3, 2)
    assert torch.equal(call_model(TwoInputs(), (a, b)), a + b)
    x = {"x": torch.randn(3, 4), "ids": torch.randint(0, 9, (3,))}
    out = call_model(DictInput(), x)
    assert torch.equal(out["sum"], x["x"].sum(1)) and torch.equal(out["ids"], x["ids"] * 2)
    assert torch.equal(call_model(nn.Identity(), a), a)


def test_split_tree_matches_torch_split_and_shares_plain_values():
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    ids = torch.randint(0, 100, (7, 5), generator=g)
    feats = torch.randn(7, 3, generator=g)
    tree = {"inputs": (ids, feats), "scale": torch.tensor(2.0), "tag": "t"}
    parts = split_tree(tree, [4, 3])
    assert len(parts) == 2
    for part, ref_ids, ref_feats in zip(parts, ids.split([4, 3]), feats.split([4, 3])):
        assert torch.equal(part["inputs"][0], ref_ids) and torch.equal(part["inputs"][1], ref_feats)
        assert part["scale"] is tree["scale"] and part["tag"] == "t"
    assert torch.equal(torch.cat([p["inputs"][0] for p in parts]), ids)


def test_batch_size_and_its_errors():
    assert batch_size((torch.zeros(5, 2), torch.zeros(5), 3)) == 5
    with pytest.raises(UsageError, match="mixes batch sizes 5 and 4"):
        batch_size({"a": torch.zeros(5), "b": torch.zeros(4)})
    with pytest.raises(UsageError, match="no tensor with a batch"):
        batch_size({"a": torch.tensor(1.0), "b": "x"})


def test_map_tensors_and_tensors_of_keep_structure():
    tree = {"a": [torch.ones(2), "s"], "b": torch.zeros(2, dtype=torch.int64)}
    doubled = map_tensors(lambda t: t * 2, tree)
    assert doubled["a"][1] == "s" and torch.equal(doubled["a"][0], torch.full((2,), 2.0))
    assert [t.dtype for t in tensors_of(tree)] == [torch.float32, torch.int64]


def test_describe_is_one_bounded_line():
    assert describe({"ids": torch.zeros(2, 3, dtype=torch.int64)}) == "dict{ids: int64[2,3]}"
    long = describe(list(range(100)))
    assert "\n" not in long and long.endswith(", ...)")


def test_split_tree_applies_each_per_part_and_gather_tree_inverts_it():
    from dlperf.batch import gather_tree

    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    tree = {"x": torch.randn(5, 2, generator=g), "pair": (torch.arange(5), "s"), "k": torch.tensor(3)}
    seen = []
    parts = split_tree(tree, [2, 3], each=lambda t, i: seen.append((i, tuple(t.shape))) or t + i)
    assert sorted(seen) == [(0, ()), (0, (2,)), (0, (2, 2)), (1, ()), (1, (3,)), (1, (3, 2))]
    assert torch.equal(parts[1]["pair"][0], torch.arange(2, 5) + 1) and int(parts[1]["k"]) == 4
    joined = gather_tree(split_tree(tree, [2, 3]))
    assert torch.equal(joined["x"], tree["x"]) and joined["pair"][1] == "s"
    assert torch.equal(joined["k"], torch.tensor([3, 3]))  # one 0-d value per part, stacked
    with pytest.raises(UsageError, match="hold different values 'a' and 'b'"):
        gather_tree([{"v": "a"}, {"v": "b"}])


class _Raises(nn.Module):
    def forward(self, batch):
        raise ValueError("no such feature 'y'\nsecond line")


def test_what_the_users_model_or_loss_raises_goes_on_unchanged_naming_the_call_and_the_batch():
    """The exception keeps its type (callers and a plan's fallback tell errors apart by it); the CLI's one line
    names the model's call and the batch's structure, from the innermost call that saw it."""
    with pytest.raises(ValueError) as info:
        call_model(_Raises(), {"x": torch.zeros(2, 3)})
    line = user_code_line(info.value)
    assert line is not None and line.startswith("the model _Raises(dict{x: float32[2,3]}) raised ValueError: "
                                                "no such feature 'y'; fix the model"), line
    with pytest.raises(IndexError) as info:
        call_loss(torch.nn.functional.cross_entropy, torch.zeros(2, 3), torch.tensor([0, 7]))
    assert user_code_line(info.value).startswith(
        "the loss cross_entropy(output float32[2,3], targets int64[2]) raised IndexError: Target 7 is out of bounds")
    with pytest.raises(UsageError) as info:  # dlperf's own errors are not the user's
        call_model(lambda x: batch_size(x), torch.zeros(()))
    assert user_code_line(info.value) is None
    assert user_code_line(ValueError("plain")) is None
