"""The shape marker: Shape objects, expansion, ids, and the parametrization seen by pytest."""
import pickle

import numpy as np
import pytest
import torch

from pytest_kernelcheck.check.shapes import (
    Shape,
    ShapeSpecError,
    expand_shape_marker,
    expand_shape_markers,
    format_id,
    python_scalar,
)


def test_shape_gives_attribute_and_mapping_access():
    shape = Shape({"B": 4, "S": 2048, "dtype": torch.bfloat16})
    assert (shape.B, shape.S, shape.dtype) == (4, 2048, torch.bfloat16)
    assert shape.get("causal", "absent") == "absent"
    assert shape.as_dict() == {"B": 4, "S": 2048, "dtype": torch.bfloat16}
    assert list(shape) == ["B", "S", "dtype"]
    assert dict(**shape)["S"] == 2048


def test_missing_attribute_lists_available_names():
    with pytest.raises(AttributeError, match=r"no entry 'H'; available: B, S"):
        Shape({"B": 1, "S": 2}).H


def test_shape_is_frozen_hashable_and_picklable():
    shape = Shape({"B": 2, "S": 8})
    with pytest.raises(AttributeError, match="immutable"):
        shape.B = 3
    assert hash(shape) == hash(Shape({"B": 2, "S": 8}))
    assert len({shape, Shape({"B": 2, "S": 8}), Shape({"B": 2, "S": 9})}) == 2
    assert pickle.loads(pickle.dumps(shape)) == shape


def test_id_format_for_each_kind_of_value():
    shape = Shape(
        {"B": 4, "S": 2048, "D2": 64, "p": 0.1, "dtype": torch.float16, "causal": True, "dropout": False,
         "mask": "lower_right", "window": None}
    )
    assert format_id(shape) == "B4-S2048-D2=64-p0.1-float16-causal-nodropout-lower_right-window=None"


def test_axes_cross_every_case_in_order_and_scalars_apply_to_all():
    shapes = expand_shape_marker(
        [dict(B=1, S=8), dict(B=2, S=16)], {"dtype": [torch.float16, torch.bfloat16], "D": 64}
    )
    assert [s.id for s in shapes] == [
        "B1-S8-float16-D64", "B1-S8-bfloat16-D64", "B2-S16-float16-D64", "B2-S16-bfloat16-D64",
    ]


def test_axes_alone_are_crossed():
    shapes = expand_shape_marker([], {"S": (8, 16), "causal": [True, False]})
    assert [s.as_dict() for s in shapes] == [
        {"S": 8, "causal": True}, {"S": 8, "causal": False}, {"S": 16, "causal": True}, {"S": 16, "causal": False},
    ]


@pytest.mark.parametrize(
    "cases, axes, message",
    [
        ([], {}, "the shape marker is empty"),
        ([[4, 2048]], {}, r"case 0 of the shape marker is \[4, 2048\] \(list\); each case must be a mapping"),
        ([dict(B=1)], {"dtype": {torch.float16}}, "keyword axis 'dtype' is a set"),
        ([dict(B=1)], {"S": (s for s in [1, 2])}, "keyword axis 'S' is a generator"),
        ([dict(B=1)], {"S": []}, "keyword axis 'S' is empty"),
        ([dict(B=1)], {"B": [1, 2]}, "keyword axis 'B' is also set in case 0"),
        ([{"not a name": 1}], {}, "must be Python identifiers"),
    ],
)
def test_bad_marker_arguments_are_named(cases, axes, message):
    with pytest.raises(ShapeSpecError, match=message):
        expand_shape_marker(cases, axes)


def test_numpy_arrays_and_tensors_cross_like_lists_with_plain_python_elements():
    shapes = expand_shape_marker(
        [dict(B=np.int32(3))],
        {"S": np.array([129, 257], dtype=np.int64), "p": torch.tensor([0.5, 0.25]),
         "causal": np.array([True, False]), "D": np.array(96), "scale": torch.tensor(0.125)},
    )
    assert [s.id for s in shapes] == [
        "B3-S129-p0.5-causal-D96-scale0.125", "B3-S129-p0.5-nocausal-D96-scale0.125",
        "B3-S129-p0.25-causal-D96-scale0.125", "B3-S129-p0.25-nocausal-D96-scale0.125",
        "B3-S257-p0.5-causal-D96-scale0.125", "B3-S257-p0.5-nocausal-D96-scale0.125",
        "B3-S257-p0.25-causal-D96-scale0.125", "B3-S257-p0.25-nocausal-D96-scale0.125",
    ]
    first = shapes[0]
    assert [type(first[name]) for name in first] == [int, int, float, bool, int, float]
    # A list of numpy scalars is a list axis too; its elements become plain numbers as well.
    assert [type(s.S) for s in expand_shape_marker([], {"S": [np.int64(65), np.uint16(33)]})] == [int, int]


def test_python_scalar_converts_numpy_and_torch_scalars_only():
    assert python_scalar(np.float32(0.5)) == 0.5 and type(python_scalar(np.float32(0.5))) is float
    assert type(python_scalar(np.bool_(True))) is bool
    assert type(python_scalar(torch.tensor(7, dtype=torch.int16))) is int
    row = np.array([1, 2, 3])
    assert python_scalar(row) is row  # not a scalar: unchanged
    assert python_scalar(torch.float16) is torch.float16
    assert python_scalar(np.str_("lower_right")) == "lower_right"


@pytest.mark.parametrize(
    "value, message",
    [
        (np.zeros((2, 3), dtype=np.int64), r"keyword axis 'S' is a 2-D ndarray of shape \(2, 3\); an axis must be"),
        (torch.zeros(2, 1, 5), r"keyword axis 'S' is a 3-D Tensor of shape \(2, 1, 5\); an axis must be"),
        (np.array([], dtype=np.int64), "keyword axis 'S' is empty"),
    ],
)
def test_arrays_that_are_not_one_axis_are_refused(value, message):
    with pytest.raises(ShapeSpecError, match=message):
        expand_shape_marker([dict(B=1)], {"S": value})


def test_stacked_markers_cross_like_stacked_parametrize():
    # Closest marker first, as pytest lists markers: its entries lead the id and it varies slowest.
    shapes = expand_shape_markers(
        [((dict(B=3, S=5), dict(B=1, S=7)), {}), ((), {"dtype": [torch.float16, torch.bfloat16]})]
    )
    assert [s.id for s in shapes] == ["B3-S5-float16", "B3-S5-bfloat16", "B1-S7-float16", "B1-S7-bfloat16"]
    assert expand_shape_markers([((dict(B=2),), {"S": [9]})]) == expand_shape_marker([dict(B=2)], {"S": [9]})


def test_stacked_markers_naming_the_same_size_are_refused():
    with pytest.raises(
        ShapeSpecError,
        match=r"stacked shape markers shape\(S=\[128, 256\]\) and shape\(dict\(B=2, S=64\)\) both name 'S'",
    ):
        expand_shape_markers([((), {"S": [128, 256]}), ((dict(B=2, S=64),), {})])
    with pytest.raises(
        ShapeSpecError, match=r"shape marker 2 of 2 \(counting from the test\): keyword axis 'S' is empty"
    ):
        expand_shape_markers([((dict(B=2),), {}), ((), {"S": []})])


def test_stacked_and_class_level_markers_in_a_test_file(pytester):
    pytester.makepyfile(
        test_stacked="""
        import numpy as np, pytest, torch

        @pytest.mark.shape(dtype=[torch.float16, torch.bfloat16])
        @pytest.mark.shape(dict(B=3, S=5), dict(B=1, S=7))
        def test_stacked(shape):
            assert shape.B * shape.S in (15, 7)

        @pytest.mark.shape(causal=[True, False])
        class TestCrossed:
            @pytest.mark.shape(S=np.array([33, 65]))
            def test_method(self, shape):
                assert type(shape.S) is int
        """,
        test_clash="""
        import pytest

        @pytest.mark.shape(S=[8])
        @pytest.mark.shape(dict(B=1, S=16))
        def test_clash(shape):
            pass
        """,
    )
    result = pytester.runpytest("--collect-only", "-q", "test_stacked.py")
    result.stdout.fnmatch_lines(
        [
            "*::test_stacked[[]B3-S5-float16[]]",
            "*::test_stacked[[]B3-S5-bfloat16[]]",
            "*::test_stacked[[]B1-S7-float16[]]",
            "*::test_stacked[[]B1-S7-bfloat16[]]",
            "*::TestCrossed::test_method[[]S33-causal[]]",
            "*::TestCrossed::test_method[[]S33-nocausal[]]",
            "*::TestCrossed::test_method[[]S65-causal[]]",
            "*::TestCrossed::test_method[[]S65-nocausal[]]",
        ]
    )
    result = pytester.runpytest("-q", "--continue-on-collection-errors")
    result.assert_outcomes(passed=8, errors=1)
    result.stdout.fnmatch_lines(
        ["*test_clash.py::test_clash: stacked shape markers shape(dict(B=1, S=16)) and shape(S=[[]8[]]) both name 'S'*"]
    )
    assert "Traceback" not in result.stdout.str()


def test_parametrization_ids_and_crossing_with_parametrize(pytester):
    pytester.makepyfile(
        """
        import pytest, torch

        @pytest.mark.shape(dict(B=4, S=2048, H=16, D=64), dict(B=1, S=128, H=2, D=32),
                           dtype=[torch.float16, torch.bfloat16], causal=[True, False], mask="lower_right")
        @pytest.mark.parametrize("impl", ["a", "b"])
        def test_attention(shape, impl):
            assert shape.mask == "lower_right"
            assert shape.as_dict()["dtype"] in (torch.float16, torch.bfloat16)

        @pytest.mark.shape(dict(B=2, S=8))
        class TestClassLevel:
            def test_uses_shape(self, shape):
                assert shape.B * shape.S == 16

        @pytest.fixture
        def numel(shape):
            return shape.B * shape.S

        @pytest.mark.shape(dict(B=3, S=5))
        def test_through_fixture(numel):
            assert numel == 15
        """
    )
    result = pytester.runpytest("--collect-only", "-q")
    result.stdout.fnmatch_lines(
        [
            "*test_attention[[]B4-S2048-H16-D64-float16-causal-lower_right-a[]]",
            "*test_attention[[]B4-S2048-H16-D64-bfloat16-nocausal-lower_right-b[]]",
            "*test_attention[[]B1-S128-H2-D32-bfloat16-nocausal-lower_right-b[]]",
            "*TestClassLevel::test_uses_shape[[]B2-S8[]]",
            "*test_through_fixture[[]B3-S5[]]",
        ]
    )
    result = pytester.runpytest("-q")
    result.assert_outcomes(passed=2 * 2 * 2 * 2 + 2)


def test_bad_markers_fail_at_collection_with_the_message(pytester):
    pytester.makepyfile(
        test_empty="""
        import pytest
        @pytest.mark.shape()
        def test_a(shape): pass
        """,
        test_not_mapping="""
        import pytest
        @pytest.mark.shape((4, 2048))
        def test_a(shape): pass
        """,
        test_bad_axis="""
        import pytest
        @pytest.mark.shape(dict(B=1), S={1, 2})
        def test_a(shape): pass
        """,
        test_no_fixture="""
        import pytest
        @pytest.mark.shape(dict(B=1))
        def test_a(): pass
        """,
    )
    result = pytester.runpytest()
    result.assert_outcomes(errors=4)
    result.stdout.fnmatch_lines_random(
        [
            "*test_empty.py::test_a: the shape marker is empty*",
            "*test_not_mapping.py::test_a: case 0 of the shape marker is (4, 2048) (tuple); each case must be a mapping*",
            "*test_bad_axis.py::test_a: keyword axis 'S' is a set*",
            "*test_no_fixture.py::test_a: @pytest.mark.shape needs the test to take the `shape` fixture*",
        ]
    )
    assert "Traceback" not in result.stdout.str()


def test_shape_fixture_without_marker_is_an_error(pytester):
    pytester.makepyfile(
        """
        def test_a(shape): pass
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*the `shape` fixture needs @pytest.mark.shape(...) on the test*"])


def test_a_cuda_case_names_what_this_machine_lacks():
    from pytest_kernelcheck.check.shapes import missing_device

    assert missing_device(Shape({"device": "cuda"}), cuda=(False, 0)) == (
        "device 'cuda': CUDA is not available on this machine")
    assert missing_device(Shape({"device": "cuda:1"}), cuda=(True, 1)) == (
        "device 'cuda:1': this machine has 1 CUDA device (cuda:0)")
    assert missing_device(Shape({"device": "cuda:0"}), cuda=(True, 1)) is None
    assert missing_device(Shape({"device": "cpu"}), cuda=(False, 0)) is None
