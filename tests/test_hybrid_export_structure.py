"""export/load of models that take and return structures: tuples, dicts (nested), integer token ids.

Every round trip is compared with the eager model on fresh random inputs of another batch size; every
malformed structure in graph.json (the attacker recomputes the checksums) is one ExportFormatError.
"""

from __future__ import annotations

import collections
import json

import pytest
import torch
from torch import nn

from dlperf.errors import DlperfError
from dlperf.hybrid import export, load
from dlperf.hybrid.export import ExportFormatError
from dlperf.hybrid.export_format import content_hash
from dlperf.hybrid.export_tree import MAX_KEY_CHARS, MAX_TREE_DEPTH, MAX_TREE_NODES

VOCAB = 50


def _gen():
    return torch.Generator().manual_seed(torch.seed() % 2**31)


class DictInDictOut(nn.Module):
    """A dict of token ids, a mask and features in; a dict with a nested tuple and list out."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.feats = nn.Linear(3, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, batch):
        mask = batch["mask"].float().unsqueeze(-1)
        pooled = (self.embed(batch["ids"]) * mask).sum(1) / mask.sum(1).clamp(min=1)
        h = torch.tanh(pooled + self.feats(batch["feats"]))
        return {"logits": self.head(h), "extra": (h.sum(-1), [h * 2]), "none": None}


class TupleIn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 6)
        self.out = nn.Linear(6, 2)

    def forward(self, ids, scale):
        return self.out(self.embed(ids).mean(1)) * scale, ids.sum(1)


Pair = collections.namedtuple("Pair", "a b")


class NamedOut(nn.Module):
    def forward(self, x):
        return Pair(x + 1, x * 2)


def _dict_batch(n, g):
    return {"ids": torch.randint(0, VOCAB, (n, 7), generator=g), "mask": torch.rand(n, 7, generator=g) > 0.3,
            "feats": torch.randn(n, 3, generator=g)}


def _assert_same_structure(got, want):
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    elif isinstance(want, dict):
        assert type(got) is dict and list(got) == list(want)
        for k in want:
            _assert_same_structure(got[k], want[k])
    elif isinstance(want, (tuple, list)):
        assert type(got) is (tuple if isinstance(want, tuple) else list) and len(got) == len(want)
        for a, b in zip(got, want):
            _assert_same_structure(a, b)
    else:
        assert got == want


def test_dict_in_dict_out_round_trip_keeps_keys_and_nesting(tmp_path):
    g = _gen()
    model = DictInDictOut().eval()
    export(model, tmp_path, _dict_batch(4, g))  # a dict is the one input
    loaded = load(tmp_path)
    assert loaded.input_structure == "tuple(dict{ids: int64[N,7], mask: bool[N,7], feats: float32[N,3]})"
    fresh = _dict_batch(9, g)
    with torch.no_grad():
        _assert_same_structure(loaded(fresh), model(fresh))
    doc = json.loads((tmp_path / "graph.json").read_text())
    assert doc["format_version"] == 2
    assert doc["output_tree"]["dict"]["extra"] == {"tuple": [1, {"list": [2]}]}


def test_tuple_inputs_with_integer_tokens_and_tuple_output(tmp_path):
    g = _gen()
    model = TupleIn().eval()
    export(model, tmp_path, (torch.randint(0, VOCAB, (3, 5), generator=g), torch.randn(3, 1, generator=g)))
    loaded = load(tmp_path)
    ids, scale = torch.randint(0, VOCAB, (6, 5), generator=g), torch.randn(6, 1, generator=g)
    with torch.no_grad():
        _assert_same_structure(loaded(ids, scale), model(ids, scale))


def test_namedtuple_output_comes_back_a_tuple(tmp_path):
    export(NamedOut(), tmp_path, torch.randn(2, 3))
    x = torch.randn(5, 3)
    got = load(tmp_path)(x)
    assert type(got) is tuple
    torch.testing.assert_close(got[0], x + 1)
    torch.testing.assert_close(got[1], x * 2)


def test_a_call_of_another_structure_is_one_error_naming_both(tmp_path):
    g = _gen()
    export(DictInDictOut().eval(), tmp_path, _dict_batch(2, g))
    loaded = load(tmp_path)
    batch = _dict_batch(3, g)
    del batch["feats"]
    with pytest.raises(DlperfError, match=r"takes tuple\(dict\{ids: int64\[N,7\].*got tuple\(dict\{ids: int64\[3,7\], "
                                          r"mask: bool\[3,7\]\}\)"):
        loaded(batch)
    with pytest.raises(DlperfError, match="takes tuple"):
        loaded(batch["ids"])
    wrong = _dict_batch(3, g)
    wrong["ids"] = wrong["ids"].float()
    with pytest.raises(DlperfError, match=r"input batch_ids: expected int64\['N', 7\], got float32\[3, 7\]"):
        loaded(wrong)


@pytest.mark.parametrize("inputs,what", [
    ((torch.zeros(2, 3), "fast"), "a str"),
    ({"x": torch.zeros(2, 3), "n": 3}, "a int"),
    ((torch.zeros(2, 3), None), "a NoneType"),
])
def test_example_inputs_that_are_not_tensors_are_one_error(tmp_path, inputs, what):
    with pytest.raises(DlperfError, match=f"cannot export with example inputs .*hold {what}"):
        export(nn.Identity(), tmp_path, inputs)


def test_unsupported_output_container_is_one_error_naming_it(tmp_path):
    class IntKeys(nn.Module):
        def forward(self, x):
            return {1: x}

    with pytest.raises(DlperfError, match="dict key 1"):
        export(IntKeys(), tmp_path / "a", torch.randn(2, 2))


def test_format_1_exports_still_load(tmp_path):
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU()).eval()
    export(model, tmp_path, torch.randn(2, 4))
    doc = json.loads((tmp_path / "graph.json").read_text())
    doc["format_version"] = 1
    del doc["input_tree"], doc["output_tree"]
    doc["content_sha256"] = content_hash(doc)
    (tmp_path / "graph.json").write_text(json.dumps(doc))
    x = torch.randn(5, 4)
    with torch.no_grad():
        torch.testing.assert_close(load(tmp_path)(x), model(x))


# --- hostile structures: the attacker recomputes every checksum ------------------------------------

def _deep(depth):
    tree = 0
    for _ in range(depth):
        tree = {"tuple": [tree]}
    return tree


HOSTILE = [
    ("input_tree", 0, "expected an object with 'tuple' at its root"),
    ("input_tree", {"list": [0]}, "expected an object with 'tuple' at its root"),
    ("input_tree", {"tuple": [{"eval": [0]}]}, "'eval' is not a structure kind"),
    ("input_tree", {"tuple": [{"__class__": 0}]}, "'__class__' is not a structure kind"),
    ("input_tree", {"tuple": [0, 0]}, "leaf 0 out of order"),
    ("input_tree", {"tuple": []}, "has 0 leaves for 3 entries"),
    ("input_tree", {"tuple": [{"dict": {"ids": 0, "mask": 1, "feats": 2, "x": 3}}]}, "has 4 leaves for 3"),
    ("input_tree", {"tuple": [{"dict": {"ids": 0, "mask": 1, "feats": 2}, "list": []}]}, "expected a leaf number"),
    ("input_tree", {"tuple": [{"dict": [["ids", 0]]}]}, "expected an object"),
    ("input_tree", {"tuple": [{"dict": {"k" * (MAX_KEY_CHARS + 1): 0, "mask": 1, "feats": 2}}]},
     "is not a string of at most"),
    ("input_tree", {"tuple": [{"dict": {"a\nb": 0, "mask": 1, "feats": 2}}]}, "printable"),
    ("input_tree", {"tuple": [True, 1, 2]}, "expected a leaf number"),
    ("input_tree", {"tuple": [0.0, 1, 2]}, "expected a leaf number"),
    ("input_tree", {"tuple": [-1, 1, 2]}, "leaf -1 out of order"),
    ("input_tree", {"tuple": [0, 1, "2"]}, "is a string"),
    ("input_tree", {"tuple": [0, 1, None]}, "is null"),
    ("input_tree", {"tuple": {"0": 0}}, "expected an array"),
    ("input_tree", {"tuple": [_deep(MAX_TREE_DEPTH + 2)]}, f"nests deeper than {MAX_TREE_DEPTH}"),
    ("input_tree", {"tuple": [{"list": [{"list": []}] * (MAX_TREE_NODES + 1)}]}, f"more than {MAX_TREE_NODES} nodes"),
    ("output_tree", {"dict": {"logits": 0, "extra": 1}}, "has 2 leaves for 4"),
    ("output_tree", {"set": [0, 1, 2, 3]}, "'set' is not a structure kind"),
    ("output_tree", {"tuple": [0, 1, 2, 3], "dict": {}}, "expected a leaf number"),
    ("output_tree", 7, "leaf 7 out of order"),
    ("output_tree", "os.system", "is a string"),
    ("output_tree", None, "is null"),
    (None, "input_tree", "missing field 'input_tree'"),
    (None, "output_tree", "missing field 'output_tree'"),
]


@pytest.fixture(scope="module")
def dict_export(tmp_path_factory):
    path = tmp_path_factory.mktemp("dict_export")
    export(DictInDictOut().eval(), path, _dict_batch(2, _gen()))
    return path, (path / "graph.json").read_text()


@pytest.mark.parametrize("field,value,message", HOSTILE, ids=[f"{i}-{h[2][:24]}" for i, h in enumerate(HOSTILE)])
def test_malformed_structures_are_refused_at_load(dict_export, field, value, message):
    path, text = dict_export
    doc = json.loads(text)
    if field is None:
        del doc[value]
    else:
        doc[field] = value
    doc["content_sha256"] = content_hash(doc)
    try:
        (path / "graph.json").write_text(json.dumps(doc))
        with pytest.raises(ExportFormatError) as err:
            load(path)
        assert message in str(err.value) and "\n" not in str(err.value)
    finally:
        (path / "graph.json").write_text(text)


def test_format_1_documents_may_not_carry_trees(dict_export):
    path, text = dict_export
    doc = json.loads(text)
    doc["format_version"] = 1
    doc["content_sha256"] = content_hash(doc)
    try:
        (path / "graph.json").write_text(json.dumps(doc))
        with pytest.raises(ExportFormatError, match="field 'input_tree': unknown in format_version 1"):
            load(path)
    finally:
        (path / "graph.json").write_text(text)
